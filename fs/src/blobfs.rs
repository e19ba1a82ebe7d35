//! The daemon's FUSE filesystem: every blob the node serves, as a read-only file of its uncompressed view.
//!
//! ```text
//! <mount>/blobs/<hex>     one regular file per blob, size = the blob's view size
//! ```
//!
//! Kernel EROFS mounts each layer file-backed with these files as its `device=`s, so the kernel parses all
//! metadata itself and only data reads reach this process: a read at an offset becomes chunk lookups in
//! the blob's table of contents, served from the chunk cache or fetched (see [`crate::fetch`]). Bytes
//! between a chunk's end and the next 4 KiB block are zeros. This is the only module that speaks FUSE and
//! the one place that maps errors to errno: every failure is `EIO`, and it comes within the fetcher's
//! deadline. Access is the mounting user's (root) only unless a group is allowed.
//!
//! Each FUSE worker thread reads into one reused buffer (no allocation or zeroing per request) and the
//! reply goes out from it. A read that moves sequentially into the next chunk of a blob asks the cache
//! to read the following chunks ahead ([`Fetcher::read_ahead`]): a blob's chunks need not be neighbours
//! in the cache's files, so the kernel's readahead of those files alone may keep one small read in
//! flight at a time (measured with a file per chunk: a 1 GiB blob read in 1.0–1.3 s one chunk after
//! another, 0.66–0.71 s with eight in flight).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEntry, ReplyOpen, Request, SessionACL,
};
use strata_registry::digest::Digest;
use strata_registry::toc::BLOCK_SIZE;

use crate::fetch::{BlobHandle, FetchError, Fetcher};
use crate::metrics::Metrics;

const ROOT: u64 = 1;
const BLOBS_DIR: u64 = 2;
const FIRST_BLOB: u64 = 3;
const TTL: Duration = Duration::from_secs(3600);

/// The blobs served, shared between the FUSE threads and the daemon that registers them.
#[derive(Default)]
pub struct BlobTable {
    inner: RwLock<Table>,
    /// Notified when a blob is added (see [`BlobTable::wait_for`]).
    added: (Mutex<()>, Condvar),
    /// Records the chunks reads touch while a prefetch trace runs.
    pub trace: strata_prefetch::Recorder,
}

#[derive(Default)]
struct Table {
    blobs: Vec<Arc<BlobHandle>>,
    by_digest: HashMap<Digest, u64>,
}

impl BlobTable {
    /// Serves a blob (idempotent); returns its file name under `blobs/`.
    pub fn add(&self, h: BlobHandle) -> String {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let d = h.blob.digest;
        if !t.by_digest.contains_key(&d) {
            let ino = FIRST_BLOB + t.blobs.len() as u64;
            t.blobs.push(Arc::new(h));
            t.by_digest.insert(d, ino);
        }
        drop(t);
        let _g = self.added.0.lock().unwrap_or_else(|p| p.into_inner());
        self.added.1.notify_all();
        d.hex()
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
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let ino = *t.by_digest.get(d)?;
        t.blobs.get((ino - FIRST_BLOB) as usize).cloned()
    }

    /// True if the blob is served.
    pub fn contains(&self, d: &Digest) -> bool {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        t.by_digest.contains_key(d)
    }

    fn get(&self, ino: u64) -> Option<Arc<BlobHandle>> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        ino.checked_sub(FIRST_BLOB)
            .and_then(|i| t.blobs.get(i as usize).cloned())
    }

    fn by_name(&self, name: &OsStr) -> Option<(u64, Arc<BlobHandle>)> {
        let d = Digest::from_hex(name.to_str()?).ok()?;
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let ino = *t.by_digest.get(&d)?;
        Some((ino, t.blobs[(ino - FIRST_BLOB) as usize].clone()))
    }

    fn all(&self) -> Vec<(u64, Arc<BlobHandle>)> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        t.blobs
            .iter()
            .enumerate()
            .map(|(i, b)| (FIRST_BLOB + i as u64, b.clone()))
            .collect()
    }
}

/// The FUSE filesystem.
pub struct BlobFs {
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    started: SystemTime,
    /// Group allowed to read (besides root), if any.
    gid: u32,
    perm_file: u16,
    perm_dir: u16,
}

fn errno(e: &FetchError) -> Errno {
    tracing::warn!(error = %e, "read failed");
    Errno::EIO
}

impl BlobFs {
    /// A filesystem serving `table` through `fetcher`; `group` may read besides root.
    pub fn new(
        table: Arc<BlobTable>,
        fetcher: Arc<Fetcher>,
        metrics: Arc<Metrics>,
        group: Option<u32>,
    ) -> BlobFs {
        BlobFs {
            table,
            fetcher,
            metrics,
            started: SystemTime::now(),
            gid: group.unwrap_or(0),
            perm_file: if group.is_some() { 0o440 } else { 0o400 },
            perm_dir: if group.is_some() { 0o550 } else { 0o500 },
        }
    }

    fn attr(&self, ino: u64, size: u64, dir: bool) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if dir { self.perm_dir } else { self.perm_file },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: self.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        }
    }

    fn attr_of(&self, ino: u64) -> Option<FileAttr> {
        match ino {
            ROOT | BLOBS_DIR => Some(self.attr(ino, 0, true)),
            _ => self
                .table
                .get(ino)
                .map(|b| self.attr(ino, b.toc.view_size(), false)),
        }
    }

    /// Fills `buf` from the blob's view at `offset` (zeros where no chunk lies).
    fn read_view(
        &self,
        blob: &Arc<BlobHandle>,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), FetchError> {
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
            self.table.trace.record(&blob.blob.digest, i as u32);
            let bytes = self.fetcher.chunk(blob, i)?;
            self.fetcher.read_ahead(blob, i);
            bytes.read_at(&mut buf[pos..pos + n], within)?;
            pos += n;
        }
        Ok(())
    }
}

impl Filesystem for BlobFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_readahead(1 << 20);
        // EROFS reads its devices with direct I/O from its readahead; without asynchronous direct I/O
        // the kernel waits for each FUSE reply before it sends the next request, one at a time.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent.0, name.to_str()) {
            (ROOT, Some("blobs")) => {
                reply.entry(&TTL, &self.attr(BLOBS_DIR, 0, true), Generation(0))
            }
            (BLOBS_DIR, _) => match self.table.by_name(name) {
                Some((ino, b)) => reply.entry(
                    &TTL,
                    &self.attr(ino, b.toc.view_size(), false),
                    Generation(0),
                ),
                None => reply.error(Errno::ENOENT),
            },
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr_of(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.table.get(ino.0).is_none() {
            return reply.error(Errno::ENOENT);
        }
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        // Blob views never change: the kernel may keep their pages across opens.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(blob) = self.table.get(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let end = blob.toc.view_size();
        if offset >= end {
            return reply.data(&[]);
        }
        let n = (size as u64).min(end - offset) as usize;
        thread_local! {
            static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        BUF.with_borrow_mut(|buf| {
            if buf.len() < n {
                buf.resize(n, 0);
            }
            let buf = &mut buf[..n];
            match self.read_view(&blob, offset, buf) {
                Ok(()) => {
                    self.metrics.reads.fetch_add(1, Ordering::Relaxed);
                    self.metrics
                        .read_bytes
                        .fetch_add(n as u64, Ordering::Relaxed);
                    reply.data(buf)
                }
                Err(e) => {
                    self.metrics.error(e.kind());
                    reply.error(errno(&e))
                }
            }
        })
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut entries: Vec<(u64, FileType, String)> = vec![
            (ino.0, FileType::Directory, ".".into()),
            (ROOT, FileType::Directory, "..".into()),
        ];
        match ino.0 {
            ROOT => entries.push((BLOBS_DIR, FileType::Directory, "blobs".into())),
            BLOBS_DIR => {
                for (i, b) in self.table.all() {
                    entries.push((i, FileType::RegularFile, b.blob.digest.hex()));
                }
            }
            _ => return reply.error(Errno::ENOTDIR),
        }
        for (k, (i, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(i), (k + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// Mount options for the blob filesystem.
pub fn fuse_config(threads: usize, group: Option<u32>) -> Config {
    let mut c = Config::default();
    c.mount_options = vec![
        MountOption::FSName("strata".into()),
        MountOption::Subtype("strata".into()),
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    if group.is_some() {
        c.acl = SessionACL::All;
        c.mount_options.push(MountOption::DefaultPermissions);
    }
    c.n_threads = Some(threads.max(1));
    c.clone_fd = true;
    c
}

/// Mounts the blob filesystem at `mountpoint` in background threads; dropping the session unmounts.
pub fn mount(
    fs: BlobFs,
    mountpoint: &Path,
    threads: usize,
    group: Option<u32>,
) -> std::io::Result<fuser::BackgroundSession> {
    let config = fuse_config(threads, group);
    fuser::Session::new(fs, mountpoint, &config)?.spawn()
}
