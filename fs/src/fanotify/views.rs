//! View files: each blob's uncompressed view as a local sparse file, filled a chunk at a time.
//!
//! A view file has the size of the blob's view (`Toc::view_size`) and starts as one hole. Chunk `i`
//! lives where the blob server would show it: at block `chunks[i].block`, `len` bytes, then zeros to
//! the block's end. Filling a chunk writes its verified bytes and padding through the page cache
//! (whole blocks), so the kernel reads a range it was just allowed from memory; [`super::pages`]
//! drops those pages again once the kernel has had them, so that what sandboxes read stays in memory
//! once, in EROFS's page cache. The server's own reads of a file (checking a chunk, a scrub, another
//! mode reading a kept chunk) go through a second descriptor with direct I/O: they read what is on
//! disk (the kernel writes a dirty range out before a direct read of it) and cache nothing.
//!
//! **The blob's home.** A view file is where the fetcher puts the blob's chunks (`fetch::home`): each
//! chunk it verifies is written here ([`ChunkHome::take`]) instead of into the chunk cache, so a miss
//! costs one disk write and the node holds the bytes once. The fetcher's other readers of the blob (a
//! layer of the same blob in another mode) read kept chunks back from here ([`ChunkHome::read_at`]).
//!
//! **Which chunks are there.** Each file has a bitmap of chunks known to be filled. It is in memory
//! only: a server that starts on files an earlier one filled knows nothing, and finds out chunk by
//! chunk on first use — it reads the chunk from the file and takes it if its BLAKE3 is the chunk's
//! digest (a hole reads as zeros and fails the check, unless the chunk is all zeros, which is then
//! right). So no record can disagree with the data, a torn write (a crash mid-fill) is found and
//! filled again, and data at rest is checked once per server before it is first served. Files this
//! server created are known to be holes: no check.
//!
//! **Writing without events.** The server's own descriptor of a view file is opened before the file
//! is marked when it can be, and then the kernel never reports its reads and writes. One opened on a
//! file a predecessor marked does cause events: each of this server's own accesses registers its
//! range first ([`ViewFile::is_own`]), and the event loop allows an event of this process whose range
//! a registered access covers. Any other event — a reader in this very process included — is served
//! as every reader's is.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;

use strata_registry::digest::Digest;
use strata_registry::store::direct;
use strata_registry::toc::BLOCK_SIZE;

use crate::attribution::with_reader;
use crate::fetch::{BlobHandle, ChunkBytes, ChunkHome, FetchError, Fetcher};
use crate::metadir::{trim_lru, Candidate};

use super::pages::Touched;

/// Zeros after a chunk's bytes to the end of its last block.
static ZEROS: [u8; BLOCK_SIZE as usize] = [0; BLOCK_SIZE as usize];

/// Chunk states in a view file's bitmap.
pub(super) const UNKNOWN: u8 = 0;
pub(super) const HOLE: u8 = 1;
pub(super) const FILLED: u8 = 2;
/// Filled, but to be punched out ([`super::evict`]): not counted filled, so its next read goes to a
/// fill thread, which takes it back ([`ViewFile::rescue`]) — its bytes are still in the file.
pub(super) const EVICTING: u8 = 3;
/// [`EVICTING`] a chunk this server had not checked yet (one an earlier server filled): taken back
/// as [`UNKNOWN`], to be checked on its use as any such chunk is.
pub(super) const EVICTING_UNCHECKED: u8 = 4;

/// Why a range could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("view file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("no view file has inode {dev}:{ino}")]
    Unknown { dev: u64, ino: u64 },
}

impl FillError {
    /// Whether a write found the view files' disk full (`ENOSPC`, `EDQUOT`): space freed meanwhile
    /// may let the same fill through.
    pub fn is_full(&self) -> bool {
        matches!(self, FillError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)))
    }
}

/// One blob's view file.
pub struct ViewFile {
    pub blob: Arc<BlobHandle>,
    pub path: PathBuf,
    /// Written (and read by the kernel) through the page cache.
    pub(super) file: File,
    /// The same file with direct I/O, for this server's own reads.
    direct: File,
    /// Ranges touched lately, whose pages [`super::pages`] drops.
    pub touched: Touched,
    pub(super) chunks: Vec<AtomicU8>,
    /// Chunks in state [`FILLED`].
    pub(super) filled: AtomicUsize,
    /// Set once the file is complete and no longer watched.
    pub unmarked: AtomicBool,
    /// Mounts about to open the file ([`super::Server::mounting`] to [`super::Server::mounted`]): it
    /// stays watched meanwhile, whether complete or not.
    pub opening: AtomicUsize,
    /// Held while the file is watched or unwatched (and `unmarked`, `opening` checked for it).
    pub watch: Mutex<()>,
    /// When each chunk was last filled or allowed ([`super::evict::clock`]; 0: not since this server
    /// started): eviction takes the least recently used first.
    pub(super) used: Vec<AtomicU32>,
    /// Chunks marked [`EVICTING`], and when.
    pub(super) evicting: Mutex<Vec<(usize, Instant)>>,
    /// Held shared by whoever writes a chunk's bytes and sets its state to match (and by a rescue),
    /// alone by a punch: no punch can land between a write and the state that says it is there.
    pub(super) punch: RwLock<()>,
    /// The chunk after the last range a reader's miss filled (read-ahead follows sequential misses).
    last: AtomicUsize,
    /// Ranges this server is reading or writing itself: `(offset, len)`.
    own: Mutex<Vec<(u64, u64)>>,
    /// Chunks a thread is filling now: others wanting them wait ([`ViewFile::claim`]) rather than
    /// fill them again (the kernel's read-ahead has several reads of one chunk in flight at once).
    filling: Mutex<HashSet<usize>>,
    filled_cv: Condvar,
}

/// What a scrub checked ([`ViewFile::scrub`]: the filled chunks of a view file).
pub use crate::cache::Scrubbed;

/// The view files of a node, by blob and by inode.
pub struct Views {
    dir: PathBuf,
    by_blob: RwLock<HashMap<Digest, Arc<ViewFile>>>,
    by_inode: RwLock<HashMap<(u64, u64), Arc<ViewFile>>>,
}

impl Views {
    /// View files under `dir` (created if missing; on a local filesystem with sparse files and
    /// direct I/O).
    pub fn new(dir: &Path) -> io::Result<Views> {
        std::fs::create_dir_all(dir)?;
        Ok(Views {
            dir: dir.to_path_buf(),
            by_blob: RwLock::default(),
            by_inode: RwLock::default(),
        })
    }

    /// Where blob `d`'s view file is.
    pub fn path(&self, d: &Digest) -> PathBuf {
        self.dir.join(d.hex())
    }

    /// The view file of `blob`, opened (and created as one hole when missing); `mark` is called on
    /// its path after this server's descriptor is open.
    pub fn open(
        &self,
        blob: &Arc<BlobHandle>,
        mark: impl FnOnce(&Path) -> io::Result<()>,
    ) -> io::Result<Arc<ViewFile>> {
        let d = blob.blob.digest;
        if let Some(v) = self.get(&d) {
            return Ok(v);
        }
        let path = self.path(&d);
        let size = blob.toc.view_size();
        let fresh = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.len() == size => false,
            Ok(_) => {
                // Not this blob's size: an interrupted creation or a damaged file. Start again.
                std::fs::remove_file(&path)?;
                true
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => true,
            Err(e) => return Err(e),
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        if fresh {
            file.set_len(size)?;
        }
        // Both descriptors before the mark: their accesses then cause no events.
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path)?;
        mark(&path)?;
        let meta = file.metadata()?;
        let state = if fresh { HOLE } else { UNKNOWN };
        let v = Arc::new(ViewFile {
            blob: blob.clone(),
            path,
            file,
            direct,
            touched: Touched::default(),
            chunks: (0..blob.toc.chunks.len())
                .map(|_| AtomicU8::new(state))
                .collect(),
            filled: AtomicUsize::new(0),
            unmarked: AtomicBool::new(false),
            opening: AtomicUsize::new(0),
            watch: Mutex::new(()),
            used: (0..blob.toc.chunks.len())
                .map(|_| AtomicU32::new(0))
                .collect(),
            evicting: Mutex::default(),
            punch: RwLock::default(),
            last: AtomicUsize::new(usize::MAX),
            own: Mutex::default(),
            filling: Mutex::default(),
            filled_cv: Condvar::new(),
        });
        let mut by_blob = self.by_blob.write().unwrap_or_else(|p| p.into_inner());
        let v = by_blob.entry(d).or_insert(v).clone();
        // The fetcher writes this blob's chunks here, not into the chunk cache (`fetch::home`).
        let home: std::sync::Weak<ViewFile> = Arc::downgrade(&v);
        blob.set_home(home);
        self.by_inode
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert((meta.dev(), meta.ino()), v.clone());
        Ok(v)
    }

    /// View files open.
    pub fn len(&self) -> usize {
        self.by_blob.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every open view file.
    pub fn all(&self) -> Vec<Arc<ViewFile>> {
        let t = self.by_blob.read().unwrap_or_else(|p| p.into_inner());
        t.values().cloned().collect()
    }

    /// Disk space the view files take (the allocated blocks of every file in the directory named
    /// by a blob digest, open or left by an earlier server; not the reserve, `fanotify::room`).
    pub fn disk_bytes(&self) -> u64 {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        dir.flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| Digest::from_hex(n).is_ok())
            })
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    pub fn get(&self, d: &Digest) -> Option<Arc<ViewFile>> {
        let t = self.by_blob.read().unwrap_or_else(|p| p.into_inner());
        t.get(d).cloned()
    }

    /// Deletes view files of blobs not in `used` (no mounted layer reads them, so no reader can be
    /// reading them), least recently filled first, until the files together take at most `bound`
    /// bytes of disk; `unmark` is called on each before it goes. Files of `used` blobs are never
    /// touched (a hole punched under a mounted layer could be read by a read already allowed).
    /// Returns the files and bytes freed.
    pub fn trim(&self, used: &HashSet<Digest>, bound: u64, unmark: impl Fn(&Path)) -> (u64, u64) {
        let digest = |p: &Path| Digest::from_hex(p.file_name()?.to_str()?).ok();
        let judge = |p: &Path, m: &std::fs::Metadata| {
            Some(Candidate {
                bytes: m.blocks() * 512,
                keep: used.contains(&digest(p)?),
            })
        };
        let before = |p: &Path| {
            let forgotten = digest(p).and_then(|d| self.forget(&d));
            if forgotten.is_some_and(|v| !v.unmarked.load(Ordering::Acquire)) {
                unmark(p);
            }
        };
        trim_lru(&self.dir, bound, judge, before)
    }

    /// Drops blob `d`'s view file from the maps (the file stays).
    fn forget(&self, d: &Digest) -> Option<Arc<ViewFile>> {
        let v = self
            .by_blob
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(d)?;
        self.by_inode
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, f| !Arc::ptr_eq(f, &v));
        Some(v)
    }

    /// The view file behind an event's descriptor.
    pub fn by_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<Arc<ViewFile>, FillError> {
        let st = rustix::fs::fstat(fd).map_err(|e| FillError::Io {
            path: PathBuf::from("<event descriptor>"),
            source: e.into(),
        })?;
        let key = (st.st_dev, st.st_ino);
        let t = self.by_inode.read().unwrap_or_else(|p| p.into_inner());
        t.get(&key).cloned().ok_or(FillError::Unknown {
            dev: key.0,
            ino: key.1,
        })
    }
}

impl ViewFile {
    /// The chunks overlapping `count` bytes at `offset`.
    pub fn chunks_in(&self, offset: u64, count: u64) -> std::ops::Range<usize> {
        let toc = &self.blob.toc;
        let end = offset.saturating_add(count.max(1));
        let first = toc
            .chunks
            .partition_point(|c| (c.block as u64 + c.blocks()) * BLOCK_SIZE <= offset);
        let last = toc
            .chunks
            .partition_point(|c| (c.block as u64) * BLOCK_SIZE < end);
        first..last.max(first)
    }

    /// Whether every chunk in `range` is known to be filled.
    pub fn filled(&self, range: std::ops::Range<usize>) -> bool {
        self.chunks[range]
            .iter()
            .all(|c| c.load(Ordering::Acquire) == FILLED)
    }

    /// Fills every chunk in `range` not yet filled: from the file itself when it already holds the
    /// chunk (checked), else fetched (charged to reader `pid`), verified and written.
    pub fn fill(
        &self,
        fetcher: &Arc<Fetcher>,
        range: std::ops::Range<usize>,
        pid: u32,
    ) -> Result<(), FillError> {
        self.fill_with(fetcher, range, pid, false)
    }

    /// [`ViewFile::fill`] of the chunks in `range` that need no fetch (in the file or the chunk
    /// cache), up to the first that would: what reading ahead costs nothing but local I/O.
    pub fn fill_cached(
        &self,
        fetcher: &Arc<Fetcher>,
        range: std::ops::Range<usize>,
    ) -> Result<(), FillError> {
        self.fill_with(fetcher, range, 0, true)
    }

    fn fill_with(
        &self,
        fetcher: &Arc<Fetcher>,
        range: std::ops::Range<usize>,
        pid: u32,
        cached_only: bool,
    ) -> Result<(), FillError> {
        for i in range {
            if !self.claim(i) {
                continue;
            }
            let done = self.fill_one(fetcher, i, pid, cached_only);
            self.release(i);
            if !done? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Takes chunk `i` to fill: `false` when it is filled (perhaps by another thread meanwhile, which
    /// this one waited for).
    fn claim(&self, i: usize) -> bool {
        let mut filling = self.filling.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if self.chunks[i].load(Ordering::Acquire) == FILLED {
                return false;
            }
            if filling.insert(i) {
                return true;
            }
            filling = self
                .filled_cv
                .wait(filling)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn release(&self, i: usize) {
        let mut filling = self.filling.lock().unwrap_or_else(|p| p.into_inner());
        filling.remove(&i);
        self.filled_cv.notify_all();
    }

    /// Fills claimed chunk `i`: `false` when `cached_only` and the chunk would need a fetch.
    fn fill_one(
        &self,
        fetcher: &Arc<Fetcher>,
        i: usize,
        pid: u32,
        cached_only: bool,
    ) -> Result<bool, FillError> {
        if self.rescue(i) {
            return Ok(true);
        }
        match self.chunks[i].load(Ordering::Acquire) {
            FILLED => return Ok(true),
            UNKNOWN if self.holds(i)? => {
                self.set_filled(i);
                return Ok(true);
            }
            _ => {}
        }
        let bytes = match cached_only {
            true => match fetcher.cached(&self.blob, i)? {
                Some(b) => b,
                None => return Ok(false),
            },
            false => with_reader(pid, || fetcher.chunk(&self.blob, i))?,
        };
        fetcher.read_ahead(&self.blob, i);
        if self.chunks[i].load(Ordering::Acquire) == FILLED {
            // The fetch wrote it here itself (this file is the blob's home).
            return Ok(true);
        }
        let _punch = self.punch.read().unwrap_or_else(|p| p.into_inner());
        match &bytes {
            ChunkBytes::Memory(b) => self.write_chunk(i, b)?,
            _ => {
                let mut buf = vec![0u8; self.blob.toc.chunks[i].len as usize];
                bytes.read_at(&mut buf, 0)?;
                self.write_chunk(i, &buf)?
            }
        }
        self.set_filled(i);
        Ok(true)
    }

    /// Writes chunk `i`'s whole blocks: its `bytes` (exactly the chunk's length, in memory), then
    /// zeros to the block's end. Written from where they are: a buffer of the blocks cost a miss of a
    /// 1 MiB chunk an allocation's page faults and a copy more.
    fn write_chunk(&self, i: usize, bytes: &[u8]) -> Result<(), FillError> {
        let c = self.blob.toc.chunks[i];
        if bytes.len() != c.len as usize {
            return Err(FillError::Io {
                path: self.path.clone(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "chunk of another length"),
            });
        }
        let (pos, len) = (c.block as u64 * BLOCK_SIZE, c.blocks() * BLOCK_SIZE);
        let end = pos + bytes.len() as u64;
        self.own(pos, len, || {
            self.write_all(bytes, pos)?;
            self.write_all(&ZEROS[..(pos + len - end) as usize], end)
        })?;
        self.touched.note(pos, len, true);
        Ok(())
    }

    /// Writes the dirty pages of `ranges` out ([`super::pages::write_out`]).
    pub fn write_out(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        super::pages::write_out(&self.file, ranges)
    }

    /// The descriptor the kernel's page cache of this file is advised through.
    pub(super) fn cached(&self) -> &File {
        &self.file
    }

    fn set_filled(&self, i: usize) {
        self.used[i].store(super::evict::clock(), Ordering::Relaxed);
        if self.chunks[i].swap(FILLED, Ordering::AcqRel) != FILLED {
            self.filled.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Records that the chunks of `range` were read now (an event allowed).
    pub fn note_used(&self, range: std::ops::Range<usize>) {
        let now = super::evict::clock();
        for u in self.used.get(range).unwrap_or_default() {
            u.store(now, Ordering::Relaxed);
        }
    }

    /// Takes back chunk `i` if it is marked for eviction (its bytes are still in the file): whether
    /// it is filled now. One marked [`EVICTING_UNCHECKED`] goes back to [`UNKNOWN`] (`false`).
    fn rescue(&self, i: usize) -> bool {
        let c = &self.chunks[i];
        // Every fill and every fetched chunk's `take` asks: the lock only for a marked chunk (only a
        // pass marks, and a punch needs the lock alone, so this state cannot become marked-and-punched
        // between the look and the lock).
        if !matches!(c.load(Ordering::Acquire), EVICTING | EVICTING_UNCHECKED) {
            return false;
        }
        let _punch = self.punch.read().unwrap_or_else(|p| p.into_inner());
        let _ = c.compare_exchange(
            EVICTING_UNCHECKED,
            UNKNOWN,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let back = c
            .compare_exchange(EVICTING, FILLED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if back {
            self.used[i].store(super::evict::clock(), Ordering::Relaxed);
            self.filled.fetch_add(1, Ordering::AcqRel);
        }
        back
    }

    /// Checks every chunk known to be filled against its digest (read back with direct I/O, one
    /// chunk at a time, each claimed meanwhile so no fill races the check): a chunk whose bytes at
    /// rest went bad is marked a hole, to be fetched again on its next read. Returns what it checked.
    pub fn scrub(&self) -> Scrubbed {
        let mut out = Scrubbed::default();
        for (i, c) in self.blob.toc.chunks.iter().enumerate() {
            if self.chunks[i].load(Ordering::Acquire) != FILLED || !self.try_claim(i) {
                continue;
            }
            let read = self.on_disk(i);
            out.chunks += 1;
            out.bytes += u64::from(c.len);
            if !read.as_ref().is_ok_and(|&good| good) {
                tracing::warn!(blob = %self.blob.blob.digest, chunk = i, path = %self.path.display(),
                    read_error = read.err().map(|e| e.to_string()), "scrub: a filled chunk went bad; fetched again on its next read");
                out.bad += 1;
                if self.chunks[i]
                    .compare_exchange(FILLED, HOLE, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    self.filled.fetch_sub(1, Ordering::AcqRel);
                }
            }
            self.release(i);
        }
        out
    }

    /// [`ViewFile::claim`] without waiting: `false` when another thread is filling chunk `i`.
    fn try_claim(&self, i: usize) -> bool {
        let mut filling = self.filling.lock().unwrap_or_else(|p| p.into_inner());
        filling.insert(i)
    }

    /// Chunks known to be filled.
    pub fn kept(&self) -> usize {
        self.filled.load(Ordering::Acquire)
    }

    /// Whether every chunk of the blob is filled (the file needs no more events).
    pub fn complete(&self) -> bool {
        self.filled.load(Ordering::Acquire) == self.chunks.len()
    }

    /// Records that a reader's miss filled `range`: whether it continues the last one (a sequential
    /// reader, worth reading ahead for).
    pub fn follows(&self, range: &std::ops::Range<usize>) -> bool {
        self.last.swap(range.end, Ordering::AcqRel) == range.start
    }

    /// The chunks after `range` to read ahead (at most `n`), recorded as the place the next
    /// sequential miss starts.
    pub fn ahead(&self, range: &std::ops::Range<usize>, n: usize) -> std::ops::Range<usize> {
        let end = (range.end + n).min(self.chunks.len());
        self.last.store(end, Ordering::Release);
        range.end..end
    }

    /// Whether `count` bytes at `offset` lie within an access of this server's own.
    pub fn is_own(&self, offset: u64, count: u64) -> bool {
        let own = self.own.lock().unwrap_or_else(|p| p.into_inner());
        own.iter()
            .any(|&(o, n)| offset >= o && offset.saturating_add(count) <= o + n)
    }

    /// Runs `f`, an access of this server's own to `len` bytes at `offset`, registered meanwhile.
    pub(super) fn own<T>(&self, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        let (start, end) = (
            offset / direct::ALIGN * direct::ALIGN,
            (offset + len).div_ceil(direct::ALIGN) * direct::ALIGN,
        );
        let entry = (start, end - start);
        self.own
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(entry);
        let out = f();
        let mut own = self.own.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = own.iter().position(|e| *e == entry) {
            own.swap_remove(i);
        }
        out
    }

    /// Whether the file already holds chunk `i` (its bytes have the chunk's digest).
    fn holds(&self, i: usize) -> Result<bool, FillError> {
        let ok = self.on_disk(i).map_err(|e| FillError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        if !ok {
            // Unless a fetch filled it meanwhile (a torn view of its write failed the check).
            let _ =
                self.chunks[i].compare_exchange(UNKNOWN, HOLE, Ordering::AcqRel, Ordering::Acquire);
        }
        Ok(ok)
    }

    /// Whether chunk `i`'s bytes in the file have its digest (read with direct I/O, as an access of
    /// this server's own).
    fn on_disk(&self, i: usize) -> io::Result<bool> {
        let c = self.blob.toc.chunks[i];
        let at = c.block as u64 * BLOCK_SIZE;
        let len = c.len as usize;
        let (buf, s) = self.own(at, c.len as u64, || direct::read(&self.direct, at, len))?;
        Ok(Digest::of(&buf[s..s + len]) == c.digest)
    }

    fn write_all(&self, mut buf: &[u8], mut offset: u64) -> Result<(), FillError> {
        while !buf.is_empty() {
            match self.file.write_at(buf, offset) {
                Ok(0) => {
                    return Err(FillError::Io {
                        path: self.path.clone(),
                        source: io::Error::from(io::ErrorKind::WriteZero),
                    })
                }
                Ok(n) => {
                    buf = &buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(FillError::Io {
                        path: self.path.clone(),
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }
}

/// The fetcher hands this blob's verified chunks straight to its view file (see `fetch::home`):
/// written through the page cache, then marked filled, and readers waiting to fill the chunk are woken.
impl ChunkHome for ViewFile {
    fn take(&self, j: usize, bytes: &[u8]) -> bool {
        if j >= self.chunks.len() {
            return false;
        }
        if self.chunks[j].load(Ordering::Acquire) == FILLED || self.rescue(j) {
            return true;
        }
        let punch = self.punch.read().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.write_chunk(j, bytes) {
            tracing::warn!(blob = %self.blob.blob.digest, chunk = j, error = %e,
                "a fetched chunk could not be written to its view file; cached instead");
            return false;
        }
        self.set_filled(j);
        drop(punch);
        // Under the lock `claim` checks the state with, so that no waiter misses the news.
        let _filling = self.filling.lock().unwrap_or_else(|p| p.into_inner());
        self.filled_cv.notify_all();
        true
    }

    fn has(&self, j: usize) -> bool {
        self.chunks
            .get(j)
            .is_some_and(|c| c.load(Ordering::Acquire) == FILLED)
    }

    fn read_at(&self, j: usize, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let c = self
            .blob
            .toc
            .chunks
            .get(j)
            .ok_or(io::ErrorKind::InvalidInput)?;
        if offset.saturating_add(buf.len() as u64) > u64::from(c.len) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let at = c.block as u64 * BLOCK_SIZE + offset;
        // No punch meanwhile: a chunk still filled (or only marked) has its bytes in the file; one
        // evicted since the caller asked `has` is an error, never zeros.
        let _punch = self.punch.read().unwrap_or_else(|p| p.into_inner());
        if !matches!(self.chunks[j].load(Ordering::Acquire), FILLED | EVICTING) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the chunk was evicted from its view file",
            ));
        }
        let (data, start) = self.own(at, buf.len() as u64, || {
            direct::read(&self.direct, at, buf.len())
        })?;
        buf.copy_from_slice(&data[start..start + buf.len()]);
        Ok(())
    }
}
