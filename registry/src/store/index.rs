//! The local store's index: a RocksDB database in `<root>/index`, the one module that speaks RocksDB.
//!
//! A local directory has no compare-and-swap put, so tags of a `file://` store live here and every tag
//! update is a read-compare-write done while holding the database: RocksDB's lock file excludes other
//! processes, a process-wide mutex excludes other threads. The database is opened for one operation at a
//! time, so a long build never blocks another process's tag update; a busy database is retried for a few
//! seconds. Readers open it read-only, which takes no lock.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rocksdb::{Options, DB};

use super::StoreError;

static LOCAL: Mutex<()> = Mutex::new(());
const TAG_PREFIX: &[u8] = b"tag/";
const BUSY_WAIT: Duration = Duration::from_secs(10);

/// The index of a local store.
pub struct Index {
    path: PathBuf,
}

fn db_err(path: &Path, e: rocksdb::Error) -> StoreError {
    StoreError::Index {
        path: path.to_path_buf(),
        message: e.into_string(),
    }
}

impl Index {
    /// The index of the store rooted at `root`.
    pub fn new(root: &Path) -> Index {
        Index {
            path: root.join("index"),
        }
    }

    fn open_rw(&self) -> Result<DB, StoreError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_keep_log_file_num(2);
        let start = Instant::now();
        loop {
            match DB::open(&opts, &self.path) {
                Ok(db) => return Ok(db),
                Err(e) if e.as_ref().contains("lock") && start.elapsed() < BUSY_WAIT => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(db_err(&self.path, e)),
            }
        }
    }

    fn open_ro(&self) -> Result<Option<DB>, StoreError> {
        if !self.path.join("CURRENT").exists() {
            return Ok(None);
        }
        DB::open_for_read_only(&Options::default(), &self.path, false)
            .map(Some)
            .map_err(|e| db_err(&self.path, e))
    }

    fn key(name: &str) -> Vec<u8> {
        [TAG_PREFIX, name.as_bytes()].concat()
    }

    /// The value of a tag (`name:tag`).
    pub fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(db) = self.open_ro()? else {
            return Ok(None);
        };
        db.get(Self::key(name)).map_err(|e| db_err(&self.path, e))
    }

    /// Sets a tag to `new` if its current value is `expected` (`None`: absent). Returns the value found
    /// when it was not the expected one.
    pub fn compare_and_swap(
        &self,
        name: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<Result<(), Option<Vec<u8>>>, StoreError> {
        let _guard = LOCAL.lock().unwrap_or_else(|p| p.into_inner());
        let db = self.open_rw()?;
        let key = Self::key(name);
        let current = db.get(&key).map_err(|e| db_err(&self.path, e))?;
        if current.as_deref() != expected {
            return Ok(Err(current));
        }
        let mut wo = rocksdb::WriteOptions::default();
        wo.set_sync(true);
        db.put_opt(&key, new, &wo)
            .map_err(|e| db_err(&self.path, e))?;
        Ok(Ok(()))
    }

    /// Every tag and its value, sorted by name.
    pub fn list(&self) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let Some(db) = self.open_ro()? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for item in db.prefix_iterator(TAG_PREFIX) {
            let (k, v) = item.map_err(|e| db_err(&self.path, e))?;
            let Some(name) = k.strip_prefix(TAG_PREFIX) else {
                break;
            };
            out.push((String::from_utf8_lossy(name).into_owned(), v.to_vec()));
        }
        Ok(out)
    }
}
