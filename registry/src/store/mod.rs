//! Stores: where layers, blobs, manifests and tags live.
//!
//! A store is one bucket or directory laid out as
//!
//! ```text
//! blobs/<hex>            blob objects (zstd frames + table of contents + footer)
//! index/<hex>            the blob's index segment (store-wide dedup: crate::index)
//! meta/<hex>             EROFS metadata images
//! layers/<hex>.json      layer descriptors
//! manifests/<hex>.json   image manifests
//! tags/<name>/<tag>      tags (the text `blake3:<hex>`); a local store serializes updates with tags/.lock
//! plans/<hex>.json       prefetch plans (content addressed); plans/by-manifest/<hex> names an image's plan,
//!                        plans/by-layer/<hex> a layer's, plans/by-blob/<hex> the layer plan that
//!                        last credited the blob's chunks
//! oci/<sha256>           import records: the layer made from an OCI layer, by its chain ID
//! gc/condemned/<key>     garbage collection's marks on unreferenced objects it will delete later
//! tmp/                   a local store's spool for blobs being written (leftovers of writers that died
//!                        are removed by gc and imports: [`spool`])
//! ```
//!
//! `<hex>` is the BLAKE3 digest of the object's bytes. [`Store::open`] picks the backend from the URL:
//! `file:///path` or `s3://bucket/prefix` (endpoint from `AWS_ENDPOINT_URL`, region and credentials from
//! the usual `AWS_*` variables; path-style requests so that MinIO, Ceph RGW and other S3-compatible
//! servers work). Underneath is the seam [`StoreBackend`] ([`object`] has its contract):
//! [`Store::with_backend`] builds a store on any implementation — the in-memory [`MemoryStore`], or a
//! [`FaultyStore`] that delays, hangs, fails or corrupts chosen reads for tests. [`conformance`] is the
//! one suite every backend passes.
//!
//! Rules every writer here follows: objects are content addressed, so writes are idempotent; a caller
//! writes an object before anything that refers to it (blob → index segment → metadata → layer →
//! manifest → tag), so a crash leaves unreferenced garbage, never a broken image; tags move only by
//! compare-and-swap. Every read of a whole object is verified against its digest before it is returned.

mod backend;
pub mod conditional;
#[doc(hidden)]
pub mod conformance;
pub mod direct;
mod error;
pub mod fault;
pub(crate) mod frames;
mod image_size;
pub mod memory;
mod meta;
pub mod object;
pub mod spool;
mod tagfile;
mod tags;
pub mod tripwire;
pub(crate) mod unpack;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::digest::Digest;
use crate::model::{JsonObject, LayerDescriptor, Manifest};
use crate::toc::{Footer, Toc, TocError, FOOTER_LEN};

pub use backend::ObjectStoreBackend;
pub use error::StoreError;
pub use fault::{Fault, FaultId, FaultKind, FaultyStore, Op};
pub use memory::MemoryStore;
pub use object::{ObjectMeta, PutMode, StoreBackend, Version};
pub use spool::{SpoolReport, SPOOL_GRACE};

/// The embedded default store.
pub const DEFAULT_STORE: &str = "file:///var/lib/strata/store";

/// Default deadline of a store operation other than a range read (whole-object reads and writes, `head`,
/// deletes, a page of a listing, a part of an upload): past it the operation fails with
/// [`StoreError::Timeout`].
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(60);

/// How to open a store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Deadline of every operation but a range read ([`DEFAULT_STORE_TIMEOUT`]).
    pub timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            timeout: DEFAULT_STORE_TIMEOUT,
        }
    }
}

/// Object keys.
pub mod key {
    use crate::digest::Digest;

    pub fn blob(d: &Digest) -> String {
        format!("blobs/{}", d.hex())
    }
    pub fn meta(d: &Digest) -> String {
        format!("meta/{}", d.hex())
    }
    pub fn layer(d: &Digest) -> String {
        format!("layers/{}.json", d.hex())
    }
    pub fn manifest(d: &Digest) -> String {
        format!("manifests/{}.json", d.hex())
    }
    /// A prefetch plan (content addressed).
    pub fn plan(d: &Digest) -> String {
        format!("plans/{}.json", d.hex())
    }
    /// The pointer to the prefetch plan of the image with manifest `d` (an index object).
    pub fn plan_of(manifest: &Digest) -> String {
        format!("plans/by-manifest/{}", manifest.hex())
    }
    /// The pointer to the prefetch plan of layer `d` (an index object; see `strata_prefetch::layerplan`).
    pub fn plan_of_layer(layer: &Digest) -> String {
        format!("plans/by-layer/{}", layer.hex())
    }

    /// The index object naming the layer plan that last credited chunks of `blob`: a layer without a
    /// plan of its own (a rebuilt base) inherits what plans know of the blobs it names.
    pub fn plan_of_blob(blob: &Digest) -> String {
        format!("plans/by-blob/{}", blob.hex())
    }
    /// The marker garbage collection leaves on an unreferenced object it will delete in a later run
    /// (see [`crate::gc`]).
    pub fn condemned(object_key: &str) -> String {
        format!("gc/condemned/{object_key}")
    }
    /// The layer imported from the OCI layer whose chain ID (the layer and the layers below it) is
    /// `sha256:<chain_id_hex>`.
    pub fn oci_import(chain_id_hex: &str) -> String {
        format!("oci/{chain_id_hex}")
    }
}

pub use tags::{BrokenTag, TagList, TagState};

/// An open store.
pub struct Store {
    backend: Arc<dyn StoreBackend>,
    /// Root directory of a local store.
    local: Option<PathBuf>,
    /// The lock file that serializes tag changes on an S3 server without conditional writes
    /// (`STRATA_TAG_LOCK`; see [`tags`]).
    tag_lock: Option<PathBuf>,
    /// Deadline of a range read.
    pub range_deadline: Duration,
}

impl Store {
    /// Opens a store that must already exist: a `file://` store whose directory is missing is
    /// [`StoreError::NoStore`] and nothing is created (commands that only read use this).
    pub fn open_existing(url: &str) -> Result<Store, StoreError> {
        Store::open_existing_with(url, &StoreOptions::default())
    }

    /// [`Store::open_existing`] with options.
    pub fn open_existing_with(url: &str, opts: &StoreOptions) -> Result<Store, StoreError> {
        if let Some(path) = url
            .strip_prefix("file://")
            .or(url.starts_with('/').then_some(url))
        {
            let root = Path::new(path);
            if root.is_absolute() && !root.is_dir() {
                return Err(StoreError::NoStore {
                    url: url.to_string(),
                    path: root.to_path_buf(),
                });
            }
        }
        Store::open_with(url, opts)
    }

    /// Opens the store at `url` (`file:///path` or `s3://bucket/prefix`), creating a local store's
    /// directory.
    pub fn open(url: &str) -> Result<Store, StoreError> {
        Store::open_with(url, &StoreOptions::default())
    }

    /// [`Store::open`] with options.
    pub fn open_with(url: &str, opts: &StoreOptions) -> Result<Store, StoreError> {
        let bad = |why: &str| StoreError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let (backend, local) = if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(bad(
                    "a file:// URL needs an absolute path (file:///var/lib/strata/store)",
                ));
            }
            let root = PathBuf::from(path);
            let backend: Arc<dyn StoreBackend> =
                Arc::new(ObjectStoreBackend::local(&root)?.with_deadline(opts.timeout));
            (backend, Some(root))
        } else if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("missing bucket name (s3://bucket/prefix)"));
            }
            let endpoint = std::env::var("AWS_ENDPOINT_URL")
                .or_else(|_| std::env::var("AWS_ENDPOINT"))
                .ok();
            let backend: Arc<dyn StoreBackend> = Arc::new(
                ObjectStoreBackend::s3(bucket, prefix.trim_matches('/'), endpoint.as_deref())?
                    .with_deadline(opts.timeout),
            );
            (backend, None)
        } else if url.starts_with('/') {
            return Store::open_with(&format!("file://{url}"), opts);
        } else {
            return Err(bad("expected file:///path or s3://bucket/prefix"));
        };
        Ok(Store {
            backend,
            local,
            tag_lock: std::env::var_os("STRATA_TAG_LOCK")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            range_deadline: Duration::from_secs(30),
        })
    }

    /// A store on any backend (tests: a [`MemoryStore`], a [`FaultyStore`]). Tags move by the backend's
    /// compare-and-swap put; blobs are spooled in the system temporary directory.
    pub fn with_backend(backend: Arc<dyn StoreBackend>) -> Store {
        Store {
            backend,
            local: None,
            tag_lock: None,
            range_deadline: Duration::from_secs(30),
        }
    }

    /// The same store with tag changes serialized by `flock` on `path` where the server has no
    /// conditional writes (what `STRATA_TAG_LOCK` sets for [`Store::open`]; see [`tags`]).
    pub fn with_tag_lock(mut self, path: PathBuf) -> Store {
        self.tag_lock = Some(path);
        self
    }

    /// The backend under this store.
    pub fn backend(&self) -> &Arc<dyn StoreBackend> {
        &self.backend
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        self.backend.url()
    }

    /// A directory for spooling blobs before upload: inside a local store (so that finishing is a
    /// rename), else the system temporary directory.
    pub fn spool_dir(&self) -> Result<PathBuf, StoreError> {
        let dir = match &self.local {
            Some(root) => root.join("tmp"),
            None => std::env::temp_dir(),
        };
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::io(&dir, e))?;
        Ok(dir)
    }

    /// True if an object exists.
    pub fn exists(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.backend.head(key)?.is_some())
    }

    /// True if an object can be relied on by a new reference: it exists and garbage collection has not
    /// condemned it. A condemned object is written again, which makes it young, so the collection
    /// that condemned it keeps it (see [`crate::gc`]).
    pub fn reusable(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.exists(key)? && !self.exists(&key::condemned(key))?)
    }

    /// After writing `key` because it was not reusable (or before tagging what reaches it:
    /// [`Store::revive_image`]): if gc had condemned it, its mark goes, as gc itself drops the mark of an
    /// object it finds written since or tagged.
    fn unmark(&self, key: &str) -> Result<(), StoreError> {
        let mark = key::condemned(key);
        if self.exists(&mark)? {
            self.backend.delete(&mark)?;
        }
        Ok(())
    }

    /// The first object of a stored layer (its descriptor, metadata, metadata base, blobs) that cannot be
    /// relied on by a new reference ([`Store::reusable`]), if any.
    pub fn layer_unreusable(
        &self,
        d: &Digest,
        l: &LayerDescriptor,
    ) -> Result<Option<String>, StoreError> {
        self.first_unreusable(&self.layer_keys(d, l)?)
    }

    /// The objects a stored layer needs: its descriptor, metadata, metadata base and blobs.
    fn layer_keys(&self, d: &Digest, l: &LayerDescriptor) -> Result<Vec<String>, StoreError> {
        let mut keys = vec![key::layer(d), key::meta(&l.meta.digest)];
        keys.extend(self.meta_base(&l.meta.digest)?.map(|b| key::meta(&b)));
        keys.extend(l.blobs.iter().map(|b| key::blob(&b.digest)));
        Ok(keys)
    }

    /// The first of `keys` that cannot be relied on by a new reference ([`Store::reusable`]), if any.
    fn first_unreusable(&self, keys: &[String]) -> Result<Option<String>, StoreError> {
        self.first_failing(keys, &|k| self.reusable(k))
    }

    /// The first of `keys` for which `ok` is false, if any. Each check is a request or two, a round
    /// trip each on S3: up to 8 threads at once, so an image of a few layers and dozens of blobs costs a
    /// few round trips, not a hundred.
    fn first_failing(
        &self,
        keys: &[String],
        ok: &(dyn Fn(&str) -> Result<bool, StoreError> + Sync),
    ) -> Result<Option<String>, StoreError> {
        const AT_ONCE: usize = 8;
        let first_of = |part: &[String]| -> Result<Option<String>, StoreError> {
            for k in part {
                if !ok(k)? {
                    return Ok(Some(k.clone()));
                }
            }
            Ok(None)
        };
        if keys.len() <= 2 {
            return first_of(keys);
        }
        let parts = std::thread::scope(|s| {
            let threads: Vec<_> = keys
                .chunks(keys.len().div_ceil(AT_ONCE))
                .map(|part| s.spawn(move || first_of(part)))
                .collect();
            let joined = threads.into_iter().map(|t| t.join());
            joined.collect::<Vec<_>>()
        });
        for part in parts {
            match part {
                Ok(found) => {
                    if let Some(k) = found? {
                        return Ok(Some(k));
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(None)
    }

    /// Stores content-addressed bytes under `key` unless already there (and not condemned by gc).
    pub fn put_bytes(&self, key: &str, data: Vec<u8>) -> Result<(), StoreError> {
        if self.reusable(key)? {
            return Ok(());
        }
        self.backend
            .put(key, Bytes::from(data), PutMode::Overwrite)?;
        self.unmark(key)
    }

    /// Writes a small index object (not content addressed: an `oci/` import record, a plan pointer),
    /// replacing what was there. Index objects are hints: a reader checks what one names before using it.
    pub fn put_index(&self, key: &str, data: Vec<u8>) -> Result<(), StoreError> {
        self.backend
            .put(key, Bytes::from(data), PutMode::Overwrite)
            .map(|_| ())
    }

    /// Reads an index object; `None` when there is none.
    pub fn get_index(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        match self.backend.get(key) {
            Ok((b, _)) => Ok(Some(b)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads a whole object and checks it against `digest`.
    pub fn get_verified(&self, key: &str, digest: &Digest) -> Result<Bytes, StoreError> {
        let b = self.backend.get(key)?.0;
        let actual = Digest::of(&b);
        if actual != *digest {
            return Err(StoreError::Corrupt {
                key: key.to_string(),
                expected: *digest,
                actual,
            });
        }
        Ok(b)
    }

    /// Reads `range` of an object, within [`Self::range_deadline`]. The caller verifies the content.
    pub fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes, StoreError> {
        self.backend.get_range(key, range, self.range_deadline)
    }

    /// Reads `range` of an object into `sink` piece by piece as it arrives, within
    /// [`Self::range_deadline`] (see [`StoreBackend::get_range_streamed`]). The caller verifies the content.
    pub fn get_range_streamed(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), StoreError> {
        self.backend
            .get_range_streamed(key, range, self.range_deadline, sink)
    }

    /// Stores a blob from a spool file named by its digest; the file is consumed.
    pub fn put_blob_file(&self, digest: &Digest, file: &Path) -> Result<(), StoreError> {
        let key = key::blob(digest);
        if self.reusable(&key)? {
            let _ = std::fs::remove_file(file);
            return Ok(());
        }
        match &self.local {
            Some(root) => {
                let dest = root.join(&key);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
                }
                std::fs::rename(file, &dest).map_err(|e| StoreError::io(&dest, e))?;
            }
            None => {
                self.backend.put_file(&key, file)?;
                let _ = std::fs::remove_file(file);
            }
        }
        self.unmark(&key)
    }

    /// Stores a JSON object under the key `key_of` gives for its digest.
    fn put_json<T: JsonObject>(
        &self,
        v: &T,
        key_of: fn(&Digest) -> String,
    ) -> Result<Digest, StoreError> {
        let b = v.to_bytes();
        let d = Digest::of(&b);
        self.put_bytes(&key_of(&d), b)?;
        Ok(d)
    }

    fn get_json<T: JsonObject>(
        &self,
        d: &Digest,
        key_of: fn(&Digest) -> String,
    ) -> Result<T, StoreError> {
        let b = self.get_verified(&key_of(d), d)?;
        Ok(T::from_bytes(&b)?)
    }

    /// Stores a layer descriptor (after its metadata and blobs); returns its name
    /// ([`LayerDescriptor::digest`]). A reproducible layer stored under that name already keeps its
    /// placement while the layer can be relied on ([`Store::layer_unreusable`]); one that cannot (a blob
    /// gone or condemned by gc, a damaged descriptor) gets `l`'s placement instead.
    pub fn put_layer(&self, l: &LayerDescriptor) -> Result<Digest, StoreError> {
        let d = l.digest();
        if l.content.is_none() {
            return self.put_json(l, key::layer);
        }
        if self.stored_layer(&d)?.is_none() {
            let key = key::layer(&d);
            self.backend
                .put(&key, Bytes::from(l.to_bytes()), PutMode::Overwrite)?;
            self.unmark(&key)?;
        }
        Ok(d)
    }

    /// The stored descriptor of layer `d` if it can be relied on by a new reference: it and every object
    /// it names exist and are not condemned by gc. `None` when it is absent, damaged or not reusable.
    pub fn stored_layer(&self, d: &Digest) -> Result<Option<LayerDescriptor>, StoreError> {
        if !self.reusable(&key::layer(d))? {
            return Ok(None);
        }
        match self.get_layer(d) {
            Ok(l) if self.layer_unreusable(d, &l)?.is_none() => Ok(Some(l)),
            Ok(_) => Ok(None),
            Err(e) if e.is_damaged() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads a layer descriptor, verified against its name: the digest of its identity for a
    /// reproducible layer, of its bytes for an older one ([`LayerDescriptor::digest`]).
    pub fn get_layer(&self, d: &Digest) -> Result<LayerDescriptor, StoreError> {
        let key = key::layer(d);
        let b = self.backend.get(&key)?.0;
        let (actual, parsed) = match LayerDescriptor::from_bytes(&b) {
            Ok(l) if l.content.is_some() => (l.digest(), Ok(l)),
            parsed => (Digest::of(&b), parsed),
        };
        if actual != *d {
            return Err(StoreError::Corrupt {
                key,
                expected: *d,
                actual,
            });
        }
        Ok(parsed?)
    }

    /// Stores a manifest (after its layers); returns its digest.
    pub fn put_manifest(&self, m: &Manifest) -> Result<Digest, StoreError> {
        for l in &m.layers {
            if !self.exists(&key::layer(&l.digest))? {
                return Err(StoreError::NotFound(key::layer(&l.digest)));
            }
        }
        self.put_json(m, key::manifest)
    }

    /// Reads a manifest.
    pub fn get_manifest(&self, d: &Digest) -> Result<Manifest, StoreError> {
        self.get_json(d, key::manifest)
    }

    /// Makes image `d` safe to name in a new tag, as gc would by finding it tagged: every object it
    /// reaches (its manifest, each layer's objects: [`Self::layer_keys`]) that gc condemned loses its
    /// mark. Returns the first one that is gone, if any — gc deleted it, and the image cannot be tagged.
    /// A damaged manifest or descriptor is not reported: gc stops at a broken image before deleting.
    ///
    /// Pardoning, not refusing, a condemned object: a tag written before gc's deleting run lists the tags
    /// keeps the object anyway (gc pardons what a tag reaches), and a writer that finds the object still
    /// there is before that deleting run — unless the run is under way at that very moment, the window
    /// `crate::gc` names. Refusing would also refuse images that a build reused an old object for while a
    /// gc ran, until gc's next run (the soak saw 20 refusals in a row).
    pub fn revive_image(&self, d: &Digest) -> Result<Option<String>, StoreError> {
        let revive = |k: &str| -> Result<bool, StoreError> {
            if !self.exists(k)? {
                return Ok(false);
            }
            self.unmark(k)?;
            Ok(true)
        };
        let key = key::manifest(d);
        if !revive(&key)? {
            return Ok(Some(key));
        }
        // A manifest that cannot be read as one is a broken image, which gc refuses to collect past
        // (`crate::gc`): nothing it could reach is deleted, so there is nothing to check here.
        let manifest = match self.get_manifest(d) {
            Ok(m) => m,
            Err(e) if e.is_damaged() => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut keys = Vec::new();
        for l in manifest.layers {
            match self.get_layer(&l.digest) {
                Ok(layer) => keys.extend(self.layer_keys(&l.digest, &layer)?),
                Err(e) if e.is_not_found() => return Ok(Some(key::layer(&l.digest))),
                Err(e) if e.is_damaged() => continue,
                Err(e) => return Err(e),
            };
        }
        self.first_failing(&keys, &revive)
    }

    /// True if `d` names a manifest in this store.
    pub fn has_manifest(&self, d: &Digest) -> Result<bool, StoreError> {
        self.exists(&key::manifest(d))
    }

    /// Reads and verifies a blob's table of contents, as its descriptor entry locates it.
    pub fn get_toc(&self, b: &crate::model::BlobRef) -> Result<Toc, StoreError> {
        let key = key::blob(&b.digest);
        let bytes = self.get_range(&key, b.toc_offset..b.toc_offset + b.toc_len)?;
        let actual = Digest::of(&bytes);
        if actual != b.toc_digest {
            return Err(StoreError::Corrupt {
                key: format!("{key} (table of contents)"),
                expected: b.toc_digest,
                actual,
            });
        }
        Toc::decode(&bytes).map_err(|e| malformed(&key, e))
    }

    /// Reads a blob's footer (for tools that have only the blob).
    pub fn get_footer(&self, blob: &Digest) -> Result<Footer, StoreError> {
        let key = key::blob(blob);
        let size = self
            .size(&key)?
            .ok_or_else(|| StoreError::NotFound(key.clone()))?;
        if size < FOOTER_LEN as u64 {
            return Err(StoreError::Malformed {
                key,
                why: "shorter than its footer".into(),
            });
        }
        let b = self.get_range(&key, size - FOOTER_LEN as u64..size)?;
        Footer::decode(&b, size).map_err(|e| malformed(&key, e))
    }

    /// Keys under a prefix.
    pub fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.backend.list(prefix)
    }

    /// Objects under a prefix: key, size, last modified (Unix seconds).
    pub fn list_info(&self, prefix: &str) -> Result<Vec<(String, u64, i64)>, StoreError> {
        Ok(self
            .backend
            .list_info(prefix)?
            .into_iter()
            .map(|m| (m.key, m.size, m.modified))
            .collect())
    }

    /// The size of an object, or `None` if it does not exist.
    pub fn size(&self, key: &str) -> Result<Option<u64>, StoreError> {
        Ok(self.backend.head(key)?.map(|m| m.size))
    }

    /// Deletes an object (garbage collection only: objects are otherwise never deleted).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.backend.delete(key)
    }
}

fn malformed(key: &str, e: TocError) -> StoreError {
    StoreError::Malformed {
        key: key.to_string(),
        why: e.to_string(),
    }
}

#[cfg(test)]
#[path = "meta_tests.rs"]
mod meta_tests;
