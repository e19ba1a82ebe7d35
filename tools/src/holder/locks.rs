//! One node per state directory *and* per runtime directory.
//!
//! A node is a state directory (records, cache, upper directories) and a runtime directory (the control
//! socket, the blob server's mount, layer and rootfs mounts). Each gets a lock file, `stratad.lock`,
//! held with `flock` for as long as any of the node's processes lives (the holder and its server share
//! the open descriptions). The lock file says who holds it: the holder's pid, then the state directory
//! (in the runtime directory's lock) — so a second daemon is refused naming the first, and a daemon that
//! finds mounts under a runtime directory it just locked knows whose they were.
//!
//! A stale runtime directory (its node died) may hold mounts. They are detached at start only when the
//! runtime lock last named *this* node's state directory (or nothing): mounts of another node's runtime
//! directory are not ours to take down, and start fails saying so.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rustix::fs::{flock, FlockOperation};

/// The two locks of a node, held for the life of the process (and inherited by its server).
pub struct NodeLocks {
    pub state: File,
    pub runtime: File,
    /// The state directory the runtime directory's lock named before this daemon took it (a dead node's).
    pub previous_owner: Option<PathBuf>,
}

/// Opens `dir/stratad.lock` (0600) and takes it, or fails with `who` and what the lock file says.
fn take(dir: &Path, what: &str) -> Result<(File, String)> {
    std::fs::create_dir_all(dir).with_context(|| format!("{what} {}", dir.display()))?;
    let path = dir.join("stratad.lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("lock {}", path.display()))?;
    let mut before = String::new();
    let _ = f.read_to_string(&mut before);
    if flock(&f, FlockOperation::NonBlockingLockExclusive).is_err() {
        let mut lines = before.lines();
        let pid = lines.next().unwrap_or("?").trim().to_string();
        let state = lines
            .next()
            .map(|s| format!(", state directory {s}"))
            .unwrap_or_default();
        bail!(
            "another stratad serves {what} {} (pid {pid}{state}); stop it first, give this one its own \
             --state-dir and --runtime-dir, or use `strata daemon upgrade` to replace it",
            dir.display()
        );
    }
    Ok((f, before))
}

fn record(f: &mut File, text: &str) -> Result<()> {
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// Takes the state directory's lock, then the runtime directory's. A second daemon on either fails,
/// naming the process (and state directory) that holds it.
pub fn lock_node(state_dir: &Path, runtime_dir: &Path) -> Result<NodeLocks> {
    let pid = std::process::id();
    let (mut state, _) = take(state_dir, "state directory")?;
    record(&mut state, &format!("{pid}\n"))?;
    let (mut runtime, before) = take(runtime_dir, "runtime directory")?;
    let previous_owner = before.lines().nth(1).map(PathBuf::from);
    record(
        &mut runtime,
        &format!("{pid}\n{}\n", absolute(state_dir).display()),
    )?;
    Ok(NodeLocks {
        state,
        runtime,
        previous_owner,
    })
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Refuses to clean a stale runtime directory whose mounts belong to another node (its lock last named
/// another state directory). Mounts of this node's own past, or of nobody recorded, may be detached.
pub fn check_stale_mounts(locks: &NodeLocks, state_dir: &Path, runtime_dir: &Path) -> Result<()> {
    let Some(owner) = &locks.previous_owner else {
        return Ok(());
    };
    if *owner == absolute(state_dir) {
        return Ok(());
    }
    let mounts = strata_fs::state::mount_points(runtime_dir);
    if mounts.is_empty() {
        return Ok(());
    }
    bail!(
        "runtime directory {} holds {} mount(s) of another node (state directory {}), whose stratad is \
         gone: not detaching them. Start that node again, unmount them (first: {}), or give this stratad \
         its own --runtime-dir",
        runtime_dir.display(),
        mounts.len(),
        owner.display(),
        mounts[0].display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_node_on_either_directory_is_refused_naming_the_first() {
        let t = tempfile::tempdir().unwrap();
        let (s1, s2, run) = (
            t.path().join("s1"),
            t.path().join("s2"),
            t.path().join("run"),
        );
        let first = lock_node(&s1, &run).unwrap();
        // Another state directory, the same runtime directory.
        let e = format!("{:#}", lock_node(&s2, &run).err().unwrap());
        assert!(e.contains("runtime directory"), "{e}");
        assert!(e.contains(&std::process::id().to_string()), "{e}");
        assert!(
            e.contains("s1"),
            "names the first node's state directory: {e}"
        );
        // The same state directory, another runtime directory.
        let e = format!(
            "{:#}",
            lock_node(&s1, &t.path().join("run2")).err().unwrap()
        );
        assert!(e.contains("state directory"), "{e}");
        drop(first);
        let again = lock_node(&s2, &run).unwrap();
        assert_eq!(
            again.previous_owner.as_deref(),
            Some(absolute(&s1).as_path())
        );
        assert!(
            check_stale_mounts(&again, &s2, &run).is_ok(),
            "no mounts: nothing to refuse"
        );
        let mode = std::os::unix::fs::MetadataExt::mode(
            &std::fs::metadata(run.join("stratad.lock")).unwrap(),
        );
        assert_eq!(mode & 0o777, 0o600);
    }
}
