//! Sandboxes reading under fire: an image of many files, and readers that read every file of it in a
//! loop through each rootfs and count failed and wrong reads (the survival and hardening tests).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::{busybox_rootfs, random_bytes, scratch, StoreEnv};

/// An image of busybox plus `n` files of mixed sizes under /data; returns their contents by name.
pub fn build_tree_image(store: &StoreEnv, tag: &str, n: usize) -> BTreeMap<String, Vec<u8>> {
    let src = scratch("img");
    busybox_rootfs(src.path());
    let mut files = BTreeMap::new();
    for i in 0..n {
        let size = match i % 4 {
            0 => 3 << 20,
            1 => 700 << 10,
            2 => 40 << 10,
            _ => 3000,
        };
        let data = random_bytes(size, 1000 + i as u32);
        std::fs::write(src.path().join("data").join(format!("f{i:03}")), &data).expect("write");
        files.insert(format!("f{i:03}"), data);
    }
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
    files
}

pub fn drop_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

#[derive(Default)]
pub struct Counts {
    pub reads: AtomicU64,
    pub failed: AtomicU64,
    pub wrong: AtomicU64,
    /// The longest single file read, in microseconds.
    pub longest_us: AtomicU64,
}

/// What a reader does with a file's pages after reading it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Leaves them cached: after the first pass most reads are served by the page cache.
    Kept,
    /// Drops them (`POSIX_FADV_DONTNEED`, which overlayfs passes to the layer), so that every read
    /// reaches the daemon again: for tests that need requests in flight whenever the server dies,
    /// in every mount mode.
    Dropped,
}

/// Reads `path` whole, then does with its pages as `pages` says.
fn read_file(path: &std::path::Path, pages: Pages) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut b = Vec::new();
    f.read_to_end(&mut b)?;
    if pages == Pages::Dropped {
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
    }
    Ok(b)
}

/// Readers: one thread per rootfs reading every file in a loop (order rotated per thread) until `stop`.
pub fn start_readers(
    rootfs: &[PathBuf],
    files: &Arc<BTreeMap<String, Vec<u8>>>,
    stop: &Arc<AtomicBool>,
    counts: &Arc<Counts>,
    pages: Pages,
) -> Vec<std::thread::JoinHandle<()>> {
    rootfs
        .iter()
        .enumerate()
        .map(|(k, r)| {
            let (r, files, stop, counts) = (r.clone(), files.clone(), stop.clone(), counts.clone());
            std::thread::spawn(move || {
                let names: Vec<&String> = files.keys().collect();
                while !stop.load(Ordering::Relaxed) {
                    for j in 0..names.len() {
                        let name = names[(j + k * 7) % names.len()];
                        let t = Instant::now();
                        let got = read_file(&r.join("data").join(name), pages);
                        counts
                            .longest_us
                            .fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                        match got {
                            Ok(b) if b == files[name] => {}
                            Ok(_) => {
                                counts.wrong.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                eprintln!("read {name} in {}: {e}", r.display());
                                counts.failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        counts.reads.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect()
}

impl Counts {
    /// (reads, failed, wrong) so far.
    pub fn get(&self) -> (u64, u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.wrong.load(Ordering::Relaxed),
        )
    }
}
