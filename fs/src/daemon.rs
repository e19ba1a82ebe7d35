//! The node daemon's core: layer mounts shared by every sandbox, and one overlay per sandbox.
//!
//! Mounting an image resolves tag → manifest → layers. Each layer not yet mounted on the node has its
//! metadata fetched to local disk (verified), its blobs registered with the FUSE blob server (their
//! tables of contents fetched and verified), and is mounted as kernel EROFS, file-backed, with one
//! `device=` per blob file. Layer mounts are reference counted: every sandbox of every image that uses a
//! layer shares one mount (one page-cache copy) and the last sandbox to go releases it. A sandbox is an
//! overlay of its image's layers (top first) with its own upper and work directories.
//!
//! Directories: `<state>/layers/<hex>.erofs` (metadata, on disk: the kernel refuses tmpfs),
//! `<state>/cache/` (chunk cache), `<state>/sandboxes/<id>/{upper,work,sandbox.json}`;
//! `<runtime>/fuse/` (blob server), `<runtime>/layers/<hex>/`, `<runtime>/sandboxes/<id>/rootfs`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use strata_prefetch::{PlanEntry, WarmOptions};
use strata_registry::digest::Digest;
use strata_registry::model::{Manifest, Reference};
use strata_registry::store::{Store, StoreError};

use crate::api::ErrorKind;
use crate::blobfs::{self, BlobFs, BlobTable};
use crate::cache::ChunkCache;
use crate::fetch::{BlobHandle, Fetcher};
use crate::metadir;
use crate::metrics::Metrics;
use crate::mount::{self, MountError};
use crate::warming::Warming;

/// How the daemon runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Store URL (`file:///…` or `s3://bucket/prefix`).
    pub store: String,
    /// Persistent state: layer metadata, chunk cache, sandbox upper directories.
    pub state_dir: PathBuf,
    /// Mount points and the control socket.
    pub runtime_dir: PathBuf,
    /// Chunk cache bound in bytes.
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub cache_size: u64,
    /// A read that cannot complete within this many seconds fails with EIO.
    pub read_timeout_secs: f64,
    /// Largest compressed span a miss fetches (its chunk, then the missing chunks after it, in a
    /// parallel request). `None`: [`default_fetch_span`] for the store.
    #[serde(deserialize_with = "crate::size::deserialize_opt")]
    pub max_fetch_span: Option<u64>,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// A group (gid) allowed to use the control socket and read the blob files, besides root.
    pub group: Option<u32>,
    /// Warm an image's prefetch plan (if it has one) when a sandbox of it is created.
    pub prefetch: bool,
    /// Concurrent prefetch requests (default: 4 from a `file://` store, where they cost CPU; 32 over a
    /// network, where each costs a round trip).
    pub prefetch_threads: Option<usize>,
    /// Prefetch bandwidth cap in bytes per second (0: none).
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub prefetch_rate: u64,
    /// Bound of the metadata kept on disk for layers no longer mounted (least recently used go first).
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub metadata_cache_size: u64,
    /// Record the chunks read in this many seconds after a sandbox of an image without a prefetch plan
    /// is requested, and store them as its plan (0: never). Needs write access to the store.
    pub record_plans_secs: f64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            store: strata_registry::store::DEFAULT_STORE.to_string(),
            state_dir: PathBuf::from("/var/lib/strata"),
            runtime_dir: PathBuf::from("/run/strata"),
            cache_size: 10 << 30,
            read_timeout_secs: 30.0,
            max_fetch_span: None,
            fuse_threads: 8,
            group: None,
            prefetch: true,
            prefetch_threads: None,
            prefetch_rate: 256 << 20,
            metadata_cache_size: 4 << 30,
            record_plans_secs: 0.0,
        }
    }
}

/// The fetch span for a store when none is configured. Over a network (`s3://`, `http(s)://`) every
/// miss costs a round trip, and 2 MiB is where the slow-link benchmark's time stops falling (4 MiB: same
/// time, 38 % more bytes). A local directory (`file://`) costs no round trip, so fetching ahead only
/// spends CPU on chunks that may never be read: 256 KiB (local cold import 1.03 s against 1.59 s with
/// 2 MiB). See BENCHMARKS.md, "Node daemon".
pub fn default_fetch_span(store: &str) -> u64 {
    match is_local_store(store) {
        true => 256 << 10,
        false => 2 << 20,
    }
}

/// A `file://` store: no round trip per request, fetching costs CPU only.
fn is_local_store(store: &str) -> bool {
    store.starts_with("file://")
}

/// Errors of daemon operations.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Mount(#[from] MountError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no sandbox {0}")]
    NoSandbox(String),
    #[error("sandbox {0} already exists")]
    SandboxExists(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("metadata: {0}")]
    Metadata(String),
}

impl DaemonError {
    /// The HTTP status the control API answers with.
    pub fn status(&self) -> u16 {
        match self {
            DaemonError::NoSandbox(_) => 404,
            DaemonError::Store(e) if e.is_not_found() => 404,
            DaemonError::SandboxExists(_) => 409,
            DaemonError::Invalid(_) => 400,
            DaemonError::Store(StoreError::Model(_)) => 400,
            DaemonError::Store(StoreError::Backend { .. } | StoreError::Timeout { .. }) => 502,
            _ => 500,
        }
    }

    /// What kind of failure this is, for clients: the control API's `kind`, `strata`'s exit code.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DaemonError::NoSandbox(_) => ErrorKind::NotFound,
            DaemonError::SandboxExists(_) => ErrorKind::Conflict,
            DaemonError::Invalid(_) => ErrorKind::Invalid,
            DaemonError::Store(e) if e.is_not_found() => ErrorKind::NotFound,
            DaemonError::Store(e) => match e {
                StoreError::Model(_) | StoreError::BadUrl { .. } => ErrorKind::Invalid,
                StoreError::TagConflict { .. } => ErrorKind::Conflict,
                StoreError::Corrupt { .. } | StoreError::Malformed { .. } => ErrorKind::Corrupt,
                StoreError::Backend { .. } | StoreError::Timeout { .. } => ErrorKind::Store,
                _ => ErrorKind::Internal,
            },
            _ => ErrorKind::Internal,
        }
    }
}

/// Gives directory `dir` the owner, permissions and modification time of directory `from`.
fn root_attrs(from: &Path, dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(from)?;
    std::os::unix::fs::chown(dir, Some(m.uid()), Some(m.gid()))?;
    std::fs::set_permissions(dir, m.permissions())?;
    let f = std::fs::File::open(dir)?;
    f.set_times(std::fs::FileTimes::new().set_modified(m.modified()?))
}

fn io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

struct LayerMount {
    refs: usize,
    path: PathBuf,
    blobs: Vec<Digest>,
    /// Stored bytes of the layer (metadata and blobs).
    bytes: u64,
}

/// A sandbox, as recorded on disk and reported by the API.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub image: String,
    pub manifest: Digest,
    /// Layers bottom first.
    pub layers: Vec<Digest>,
    pub rootfs: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub created: u64,
    /// Stored bytes of the image (metadata and blobs).
    pub image_bytes: u64,
}

#[derive(Default)]
struct State {
    layers: HashMap<Digest, LayerMount>,
    sandboxes: BTreeMap<String, Sandbox>,
    /// Manifests are immutable: each is read from the store once.
    manifests: HashMap<Digest, Arc<Manifest>>,
}

/// The node daemon.
pub struct Daemon {
    pub config: Config,
    store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    fetcher: Arc<Fetcher>,
    table: Arc<BlobTable>,
    state: Mutex<State>,
    /// Serializes mounting new layers (not sandboxes of mounted layers).
    layer_lock: Mutex<()>,
    fuse: Mutex<Option<fuser::BackgroundSession>>,
    warming: Warming,
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !id.starts_with('.')
}

impl Daemon {
    /// Starts the daemon: cleans mounts a crashed predecessor left, opens the store and cache, mounts
    /// the blob server.
    pub fn start(config: Config) -> Result<Arc<Daemon>, DaemonError> {
        for d in [
            config.state_dir.join("layers"),
            config.state_dir.join("sandboxes"),
            config.runtime_dir.join("fuse"),
            config.runtime_dir.join("layers"),
            config.runtime_dir.join("sandboxes"),
        ] {
            std::fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
        }
        crate::perms::secure(&config)?;
        cleanup_mounts(&config.runtime_dir);
        let mut store = Store::open(&config.store)?;
        let deadline = Duration::from_secs_f64(config.read_timeout_secs.max(0.1));
        store.range_deadline = deadline;
        let store = Arc::new(store);
        let cache_dir = config.state_dir.join("cache");
        let cache = ChunkCache::open(&cache_dir, config.cache_size)
            .map_err(|e| DaemonError::Metadata(e.to_string()))?;
        let metrics = Arc::new(Metrics::default());
        let fetcher = Arc::new(Fetcher::new(
            store.clone(),
            cache,
            metrics.clone(),
            config
                .max_fetch_span
                .unwrap_or_else(|| default_fetch_span(&config.store)),
            deadline,
        ));
        let table = Arc::new(BlobTable::default());
        let fs = BlobFs::new(
            table.clone(),
            fetcher.clone(),
            metrics.clone(),
            config.group,
        );
        let fuse_dir = config.runtime_dir.join("fuse");
        let session = blobfs::mount(fs, &fuse_dir, config.fuse_threads, config.group)
            .map_err(|e| io(&fuse_dir, e))?;
        let warm_opts = config.prefetch.then(|| WarmOptions {
            threads: config
                .prefetch_threads
                .unwrap_or(match is_local_store(&config.store) {
                    true => 4,
                    // A plan's chunks are mostly not neighbours, so most requests carry one chunk and
                    // a round trip: 32 in flight fill a 1 Gbit/s, 20 ms link (16 filled half).
                    false => 32,
                })
                .max(1),
            rate: config.prefetch_rate,
            ..WarmOptions::default()
        });
        let record = (config.record_plans_secs > 0.0)
            .then(|| Duration::from_secs_f64(config.record_plans_secs.min(86_400.0)));
        let warming = Warming::new(
            store.clone(),
            table.clone(),
            fetcher.clone(),
            warm_opts,
            record,
        );
        Ok(Arc::new(Daemon {
            warming,
            config,
            store,
            metrics,
            fetcher,
            table,
            state: Mutex::new(State::default()),
            layer_lock: Mutex::new(()),
            fuse: Mutex::new(Some(session)),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves an image reference to its manifest (tags are read every time: they move).
    pub fn resolve(&self, image: &str) -> Result<(Digest, Arc<Manifest>), DaemonError> {
        let d = match Reference::parse(image).map_err(StoreError::from)? {
            Reference::Digest(d) => d,
            Reference::Tag(t) => {
                self.store
                    .tag_get(&t)?
                    .ok_or_else(|| StoreError::NotFound(format!("tag {t}")))?
                    .digest
            }
        };
        if let Some(m) = self.lock().manifests.get(&d) {
            return Ok((d, m.clone()));
        }
        let m = Arc::new(self.store.get_manifest(&d)?);
        self.lock().manifests.insert(d, m.clone());
        Ok((d, m))
    }

    /// Mounts a layer if needed and takes a reference; returns its mount point and stored bytes.
    fn acquire_layer(&self, d: &Digest) -> Result<(PathBuf, u64), DaemonError> {
        let take = |st: &mut State| {
            st.layers.get_mut(d).map(|l| {
                l.refs += 1;
                (l.path.clone(), l.bytes)
            })
        };
        if let Some(found) = take(&mut self.lock()) {
            return Ok(found);
        }
        let _g = self.layer_lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = take(&mut self.lock()) {
            return Ok(found);
        }
        let started = std::time::Instant::now();
        let desc = self.store.get_layer(d)?;
        let bytes = desc.meta.size + desc.blobs.iter().map(|b| b.size).sum::<u64>();
        let meta_path = self
            .config
            .state_dir
            .join("layers")
            .join(format!("{}.erofs", d.hex()));
        // The metadata and the blobs' tables of contents are fetched at once: over a slow link each is a
        // round trip or more, and the mount needs them all.
        let (meta, tocs) = std::thread::scope(|s| {
            let tocs: Vec<_> = desc
                .blobs
                .iter()
                .filter(|b| !self.table.contains(&b.digest))
                .map(|b| s.spawn(move || BlobHandle::open(&self.store, b)))
                .collect();
            let meta = self.fetch_meta(&desc.meta.digest, &meta_path);
            let tocs: Result<Vec<BlobHandle>, DaemonError> = tocs
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r.map_err(DaemonError::from),
                    Err(_) => Err(DaemonError::Metadata(
                        "table of contents fetch panicked".into(),
                    )),
                })
                .collect();
            (meta, tocs)
        });
        meta?;
        let fetched = started.elapsed();
        let mut devices = Vec::new();
        for h in tocs? {
            self.table.add(h);
        }
        for b in &desc.blobs {
            devices.push(
                self.config
                    .runtime_dir
                    .join("fuse/blobs")
                    .join(b.digest.hex()),
            );
        }
        let target = self.config.runtime_dir.join("layers").join(d.hex());
        std::fs::create_dir_all(&target).map_err(|e| io(&target, e))?;
        mount::mount_erofs_with(&meta_path, &devices, &target, true)?;
        tracing::debug!(layer = %d, fetched_ms = fetched.as_millis() as u64,
            mounted_ms = started.elapsed().as_millis() as u64, "layer mounted");
        self.lock().layers.insert(
            *d,
            LayerMount {
                refs: 1,
                path: target.clone(),
                blobs: desc.blobs.iter().map(|b| b.digest).collect(),
                bytes,
            },
        );
        Ok((target, bytes))
    }

    /// A layer's metadata image at `path`, verified: reused if already there and intact, else fetched.
    fn fetch_meta(&self, digest: &Digest, path: &Path) -> Result<(), DaemonError> {
        if std::fs::read(path).is_ok_and(|b| digest.matches(&b)) {
            metadir::touch(path);
            return Ok(());
        }
        let t = std::time::Instant::now();
        let image = self.store.get_meta(digest)?;
        let got = t.elapsed();
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &image).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
        tracing::debug!(meta = %digest, bytes = image.len(), fetch_ms = got.as_secs_f64() * 1e3,
            write_ms = (t.elapsed() - got).as_secs_f64() * 1e3, "layer metadata fetched");
        Ok(())
    }

    /// Drops a reference to a layer; unmounts it when unused.
    fn release_layer(&self, d: &Digest) {
        let path = {
            let mut st = self.lock();
            let Some(l) = st.layers.get_mut(d) else {
                return;
            };
            l.refs -= 1;
            if l.refs > 0 {
                return;
            }
            st.layers.remove(d).map(|l| l.path)
        };
        if let Some(p) = path {
            if let Err(e) = mount::unmount(&p, true) {
                tracing::warn!(error = %e, "releasing layer");
            }
            let _ = std::fs::remove_dir(&p);
            let mounted = self.lock().layers.keys().map(Digest::hex).collect();
            let dir = self.config.state_dir.join("layers");
            let (files, bytes) = metadir::trim(&dir, &mounted, self.config.metadata_cache_size);
            if files > 0 {
                tracing::info!(files, bytes, "layer metadata trimmed to its bound");
            }
        }
    }

    /// Creates a sandbox of `image`: an overlay rootfs with its own upper directory.
    pub fn create_sandbox(
        &self,
        image: &str,
        id: &str,
        dir: Option<&Path>,
    ) -> Result<Sandbox, DaemonError> {
        if !valid_id(id) {
            return Err(DaemonError::Invalid(format!(
                "sandbox id {id:?}: use 1 to 128 of [A-Za-z0-9._-], not starting with '.'"
            )));
        }
        if self.lock().sandboxes.contains_key(id) {
            return Err(DaemonError::SandboxExists(id.to_string()));
        }
        let started = std::time::Instant::now();
        let (manifest, m) = self.resolve(image)?;
        // The plan's lookup overlaps the layers' fetch and mount.
        self.warming.sandbox_requested(&manifest);
        let mut lowers = Vec::new();
        let mut acquired = Vec::new();
        let mut image_bytes = 0;
        for l in &m.layers {
            match self.acquire_layer(&l.digest) {
                Ok((p, b)) => {
                    lowers.push(p);
                    acquired.push(l.digest);
                    image_bytes += b;
                }
                Err(e) => {
                    for a in &acquired {
                        self.release_layer(a);
                    }
                    return Err(e);
                }
            }
        }
        let base = match dir {
            Some(d) => d.to_path_buf(),
            None => self.config.state_dir.join("sandboxes").join(id),
        };
        let (upper, work) = (base.join("upper"), base.join("work"));
        let rootfs = self
            .config
            .runtime_dir
            .join("sandboxes")
            .join(id)
            .join("rootfs");
        let fresh = !upper.exists();
        let made = [&upper, &work, &rootfs]
            .iter()
            .try_for_each(|p| std::fs::create_dir_all(p).map_err(|e| io(p, e)));
        // The overlay's root shows the upper directory's attributes: a new one takes the image's.
        let made = match (made, lowers.last()) {
            (Ok(()), Some(top)) if fresh => root_attrs(top, &upper).map_err(|e| io(&upper, e)),
            (r, _) => r,
        };
        lowers.reverse(); // overlay wants the top layer first
        let mounted = made.and_then(|_| {
            mount::mount_overlay(&lowers, &upper, &work, &rootfs).map_err(DaemonError::from)
        });
        if let Err(e) = mounted {
            for a in &acquired {
                self.release_layer(a);
            }
            return Err(e);
        }
        let sb = Sandbox {
            id: id.to_string(),
            image: image.to_string(),
            manifest,
            layers: acquired,
            rootfs,
            upper,
            work,
            created: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            image_bytes,
        };
        self.lock().sandboxes.insert(id.to_string(), sb.clone());
        tracing::debug!(
            id,
            ms = started.elapsed().as_millis() as u64,
            "sandbox created"
        );
        Ok(sb)
    }

    /// Removes a sandbox's rootfs (its upper directory stays on disk for `pack_diff`).
    pub fn remove_sandbox(&self, id: &str) -> Result<Sandbox, DaemonError> {
        let sb = self
            .lock()
            .sandboxes
            .remove(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.to_string()))?;
        if let Err(e) = mount::unmount(&sb.rootfs, true) {
            tracing::warn!(error = %e, sandbox = id, "unmounting rootfs");
        }
        let _ = std::fs::remove_dir(&sb.rootfs);
        if let Some(parent) = sb.rootfs.parent() {
            let _ = std::fs::remove_dir(parent);
        }
        for l in &sb.layers {
            self.release_layer(l);
        }
        Ok(sb)
    }

    /// [`Daemon::remove_sandbox`], then deletes its upper and work directories (and their directory if
    /// that is left empty): for sandboxes nothing runs in any more and that will not be packed.
    pub fn purge_sandbox(&self, id: &str) -> Result<Sandbox, DaemonError> {
        let sb = self.remove_sandbox(id)?;
        for d in [&sb.upper, &sb.work] {
            match std::fs::remove_dir_all(d) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(d, e)),
                _ => {}
            }
        }
        if let Some(base) = sb.upper.parent() {
            let _ = std::fs::remove_dir(base);
        }
        Ok(sb)
    }

    /// Every sandbox.
    pub fn sandboxes(&self) -> Vec<Sandbox> {
        self.lock().sandboxes.values().cloned().collect()
    }

    /// One sandbox.
    pub fn sandbox(&self, id: &str) -> Option<Sandbox> {
        self.lock().sandboxes.get(id).cloned()
    }

    /// Bytes fetched for the blobs of these layers.
    pub fn fetched_bytes(&self, layers: &[Digest]) -> u64 {
        let st = self.lock();
        let mut blobs: Vec<Digest> = layers
            .iter()
            .filter_map(|l| st.layers.get(l))
            .flat_map(|l| l.blobs.iter().copied())
            .collect();
        blobs.sort();
        blobs.dedup();
        blobs.iter().map(|b| self.metrics.fetched_bytes(b)).sum()
    }

    /// A status document: layers, cache, sandboxes.
    pub fn status(&self) -> serde_json::Value {
        let cache = self.fetcher.cache();
        let st = self.lock();
        let layers: Vec<_> = st
            .layers
            .iter()
            .map(|(d, l)| serde_json::json!({"digest": d.to_string(), "refs": l.refs, "path": l.path}))
            .collect();
        serde_json::json!({
            "store": self.config.store,
            "cache": {"used": cache.used(), "capacity": cache.capacity(), "chunks": cache.len()},
            "layers": layers,
            "sandboxes": st.sandboxes.len(),
            "prefetch": self.warming.status(),
            "trace": self.table.trace.is_on(),
            "recording_plan": self.warming.recording().map(|d| d.to_string()),
        })
    }

    /// Starts recording the chunks reads touch (`strata trace`); `false` if a trace already runs.
    pub fn trace_start(&self) -> bool {
        // An explicit trace takes the recorder from a plan recording.
        self.warming.cancel_recording();
        self.table.trace.start()
    }

    /// Stops the trace; returns the chunks touched, first touch first.
    pub fn trace_stop(&self) -> Vec<PlanEntry> {
        self.table.trace.stop()
    }

    /// Prometheus metrics.
    pub fn render_metrics(&self) -> String {
        let prefetched = self.warming.totals();
        let cache = self.fetcher.cache();
        let st = self.lock();
        let extra = format!(
            "# HELP strata_cache_bytes Bytes in the chunk cache\n# TYPE strata_cache_bytes gauge\nstrata_cache_bytes {}\n\
             # HELP strata_cache_capacity_bytes Chunk cache bound\n# TYPE strata_cache_capacity_bytes gauge\nstrata_cache_capacity_bytes {}\n\
             # HELP strata_layers_mounted Layers mounted on this node\n# TYPE strata_layers_mounted gauge\nstrata_layers_mounted {}\n\
             # HELP strata_sandboxes Sandboxes on this node\n# TYPE strata_sandboxes gauge\nstrata_sandboxes {}\n\
             # HELP strata_prefetch_chunks_total Chunks fetched by prefetch\n# TYPE strata_prefetch_chunks_total counter\nstrata_prefetch_chunks_total {}\n\
             # HELP strata_prefetch_bytes_total Bytes fetched by prefetch\n# TYPE strata_prefetch_bytes_total counter\nstrata_prefetch_bytes_total {}\n",
            cache.used(),
            cache.capacity(),
            st.layers.len(),
            st.sandboxes.len(),
            prefetched.0,
            prefetched.1
        );
        drop(st);
        self.metrics.render(&extra)
    }

    /// Stops: detaches every sandbox rootfs and layer mount, then unmounts the blob server. Processes
    /// still running in a sandbox keep what they have open; reads of data not yet cached fail with EIO.
    pub fn shutdown(&self) {
        self.warming.stop();
        let ids: Vec<String> = self.lock().sandboxes.keys().cloned().collect();
        for id in ids {
            let _ = self.remove_sandbox(&id);
        }
        let layers: Vec<(Digest, PathBuf)> = self
            .lock()
            .layers
            .drain()
            .map(|(d, l)| (d, l.path))
            .collect();
        for (_, p) in layers {
            let _ = mount::unmount(&p, true);
        }
        if let Some(s) = self.fuse.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if let Err(e) = s.umount_and_join() {
                tracing::warn!(error = %e, "unmounting blob server");
                let _ = mount::unmount(&self.config.runtime_dir.join("fuse"), true);
            }
        }
    }
}

/// Detaches every mount below `runtime` (left by a daemon that was killed), deepest first.
pub fn cleanup_mounts(runtime: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let prefix = runtime.to_string_lossy().to_string();
    let mut points: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| p.replace("\\040", " "))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        tracing::info!(mount = %p, "detaching stale mount");
        let _ = mount::unmount(Path::new(&p), true);
    }
}
