//! The request journal: what a dead server had read but not answered, for kernels that cannot resend.
//!
//! A server that dies (`kill -9`, a crash, an upgrade's handover) leaves the requests it had read and not
//! answered in the connection's processing queue. Linux 6.9+ queues them again on `FUSE_NOTIFY_RESEND`;
//! older kernels (Debian 12's and AL2023's 6.1) cannot, and a reader would wait for ever. So every server
//! records each request it reads in a journal that outlives it — a shared memory file (`memfd`) created
//! with the connection and kept open by the connection's holder beside the `/dev/fuse` descriptor — and
//! clears the record when it has answered. A successor finds what is left: on a kernel that resends, it
//! drops those records (the kernel brings the requests back); on one that cannot, it answers them itself
//! from the records. The kernel's request ids (`unique`) only grow on a connection, so an answer to a
//! request that was in fact answered just before the death is refused by the kernel (`ENOENT`), never
//! taken for another request.
//!
//! **Layout.** [`SLOTS`] slots of [`SLOT`] bytes: `state: u64` (0 free, [`WRITING`] being written, else
//! the request's `unique`), `len: u32`, 4 bytes of padding, then the request's bytes. A slot is claimed
//! by a compare-and-swap from 0 to [`WRITING`], filled, then published by storing the unique (release):
//! a server that dies mid-write leaves a [`WRITING`] slot, which its successor frees (that request was
//! lost in a window of a few instructions; nothing smaller exists without the kernel's help). Requests
//! longer than a slot's payload (none of a read-only server's: a `LOOKUP` name is at most 255 bytes) and
//! requests that find the journal full are served unrecorded, and counted.
//!
//! **Invariants** (tested in `journal_tests`): a published slot holds exactly the bytes recorded; a slot
//! is free again only once its request was answered or found stale; [`Journal::leftovers`] returns every
//! published slot and frees every half-written one; nothing a live server recorded after taking the
//! leftovers is returned by them.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};

/// Slots in a journal: more than the requests a connection has in flight (1,024 background reads plus
/// one synchronous request per thread that asked).
pub const SLOTS: usize = 4096;
/// Bytes per slot.
pub const SLOT: usize = 512;
const HEADER: usize = 16;
/// Largest request recorded.
pub const MAX_REQUEST: usize = SLOT - HEADER;
/// A slot being written.
pub const WRITING: u64 = u64::MAX;
/// The journal's size in bytes.
pub const SIZE: usize = SLOTS * SLOT;

/// A request a dead server left unanswered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub slot: usize,
    pub unique: u64,
    pub bytes: Vec<u8>,
}

/// The mapped journal of one connection.
pub struct Journal {
    fd: OwnedFd,
    base: NonNull<u8>,
    /// Where the next claim starts looking.
    hint: AtomicUsize,
    /// Requests served unrecorded (too long, or the journal full).
    pub unrecorded: AtomicU64,
}

// SAFETY: the mapping is shared memory accessed only through atomics (slot states) and through slot
// bytes that one claimant writes before publishing them (release) and readers read after (acquire).
unsafe impl Send for Journal {}
// SAFETY: as above.
unsafe impl Sync for Journal {}

impl Journal {
    /// A new, empty journal (a memfd of [`SIZE`] bytes).
    pub fn create() -> io::Result<Journal> {
        let fd = rustix::fs::memfd_create("strata-fuse-journal", MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, SIZE as u64)?;
        Journal::map(fd)
    }

    /// Maps the journal behind `fd` (inherited from the holder or systemd's store).
    pub fn from_fd(fd: OwnedFd) -> io::Result<Journal> {
        let st = rustix::fs::fstat(&fd)?;
        if st.st_size != SIZE as i64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "FUSE request journal is {} bytes, expected {SIZE}",
                    st.st_size
                ),
            ));
        }
        Journal::map(fd)
    }

    fn map(fd: OwnedFd) -> io::Result<Journal> {
        // SAFETY: a fresh shared mapping of the whole file, which stays open (in `fd`) as long as the
        // mapping; unmapped in Drop.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                SIZE,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Journal {
            fd,
            base,
            hint: AtomicUsize::new(0),
            unrecorded: AtomicU64::new(0),
        })
    }

    /// The descriptor (to hand to a successor).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn state(&self, slot: usize) -> &AtomicU64 {
        // SAFETY: slot < SLOTS, so the 8-byte aligned word lies inside the mapping (page aligned,
        // SLOT a multiple of 8), which lives as long as `self`.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(slot * SLOT).cast::<u64>()) }
    }

    fn payload(&self, slot: usize) -> *mut u8 {
        // SAFETY: inside the mapping (slot < SLOTS).
        unsafe { self.base.as_ptr().add(slot * SLOT + 8) }
    }

    /// Records request `bytes` (id `unique`); returns its slot, or `None` when it is not recorded.
    pub fn record(&self, unique: u64, bytes: &[u8]) -> Option<usize> {
        if bytes.len() > MAX_REQUEST || unique == 0 || unique == WRITING {
            self.unrecorded.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let start = self.hint.load(Ordering::Relaxed);
        for k in 0..SLOTS {
            let slot = (start + k) % SLOTS;
            let s = self.state(slot);
            if s.compare_exchange(0, WRITING, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let p = self.payload(slot);
            // SAFETY: this process owns the slot (claimed above) until it publishes it; the payload
            // (len, padding, bytes) fits the slot (checked above).
            unsafe {
                p.cast::<u32>().write(bytes.len() as u32);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(8), bytes.len());
            }
            s.store(unique, Ordering::Release);
            self.hint.store(slot + 1, Ordering::Relaxed);
            return Some(slot);
        }
        self.unrecorded.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// The request in `slot` was answered (or handed to the kernel's resend): the slot is free.
    pub fn clear(&self, slot: usize) {
        if slot < SLOTS {
            self.state(slot).store(0, Ordering::Release);
        }
    }

    /// What earlier servers left: every published slot (still held, until cleared), and every
    /// half-written one freed. Call before this server reads its first request.
    pub fn leftovers(&self) -> Vec<Leftover> {
        let mut out = Vec::new();
        for slot in 0..SLOTS {
            let s = self.state(slot);
            match s.load(Ordering::Acquire) {
                0 => {}
                WRITING => s.store(0, Ordering::Release),
                unique => {
                    let p = self.payload(slot);
                    // SAFETY: a published slot's payload was written before its state (release,
                    // paired with the acquire load above); its length was checked when written, and
                    // is checked again against a damaged journal.
                    let bytes = unsafe {
                        let len = (p.cast::<u32>().read() as usize).min(MAX_REQUEST);
                        std::slice::from_raw_parts(p.add(8), len).to_vec()
                    };
                    out.push(Leftover {
                        slot,
                        unique,
                        bytes,
                    });
                }
            }
        }
        out
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe {
            let _ = rustix::mm::munmap(self.base.as_ptr().cast(), SIZE);
        }
    }
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
