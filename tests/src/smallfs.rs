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

/// An ext4 filesystem of `bytes` (no journal) on a loop device at `at` (tmpfs refuses pre-content
/// marks), unmounted when the guard drops.
pub fn small_ext4(at: &Path, bytes: u64) -> Umount {
    let img = at.with_extension("img");
    let f = std::fs::File::create(&img).expect("filesystem image");
    f.set_len(bytes).expect("size");
    let mkfs = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal"])
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
