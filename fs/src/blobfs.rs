//! The daemon's FUSE filesystem: every blob the node serves, as a read-only file of its uncompressed view.
//!
//! ```text
//! <mount>/blobs/<hex>     one regular file per blob, size = the blob's view size
//! <mount>/meta/<hex>      a layer's EROFS metadata, for microVMs (see [`crate::metafile`])
//! ```
//!
//! Kernel EROFS mounts each layer file-backed with these files as its `device=`s, so the kernel parses all
//! metadata itself and only data reads reach this process: a read at an offset becomes chunk lookups in
//! the blob's table of contents, served from the chunk cache or fetched (see [`crate::fetch`]). Bytes
//! between a chunk's end and the next 4 KiB block are zeros. This is the one place that maps errors to
//! errno: every failure to serve data is `EIO`, and it comes within the read deadline. Access is the
//! mounting user's (root) only unless a group is allowed.
//!
//! **Node ids survive the server.** A blob file's node id is derived from its digest (its first eight
//! bytes, top bit set), not handed out in order: a successor serving the same FUSE connection (see
//! [`crate::fuse`]) gives every blob the id the kernel already knows, whatever order it registers them
//! in. Attributes are fixed too (times are the epoch), so nothing the kernel cached goes stale.
//!
//! **Reads never wait on the network on a FUSE worker.** A worker answers a read itself when every chunk
//! it needs is cached (into one reused buffer per worker thread); otherwise the read goes to
//! [`crate::slowread`], which fetches on threads bounded per blob and answers by the deadline. A read
//! that moves sequentially into the next chunk of a blob asks the cache to read the following chunks
//! ahead ([`Fetcher::read_ahead`]): a blob's chunks need not be neighbours in the cache's files.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use strata_registry::digest::Digest;
use strata_registry::toc::BLOCK_SIZE;

use crate::attribution::with_reader;
use crate::fetch::{BlobHandle, FetchError, Fetcher};
use crate::fuse::proto::{self, Attr};
use crate::fuse::session::{Entries, Filesystem, Reply};
use crate::metafile::{meta_ino, MetaTable};
use crate::metrics::Metrics;
use crate::slowread::{SlowError, SlowReads};
use crate::treefs::TreeError;

const ROOT: u64 = proto::ROOT_ID;
const BLOBS_DIR: u64 = 2;
const META_DIR: u64 = 3;

/// The node id of the blob file with digest `d`: stable across servers (never 1 or 2).
pub fn blob_ino(d: &Digest) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d.0[..8]);
    u64::from_le_bytes(b) | (1 << 63)
}

/// Two blobs whose digests share the 63 bits a node id keeps (never seen; refused rather than served).
#[derive(Debug, thiserror::Error)]
#[error("blobs {0} and {1} would share a FUSE node id")]
pub struct InoCollision(pub Digest, pub Digest);

/// The blobs served, shared between the FUSE threads and the daemon that registers them.
#[derive(Default)]
pub struct BlobTable {
    inner: RwLock<HashMap<u64, Arc<BlobHandle>>>,
    /// Notified when a blob is added (see [`BlobTable::wait_for`]).
    added: (Mutex<()>, Condvar),
    /// Records the chunks reads touch while a prefetch trace runs.
    pub trace: strata_prefetch::Recorder,
    /// Layer metadata served to microVMs.
    pub metas: MetaTable,
}

impl BlobTable {
    /// Serves a blob (idempotent); returns its file name under `blobs/`.
    pub fn add(&self, h: BlobHandle) -> Result<String, InoCollision> {
        let d = h.blob.digest;
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        match t.get(&blob_ino(&d)) {
            Some(other) if other.blob.digest != d => {
                return Err(InoCollision(other.blob.digest, d));
            }
            Some(_) => {}
            None => {
                t.insert(blob_ino(&d), Arc::new(h));
            }
        }
        drop(t);
        let _g = self.added.0.lock().unwrap_or_else(|p| p.into_inner());
        self.added.1.notify_all();
        Ok(d.hex())
    }

    /// Waits until every blob of `ds` is served; `false` if that has not happened within `timeout`.
    pub fn wait_for(&self, ds: &[Digest], timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut g = self.added.0.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if ds.iter().all(|d| self.contains(d)) {
                return true;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .added
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The served blob with digest `d`.
    pub fn handle(&self, d: &Digest) -> Option<Arc<BlobHandle>> {
        self.get(blob_ino(d)).filter(|h| h.blob.digest == *d)
    }

    /// True if the blob is served.
    pub fn contains(&self, d: &Digest) -> bool {
        self.handle(d).is_some()
    }

    fn get(&self, ino: u64) -> Option<Arc<BlobHandle>> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        t.get(&ino).cloned()
    }

    fn by_name(&self, name: &[u8]) -> Option<Arc<BlobHandle>> {
        let d = Digest::from_hex(std::str::from_utf8(name).ok()?).ok()?;
        self.handle(&d)
    }

    pub(crate) fn all(&self) -> Vec<Arc<BlobHandle>> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = t.values().cloned().collect();
        v.sort_by_key(|b| b.blob.digest);
        v
    }
}

/// Reads a blob's view: shared by the FUSE workers (cached data) and the slow-read threads, of this
/// server and of the tree server ([`crate::treefs`]).
pub(crate) struct View {
    pub(crate) table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
}

impl View {
    pub(crate) fn new(table: Arc<BlobTable>, fetcher: Arc<Fetcher>) -> View {
        View { table, fetcher }
    }

    /// Fills `buf` from the blob's view at `offset` (zeros where no chunk lies); returns the bytes
    /// filled. With `cached_only` it stops at the first chunk not in the cache (nothing is fetched), so
    /// that a slow read can go on from there instead of reading the cached part again.
    pub(crate) fn read(
        &self,
        blob: &Arc<BlobHandle>,
        offset: u64,
        buf: &mut [u8],
        cached_only: bool,
    ) -> Result<usize, FetchError> {
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = offset + pos as u64;
            let block = at / BLOCK_SIZE;
            let Some(i) = blob.toc.chunk_at(block) else {
                // Past the last chunk or in alignment padding: zeros up to the next block.
                let next = (block + 1) * BLOCK_SIZE;
                let n = ((next - at) as usize).min(buf.len() - pos);
                buf[pos..pos + n].fill(0);
                pos += n;
                continue;
            };
            let c = blob.toc.chunks[i];
            let start = c.block as u64 * BLOCK_SIZE;
            let within = at - start;
            let padded_end = start + c.blocks() * BLOCK_SIZE;
            if within >= c.len as u64 {
                let n = ((padded_end - at) as usize).min(buf.len() - pos);
                buf[pos..pos + n].fill(0);
                pos += n;
                continue;
            }
            let n = ((c.len as u64 - within) as usize).min(buf.len() - pos);
            let bytes = match cached_only {
                true => match self.fetcher.cached(blob, i)? {
                    Some(b) => b,
                    None => return Ok(pos),
                },
                false => self.fetcher.chunk(blob, i)?,
            };
            self.table.trace.record(&blob.blob.digest, i as u32);
            self.fetcher.read_ahead(blob, i);
            bytes.read_at(&mut buf[pos..pos + n], within)?;
            pos += n;
        }
        Ok(pos)
    }
}

/// The FUSE filesystem.
pub struct BlobFs {
    view: Arc<View>,
    metrics: Arc<Metrics>,
    slow: SlowReads,
    /// Group allowed to read (besides root), if any.
    gid: u32,
    perm_file: u32,
    perm_dir: u32,
}

/// The one errno map: data that cannot be served is an I/O error (logged with its cause).
pub(crate) fn errno(e: &FetchError, metrics: &Metrics) -> Errno {
    metrics.error(e.kind());
    tracing::warn!(error = %e, "read failed");
    Errno::IO
}

/// The tree server's errors in the same map: what cannot be served — data or metadata (a damaged
/// image, a blob the node does not serve) — is an I/O error; only a layout the server does not read
/// (compressed files of other writers) says so.
pub(crate) fn tree_errno(e: &TreeError, metrics: &Metrics) -> Errno {
    match e {
        TreeError::Fetch(f) => errno(f, metrics),
        TreeError::Layout { .. } => {
            metrics.error("unsupported");
            tracing::warn!(error = %e, "read refused");
            Errno::OPNOTSUPP
        }
        _ => {
            metrics.error("metadata");
            tracing::warn!(error = %e, "tree request failed");
            Errno::IO
        }
    }
}

/// Threads fetching for one blob at a time (each serves the blob's waiting reads one after another).
pub const READS_PER_BLOB: usize = 16;

impl BlobFs {
    /// A filesystem serving `table` through `fetcher`; `group` may read besides root. Reads that must
    /// fetch are answered within the fetcher's deadline.
    pub fn new(
        table: Arc<BlobTable>,
        fetcher: Arc<Fetcher>,
        metrics: Arc<Metrics>,
        group: Option<u32>,
    ) -> std::io::Result<BlobFs> {
        let m = metrics.clone();
        let slow = SlowReads::new(
            fetcher.workers().clone(),
            READS_PER_BLOB,
            fetcher.deadline,
            Box::new(move || m.error("timeout")),
        )?;
        Ok(BlobFs {
            view: Arc::new(View { table, fetcher }),
            metrics,
            slow,
            gid: group.unwrap_or(0),
            perm_file: if group.is_some() { 0o440 } else { 0o400 },
            perm_dir: if group.is_some() { 0o550 } else { 0o500 },
        })
    }

    /// Served by `workers` FUSE workers: all but [`crate::slowread::FREE_WORKERS`] of them may serve a
    /// read that must fetch themselves (see [`crate::slowread`]).
    pub fn with_workers(mut self, workers: usize) -> BlobFs {
        self.slow.set_workers(workers);
        self
    }

    /// A read of a layer's metadata file (local disk: answered on the worker).
    fn read_meta(&self, ino: u64, offset: u64, size: u32, reply: Reply) {
        let Some(m) = self.view.table.metas.get(ino) else {
            return reply.error(Errno::NOENT);
        };
        let mut buf = vec![0u8; size as usize];
        match m.read_at(offset, &mut buf) {
            Ok(n) => {
                self.metrics.served(n);
                reply.data(&[&buf[..n]]);
            }
            Err(e) => {
                tracing::warn!(layer = %m.layer, error = %e, "reading layer metadata");
                reply.error(Errno::IO);
            }
        }
    }

    fn attr(&self, ino: u64, size: u64, dir: bool) -> Attr {
        Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            mode: match dir {
                true => proto::S_IFDIR | self.perm_dir,
                false => proto::S_IFREG | self.perm_file,
            },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: self.gid,
            blksize: 1 << 20,
            ..Default::default()
        }
    }
}

impl Filesystem for BlobFs {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno> {
        match (parent, name) {
            (ROOT, b"blobs") => Ok(self.attr(BLOBS_DIR, 0, true)),
            (ROOT, b"meta") => Ok(self.attr(META_DIR, 0, true)),
            (BLOBS_DIR, _) => match self.view.table.by_name(name) {
                Some(b) => Ok(self.attr(blob_ino(&b.blob.digest), b.toc.view_size(), false)),
                None => Err(Errno::NOENT),
            },
            (META_DIR, _) => match self.view.table.metas.by_name(name) {
                Some(m) => Ok(self.attr(meta_ino(&m.layer), m.size(), false)),
                None => Err(Errno::NOENT),
            },
            _ => Err(Errno::NOENT),
        }
    }

    fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        match ino {
            ROOT | BLOBS_DIR | META_DIR => Ok(self.attr(ino, 0, true)),
            _ => match self.view.table.get(ino) {
                Some(b) => Ok(self.attr(ino, b.toc.view_size(), false)),
                None => match self.view.table.metas.get(ino) {
                    Some(m) => Ok(self.attr(ino, m.size(), false)),
                    None => Err(Errno::NOENT),
                },
            },
        }
    }

    fn open(&self, ino: u64, flags: u32) -> Result<u32, Errno> {
        if self.view.table.get(ino).is_none() && self.view.table.metas.get(ino).is_none() {
            return Err(Errno::NOENT);
        }
        if flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
            return Err(Errno::ROFS);
        }
        // Blob views never change: the kernel may keep their pages across opens.
        Ok(proto::FOPEN_KEEP_CACHE)
    }

    fn read(&self, ino: u64, offset: u64, size: u32, reply: Reply) {
        let Some(blob) = self.view.table.get(ino) else {
            return self.read_meta(ino, offset, size, reply);
        };
        let end = blob.toc.view_size();
        if offset >= end {
            return reply.data(&[]);
        }
        let n = (size as u64).min(end - offset) as usize;
        thread_local! {
            static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        // The cached part is read here; `Some` is what a slow read must go on with: the reply and the
        // bytes filled so far.
        let rest = BUF.with_borrow_mut(|buf| {
            if buf.len() < n {
                buf.resize(n, 0);
            }
            let buf = &mut buf[..n];
            match self.view.read(&blob, offset, buf, true) {
                Ok(done) if done == n => {
                    self.metrics.served(n);
                    reply.data(&[buf]);
                    None
                }
                Ok(done) => Some((reply, buf[..done].to_vec())),
                Err(e) => {
                    reply.error(errno(&e, &self.metrics));
                    None
                }
            }
        });
        let Some((reply, mut out)) = rest else { return };
        // Not all cached: fetched on this worker or the blob's own threads, answered by the deadline.
        let (view, metrics) = (self.view.clone(), self.metrics.clone());
        let digest = blob.blob.digest;
        let reader = reply.pid();
        self.slow.submit(
            digest,
            reply,
            Box::new(move || {
                let done = out.len();
                out.resize(n, 0);
                let rest = &mut out[done..];
                let read = with_reader(reader, || {
                    view.read(&blob, offset + done as u64, rest, false)
                });
                match read {
                    Ok(_) => {
                        metrics.served(n);
                        Ok(out)
                    }
                    Err(e) => Err(SlowError {
                        unavailable: matches!(e, FetchError::Timeout { .. }),
                        errno: errno(&e, &metrics),
                    }),
                }
            }),
        );
    }

    fn readdir(&self, ino: u64) -> Result<Arc<Entries>, Errno> {
        Ok(Arc::new(match ino {
            ROOT => vec![
                (BLOBS_DIR, proto::DT_DIR, b"blobs".to_vec()),
                (META_DIR, proto::DT_DIR, b"meta".to_vec()),
            ],
            META_DIR => self
                .view
                .table
                .metas
                .all()
                .iter()
                .map(|m| {
                    (
                        meta_ino(&m.layer),
                        proto::DT_REG,
                        m.layer.hex().into_bytes(),
                    )
                })
                .collect(),
            BLOBS_DIR => self
                .view
                .table
                .all()
                .iter()
                .map(|b| {
                    let d = &b.blob.digest;
                    (blob_ino(d), proto::DT_REG, d.hex().into_bytes())
                })
                .collect(),
            _ => return Err(Errno::NOTDIR),
        }))
    }
}

#[cfg(test)]
#[path = "blobfs_tests.rs"]
mod tests;
