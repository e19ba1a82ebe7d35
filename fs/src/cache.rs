//! The node's chunk cache: verified chunks on local disk, shared by every mount, bounded, persistent.
//!
//! Chunks are files named by their digest (`<dir>/<hh>/<hex>`), written to a temporary name and renamed
//! into place only after their digest was checked, so the cache never holds a byte that was not verified.
//! The index (size, recency, pins) lives in memory and is rebuilt from the directory when the daemon
//! starts; chunks found on disk at start are re-verified on their first read, so a torn or rotted file is
//! dropped rather than served. The cache is bounded: inserting past the capacity evicts the least recently
//! used chunks, never one that is pinned by a reader. Equal chunks of different blobs are cached once.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use strata_registry::digest::Digest;

/// Errors of the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("chunk cache {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path, source: std::io::Error) -> CacheError {
    CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

struct Entry {
    size: u64,
    tick: u64,
    pins: u32,
    /// False for chunks found on disk at start, until a read re-verifies them.
    verified: bool,
}

#[derive(Default)]
struct State {
    entries: HashMap<Digest, Entry>,
    /// Recency order of unpinned and pinned entries alike: tick → digest.
    lru: BTreeMap<u64, Digest>,
    tick: u64,
    used: u64,
}

/// Counters the daemon exports.
#[derive(Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub inserted_bytes: AtomicU64,
}

/// A bounded on-disk cache of verified chunks.
pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    state: Mutex<State>,
    pub stats: CacheStats,
}

/// A cached chunk, pinned (never evicted) while this handle lives.
pub struct Pinned {
    cache: Arc<ChunkCache>,
    digest: Digest,
    file: File,
    pub size: u64,
}

impl Pinned {
    /// Reads `buf.len()` bytes at `offset` in the chunk.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), CacheError> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| io(&self.cache.path_of(&self.digest), e))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        if let Some(e) = st.entries.get_mut(&self.digest) {
            e.pins = e.pins.saturating_sub(1);
        }
        let cap = self.cache.capacity;
        self.cache.evict(&mut st, cap);
    }
}

impl ChunkCache {
    /// Opens (creating) the cache in `dir`, bounded to `capacity` bytes; indexes chunks already there.
    pub fn open(dir: &Path, capacity: u64) -> Result<Arc<ChunkCache>, CacheError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let mut found = Vec::new();
        for sub in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let sub = sub.map_err(|e| io(dir, e))?.path();
            if !sub.is_dir() {
                continue;
            }
            for f in std::fs::read_dir(&sub).map_err(|e| io(&sub, e))? {
                let f = f.map_err(|e| io(&sub, e))?;
                let name = f.file_name();
                let name = name.to_string_lossy();
                let Ok(d) = Digest::from_hex(&name) else {
                    // Temporary files of an interrupted insert.
                    let _ = std::fs::remove_file(f.path());
                    continue;
                };
                let m = f.metadata().map_err(|e| io(&f.path(), e))?;
                let atime = m.accessed().or_else(|_| m.modified()).ok();
                found.push((atime, d, m.len()));
            }
        }
        found.sort_by_key(|(t, _, _)| *t);
        let cache = Arc::new(ChunkCache {
            dir: dir.to_path_buf(),
            capacity,
            state: Mutex::new(State::default()),
            stats: CacheStats::default(),
        });
        {
            let mut st = cache.lock();
            for (_, d, size) in found {
                st.tick += 1;
                let tick = st.tick;
                st.lru.insert(tick, d);
                st.used += size;
                st.entries.insert(
                    d,
                    Entry {
                        size,
                        tick,
                        pins: 0,
                        verified: false,
                    },
                );
            }
            cache.evict(&mut st, capacity);
        }
        Ok(cache)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path_of(&self, d: &Digest) -> PathBuf {
        let hex = d.hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// The configured bound.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Number of chunks held.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// True if the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True if the chunk is cached (without touching its recency).
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

    /// Evicts least recently used, unpinned chunks until `used <= target`.
    fn evict(&self, st: &mut State, target: u64) {
        if st.used <= target {
            return;
        }
        let victims: Vec<(u64, Digest)> = st
            .lru
            .iter()
            .map(|(t, d)| (*t, *d))
            .filter(|(_, d)| st.entries.get(d).is_some_and(|e| e.pins == 0))
            .collect();
        for (tick, d) in victims {
            if st.used <= target {
                break;
            }
            if let Some(e) = st.entries.remove(&d) {
                st.used -= e.size;
                st.lru.remove(&tick);
                let _ = std::fs::remove_file(self.path_of(&d));
                self.stats.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Asks the kernel to start reading chunk `d`'s file into the page cache, if it is cached; does not
    /// wait for the disk.
    pub fn advise(&self, d: &Digest) {
        if !self.contains(d) {
            return;
        }
        // An evicted or missing file is no matter: this is only a hint.
        if let Ok(f) = File::open(self.path_of(d)) {
            // SAFETY: fadvise on a descriptor this function owns; no pointers involved.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
        }
    }

    /// The chunk, pinned, if cached. A chunk found on disk at start is verified on its first read and
    /// dropped if it does not match.
    pub fn get(self: &Arc<Self>, d: &Digest) -> Option<Pinned> {
        let needs_check = {
            let mut st = self.lock();
            let e = st.entries.get_mut(d)?;
            e.pins += 1;
            let check = !e.verified;
            Self::touch(&mut st, d);
            check
        };
        let path = self.path_of(d);
        let ok_file = File::open(&path)
            .ok()
            .filter(|_| !needs_check || std::fs::read(&path).is_ok_and(|b| d.matches(&b)));
        let mut st = self.lock();
        match ok_file {
            Some(file) => {
                let e = st.entries.get_mut(d)?;
                e.verified = true;
                let size = e.size;
                drop(st);
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(Pinned {
                    cache: self.clone(),
                    digest: *d,
                    file,
                    size,
                })
            }
            None => {
                if let Some(e) = st.entries.remove(d) {
                    st.used -= e.size;
                    st.lru.remove(&e.tick);
                }
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Inserts a chunk whose bytes the caller has verified against `d`, then evicts down to the bound.
    pub fn insert(&self, d: &Digest, bytes: &[u8]) -> Result<(), CacheError> {
        if self.contains(d) {
            return Ok(());
        }
        let path = self.path_of(d);
        let parent = path.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = parent.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
        let written = f.write_all(bytes).and_then(|_| f.flush());
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&tmp, e));
        }
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        let mut st = self.lock();
        if !st.entries.contains_key(d) {
            st.tick += 1;
            let tick = st.tick;
            st.lru.insert(tick, *d);
            st.used += bytes.len() as u64;
            st.entries.insert(
                *d,
                Entry {
                    size: bytes.len() as u64,
                    tick,
                    pins: 0,
                    verified: true,
                },
            );
            self.stats
                .inserted_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        let cap = self.capacity;
        self.evict(&mut st, cap);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(i: u8, n: usize) -> (Digest, Vec<u8>) {
        let b = vec![i; n];
        (Digest::of(&b), b)
    }

    #[test]
    fn bounded_lru_never_evicts_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), 3000).unwrap();
        let (d1, b1) = chunk(1, 1000);
        let (d2, b2) = chunk(2, 1000);
        let (d3, b3) = chunk(3, 1000);
        let (d4, b4) = chunk(4, 1000);
        c.insert(&d1, &b1).unwrap();
        c.insert(&d2, &b2).unwrap();
        c.insert(&d3, &b3).unwrap();
        let pinned = c.get(&d1).unwrap(); // d1 most recent and pinned
        c.insert(&d4, &b4).unwrap(); // evicts d2 (least recent)
        assert!(c.contains(&d1) && !c.contains(&d2) && c.contains(&d3) && c.contains(&d4));
        assert!(c.used() <= 3000);
        let mut buf = [0u8; 10];
        pinned.read_at(&mut buf, 990).unwrap();
        assert_eq!(buf, [1u8; 10]);
        drop(pinned);
    }

    #[test]
    fn survives_restart_and_drops_rotten_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let (d1, b1) = chunk(1, 500);
        let (d2, b2) = chunk(2, 500);
        {
            let c = ChunkCache::open(dir.path(), 10_000).unwrap();
            c.insert(&d1, &b1).unwrap();
            c.insert(&d2, &b2).unwrap();
        }
        // Rot one file on disk.
        let hex = d2.hex();
        std::fs::write(dir.path().join(&hex[..2]).join(&hex), vec![9u8; 500]).unwrap();
        let c = ChunkCache::open(dir.path(), 10_000).unwrap();
        assert_eq!(c.len(), 2);
        assert!(c.get(&d1).is_some());
        assert!(c.get(&d2).is_none(), "rotten chunk served");
        assert!(!c.contains(&d2));
    }
}
