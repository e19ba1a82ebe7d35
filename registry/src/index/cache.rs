//! A builder's local copy of the store-wide chunk index, in RocksDB.
//!
//! One database per store (`<cache dir>/<first 16 hex of BLAKE3(store URL [+ S3 endpoint])>`), with three
//! kinds of keys:
//!
//! ```text
//! 's' blob[32]   → the blob's reference (encode_blob_ref): the segment was synced
//! 'c' chunk[32]  → one or more (blob[32], block u32, len u32) (little endian): where the chunk lies
//! 'd' blob[32]   → empty: the blob is gone or condemned (lookups skip it)
//! ```
//!
//! A lookup is one point read (bloom filters answer a chunk the store lacks from memory; index and
//! filter blocks stay loaded), so its cost depends on the database's depth, not its size. (A first version
//! kept a key per chunk and blob and looked chunks up with a prefix seek: at 10 M chunks a seek cost 88 µs,
//! a seek through every level, against a few µs for a point read.) Each synced segment is written in one atomic
//! batch together with its `'s'` key, so a sync interrupted anywhere leaves a consistent cache that the
//! next sync completes: it lists `index/`, fetches only segments without an `'s'` key, marks blobs whose
//! segment vanished (gc deleted them) or that are condemned dead, and pardons the ones no longer condemned.
//!
//! Concurrency: RocksDB lets one process write a database. [`IndexCache::sync_and_open`] syncs with the
//! write handle (waiting up to [`LOCK_WAIT`] for another builder's sync to end, else going on with the
//! cache as it is), closes it, and reopens the database read-only for the build's lookups (any number of
//! builders at once; all table files are opened at once, so a writer's compactions cannot pull one away).
//!
//! **A damaged cache heals.** A cache is only a copy of the store's segments, so one that RocksDB cannot
//! open, sync or read (a flipped byte in a table file, a truncated log) is moved aside
//! (`<db>.damaged`, replacing an earlier one) and rebuilt from the store's segments by the same sync, with
//! one warning. A lookup that fails during a build marks the cache damaged ([`IndexCache::mark_damaged`]:
//! the file `<db>.damaged-mark`), and the next build's sync rebuilds it. Another process holding the
//! database (RocksDB's `LOCK`) is told apart from damage by RocksDB's own message, so a damaged cache is
//! never mistaken for a busy one and waited on.
//!
//! Why RocksDB, linked from Debian's `librocksdb-dev` (see `.cargo/config.toml`): lookups stay flat to
//! 10 M chunks (BENCHMARKS.md), updates are incremental and crash-safe, and it costs about a minute of
//! build (bindgen) instead of the 35 minutes compiling its C++ takes here.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rocksdb::{
    BlockBasedOptions, Cache, DBCompressionType, Direction, IteratorMode, Options, WriteBatch, DB,
};

use super::{decode_blob_ref, encode_blob_ref, IndexError, Segment};
use crate::digest::Digest;
use crate::model::BlobRef;
use crate::store::Store;

/// How long a sync waits for another process's sync of the same cache.
pub const LOCK_WAIT: Duration = Duration::from_secs(60);

/// Where a chunk lies: a blob, its first view block, its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub blob: Digest,
    pub block: u32,
    pub len: u32,
}

/// What a sync did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SyncReport {
    /// Segments listed in the store.
    pub segments: u64,
    /// Segments fetched and added now.
    pub fetched: u64,
    /// Chunk entries added now.
    pub chunks: u64,
    /// Blobs marked dead (segment gone, or condemned).
    pub dead: u64,
    /// False when another process held the cache for longer than [`LOCK_WAIT`] (no sync was done).
    pub synced: bool,
    pub seconds: f64,
}

/// The default cache directory: `$STRATA_INDEX_CACHE`, else `$XDG_CACHE_HOME/strata/index`, else
/// `~/.cache/strata/index`, else `/var/cache/strata/index`.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STRATA_INDEX_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("strata/index");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/strata/index"),
        None => PathBuf::from("/var/cache/strata/index"),
    }
}

/// The database directory of `store` under the cache directory `dir`: named by the store's URL and, for
/// S3, its endpoint (`s3://b/p` on two servers are two stores).
pub fn store_dir(dir: &Path, store: &Store) -> PathBuf {
    let mut id = store.url().to_string();
    if id.starts_with("s3://") {
        if let Ok(e) = std::env::var("AWS_ENDPOINT_URL").or_else(|_| std::env::var("AWS_ENDPOINT"))
        {
            id = format!("{id} {e}");
        }
    }
    dir.join(&Digest::of(id.as_bytes()).hex()[..16])
}

fn chunk_key(chunk: &Digest) -> [u8; 33] {
    blob_key(b'c', chunk)
}

/// Bytes of one location in a `'c'` value.
const HIT_LEN: usize = 40;

fn blob_key(kind: u8, blob: &Digest) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = kind;
    k[1..].copy_from_slice(&blob.0);
    k
}

fn digest_at(b: &[u8]) -> Option<Digest> {
    let mut d = [0u8; 32];
    d.copy_from_slice(b.get(..32)?);
    Some(Digest(d))
}

/// The blobs of every `kind` key (`'s'` or `'d'`): a scan in key order.
fn blobs_of_kind(db: &DB, kind: u8) -> HashSet<Digest> {
    db.iterator(IteratorMode::From(&[kind], Direction::Forward))
        .filter_map(Result::ok)
        .take_while(|(k, _)| k.first() == Some(&kind))
        .filter_map(|(k, _)| digest_at(&k[1..]))
        .collect()
}

fn options() -> Options {
    // Index and filter blocks stay in the table readers (all opened at once, see `open_ro`), not in the
    // block cache: evicted from a small cache, each lookup would reload megabytes of them (measured: 112 µs
    // a lookup at 1 M chunks with them cached, BENCHMARKS.md).
    let mut bo = BlockBasedOptions::default();
    bo.set_bloom_filter(10.0, false);
    if let Ok(cache) = Cache::new_lru_cache(64 << 20) {
        bo.set_block_cache(&cache);
    }
    let mut o = Options::default();
    o.create_if_missing(true);
    o.set_memtable_whole_key_filtering(true);
    o.set_memtable_prefix_bloom_ratio(0.1);
    // Keys and values are digests and block numbers: nothing to compress.
    o.set_compression_type(DBCompressionType::None);
    o.set_block_based_table_factory(&bo);
    o.set_keep_log_file_num(2);
    o
}

/// An open cache.
pub struct IndexCache {
    db: DB,
    path: PathBuf,
    /// Blobs marked dead (loaded once; few).
    dead: HashSet<Digest>,
}

impl IndexCache {
    fn err(path: &Path, e: impl std::fmt::Display) -> IndexError {
        IndexError::Cache {
            path: path.to_path_buf(),
            why: e.to_string(),
        }
    }

    /// Opens the cache at `path` for writing, waiting up to `wait` for another writer; `None` when it
    /// stayed busy.
    pub fn open_rw(path: &Path, wait: Duration) -> Result<Option<IndexCache>, IndexError> {
        std::fs::create_dir_all(path).map_err(|e| Self::err(path, e))?;
        let start = Instant::now();
        loop {
            match DB::open(&options(), path) {
                Ok(db) => return Ok(Some(Self::with_db(db, path))),
                Err(e) if held_by_another(&e) && start.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) if held_by_another(&e) => return Ok(None),
                Err(e) => return Err(Self::err(path, e)),
            }
        }
    }

    /// Opens the cache read-only (it must exist: [`IndexCache::open_rw`] creates it).
    pub fn open_ro(path: &Path) -> Result<IndexCache, IndexError> {
        let mut o = options();
        o.set_max_open_files(-1);
        let db = DB::open_for_read_only(&o, path, false).map_err(|e| Self::err(path, e))?;
        Ok(Self::with_db(db, path))
    }

    fn with_db(db: DB, path: &Path) -> IndexCache {
        let dead = blobs_of_kind(&db, b'd');
        IndexCache {
            db,
            path: path.to_path_buf(),
            dead,
        }
    }

    /// Syncs the cache of `store` under `dir` with the store, then opens it read-only for lookups. A
    /// damaged cache is moved aside and rebuilt (see the module documentation).
    pub fn sync_and_open(
        store: &Store,
        dir: &Path,
    ) -> Result<(IndexCache, SyncReport), IndexError> {
        let path = store_dir(dir, store);
        let mark = damage_mark(&path);
        let damage = match std::fs::read_to_string(&mark) {
            Ok(why) => Err(Self::err(&path, format!("a lookup failed earlier: {why}"))),
            Err(_) => Self::sync_and_open_at(store, &path),
        };
        match damage {
            Err(e @ IndexError::Cache { .. }) => {
                let aside = path.with_extension("damaged");
                let _ = std::fs::remove_dir_all(&aside);
                if path.exists() {
                    std::fs::rename(&path, &aside).map_err(|e| Self::err(&path, e))?;
                }
                let _ = std::fs::remove_file(&mark);
                tracing::warn!(error = %e, aside = %aside.display(),
                    "the index cache is damaged: moved it aside, rebuilding it from the store's index segments");
                Self::sync_and_open_at(store, &path)
            }
            other => other,
        }
    }

    fn sync_and_open_at(
        store: &Store,
        path: &Path,
    ) -> Result<(IndexCache, SyncReport), IndexError> {
        let path = path.to_path_buf();
        let report = match IndexCache::open_rw(&path, LOCK_WAIT)? {
            Some(rw) => rw.sync(store)?,
            None => {
                tracing::warn!(cache = %path.display(), "index cache busy: building without syncing it");
                SyncReport::default()
            }
        };
        Ok((IndexCache::open_ro(&path)?, report))
    }

    /// Adds one segment (one atomic batch): appends the blob's location to each of its chunks' values.
    pub fn add(&mut self, seg: &Segment) -> Result<u64, IndexError> {
        let mut batch = WriteBatch::default();
        for c in &seg.toc.chunks {
            let key = chunk_key(&c.digest);
            let mut v = self
                .db
                .get(key)
                .map_err(|e| Self::err(&self.path, e))?
                .unwrap_or_default();
            if v.chunks_exact(HIT_LEN)
                .any(|h| h[..32] == seg.blob.digest.0)
            {
                continue;
            }
            v.truncate(v.len() - v.len() % HIT_LEN);
            v.extend_from_slice(&seg.blob.digest.0);
            v.extend_from_slice(&c.block.to_le_bytes());
            v.extend_from_slice(&c.len.to_le_bytes());
            batch.put(key, v);
        }
        batch.delete(blob_key(b'd', &seg.blob.digest));
        batch.put(blob_key(b's', &seg.blob.digest), encode_blob_ref(&seg.blob));
        self.db.write(batch).map_err(|e| Self::err(&self.path, e))?;
        self.dead.remove(&seg.blob.digest);
        Ok(seg.toc.chunks.len() as u64)
    }

    /// Marks blob `d` dead: lookups ignore its chunks (until a sync finds it usable again).
    pub fn mark_dead(&mut self, d: &Digest) -> Result<(), IndexError> {
        self.db
            .put(blob_key(b'd', d), [])
            .map_err(|e| Self::err(&self.path, e))?;
        self.dead.insert(*d);
        Ok(())
    }

    fn pardon(&mut self, d: &Digest) -> Result<(), IndexError> {
        self.db
            .delete(blob_key(b'd', d))
            .map_err(|e| Self::err(&self.path, e))?;
        self.dead.remove(d);
        Ok(())
    }

    /// Blobs whose segment the cache holds.
    fn synced(&self) -> HashSet<Digest> {
        blobs_of_kind(&self.db, b's')
    }

    /// Brings the cache up to date with `store` (see the module documentation). A segment that fails its
    /// checks is skipped with a warning (its blob's chunks are then stored again, never trusted).
    pub fn sync(mut self, store: &Store) -> Result<SyncReport, IndexError> {
        let start = Instant::now();
        let listed: HashSet<Digest> = store.list_segments()?.into_iter().collect();
        let condemned: HashSet<Digest> = store.list_condemned()?.into_iter().collect();
        let synced = self.synced();
        let mut r = SyncReport {
            segments: listed.len() as u64,
            synced: true,
            ..SyncReport::default()
        };
        for d in listed.difference(&synced) {
            match store.get_segment(d) {
                Ok(Some(seg)) => {
                    r.chunks += self.add(&seg)?;
                    r.fetched += 1;
                }
                Ok(None) => {}
                Err(IndexError::Malformed { key, why }) => {
                    tracing::warn!(%key, %why, "skipping a malformed index segment");
                }
                Err(e) => return Err(e),
            }
        }
        for d in synced.iter().chain(listed.iter()) {
            let gone = !listed.contains(d) || condemned.contains(d);
            if gone && !self.dead.contains(d) {
                self.mark_dead(d)?;
                r.dead += 1;
            } else if !gone && self.dead.contains(d) {
                self.pardon(d)?;
            }
        }
        if r.fetched > 0 {
            self.settle()?;
        }
        r.seconds = start.elapsed().as_secs_f64();
        Ok(r)
    }

    /// Writes what a sync added to table files, and merges them when they pile up: builds open the cache
    /// for a short sync each, so background compaction alone may not keep up, and lookups would have to
    /// probe every pile.
    pub fn settle(&self) -> Result<(), IndexError> {
        self.db.flush().map_err(|e| Self::err(&self.path, e))?;
        let l0 = self
            .db
            .property_int_value("rocksdb.num-files-at-level0")
            .map_err(|e| Self::err(&self.path, e))?
            .unwrap_or(0);
        if l0 > 8 {
            self.db.compact_range::<&[u8], &[u8]>(None, None);
        }
        Ok(())
    }

    /// Where chunk `d` lies, in every blob not known to be dead, in the order the blobs were synced.
    pub fn lookup(&self, d: &Digest) -> Result<Vec<Hit>, IndexError> {
        let v = self
            .db
            .get_pinned(chunk_key(d))
            .map_err(|e| Self::err(&self.path, e))?;
        let Some(v) = v else {
            return Ok(Vec::new());
        };
        Ok(v.chunks_exact(HIT_LEN)
            .filter_map(|h| {
                let blob = digest_at(h)?;
                let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
                (!self.dead.contains(&blob)).then(|| Hit {
                    blob,
                    block: u32_at(32),
                    len: u32_at(36),
                })
            })
            .collect())
    }

    /// The reference of a synced blob (for a layer's device table).
    pub fn blob(&self, d: &Digest) -> Result<Option<BlobRef>, IndexError> {
        let v = self
            .db
            .get_pinned(blob_key(b's', d))
            .map_err(|e| Self::err(&self.path, e))?;
        Ok(v.and_then(|v| decode_blob_ref(&v)))
    }

    /// The database's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Marks the cache damaged (a lookup failed): the next [`IndexCache::sync_and_open`] moves it aside
    /// and rebuilds it. Best effort.
    pub fn mark_damaged(&self, why: &str) {
        let mark = damage_mark(&self.path);
        if let Err(e) = std::fs::write(&mark, why) {
            tracing::warn!(mark = %mark.display(), error = %e, "could not mark the index cache damaged");
        }
    }
}

/// The file that marks the cache at `path` damaged.
fn damage_mark(path: &Path) -> PathBuf {
    path.with_extension("damaged-mark")
}

/// True when RocksDB refused to open a database because another process holds its `LOCK` (its message
/// is `IO error: While lock file: <db>/LOCK: Resource temporarily unavailable`). Anything else — a
/// corrupt table file ("block checksum mismatch", which contains "lock" too) — is damage.
fn held_by_another(e: &rocksdb::Error) -> bool {
    let m = e.to_string();
    m.contains("While lock file") || m.contains("lock hold by current process")
}
