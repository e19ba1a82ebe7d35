//! Writing a local file so that a reader, or a crash, sees the old content or the new, never a part:
//! the one helper the node's records, the docker config file and exported OCI layouts share.
//!
//! The bytes go to a temporary file beside the target (`<name>.strata-tmp-<pid>`: on the same
//! filesystem, and ending in no extension a directory scan looks for), created with the given mode,
//! then renamed over the target. `sync` flushes the temporary file first, for files whose loss after
//! a power cut matters more than the write's cost (credentials); records rewritten at every sandbox
//! change skip it. A failed write leaves no temporary file behind.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// How [`write_atomic`] writes.
#[derive(Clone, Copy, Debug)]
pub struct Atomic {
    /// Permission bits of a file created (before the umask).
    pub mode: u32,
    /// Flush the data to disk before the rename.
    pub sync: bool,
}

/// Replaces `path`'s content with `bytes` in one rename (see the module documentation).
pub fn write_atomic(path: &Path, bytes: &[u8], how: Atomic) -> std::io::Result<()> {
    let tmp = temporary(path);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(how.mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if how.sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".strata-tmp-{}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn replaces_the_content_with_the_mode_and_leaves_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("a.json");
        let how = Atomic {
            mode: 0o600,
            sync: true,
        };
        write_atomic(&p, b"one", how).expect("write");
        write_atomic(&p, b"two", how).expect("rewrite");
        assert_eq!(std::fs::read(&p).expect("read"), b"two");
        let mode = std::fs::metadata(&p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["a.json"]);
        // A target that cannot be written (its directory is missing): an error, no leftover.
        let bad = dir.path().join("missing/b.json");
        assert!(write_atomic(&bad, b"x", how).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
