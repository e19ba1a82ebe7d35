//! Who may read what the daemon keeps: image data is readable by root only, or by the configured group
//! where that group must reach it.
//!
//! The chunk cache holds uncompressed file data of every image the node ran (an image's `/etc/shadow`
//! among it), the layer metadata holds whole directory trees with their modes and owners, and sandboxes'
//! upper directories hold what their programs wrote. Modes inside an image do not protect any of it once
//! it is a plain file of the daemon's, so the directories that hold it are closed:
//!
//! | directory | mode without a group | with `group` |
//! |---|---|---|
//! | `state_dir/cache`, `state_dir/views` (`fanotify` mode), `state_dir/layers`, `state_dir/sandboxes` | 0700 | 0700 (the group never needs them) |
//! | `state_dir/node` and everything in it (sandbox records hold image configs, whose env may carry secrets; layer descriptors; tables of contents) | 0700, files 0600 | 0700, files 0600 |
//! | `state_dir/stratad.lock` (the pid of the node's holder) | 0600 | 0600 |
//! | `runtime_dir` (the control socket, the blob server's mount) | 0700 | 0750, that gid |
//! | `runtime_dir/sandboxes` (the rootfs paths a launcher is given) | 0700 | 0750, that gid |
//! | `runtime_dir/layers` (the layer mounts, overlay lowers only) | 0700 | 0700 |
//! | `state_dir/vms` (microVMs' scratch images, for a VMM that is not root) | 0700 | 0750, that gid |
//!
//! `runtime_dir/fuse` is not touched: it is the blob server's mount point, whose root's attributes the
//! blob server gives (following `group`), and a `chmod` there would wait on a FUSE connection whose
//! server may be gone. Files are 0600: chunk cache segments get their mode where they are created (`cache.rs`),
//! node records theirs in [`crate::control::state::write_atomic`]; layer metadata files and node records found at
//! start (an older daemon wrote them 0644) are fixed here. Directories an older daemon left with looser modes are
//! tightened at every start. A `runtime_dir` that is shared with others (world-writable or sticky, like
//! `/tmp`) is not changed — only warned about — since tightening it would break every other user of it.
//! `state_dir` itself is left as it is: it may hold the embedded store other users read.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::control::daemon::{Config, DaemonError};

/// Mode of files holding image data.
const FILE_MODE: u32 = 0o600;

/// Creates the daemon's directories and gives them, and the layer metadata files in them, the modes in
/// the module documentation.
pub fn secure(config: &Config) -> Result<(), DaemonError> {
    let group = config.group;
    let shared = group.map_or(0o700, |_| 0o750);
    let (state, run) = (&config.state_dir, &config.runtime_dir);
    let dirs = [
        (state.join("cache"), 0o700, None),
        (state.join("views"), 0o700, None),
        (state.join("layers"), 0o700, None),
        (state.join("sandboxes"), 0o700, None),
        (state.join("vms"), shared, group),
        (run.join("sandboxes"), shared, group),
        (run.join("layers"), 0o700, None),
    ];
    for (dir, mode, gid) in &dirs {
        close_dir(dir, *mode, *gid)?;
    }
    let m = std::fs::metadata(run).map_err(|e| io(run, e))?;
    match m.mode() & 0o1002 {
        0 => close_dir(run, shared, group)?,
        _ => tracing::warn!(dir = %run.display(), mode = format!("{:o}", m.mode() & 0o7777),
            "runtime_dir is shared (world-writable or sticky): not restricting it; give stratad one of its own"),
    }
    let layers = state.join("layers");
    for f in std::fs::read_dir(&layers)
        .map_err(|e| io(&layers, e))?
        .flatten()
    {
        if f.file_type().is_ok_and(|t| t.is_file()) {
            set_mode(&f.path(), FILE_MODE)?;
        }
    }
    close_tree(&state.join("node"))?;
    let lock = state.join("stratad.lock");
    if lock.exists() {
        set_mode(&lock, FILE_MODE)?;
    }
    Ok(())
}

/// Creates `dir` if needed and closes it and everything under it: directories 0700, files 0600.
fn close_tree(dir: &Path) -> Result<(), DaemonError> {
    close_dir(dir, 0o700, None)?;
    for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
        match e.file_type() {
            Ok(t) if t.is_dir() => close_tree(&e.path())?,
            Ok(t) if t.is_file() => set_mode(&e.path(), FILE_MODE)?,
            _ => {}
        }
    }
    Ok(())
}

/// Creates `dir` if needed and gives it `mode` (and group `gid`).
pub(crate) fn close_dir(dir: &Path, mode: u32, gid: Option<u32>) -> Result<(), DaemonError> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let m = std::fs::metadata(dir).map_err(|e| io(dir, e))?;
    if let Some(g) = gid.filter(|&g| g != m.gid()) {
        std::os::unix::fs::chown(dir, None, Some(g)).map_err(|e| io(dir, e))?;
    }
    set_mode(dir, mode)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), DaemonError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| io(path, e))
}

fn io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn directories_are_closed_and_old_modes_fixed() {
        let tmp = tempfile::tempdir().unwrap();
        let config = Config {
            state_dir: tmp.path().join("state"),
            runtime_dir: tmp.path().join("run"),
            ..Config::default()
        };
        // What an older daemon left: open directories, a world-readable metadata file.
        for d in ["state/layers", "run/sandboxes"] {
            std::fs::create_dir_all(tmp.path().join(d)).unwrap();
            std::fs::set_permissions(tmp.path().join(d), PermissionsExt::from_mode(0o755)).unwrap();
        }
        let meta = tmp.path().join("state/layers/ab.erofs");
        std::fs::write(&meta, b"x").unwrap();
        std::fs::set_permissions(&meta, PermissionsExt::from_mode(0o644)).unwrap();
        // An older daemon's node records: 0755 directories, 0644 records (an image's env in them).
        let record = tmp.path().join("state/node/sandboxes/sb.json");
        std::fs::create_dir_all(record.parent().unwrap()).unwrap();
        for d in ["state/node", "state/node/sandboxes"] {
            std::fs::set_permissions(tmp.path().join(d), PermissionsExt::from_mode(0o755)).unwrap();
        }
        std::fs::write(&record, b"{\"env\": [\"API_TOKEN=x\"]}").unwrap();
        std::fs::set_permissions(&record, PermissionsExt::from_mode(0o644)).unwrap();
        secure(&config).unwrap();
        assert_eq!(mode(&record), 0o600);
        for d in ["node", "node/sandboxes"] {
            assert_eq!(mode(&config.state_dir.join(d)), 0o700, "state/{d}");
        }
        for d in ["cache", "layers", "sandboxes"] {
            assert_eq!(mode(&config.state_dir.join(d)), 0o700, "state/{d}");
        }
        for d in ["", "layers", "sandboxes"] {
            assert_eq!(mode(&config.runtime_dir.join(d)), 0o700, "run/{d}");
        }
        assert_eq!(mode(&meta), 0o600);
        assert_eq!(
            mode(&config.state_dir),
            0o777 & !umask(),
            "state_dir itself is left alone"
        );

        // With a group: what it must reach opens to it, nothing else. (Needs root to chown.)
        if rustix::process::geteuid().is_root() {
            let config = Config {
                group: Some(65534),
                ..config
            };
            secure(&config).unwrap();
            for d in ["", "sandboxes"] {
                let p = config.runtime_dir.join(d);
                assert_eq!(
                    (mode(&p), std::fs::metadata(&p).unwrap().gid()),
                    (0o750, 65534)
                );
            }
            assert_eq!(mode(&config.runtime_dir.join("layers")), 0o700);
            assert_eq!(mode(&config.state_dir.join("cache")), 0o700);
        }
    }

    #[test]
    fn a_shared_runtime_directory_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("tmp");
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, PermissionsExt::from_mode(0o1777)).unwrap();
        let config = Config {
            state_dir: tmp.path().join("state"),
            runtime_dir: run.clone(),
            ..Config::default()
        };
        secure(&config).unwrap();
        assert_eq!(mode(&run), 0o1777);
        assert_eq!(mode(&run.join("layers")), 0o700);
    }

    fn umask() -> u32 {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("d");
        std::fs::create_dir(&p).unwrap();
        0o777 & !mode(&p)
    }
}
