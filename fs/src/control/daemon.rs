//! The node daemon's core: layer mounts shared by every sandbox, and one overlay per sandbox.
//!
//! Mounting an image resolves tag → manifest → layers. Each layer not yet mounted on the node has its
//! metadata fetched to local disk (verified), its blobs registered with the FUSE blob server (their
//! tables of contents fetched and verified), and is mounted as kernel EROFS with one `device=` per blob
//! file — file-backed, or on loop devices of those files on older kernels (the mount mode, probed at
//! start: [`crate::control::modes`], [`crate::control::loops`]). Layer mounts are reference counted: every sandbox of every image that uses a
//! layer shares one mount (one page-cache copy) and the last sandbox to go releases it. A sandbox is an
//! overlay of its image's layers (top first) with its own upper and work directories.
//!
//! **Surviving the process.** The daemon serves a FUSE connection it may not have opened: started with
//! an inherited one ([`Daemon::start`] with a [`Channel`]), it adopts the node as a predecessor left it —
//! sandbox records from [`crate::control::state`], their layers' blobs registered from kept tables of contents
//! before the first request is read, then the kernel asked to resend what the predecessor had read but
//! not answered. Nothing is unmounted, so sandboxes never notice. Started without one, it cleans up what a
//! dead node left (mounts under the runtime directory) and mounts a new connection; sandboxes recorded
//! then are listed as stopped, their upper directories intact. [`Daemon::stop_serving`] is the
//! handover half: stop reading requests and leave everything mounted for the successor;
//! [`Daemon::shutdown`] is the teardown.
//!
//! Directories: `<state>/layers/<hex>.erofs` (metadata, on disk: the kernel refuses tmpfs),
//! `<state>/cache/` (chunk cache), `<state>/node/` (records, see [`crate::control::state`]),
//! `<state>/sandboxes/<id>/{upper,work}`; `<runtime>/fuse/` (blob server), `<runtime>/layers/<hex>/`,
//! `<runtime>/sandboxes/<id>/rootfs`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use strata_prefetch::{PlanEntry, WarmOptions};
use strata_registry::digest::Digest;
use strata_registry::model::{Manifest, Reference};
use strata_registry::store::{Store, StoreError};

use crate::blobfs::{BlobFs, BlobTable, InoCollision};
use crate::cache::ChunkCache;
use crate::control::loops::Loops;
use crate::control::modes::{ModeError, ModeReport, MountMode};
use crate::control::state::{NodeState, StateError};
use crate::control::trees::{Kept, Trees};
use crate::fetch::Fetcher;
use crate::fuse::session::{Options, Session};
use crate::fuse::Channel;
use crate::metadir;
use crate::metrics::Metrics;
use crate::mount::{self, MountError};
use crate::warming::Warming;
use strata_api::ErrorKind;

pub use crate::control::state::{Sandbox, SandboxState};

use super::config::is_local_store;
pub use super::config::{default_fetch_behind, default_fetch_span, default_fetch_stream, Config};

/// Errors of daemon operations.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Mount(#[from] MountError),
    #[error("{0}")]
    Kernel(#[from] crate::kernelcheck::KernelCheckError),
    #[error("fuse mode: {0}")]
    Tree(#[from] crate::treefs::TreeError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    State(#[from] StateError),
    #[error("{0}")]
    Ino(#[from] InoCollision),
    #[error("{0}")]
    Vm(#[from] crate::control::vm::VmError),
    #[error("{0}")]
    Mode(#[from] ModeError),
    #[error("chunk cache: {0}")]
    Cache(#[from] crate::cache::CacheError),
    #[error("no sandbox {0}")]
    NoSandbox(String),
    #[error("sandbox {0} already exists")]
    SandboxExists(String),
    #[error("sandbox {0} is stopped (its upper directory is kept: `strata rm` removes it, `strata mount --resume` continues it)")]
    NotRunning(String),
    /// The id has a stopped sandbox's upper directory and the request did not say what to do with it.
    #[error("sandbox {id} has a stopped upper directory{}: resume it with --resume (same image) or discard it with --fresh", of_image(.image))]
    Leftover { id: String, image: Option<String> },
    /// `--resume` of a sandbox made from another image.
    #[error("sandbox {id} was made from image {was} ({was_manifest}), not {image}: use --fresh to discard its upper directory")]
    OtherImage {
        id: String,
        was: String,
        was_manifest: Digest,
        image: String,
    },
    /// Processes still run in the sandbox's rootfs.
    #[error(
        "sandbox {id} still has processes in its rootfs (pids {pids:?}): stop them, or use --force"
    )]
    Busy { id: String, pids: Vec<i32> },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("metadata: {0}")]
    Metadata(String),
}

fn of_image(image: &Option<String>) -> String {
    image
        .as_ref()
        .map_or_else(String::new, |i| format!(" from image {i}"))
}

impl DaemonError {
    /// The HTTP status the control API answers with: the kind's.
    pub fn status(&self) -> u16 {
        self.kind().status()
    }

    /// What kind of failure this is, for clients: the control API's `kind`, `strata`'s exit code.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DaemonError::NoSandbox(_) => ErrorKind::NotFound,
            DaemonError::SandboxExists(_) => ErrorKind::Conflict,
            DaemonError::Leftover { .. }
            | DaemonError::OtherImage { .. }
            | DaemonError::Busy { .. }
            | DaemonError::NotRunning(_) => ErrorKind::Sandbox,
            DaemonError::Invalid(_) => ErrorKind::Invalid,
            DaemonError::Vm(
                crate::control::vm::VmError::TooManyDrives { .. }
                | crate::control::vm::VmError::ScratchTooSmall(_),
            ) => ErrorKind::Invalid,
            DaemonError::Store(e) => e.kind(),
            _ => ErrorKind::Internal,
        }
    }
}

pub(crate) fn io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) struct LayerMount {
    pub(crate) refs: usize,
    pub(crate) path: PathBuf,
    /// Stored bytes of the layer (metadata and blobs).
    pub(crate) bytes: u64,
    /// The blobs the layer reads (`fanotify` mode keeps their view files: [`Daemon::trim_views`]).
    pub(crate) blobs: Vec<Digest>,
    /// Mounted with its view files watched: by this process, or by one that left the marker saying so
    /// (`loops::watched_marker`). `fanotify` mode evicts chunks only of blobs no other layer reads
    /// ([`crate::fanotify::evict`]).
    pub(crate) views_watched: bool,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) layers: HashMap<Digest, LayerMount>,
    /// Every recorded sandbox, running or stopped.
    pub(crate) sandboxes: BTreeMap<String, Sandbox>,
    /// Layers microVMs use (served, not mounted): see [`crate::control::vm`].
    pub(crate) vm_layers: HashMap<Digest, crate::control::vm::VmLayer>,
    /// Manifests are immutable: each is read from the store once.
    manifests: HashMap<Digest, Arc<Manifest>>,
    /// Stored bytes of images, as `strata images` counts them (see [`Daemon::image_bytes`]).
    pub(crate) image_sizes: HashMap<Digest, u64>,
}

/// The node daemon.
pub struct Daemon {
    pub config: Config,
    pub(crate) store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub(crate) fetcher: Arc<Fetcher>,
    pub(crate) table: Arc<BlobTable>,
    pub(crate) state: Mutex<State>,
    pub(crate) node: NodeState,
    /// Serializes serving and mounting new layers (not their fetches: [`crate::control::acquire`]).
    pub(crate) layer_lock: Mutex<()>,
    /// One fetch per layer, and one per blob's table of contents, at a time.
    pub(crate) layer_flights: super::flights::Flights,
    pub(crate) blob_flights: super::flights::Flights,
    fuse: Mutex<Option<Session>>,
    chan: Arc<Channel>,
    pub(crate) warming: Warming,
    /// True when this process took over a connection another one served.
    pub adopted: bool,
    /// How layers are mounted, and why (probed at start).
    pub(crate) mode: MountMode,
    pub mode_report: ModeReport,
    pub(crate) loops: Loops,
    /// Where removed sandboxes' directories go to be deleted in the background.
    pub(crate) trash: crate::control::teardown::Trash,
    /// `fuse` mode's tree connections, and where they are kept for successors.
    pub(crate) trees: Trees,
    /// `fanotify` mode's pre-content server and view files.
    pub(crate) views: Option<Arc<crate::fanotify::Server>>,
    /// Sandboxes made ahead ([`crate::control::pool`]).
    pub(crate) pool: crate::control::pool::Pool,
    /// Scrubs, one at a time (a scrub asked for while another runs answers that one's report), and the
    /// last one's report, with when it ended (`GET /v1/status`'s `scrub`).
    pub(crate) scrubs: super::single::Single<serde_json::Value>,
}

pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !id.starts_with('.')
}

/// The FUSE connection a daemon serves.
pub enum Fuse {
    /// Mount a new one (after cleaning up what a dead node left).
    Mount,
    /// One this daemon's holder (or systemd) just mounted: nothing to adopt yet.
    Fresh(Channel),
    /// One another server served: adopt the node and have the kernel resend what that server held.
    Adopt(Channel),
}

/// Prefetch settings from the configuration (`None`: prefetch off).
fn warm_options(config: &Config) -> Option<WarmOptions> {
    config.prefetch.then(|| WarmOptions {
        threads: config
            .prefetch_threads
            .unwrap_or(match is_local_store(&config.store) {
                true => 4,
                // A plan's chunks are mostly not neighbours, so most requests carry one chunk and a
                // round trip: 32 in flight fill a 1 Gbit/s, 20 ms link (16 filled half).
                false => 32,
            })
            .max(1),
        rate: config.prefetch_rate,
        ..WarmOptions::default()
    })
}

/// Prepares a node whose FUSE connection is gone (first start, or both the server and the holder of
/// its descriptor died): creates the directories, detaches every mount a dead daemon left under the
/// runtime directory, and mounts a new blob-server connection. Sandboxes recorded before are then
/// stopped (their mounts are gone); their upper directories stay.
pub fn mount_fresh(config: &Config) -> Result<Channel, DaemonError> {
    // First: a dead FUSE mount makes its mount point unusable ("File exists" from mkdir, ENOTCONN
    // from stat) until it is detached.
    cleanup_mounts(&config.runtime_dir);
    for d in [
        config.state_dir.join("layers"),
        config.state_dir.join("sandboxes"),
        config.runtime_dir.join("fuse"),
        config.runtime_dir.join("layers"),
        config.runtime_dir.join("sandboxes"),
    ] {
        std::fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
    }
    crate::control::perms::secure(config)?;
    let fuse_dir = config.runtime_dir.join("fuse");
    Channel::mount(&fuse_dir, config.group.is_some()).map_err(|e| io(&fuse_dir, e))
}

/// The data plane under the control plane: the store (with the read deadline), the fetcher that serves
/// misses from it through the chunk cache, and the metrics they count into.
struct DataPlane {
    store: Arc<Store>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
}

fn open_data_plane(config: &Config) -> Result<DataPlane, DaemonError> {
    let opts = strata_registry::store::StoreOptions {
        timeout: Duration::from_secs_f64(config.store_timeout_secs.clamp(0.1, 1e9)),
    };
    let mut store = Store::open_with(&config.store, &opts)?;
    let deadline = Duration::from_secs_f64(config.read_timeout_secs.max(0.1));
    store.range_deadline = deadline;
    let store = Arc::new(store);
    let cache = ChunkCache::open(&config.state_dir.join("cache"), config.cache_size)?;
    let metrics = Arc::new(Metrics::default());
    let span = config
        .max_fetch_span
        .unwrap_or_else(|| default_fetch_span(&config.store));
    let mut fetcher = Fetcher::new(store.clone(), cache, metrics.clone(), span, deadline);
    fetcher.max_behind = config
        .max_fetch_behind
        .unwrap_or_else(|| default_fetch_behind(&config.store));
    fetcher.max_group = config.max_fetch_group;
    fetcher.max_stream = config
        .max_fetch_stream
        .unwrap_or_else(|| default_fetch_stream(&config.store));
    Ok(DataPlane {
        store,
        fetcher: Arc::new(fetcher),
        metrics,
    })
}

impl Daemon {
    /// Starts the daemon on `fuse`: a connection another server served (adopts the node's mounts and
    /// sandboxes as it left them), one its holder just mounted, or a new one ([`mount_fresh`]: detaches
    /// what a dead node left under the runtime directory first).
    pub fn start(config: Config, fuse: Fuse) -> Result<Arc<Daemon>, DaemonError> {
        Daemon::start_kept(config, fuse, Kept::default())
    }

    /// [`Daemon::start`] with the descriptors a predecessor kept (`fuse` mode's tree connections) and
    /// where to keep new ones ([`crate::control::trees`]).
    pub fn start_kept(config: Config, fuse: Fuse, kept: Kept) -> Result<Arc<Daemon>, DaemonError> {
        let (chan, adopted) = match fuse {
            Fuse::Mount => (mount_fresh(&config)?, false),
            Fuse::Fresh(c) => (c, false),
            Fuse::Adopt(c) => (c, true),
        };
        if adopted {
            // A predecessor (perhaps an older version) may have left looser modes behind.
            crate::control::perms::secure(&config)?;
        }
        let chan = Arc::new(chan);
        let mode_report =
            crate::control::modes::for_server(&config.state_dir, config.mount_mode, adopted);
        let mode = mode_report.usable()?;
        tracing::info!(%mode, passed_over = ?mode_report.passed_over,
            probe_ms = mode_report.probe_ms, "mount mode");
        let DataPlane {
            store,
            fetcher,
            metrics,
        } = open_data_plane(&config)?;
        let table = Arc::new(BlobTable::default());
        let (fan_kept, fds) = crate::control::views::take_kept(kept.fds);
        let kept = Kept {
            fds,
            keeper: kept.keeper,
        };
        let views = match mode {
            MountMode::Fanotify => Some(crate::control::views::start(
                &config,
                fan_kept,
                fetcher.clone(),
                metrics.clone(),
                table.clone(),
                kept.keeper.as_deref(),
            )?),
            _ => None,
        };
        let warming = Warming::new(
            store.clone(),
            table.clone(),
            fetcher.clone(),
            warm_options(&config),
            (config.record_plans_secs > 0.0)
                .then(|| Duration::from_secs_f64(config.record_plans_secs.min(86_400.0))),
        );
        let config_loop_dio = config.loop_direct_io;
        let config_pool = config.sandbox_pool;
        let trash = crate::control::teardown::Trash::new(
            [&config.state_dir, &config.runtime_dir]
                .iter()
                .map(|d| d.join("sandboxes").join(".trash"))
                .collect(),
        );
        let d = Arc::new(Daemon {
            warming,
            node: NodeState::open(&config.state_dir)?,
            config,
            store,
            metrics,
            fetcher,
            table,
            state: Mutex::new(State::default()),
            layer_lock: Mutex::new(()),
            layer_flights: Default::default(),
            blob_flights: Default::default(),
            fuse: Mutex::new(None),
            chan,
            adopted,
            mode,
            mode_report,
            loops: Loops::new(config_loop_dio),
            trash,
            trees: Trees::new(kept),
            views,
            pool: crate::control::pool::Pool::new(config_pool),
            scrubs: Default::default(),
        });
        // Every running sandbox's blobs are registered before the first request is read.
        d.restore()?;
        d.serve_blobs()?;
        d.serve_views();
        d.adopt_trees();
        d.remount_held_layers();
        d.start_flushing();
        d.start_scrubbing();
        d.start_evicting();
        d.start_pool();
        Ok(d)
    }

    /// Starts serving the blob server's FUSE connection. Adopted: requests the previous server read
    /// but did not answer come back to this one (the kernel resends them, or this server answers them
    /// from the connection's journal).
    fn serve_blobs(&self) -> Result<(), DaemonError> {
        let d = self;
        let fs = BlobFs::new(
            d.table.clone(),
            d.fetcher.clone(),
            d.metrics.clone(),
            d.config.group,
        )
        .map_err(|e| io(&d.config.runtime_dir, e))?
        .with_workers(d.config.fuse_threads);
        let opts = Options {
            adopt: d.adopted,
            no_resend: std::env::var_os("STRATAD_NO_RESEND").is_some(),
            ..Options::default()
        };
        let session = Session::start(d.chan.clone(), Arc::new(fs), d.config.fuse_threads, opts)
            .map_err(|e| io(&d.config.runtime_dir, e))?;
        *d.fuse.lock().unwrap_or_else(|p| p.into_inner()) = Some(session);
        Ok(())
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
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

    /// Drops a reference to a layer; unmounts it when unused.
    pub(crate) fn release_layer(&self, d: &Digest) {
        let drop_ref = |st: &mut State| {
            let l = st.layers.get_mut(d)?;
            l.refs -= 1;
            match l.refs {
                0 => st.layers.remove(d).map(|l| l.path),
                _ => None,
            }
        };
        match self.lock().layers.get_mut(d) {
            None => return,
            Some(l) if l.refs > 1 => {
                l.refs -= 1;
                return;
            }
            Some(_) => {}
        }
        // The last reference goes under the layer's flight: an acquirer that finds the layer gone waits
        // until it is unmounted (unmounted after, its new mount at the same path would be detached).
        let flight = self.layer_flights.enter(d);
        let Some(p) = drop_ref(&mut self.lock()) else {
            return;
        };
        if let Err(e) = mount::unmount(&p, true) {
            tracing::warn!(error = %e, "releasing layer");
        }
        self.trees.remove(d);
        let _ = std::fs::remove_dir(&p);
        let _ = std::fs::remove_file(crate::control::loops::watched_marker(&p));
        drop(flight);
        self.trim_metadata();
        self.trim_views();
    }

    /// Trims the layer metadata kept on disk to its bound, keeping every layer in use (mounted, or
    /// served to a microVM).
    pub(crate) fn trim_metadata(&self) {
        let used = {
            let st = self.lock();
            st.layers
                .keys()
                .chain(st.vm_layers.keys())
                .map(Digest::hex)
                .collect()
        };
        let dir = self.config.state_dir.join("layers");
        let (files, bytes) = metadir::trim(&dir, &used, self.config.metadata_cache_size);
        if files > 0 {
            tracing::info!(files, bytes, "layer metadata trimmed to its bound");
        }
    }

    /// Every sandbox.
    pub fn sandboxes(&self) -> Vec<Sandbox> {
        self.lock().sandboxes.values().cloned().collect()
    }

    /// One sandbox.
    pub fn sandbox(&self, id: &str) -> Option<Sandbox> {
        self.lock().sandboxes.get(id).cloned()
    }

    /// A status document: layers, cache, sandboxes.
    pub fn status(&self) -> serde_json::Value {
        let cache = self.fetcher.cache();
        let unattributed = self.fetched_unattributed();
        let st = self.lock();
        let layers: Vec<_> = st
            .layers
            .iter()
            .map(|(d, l)| serde_json::json!({"digest": d.to_string(), "refs": l.refs, "path": l.path}))
            .collect();
        let vm_layers: Vec<_> = st
            .vm_layers
            .iter()
            .map(|(d, l)| serde_json::json!({"digest": d.to_string(), "refs": l.refs}))
            .collect();
        let fuse = self.fuse.lock().unwrap_or_else(|p| p.into_inner());
        let fuse = fuse.as_ref().map(|s| {
            let st = &s.stats;
            serde_json::json!({
                "requests": st.requests.load(std::sync::atomic::Ordering::Relaxed),
                "resent": st.resent.load(std::sync::atomic::Ordering::Relaxed),
                "replayed": st.replayed.load(std::sync::atomic::Ordering::Relaxed),
                "journal": s.channel().journal().is_some(),
                "initialized_here": st.initialized_here.load(std::sync::atomic::Ordering::Relaxed),
                "trees": self.trees.status(),
            })
        });
        let running = st
            .sandboxes
            .values()
            .filter(|s| s.state == SandboxState::Running)
            .count();
        serde_json::json!({
            "pid": std::process::id(),
            "version": env!("CARGO_PKG_VERSION"),
            "build": option_env!("STRATA_BUILD").unwrap_or(""),
            "adopted": self.adopted,
            "mount_mode": self.mode,
            "mount_modes": self.mode_report,
            "loop_devices": self.loop_devices(),
            "fuse": fuse,
            "fanotify": self.views.as_ref().map(|v| v.status()),
            "pool": self.pool.on().then(|| self.pool.status()),
            "running": running,
            "fetched_unattributed": unattributed,
            "store": self.config.store,
            "cache": {"used": cache.used(), "capacity": cache.capacity(), "chunks": cache.len()},
            "layers": layers,
            "vm_layers": vm_layers,
            "sandboxes": st.sandboxes.len(),
            "prefetch": self.warming.status(),
            "workers": self.fetcher.workers().status(),
            "groups": (self.fetcher.max_group > 0).then(|| self.fetcher.groups().status()),
            "trace": self.table.trace.is_on(),
            "recording_plan": self.warming.recording().map(|d| d.to_string()),
            "scrub": self.scrubs.last(),
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

    /// Prometheus metrics (OpenMetrics text).
    pub fn render_metrics(&self) -> String {
        let (prefetch_chunks, prefetch_bytes) = self.warming.totals();
        let cache = self.fetcher.cache();
        let (layers, sandboxes) = {
            let st = self.lock();
            (st.layers.len() as u64, st.sandboxes.len() as u64)
        };
        let stat = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        self.metrics.render(&crate::metrics::NodeGauges {
            cache_bytes: cache.used(),
            cache_capacity: cache.capacity(),
            layers,
            sandboxes,
            prefetch_chunks,
            prefetch_bytes,
            cache_checked: stat(&cache.stats.checked),
            cache_rejected: stat(&cache.stats.rejected),
        })
    }

    /// Stops answering FUSE requests and leaves every mount in place, for a successor serving the same
    /// connection (an upgrade, or a restart under a descriptor holder): requests read from now on are
    /// resent to the successor. The process should exit soon after.
    pub fn stop_serving(&self) {
        self.warming.stop();
        self.trees.stop_all();
        if let Some(v) = &self.views {
            v.stop();
        }
        if let Some(s) = self.fuse.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            s.stop();
        }
        self.retire_fetched();
    }

    /// Tears the node down: detaches every sandbox rootfs and layer mount, then the blob server.
    /// Processes still running in a sandbox keep what they have open; reads of data not yet cached fail
    /// with EIO. Sandboxes stay recorded (stopped), with their upper directories.
    pub fn shutdown(&self) {
        self.warming.stop();
        let ids: Vec<String> = self
            .lock()
            .sandboxes
            .values()
            .filter(|s| s.state == SandboxState::Running)
            .map(|s| s.id.clone())
            .collect();
        for id in ids {
            let _ = self.remove_sandbox(&id);
        }
        self.drain_pool();
        let layers: Vec<PathBuf> = self.lock().layers.drain().map(|(_, l)| l.path).collect();
        for p in layers {
            let _ = mount::unmount(&p, true);
            let _ = std::fs::remove_file(crate::control::loops::watched_marker(&p));
        }
        self.trees.clear();
        if let Some(v) = &self.views {
            v.stop();
        }
        if let Some(s) = self.fuse.lock().unwrap_or_else(|p| p.into_inner()).take() {
            s.stop();
            if let Err(e) = mount::unmount(&self.config.runtime_dir.join("fuse"), true) {
                tracing::warn!(error = %e, "unmounting blob server");
            }
        }
    }
}

/// Detaches every mount below `runtime` (left by a daemon that was killed), deepest first.
pub fn cleanup_mounts(runtime: &Path) {
    detach(
        crate::control::state::mount_points(runtime),
        "detaching stale mount",
    );
}

/// Detaches `points` lazily, deepest first (a mount below another goes before it), logging `why`.
pub(crate) fn detach(mut points: Vec<PathBuf>, why: &str) {
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        tracing::info!(mount = %p.display(), "{why}");
        let _ = mount::unmount(&p, true);
    }
}
