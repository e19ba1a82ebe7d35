//! Tags of a local store: files `tags/<name>/<tag>` (the layout S3 stores use), changed only by
//! compare-and-swap under an exclusive `flock` on `tags/.lock`.
//!
//! A local directory has no conditional put, so an update is read-compare-write while holding the lock:
//! `flock` excludes other processes and, because every update opens the lock file anew, other threads of
//! this process too. The new value is written to a temporary file and renamed over the tag, so a reader
//! (which takes no lock) sees the old value or the new one, never a torn one, and a crash leaves the old.
//!
//! DESIGN.md chose a RocksDB index here. It was dropped after measuring its cost on the 2-core machines:
//! librocksdb-sys compiles C++ for about 35 minutes, once per feature set (a `cargo build` and a
//! `cargo clippy` of the workspace are two), which alone threatened CI's 90-minute budget; a lock file
//! gives the same serialization for tags with no dependency.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::StoreError;
use crate::model::TagName;

const LOCK_WAIT: Duration = Duration::from_secs(30);

fn io(path: &Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn tag_path(root: &Path, t: &TagName) -> PathBuf {
    root.join("tags").join(&t.name).join(&t.tag)
}

/// Holds an exclusive `flock` until dropped (the kernel releases it with the file).
pub(super) struct Lock {
    _file: File,
}

/// The store's lock, `tags/.lock`: tag updates, and if-match puts of a local store (`super::backend`).
pub(super) fn lock(root: &Path) -> Result<Lock, StoreError> {
    let dir = root.join("tags");
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    lock_file(&dir.join(".lock"))
}

/// An exclusive `flock` on the file at `path` (created if missing, with its directory).
pub(super) fn lock_file(path: &Path) -> Result<Lock, StoreError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| io(path, e))?;
    flock(f, path)
}

/// Takes an exclusive `flock` on `f` (opened from `path`), waiting up to [`LOCK_WAIT`]. Each caller
/// opens the file anew, so the lock excludes other threads of this process as well as other processes.
fn flock(f: File, path: &Path) -> Result<Lock, StoreError> {
    let start = Instant::now();
    loop {
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(Lock { _file: f }),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK && start.elapsed() <= LOCK_WAIT => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io(path, e.into())),
        }
    }
}

/// The value of a tag, if it exists.
pub fn get(root: &Path, t: &TagName) -> Result<Option<Vec<u8>>, StoreError> {
    let p = tag_path(root, t);
    match std::fs::read(&p) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&p, e)),
    }
}

/// Sets a tag to `new` (`None`: deletes it) if its value is `expected` (`None`: absent) and `check`
/// passes, both under the lock. Returns the value found when it was not the expected one.
pub fn compare_and_swap(
    root: &Path,
    t: &TagName,
    expected: Option<&[u8]>,
    new: Option<&[u8]>,
    check: &dyn Fn() -> Result<(), StoreError>,
) -> Result<Result<(), Option<Vec<u8>>>, StoreError> {
    let _lock = lock(root)?;
    let current = get(root, t)?;
    if current.as_deref() != expected {
        return Ok(Err(current));
    }
    check()?;
    let p = tag_path(root, t);
    let Some(new) = new else {
        return match std::fs::remove_file(&p) {
            Ok(()) => Ok(Ok(())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ok(())),
            Err(e) => Err(io(&p, e)),
        };
    };
    let dir = p.parent().unwrap_or(root);
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let tmp = dir.join(format!(".{}.tmp-{}", t.tag, std::process::id()));
    let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(new)
        .and_then(|_| f.sync_all())
        .map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &p).map_err(|e| io(&p, e))?;
    Ok(Ok(()))
}

/// Every tag file, as its store key (`tags/<name>/<tag>`), and its value. Files whose names start with
/// `.` (the lock, temporary files of an update) are not tags.
pub fn list(root: &Path) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let base = root.join("tags");
    let mut out = Vec::new();
    let mut stack = vec![base.clone()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&dir, e)),
        };
        for e in entries {
            let e = e.map_err(|e| io(&dir, e))?;
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            if e.file_type().map_err(|er| io(&p, er))?.is_dir() {
                stack.push(p);
                continue;
            }
            let Ok(rel) = p.strip_prefix(root) else {
                continue;
            };
            let v = std::fs::read(&p).map_err(|er| io(&p, er))?;
            out.push((rel.to_string_lossy().into_owned(), v));
        }
    }
    Ok(out)
}
