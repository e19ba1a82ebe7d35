//! The node's layer metadata directory (`state_dir/layers/<layer hex>.erofs`), kept within a bound.
//!
//! Each layer mounted on the node has its EROFS metadata on local disk; after the layer's last sandbox
//! goes, the file stays so that the next mount of the layer needs no fetch. Without a bound the directory
//! would grow with every image the node ever ran. [`trim`] deletes the least recently used files of
//! layers that are not mounted until the unmounted ones fit in the bound; a file's modification time is
//! its last use ([`touch`] on every mount). Files of mounted layers are never deleted (the kernel reads
//! them), so the bound can be exceeded by what is in use.

use std::collections::HashSet;
use std::path::Path;
use std::time::SystemTime;

/// Marks a metadata file as just used.
pub fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().write(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Deletes least recently used `*.erofs` files in `dir` whose stem is not in `mounted` until the rest
/// of the unmounted files total at most `bound` bytes. Returns (files deleted, bytes freed).
pub fn trim(dir: &Path, mounted: &HashSet<String>, bound: u64) -> (u64, u64) {
    let judge = |p: &Path, m: &std::fs::Metadata| {
        let stem = p.file_stem()?.to_str()?;
        (p.extension()? == "erofs" && !mounted.contains(stem)).then_some(Candidate {
            bytes: m.len(),
            keep: false,
        })
    };
    trim_lru(dir, bound, judge, |_| {})
}

/// How a file counts in [`trim_lru`].
pub struct Candidate {
    /// What it takes of the bound.
    pub bytes: u64,
    /// It counts, but must not be deleted.
    pub keep: bool,
}

/// The trimming both bounded directories share (this one and the `fanotify` mode's view files):
/// deletes files of `dir`, least recently modified first, until the files counted take at most `bound`
/// bytes. `judge` says of each file whether it counts (`None`: ignored), how much, and whether it must
/// be kept; `before` runs on each file just before it is deleted. Returns (files deleted, bytes freed).
pub fn trim_lru(
    dir: &Path,
    bound: u64,
    judge: impl Fn(&Path, &std::fs::Metadata) -> Option<Candidate>,
    mut before: impl FnMut(&Path),
) -> (u64, u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    let mut total = 0u64;
    let mut idle: Vec<(SystemTime, u64, std::path::PathBuf)> = Vec::new();
    for e in rd.flatten() {
        let (p, Ok(m)) = (e.path(), e.metadata()) else {
            continue;
        };
        let Some(c) = judge(&p, &m) else { continue };
        total += c.bytes;
        if !c.keep {
            idle.push((m.modified().unwrap_or(SystemTime::UNIX_EPOCH), c.bytes, p));
        }
    }
    idle.sort();
    let (mut files, mut freed) = (0, 0);
    for (_, bytes, p) in idle {
        if total <= bound {
            break;
        }
        before(&p);
        if std::fs::remove_file(&p).is_ok() {
            total -= bytes;
            files += 1;
            freed += bytes;
        }
    }
    (files, freed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn deletes_least_recently_used_unmounted_files_down_to_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
            let p = dir.path().join(format!("{name}.erofs"));
            std::fs::write(&p, vec![0u8; 100]).unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(now - Duration::from_secs(100 - i as u64 * 10))
                .unwrap();
        }
        std::fs::write(dir.path().join("other.tmp"), vec![0u8; 1000]).unwrap();
        // "a" is the oldest but mounted; 300 idle bytes, bound 150: "b" then "c" go.
        let mounted: HashSet<String> = ["a".to_string()].into();
        assert_eq!(trim(dir.path(), &mounted, 150), (2, 200));
        let left: HashSet<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            left,
            ["a.erofs", "d.erofs", "other.tmp"].map(String::from).into()
        );
        touch(&dir.path().join("a.erofs"));
        assert_eq!(trim(dir.path(), &HashSet::new(), 1000), (0, 0));
    }
}
