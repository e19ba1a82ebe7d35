//! A local store's spool (`tmp/`): the files writers fill before a rename makes them objects, and how
//! the leftovers of writers that died are collected.
//!
//! A build, import or copy spools each blob in `tmp/` and renames it into `blobs/` when it is complete;
//! a writer that is killed (or whose machine loses power) leaves its file behind, and nothing refers to
//! it. [`Store::clean_spool`] removes such leftovers: a regular file of `tmp/` is a leftover when it has
//! not been written for longer than a grace period *and* no live process on this machine owns it
//! (writers put their process id in the name: `blob-<pid>-<nanos>.tmp`, `copy-<blob>-<pid>`). A writer
//! that is alive keeps its file however old, so the rule is safe with any grace period on one machine; on
//! a store shared between machines (NFS, CephFS) the grace period is what protects other machines'
//! writers, and must exceed their longest stall. `strata gc` runs it with its `--grace`, every import
//! with [`SPOOL_GRACE`].

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::{Store, StoreError};

/// The grace period an import gives the spool's files before it removes them as leftovers.
pub const SPOOL_GRACE: Duration = Duration::from_secs(3600);

/// What a cleaning found.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SpoolReport {
    /// Leftover files removed (or, in a dry run, that would be).
    pub files: u64,
    pub bytes: u64,
}

/// True if a process with this id runs on this machine.
fn alive(pid: i32) -> bool {
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return false;
    };
    !matches!(
        rustix::process::test_kill_process(pid),
        Err(rustix::io::Errno::SRCH)
    )
}

/// True if a live process on this machine may own the spool file `name`: one of the `-`/`.` separated
/// fields of its name is the id of a live process.
fn owned(name: &str) -> bool {
    name.split(['-', '.'])
        .filter_map(|f| f.parse::<i32>().ok())
        .any(|pid| pid > 0 && alive(pid))
}

impl Store {
    /// Bytes free for spooling (for an unprivileged writer) in the store's spool directory.
    pub fn spool_free(&self) -> Result<(std::path::PathBuf, u64), StoreError> {
        let dir = self.spool_dir()?;
        let st = rustix::fs::statvfs(&dir).map_err(|e| StoreError::io(&dir, e.into()))?;
        Ok((dir, st.f_bavail.saturating_mul(st.f_frsize)))
    }

    /// Removes the leftovers in a local store's spool that are older than `grace` at `now` (see the
    /// module documentation); with `dry_run`, only counts them. Other stores spool in the system's
    /// temporary directory, which is not theirs to clean: only what a failed conditional-write probe
    /// left in the store goes.
    pub fn clean_spool(
        &self,
        grace: Duration,
        now: SystemTime,
        dry_run: bool,
    ) -> Result<SpoolReport, StoreError> {
        let mut r = SpoolReport::default();
        let Some(root) = &self.local else {
            return self.clean_probes(grace, now, dry_run);
        };
        let dir = root.join("tmp");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(r),
            Err(e) => return Err(StoreError::io(&dir, e)),
        };
        let cutoff = now.checked_sub(grace).unwrap_or(SystemTime::UNIX_EPOCH);
        for e in entries {
            let e = e.map_err(|e| StoreError::io(&dir, e))?;
            let path = e.path();
            let Ok(meta) = e.metadata() else { continue };
            let old = meta.modified().is_ok_and(|m| m <= cutoff);
            let name = e.file_name();
            if !meta.is_file() || !old || owned(&name.to_string_lossy()) {
                continue;
            }
            if !dry_run {
                remove(&path)?;
            }
            r.files += 1;
            r.bytes += meta.len();
        }
        if r.files > 0 {
            tracing::info!(files = r.files, bytes = r.bytes, dir = %dir.display(), dry_run,
                "removed the spool files of writers that died");
        }
        Ok(r)
    }
}

impl Store {
    /// An object store's spool is not its own, but a conditional-write probe that failed on the way
    /// may leave its object under `tmp/conditional-probe/` ([`super::conditional`]): those older than
    /// `grace` are removed (a probe lasts at most the backend's deadline).
    fn clean_probes(
        &self,
        grace: Duration,
        now: SystemTime,
        dry_run: bool,
    ) -> Result<SpoolReport, StoreError> {
        let mut r = SpoolReport::default();
        let cutoff = now
            .checked_sub(grace)
            .and_then(|c| c.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs() as i64);
        for (key, size, modified) in self.list_info(super::conditional::PROBE_PREFIX)? {
            if modified > cutoff {
                continue;
            }
            if !dry_run {
                self.delete(&key)?;
            }
            r.files += 1;
            r.bytes += size;
        }
        if r.files > 0 {
            tracing::info!(
                files = r.files,
                bytes = r.bytes,
                dry_run,
                "removed what failed conditional-write probes left"
            );
        }
        Ok(r)
    }
}

fn remove(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_dead_writers_go_after_the_grace_period() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&format!("file://{}", dir.path().display())).expect("store");
        let tmp = store.spool_dir().expect("spool");
        // A pid that cannot be running: above the kernel's limit.
        let dead = tmp.join("blob-2147483600-1234567890123.tmp");
        let mine = tmp.join(format!("blob-{}-1234567890123.tmp", std::process::id()));
        std::fs::write(&dead, vec![1u8; 1000]).expect("write");
        std::fs::write(&mine, vec![1u8; 10]).expect("write");
        let now = SystemTime::now();
        // Young: kept.
        let r = store
            .clean_spool(Duration::from_secs(3600), now, false)
            .expect("clean");
        assert_eq!(r, SpoolReport::default());
        // Old: the dead writer's file goes (a dry run only counts it); a live writer's stays.
        let later = now + Duration::from_secs(7200);
        let r = store
            .clean_spool(Duration::from_secs(3600), later, true)
            .expect("clean");
        assert_eq!((r.files, r.bytes), (1, 1000));
        assert!(dead.exists());
        store
            .clean_spool(Duration::from_secs(3600), later, false)
            .expect("clean");
        assert!(!dead.exists());
        assert!(mine.exists());
    }

    #[test]
    fn an_object_store_loses_old_probe_leftovers_only() {
        let store = Store::with_backend(std::sync::Arc::new(crate::store::MemoryStore::new()));
        let probe = crate::store::conditional::probe_key();
        store.put_index(&probe, b"probe".to_vec()).expect("put");
        store.put_bytes("blobs/x", b"keep".to_vec()).expect("put");
        let now = SystemTime::now();
        let r = store
            .clean_spool(Duration::from_secs(3600), now, false)
            .expect("clean");
        assert_eq!(r.files, 0, "young: kept");
        let later = now + Duration::from_secs(7200);
        let r = store
            .clean_spool(Duration::from_secs(3600), later, false)
            .expect("clean");
        assert_eq!((r.files, r.bytes), (1, 5));
        assert!(store.list("tmp/").expect("list").is_empty());
        assert_eq!(
            store.list("blobs/").expect("list"),
            vec!["blobs/x".to_string()]
        );
    }
}
