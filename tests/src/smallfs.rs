//! Small filesystems for tests that need a disk to fill up: an ext4 image on a loop device (tmpfs
//! refuses fanotify pre-content marks), unmounted when its guard drops.

use std::path::{Path, PathBuf};

/// A mount the test made, unmounted when dropped.
pub struct Umount(pub PathBuf);

impl Drop for Umount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// An ext4 filesystem of `bytes` (no journal, no blocks kept for root) on a loop device at `at` (tmpfs refuses pre-content
/// marks), unmounted when the guard drops.
pub fn small_ext4(at: &Path, bytes: u64) -> Umount {
    let img = at.with_extension("img");
    let f = std::fs::File::create(&img).expect("filesystem image");
    f.set_len(bytes).expect("size");
    let mkfs = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-O", "^has_journal"])
        .arg(&img)
        .status()
        .expect("mkfs.ext4");
    assert!(mkfs.success(), "mkfs.ext4");
    let st = std::process::Command::new("mount")
        .args(["-o", "loop"])
        .arg(&img)
        .arg(at)
        .status()
        .expect("mount");
    assert!(st.success(), "mount the small filesystem");
    Umount(at.to_path_buf())
}

/// Takes every free byte of the filesystem `dir` is on with one allocated file, `dir/<name>` (as
/// another writer filling the disk would): its path. What the filesystem cannot give in one
/// `fallocate` is given up a quarter MiB at a time.
pub fn fill_up(dir: &Path, name: &str) -> PathBuf {
    use std::os::fd::AsFd;
    let path = dir.join(name);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .expect("ballast file");
    let avail = rustix::fs::statvfs(dir).map_or(0, |s| s.f_bavail * s.f_frsize);
    let have = f.metadata().map_or(0, |m| m.len());
    let mut want = have + avail;
    while want > have {
        match rustix::fs::fallocate(f.as_fd(), rustix::fs::FallocateFlags::empty(), 0, want) {
            Ok(()) => break,
            Err(rustix::io::Errno::NOSPC) => want = want.saturating_sub(256 << 10),
            Err(e) => panic!("fallocate {}: {e}", path.display()),
        }
    }
    path
}

/// The view files in `dir`: its entries named by a digest (not `lost+found`, not the reserve).
pub fn view_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .expect("views dir")
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| strata_registry::digest::Digest::from_hex(n).is_ok())
        })
        .count()
}
