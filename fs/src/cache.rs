//! The node's chunk cache: verified chunks on local disk, shared by every mount, bounded, persistent.
//!
//! **Layout.** Chunks live in *segment files* (`<dir>/seg-<n>`, up to [`SEGMENT_BYTES`] each), appended
//! at 4 KiB-aligned offsets, not in a file per chunk: creating a file per chunk cost the cold path more
//! than decompressing it (ext4 allocating an inode for every chunk, and the page cache, dentry and inode
//! of a file per chunk afterwards), and a read then costs no `open`. Each segment has an index file
//! (`seg-<n>.idx`) of fixed-size records appended after the chunk's bytes are written: *put* (digest,
//! offset, length) and *drop* (the same, when the chunk is evicted). The index in memory (where each chunk
//! is, its size, recency) is rebuilt from those records when the daemon starts, recency then being the
//! order the chunks were written in. Files are the daemon's only (mode 0600): they hold image data.
//!
//! **Only verified bytes — checked on every read from disk.** The invariant: *every byte [`ChunkCache::get`]
//! hands out was checked against the chunk's digest after it was last read from the segment file, or is
//! the (caller-verified) bytes [`ChunkCache::insert`] was given; either way it sits in this process's
//! memory, where no other process and no disk fault can change it.* A segment file is only a hint: a
//! byte flipped in it while the daemon runs, a torn or never-synced chunk after a crash, rot — each makes
//! the chunk fail its check on its next read from disk, and the chunk is then dropped from the cache
//! (`get` answers `None`, so the fetcher fetches it again) instead of being served.
//!
//! The cost is one BLAKE3 pass per chunk read from disk, not per request: `get` reads the whole chunk,
//! checks it, and keeps it in a small in-memory LRU of verified chunks (`Arc<[u8]>`, bounded to
//! [`VERIFIED_BYTES`] or a sixteenth of the cache, whichever is smaller). A sequential reader's 128 KiB
//! requests into one 1 MiB chunk thus cost one read and one hash of the chunk, then seven memory copies;
//! concurrent readers of a chunk that is not in memory wait for one check (single flight) instead of
//! each hashing it. Chunks just inserted go into that LRU too (their bytes are at hand), so the readers
//! that waited for a fetch pay no hash either. And the hash is kept off a sequential reader's path: the
//! fetcher's read-ahead ([`ChunkCache::advise`], the next chunks of a blob being read in order) hands the
//! chunks it names to a checking thread, which reads and checks them into memory before the reader gets
//! there (measured on a warm 1 GiB sequential read: checking on the reader's path cost 14–25 % of the
//! throughput, checking ahead about nothing; BENCHMARKS.md). A reader holds its chunk's bytes, not a place
//! on disk, so eviction never disturbs a read in progress.
//!
//! **Bounded.** Inserting past the capacity evicts the least recently used chunks. An evicted chunk's
//! blocks are freed at once (`fallocate` punching a hole; on a filesystem without holes the space comes
//! back when the whole segment is deleted, which happens when its last chunk goes). Equal chunks of
//! different blobs are cached once (the key is the chunk digest).
//!
//! **Not in the page cache.** Segment pages are dropped once read or written back
//! ([`crate::pagecache`]): the verified chunks the cache hands out are in its memory already, and the
//! bytes readers keep are the kernel's own copy — a third copy of each byte in the page cache would cost
//! the node's density.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::num::NonZeroU64;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use rustix::fs::{fadvise, fallocate, Advice, FallocateFlags};
use strata_registry::digest::Digest;
use strata_registry::store::direct;

/// Largest segment file (a chunk larger than this gets a segment of its own).
pub const SEGMENT_BYTES: u64 = 256 << 20;

/// Chunks waiting for the checking thread at most (see [`ChunkCache::advise`]).
const AHEAD_QUEUE: usize = 64;

/// The checking thread: checks the chunks readers are approaching, until the cache is dropped.
fn check_ahead(cache: &Weak<ChunkCache>, queue: &Receiver<Digest>) {
    for d in queue {
        let Some(c) = cache.upgrade() else {
            return;
        };
        if !c.lock().hot.contains_key(&d) {
            c.get(&d);
        }
    }
}

/// Largest memory for verified chunks (see the module documentation).
pub const VERIFIED_BYTES: u64 = 64 << 20;

/// Mode of segment and index files: the daemon's only.
const FILE_MODE: u32 = 0o600;

/// Alignment of chunks in a segment (whole blocks, so that an evicted chunk's blocks can be freed).
const ALIGN: u64 = 4096;

/// An index record: kind (1 put, 2 drop), digest, offset, length.
const RECORD: usize = 1 + 32 + 8 + 8;
const PUT: u8 = 1;
const DROP: u8 = 2;

/// Errors of the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("chunk cache {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("chunk cache: read of {len} bytes at {offset} past the end of a {size}-byte chunk")]
    PastEnd { offset: u64, len: usize, size: u64 },
}

fn io(path: &Path, source: std::io::Error) -> CacheError {
    CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

struct Entry {
    seg: u64,
    offset: u64,
    size: u64,
    tick: u64,
}

/// One segment file and its index.
struct Segment {
    data: Arc<File>,
    /// The same file opened for direct I/O, which chunk reads use (`crate::pagecache`); `None` where
    /// the filesystem refuses it.
    direct: Option<Arc<File>>,
    index: File,
    /// Chunks stored in it (including ones being written).
    live: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<Digest, Entry>,
    /// Recency order of unpinned and pinned entries alike: tick → digest.
    lru: BTreeMap<u64, Digest>,
    tick: u64,
    used: u64,
    segments: HashMap<u64, Segment>,
    /// The segment chunks are appended to, and its end.
    head: Option<(u64, u64)>,
    next_segment: u64,
    /// Verified copies of recently read chunks (a subset of `entries`): digest → (bytes, tick).
    hot: HashMap<Digest, (Arc<[u8]>, u64)>,
    /// Recency of `hot`: tick → digest.
    hot_lru: BTreeMap<u64, Digest>,
    hot_bytes: u64,
    /// Chunks being read from disk and checked: later readers wait for the first one's answer.
    checking: HashMap<Digest, Arc<Check>>,
}

/// The answer of one check of a chunk read from disk: its bytes, or `None` if it failed.
type Check = OnceLock<Option<Arc<[u8]>>>;

/// Counters the daemon exports.
#[derive(Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub inserted_bytes: AtomicU64,
    /// Chunks read from disk and checked against their digest.
    pub checked: AtomicU64,
    /// Chunks that failed that check (and were dropped).
    pub rejected: AtomicU64,
}

/// A bounded on-disk cache of verified chunks.
pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    segment_bytes: u64,
    /// Bound of the verified copies kept in memory.
    verified_bytes: u64,
    /// Chunks to check ahead of a sequential reader, for the checking thread (see [`ChunkCache::advise`]).
    ahead: SyncSender<Digest>,
    /// Drops written segment pages once they are on disk.
    settler: crate::pagecache::Settler,
    state: Mutex<State>,
    pub stats: CacheStats,
}

/// What a scrub checked ([`ChunkCache::scrub`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Scrubbed {
    /// Chunks read back and hashed.
    pub chunks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of them, those whose bytes no longer had their digest (dropped; fetched again when read).
    pub bad: u64,
}

impl std::ops::AddAssign for Scrubbed {
    fn add_assign(&mut self, o: Scrubbed) {
        self.chunks += o.chunks;
        self.bytes += o.bytes;
        self.bad += o.bad;
    }
}

/// A cached chunk's verified bytes (in memory: nothing on disk can change them any more).
pub struct Verified {
    bytes: Arc<[u8]>,
    pub size: u64,
}

impl Verified {
    /// Reads `buf.len()` bytes at `offset` in the chunk.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), CacheError> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|o| self.bytes.get(o..o.checked_add(buf.len())?))
            .ok_or(CacheError::PastEnd {
                offset,
                len: buf.len(),
                size: self.size,
            })?;
        buf.copy_from_slice(src);
        Ok(())
    }

    /// The whole chunk.
    pub fn bytes(&self) -> &Arc<[u8]> {
        &self.bytes
    }
}

fn record(kind: u8, d: &Digest, offset: u64, len: u64) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[0] = kind;
    r[1..33].copy_from_slice(&d.0);
    r[33..41].copy_from_slice(&offset.to_le_bytes());
    r[41..49].copy_from_slice(&len.to_le_bytes());
    r
}

fn segment_id(name: &str) -> Option<u64> {
    name.strip_prefix("seg-")?.parse().ok()
}

/// The live chunks of a segment from its index records: digest → (offset, length). A torn record at the
/// end (a crash while appending) is ignored.
fn read_index(path: &Path) -> std::io::Result<HashMap<Digest, (u64, u64)>> {
    let mut b = Vec::new();
    File::open(path)?.read_to_end(&mut b)?;
    let mut live = HashMap::new();
    for r in b.chunks_exact(RECORD) {
        let mut d = [0u8; 32];
        d.copy_from_slice(&r[1..33]);
        let num = |a: usize| u64::from_le_bytes(r[a..a + 8].try_into().unwrap_or([0; 8]));
        let (offset, len) = (num(33), num(41));
        match r[0] {
            PUT => {
                live.insert(Digest(d), (offset, len));
            }
            DROP => {
                if live.get(&Digest(d)) == Some(&(offset, len)) {
                    live.remove(&Digest(d));
                }
            }
            _ => break,
        }
    }
    Ok(live)
}

impl State {
    /// Takes a segment left by an earlier daemon: its recorded chunks (unless another segment holds
    /// them), in the order they were written. An empty or unreadable segment is removed.
    fn adopt_segment(&mut self, dir: &Path, id: u64, segment_bytes: u64) {
        self.next_segment = self.next_segment.max(id + 1);
        let path = dir.join(format!("seg-{id}"));
        let idx = dir.join(format!("seg-{id}.idx"));
        let live = read_index(&idx).unwrap_or_default();
        if live.is_empty() {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(&idx);
            return;
        }
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .and_then(|d| Ok((d, OpenOptions::new().append(true).open(&idx)?)));
        let Ok((data, index)) = opened else {
            tracing::warn!(segment = %path.display(), "chunk cache segment unreadable; dropped");
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(&idx);
            return;
        };
        // Files of an older daemon may be readable by anyone: they hold image data.
        for f in [&data, &index] {
            let _ = f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE));
        }
        let mut n = 0;
        // Recency after a restart: in the order chunks were written, older segments first.
        let mut live: Vec<_> = live.into_iter().collect();
        live.sort_unstable_by_key(|(_, (offset, _))| *offset);
        for (d, (offset, size)) in live {
            if self.entries.contains_key(&d) {
                continue;
            }
            self.tick += 1;
            self.lru.insert(self.tick, d);
            self.used += size;
            n += 1;
            let entry = Entry {
                seg: id,
                offset,
                size,
                tick: self.tick,
            };
            self.entries.insert(d, entry);
        }
        // A restarted daemon appends to the last segment where the last left off (past every byte
        // already there, recorded or not), instead of starting a segment per restart.
        let end = data
            .metadata()
            .map_or(u64::MAX, |m| m.len().div_ceil(ALIGN) * ALIGN);
        self.head = (end < segment_bytes).then_some((id, end));
        let data = Arc::new(data);
        let seg = Segment {
            data,
            direct: direct::open(&path).ok().map(Arc::new),
            index,
            live: n,
        };
        self.segments.insert(id, seg);
    }
}

impl ChunkCache {
    /// Opens (creating) the cache in `dir`, bounded to `capacity` bytes; indexes chunks already there.
    /// Verified copies of chunks take at most [`VERIFIED_BYTES`] or `capacity / 16` of memory.
    pub fn open(dir: &Path, capacity: u64) -> Result<Arc<ChunkCache>, CacheError> {
        Self::open_segmented(dir, capacity, SEGMENT_BYTES)
    }

    /// [`ChunkCache::open`] with segments of `segment_bytes`.
    pub fn open_segmented(
        dir: &Path,
        capacity: u64,
        segment_bytes: u64,
    ) -> Result<Arc<ChunkCache>, CacheError> {
        let verified = (capacity / 16).min(VERIFIED_BYTES);
        Self::open_with(dir, capacity, segment_bytes, verified)
    }

    /// [`ChunkCache::open_segmented`] keeping at most `verified_bytes` of verified chunks in memory.
    pub fn open_with(
        dir: &Path,
        capacity: u64,
        segment_bytes: u64,
        verified_bytes: u64,
    ) -> Result<Arc<ChunkCache>, CacheError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let mut st = State::default();
        let mut found = Vec::new();
        for f in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let f = f.map_err(|e| io(dir, e))?;
            let path = f.path();
            let name = f.file_name().to_string_lossy().into_owned();
            if let Some(id) = segment_id(&name) {
                found.push(id);
            } else if !name.ends_with(".idx") {
                // The one-file-per-chunk layout of earlier versions, or stray files: not ours to keep.
                let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
            }
        }
        found.sort_unstable();
        for id in found {
            st.adopt_segment(dir, id, segment_bytes);
        }
        // Index files whose segment is gone.
        for f in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            let seg = name.strip_suffix(".idx").and_then(segment_id);
            if seg.is_some_and(|id| !st.segments.contains_key(&id)) {
                let _ = std::fs::remove_file(f.path());
            }
        }
        let (ahead, queue) = sync_channel(AHEAD_QUEUE);
        let cache = Arc::new(ChunkCache {
            dir: dir.to_path_buf(),
            capacity,
            segment_bytes,
            verified_bytes,
            ahead,
            settler: crate::pagecache::Settler::start().map_err(|e| io(dir, e))?,
            state: Mutex::new(st),
            stats: CacheStats::default(),
        });
        let weak = Arc::downgrade(&cache);
        std::thread::Builder::new()
            .name("strata-cache-check".into())
            .spawn(move || check_ahead(&weak, &queue))
            .map_err(|e| io(dir, e))?;
        {
            let mut st = cache.lock();
            cache.evict(&mut st, capacity);
        }
        Ok(cache)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn used(&self) -> u64 {
        self.lock().used
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, d: &Digest) -> bool {
        self.lock().entries.contains_key(d)
    }

    fn touch(st: &mut State, d: &Digest) {
        st.tick += 1;
        let tick = st.tick;
        if let Some(e) = st.entries.get_mut(d) {
            let old = std::mem::replace(&mut e.tick, tick);
            st.lru.remove(&old);
            st.lru.insert(tick, *d);
        }
    }

    /// Forgets a chunk: a drop record, its blocks freed, its segment deleted when it was the last.
    fn forget(&self, st: &mut State, d: &Digest) {
        let Some(e) = st.entries.remove(d) else {
            return;
        };
        st.used -= e.size;
        st.lru.remove(&e.tick);
        Self::cool(st, d);
        self.release(st, e.seg, d, e.offset, e.size);
    }

    /// Drops the verified copy of a chunk, if one is in memory.
    fn cool(st: &mut State, d: &Digest) {
        if let Some((b, tick)) = st.hot.remove(d) {
            st.hot_lru.remove(&tick);
            st.hot_bytes -= b.len() as u64;
        }
    }

    /// Keeps a verified copy of chunk `d` (which is cached) in memory, evicting older copies down to the
    /// bound; a copy larger than the bound is not kept.
    fn heat(&self, st: &mut State, d: &Digest, bytes: Arc<[u8]>) {
        Self::cool(st, d);
        let len = bytes.len() as u64;
        if len > self.verified_bytes || !st.entries.contains_key(d) {
            return;
        }
        while st.hot_bytes + len > self.verified_bytes {
            let Some((_, old)) = st.hot_lru.pop_first() else {
                break;
            };
            if let Some((b, _)) = st.hot.remove(&old) {
                st.hot_bytes -= b.len() as u64;
            }
        }
        st.tick += 1;
        let tick = st.tick;
        st.hot_lru.insert(tick, *d);
        st.hot.insert(*d, (bytes, tick));
        st.hot_bytes += len;
    }

    /// Deletes segment `id` (it holds no chunk).
    fn drop_segment(&self, st: &mut State, id: u64) {
        st.segments.remove(&id);
        let _ = std::fs::remove_file(self.dir.join(format!("seg-{id}")));
        let _ = std::fs::remove_file(self.dir.join(format!("seg-{id}.idx")));
    }

    /// Releases a chunk's place in segment `seg`.
    fn release(&self, st: &mut State, seg: u64, d: &Digest, offset: u64, size: u64) {
        let head = st.head.map(|h| h.0);
        let Some(s) = st.segments.get_mut(&seg) else {
            return;
        };
        s.live = s.live.saturating_sub(1);
        if s.live == 0 && head != Some(seg) {
            self.drop_segment(st, seg);
            return;
        }
        // A lost drop record only means the chunk is found, and fails its check, after a restart.
        let _ = s.index.write_all(&record(DROP, d, offset, size));
        let len = size.div_ceil(ALIGN) * ALIGN;
        // Failing (no hole support) only delays freeing the space until the segment goes.
        let _ = fallocate(
            &*s.data,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        );
    }

    /// Evicts least recently used chunks until `used <= target`.
    fn evict(&self, st: &mut State, target: u64) {
        if st.used <= target {
            return;
        }
        // Oldest first, only as many as free the excess: a full cache evicts on every insert.
        let mut excess = st.used - target;
        let mut victims = Vec::new();
        for d in st.lru.values() {
            if excess == 0 {
                break;
            }
            if let Some(e) = st.entries.get(d) {
                excess = excess.saturating_sub(e.size);
                victims.push(*d);
            }
        }
        for d in victims {
            self.forget(st, &d);
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Chunk `d` is likely to be read soon (a sequential reader is approaching it): if it is cached but
    /// not among the verified copies in memory, asks the kernel to start reading it from disk and has the
    /// checking thread read and check it, so that the reader finds it verified instead of waiting for the
    /// hash. Does not wait; a hint only (dropped when the checking thread is behind).
    pub fn advise(&self, d: &Digest) {
        let (file, offset, size) = {
            let st = self.lock();
            let Some(e) = st.entries.get(d).filter(|_| !st.hot.contains_key(d)) else {
                return;
            };
            let Some(s) = st.segments.get(&e.seg) else {
                return;
            };
            (s.direct.is_none().then(|| s.data.clone()), e.offset, e.size)
        };
        // Through the page cache only: a direct read would not use the pages, and would leave them.
        if let (Some(file), Some(size)) = (file, NonZeroU64::new(size)) {
            let _ = fadvise(&*file, offset, Some(size), Advice::WillNeed);
        }
        let _ = self.ahead.try_send(*d);
    }

    /// The chunk's bytes, checked against `d`, if cached. A chunk that is not among the verified copies
    /// in memory is read from its segment and checked (once, however many readers ask at the same time);
    /// if it fails it is dropped from the cache and this answers `None`, as for a chunk never cached.
    pub fn get(self: &Arc<Self>, d: &Digest) -> Option<Verified> {
        let (check, file, (seg, offset, size)) = {
            let mut st = self.lock();
            let e = st.entries.get(d)?;
            let place = (e.seg, e.offset, e.size);
            Self::touch(&mut st, d);
            st.tick += 1;
            let tick = st.tick;
            if let Some((bytes, t)) = st.hot.get_mut(d) {
                let (bytes, old) = (bytes.clone(), std::mem::replace(t, tick));
                st.hot_lru.remove(&old);
                st.hot_lru.insert(tick, *d);
                drop(st);
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                return Some(Verified {
                    size: bytes.len() as u64,
                    bytes,
                });
            }
            let file = st
                .segments
                .get(&place.0)
                .map(|s| (s.data.clone(), s.direct.clone()));
            let check = st.checking.entry(*d).or_default().clone();
            (check, file, place)
        };
        let mut mine = false;
        let bytes = check
            .get_or_init(|| {
                mine = true;
                self.read_checked(d, file.as_ref(), offset, size)
            })
            .clone();
        if mine {
            self.settle(d, (seg, offset), &check, bytes.clone());
        }
        let bytes = bytes?;
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        Some(Verified {
            size: bytes.len() as u64,
            bytes,
        })
    }

    /// Reads every cached chunk back from disk and checks it against its digest — a scrub, so the
    /// recency order and the in-memory verified set are left as they are. A chunk whose bytes at rest
    /// went bad is dropped, as a read would drop it (its next read fetches it again). Returns what was
    /// checked.
    pub fn scrub(&self) -> Scrubbed {
        let list: Vec<(Digest, u64, u64, u64)> = {
            let st = self.lock();
            st.entries
                .iter()
                .map(|(d, e)| (*d, e.seg, e.offset, e.size))
                .collect()
        };
        let mut out = Scrubbed::default();
        for (d, seg, offset, size) in list {
            let file = {
                let st = self.lock();
                st.segments
                    .get(&seg)
                    .map(|s| (s.data.clone(), s.direct.clone()))
            };
            let Some(file) = file else { continue };
            let good = self.read_checked(&d, Some(&file), offset, size).is_some();
            out.chunks += 1;
            out.bytes += size;
            if good {
                continue;
            }
            let mut st = self.lock();
            // Evicted meanwhile (its place perhaps reused): nothing went bad.
            if st
                .entries
                .get(&d)
                .is_some_and(|e| (e.seg, e.offset) == (seg, offset))
            {
                tracing::warn!(chunk = %d, "scrub: a cached chunk failed verification; dropped");
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                self.forget(&mut st, &d);
                out.bad += 1;
            }
        }
        out
    }

    /// Reads a chunk from its place in a segment and checks it against its digest.
    /// `file`: the segment, and the same opened for direct I/O (used when there is one).
    fn read_checked(
        &self,
        d: &Digest,
        file: Option<&(Arc<File>, Option<Arc<File>>)>,
        offset: u64,
        size: u64,
    ) -> Option<Arc<[u8]>> {
        let (file, direct) = file?;
        let len = usize::try_from(size).ok()?;
        let direct = direct
            .as_ref()
            .and_then(|f| direct::read(f, offset, len).ok());
        let b: Arc<[u8]> = match direct {
            Some((buf, start)) => Arc::from(&buf[start..start + len]),
            None => {
                // Straight into the shared allocation (a `Vec` turned into an `Arc<[u8]>` is copied).
                let mut b: Arc<[u8]> = std::iter::repeat_n(0u8, len).collect();
                let read = file.read_exact_at(Arc::get_mut(&mut b)?, offset);
                crate::pagecache::drop_pages(file, offset, size);
                read.ok()?;
                b
            }
        };
        self.stats.checked.fetch_add(1, Ordering::Relaxed);
        d.matches(&b).then_some(b)
    }

    /// After the check of chunk `d` (read from `place`, a segment and offset): keeps its verified copy,
    /// or drops the chunk if it failed and is still the one that was read.
    fn settle(&self, d: &Digest, place: (u64, u64), check: &Arc<Check>, bytes: Option<Arc<[u8]>>) {
        let mut st = self.lock();
        if st.checking.get(d).is_some_and(|c| Arc::ptr_eq(c, check)) {
            st.checking.remove(d);
        }
        match bytes {
            Some(b) => self.heat(&mut st, d, b),
            // Evicted (its blocks freed) while it was read: gone already, nothing failed.
            None if st.entries.get(d).is_none_or(|e| (e.seg, e.offset) != place) => {}
            None => {
                tracing::warn!(chunk = %d, "cached chunk failed verification; dropped");
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                self.forget(&mut st, d);
            }
        }
    }

    /// Where a chunk of `len` bytes goes: a segment and an offset, reserved (the segment counts it).
    fn reserve(&self, st: &mut State, len: u64) -> Result<(u64, u64, Arc<File>), CacheError> {
        let room = st
            .head
            .filter(|&(_, end)| end == 0 || end + len <= self.segment_bytes);
        let (seg, offset) = match room {
            Some(h) => h,
            None => {
                let id = st.next_segment;
                let path = self.dir.join(format!("seg-{id}"));
                let idx = self.dir.join(format!("seg-{id}.idx"));
                let data = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(FILE_MODE)
                    .open(&path)
                    .map_err(|e| io(&path, e))?;
                // A new segment's index starts empty (a stale one would name chunks it does not have).
                let _ = std::fs::remove_file(&idx);
                let index = OpenOptions::new()
                    .append(true)
                    .create(true)
                    .mode(FILE_MODE)
                    .open(&idx)
                    .map_err(|e| io(&idx, e))?;
                st.next_segment += 1;
                // The old head may hold nothing any more: it can go now.
                if let Some((old, _)) = st.head.replace((id, 0)) {
                    if st.segments.get(&old).is_some_and(|s| s.live == 0) {
                        self.drop_segment(st, old);
                    }
                }
                let data = Arc::new(data);
                let seg = Segment {
                    data,
                    direct: direct::open(&path).ok().map(Arc::new),
                    index,
                    live: 0,
                };
                st.segments.insert(id, seg);
                (id, 0)
            }
        };
        st.head = Some((seg, offset + len.div_ceil(ALIGN) * ALIGN));
        let s = st
            .segments
            .get_mut(&seg)
            .ok_or_else(|| io(&self.dir, std::io::Error::other("segment vanished")))?;
        s.live += 1;
        Ok((seg, offset, s.data.clone()))
    }

    /// Inserts a chunk whose bytes the caller has verified against `d`, then evicts down to the bound.
    pub fn insert(&self, d: &Digest, bytes: &[u8]) -> Result<(), CacheError> {
        self.put(d, bytes, None)
    }

    /// [`Self::insert`] of bytes already shared: the in-memory copy of verified chunks keeps this
    /// allocation itself rather than a copy (a megabyte per chunk, on a miss's path).
    pub fn insert_shared(&self, d: &Digest, bytes: &Arc<[u8]>) -> Result<(), CacheError> {
        self.put(d, bytes, Some(bytes))
    }

    fn put(&self, d: &Digest, bytes: &[u8], shared: Option<&Arc<[u8]>>) -> Result<(), CacheError> {
        if self.contains(d) {
            return Ok(());
        }
        let len = bytes.len() as u64;
        let (seg, offset, file) = self.reserve(&mut self.lock(), len)?;
        let path = self.dir.join(format!("seg-{seg}"));
        let written = file.write_all_at(bytes, offset);
        if written.is_ok() {
            self.settler.written(&file, offset, len);
        }
        let mut st = self.lock();
        if let Err(e) = written {
            self.release(&mut st, seg, d, offset, len);
            return Err(io(&path, e));
        }
        if st.entries.contains_key(d) {
            // Another insert of the same chunk won.
            self.release(&mut st, seg, d, offset, len);
            return Ok(());
        }
        if let Some(s) = st.segments.get_mut(&seg) {
            if let Err(e) = s.index.write_all(&record(PUT, d, offset, len)) {
                self.release(&mut st, seg, d, offset, len);
                return Err(io(&path.with_extension("idx"), e));
            }
        }
        st.tick += 1;
        let tick = st.tick;
        st.lru.insert(tick, *d);
        st.used += len;
        let entry = Entry {
            seg,
            offset,
            size: len,
            tick,
        };
        st.entries.insert(*d, entry);
        self.stats.inserted_bytes.fetch_add(len, Ordering::Relaxed);
        let cap = self.capacity;
        self.evict(&mut st, cap);
        // Readers that waited for this chunk's fetch find it in memory, verified by the caller.
        let hot = shared.map_or_else(|| Arc::from(bytes), Arc::clone);
        self.heat(&mut st, d, hot);
        Ok(())
    }
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;
