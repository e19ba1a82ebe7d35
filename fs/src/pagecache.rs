//! Keeping a byte in memory once: the chunk cache's and a local store's files are read and written
//! without leaving their pages in the page cache.
//!
//! A byte a sandbox reads is in the page cache as the kernel's own copy (EROFS's pages, or the FUSE tree's
//! in `fuse` mode). Without care it is there twice or three times more: the chunk cache segment it was
//! written to and read back from, and the `file://` store's blob file it was fetched from (the FUSE blob
//! files keep none: EROFS reads them with `directio`, loop devices with direct I/O). Those copies are
//! cold — the cache keeps verified chunks it hands out in its own small in-memory set, and a page evicted
//! from EROFS comes back through the cache, which reads the segment from disk — so they are dropped:
//!
//! - **reads** of a chunk cache segment, and of a `file://` store's blobs, use direct I/O
//!   ([`strata_registry::store::direct`]): chunks sit at
//!   4 KiB-aligned offsets, so a chunk is one aligned read that leaves no page behind and drops none of
//!   its neighbours'. (The first version read through the page cache and dropped a 2 MiB-widened range
//!   after each read — which also dropped the next chunk's pages the checking thread had just read
//!   ahead: warm sequential reads fell from 1,177 to 671 MB/s in `benches/loopmode.py`.) Where the
//!   filesystem refuses `O_DIRECT`, reads are followed by
//!   `POSIX_FADV_DONTNEED` on the range read: clean pages go at once;
//! - **writes** of a segment leave dirty pages, which `DONTNEED` cannot drop until they are written back
//!   (the kernel writes them after ~30 s). A *settler* thread takes each range written, waits for its
//!   writeback (`sync_file_range`) and then drops it — off the reader's path: a cold read waits for the
//!   fetch and the write into the page cache, never for the disk. A full queue (a burst of inserts) drops
//!   the range at once instead, which starts its writeback and leaves it to the next read's drop.
//!   A settled range starts one byte *before* the range written: the write that extends a segment by
//!   the next chunk touches the page holding its old end (the previous chunk's last, partial page)
//!   again, possibly after that chunk settled. Without the byte, a chunk ending just below a 2 MiB
//!   step left that one page cached (seen on ext4 in 1 run of 15 of the crate's tests in parallel;
//!   `mincore` named the page).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

/// Ranges waiting for the settler at most.
const QUEUE: usize = 256;

pub use strata_registry::store::direct::{drop_pages, widened, DROP_STEP};

/// Waits until the range's dirty pages are on disk (then they are clean, and droppable).
fn write_back(file: &File, offset: u64, len: u64) {
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on a descriptor `file` keeps open; no memory is passed. (rustix has no
    // sync_file_range.)
    unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, flags) };
}

/// Hands written ranges to the settler thread (see the module documentation).
pub struct Settler {
    queue: SyncSender<(Arc<File>, u64, u64)>,
    /// Ranges queued and not yet dropped.
    pending: Arc<AtomicUsize>,
}

impl Settler {
    /// Starts the settler thread; it ends when the `Settler` is dropped.
    pub fn start() -> std::io::Result<Settler> {
        let (queue, rx) = sync_channel(QUEUE);
        let pending = Arc::new(AtomicUsize::new(0));
        let left = pending.clone();
        std::thread::Builder::new()
            .name("strata-cache-settle".into())
            .spawn(move || settle(rx, &left))?;
        Ok(Settler { queue, pending })
    }

    /// `len` bytes at `offset` of `file` were just written: drop their pages once they are on disk.
    pub fn written(&self, file: &Arc<File>, offset: u64, len: u64) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        match self.queue.try_send((file.clone(), offset, len)) {
            Ok(()) => {}
            Err(TrySendError::Disconnected(_)) => {
                self.pending.fetch_sub(1, Ordering::AcqRel);
            }
            Err(TrySendError::Full(_)) => {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                let (start, len) = settled(offset, len);
                drop_pages(file, start, len)
            }
        }
    }

    /// Ranges written and not yet dropped. (A test that watches the page cache waits for 0 before it
    /// looks: `fincore`'s own look takes passing references to the pages, and the kernel does not drop
    /// a page someone holds — a look during a drop leaves that page cached.)
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }
}

/// The range settled for `len` bytes written at `offset`: from the byte before it (see the module
/// documentation), widened to whole [`DROP_STEP`]s, as `(start, len)`.
fn settled(offset: u64, len: u64) -> (u64, u64) {
    let before = offset.saturating_sub(1);
    widened(before, offset.saturating_add(len) - before)
}

fn settle(rx: Receiver<(Arc<File>, u64, u64)>, pending: &AtomicUsize) {
    for (file, offset, len) in rx {
        let (start, len) = settled(offset, len);
        write_back(&file, start, len);
        drop_pages(&file, start, len);
        pending.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_range_covers_the_page_before_it_in_whole_steps() {
        const M: u64 = 1 << 20;
        assert_eq!(settled(0, 5), (0, 2 * M));
        // A chunk starting at a step also settles the step before: its write touched the page there.
        assert_eq!(settled(2 * M, M), (0, 4 * M));
        assert_eq!(settled(2 * M + 4096, M), (2 * M, 2 * M));
        assert_eq!(settled(3 * M, 2 * M), (2 * M, 4 * M));
    }
}
