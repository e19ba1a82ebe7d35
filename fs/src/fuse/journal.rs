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
//! **Layout.** [`SLOTS`] slots of [`SLOT`] bytes (a blob-server connection's; a layer's tree connection
//! in `fuse` mode gets [`TREE_SLOTS`], see [`Journal::create_with`]): `state: u64` (0 free, [`WRITING`] being written, else
//! the request's `unique`), `len: u32`, 4 bytes of padding, then the request's bytes. A slot is claimed
//! by a compare-and-swap from 0 to [`WRITING`], filled, then published by storing the unique (release):
//! a server that dies mid-write leaves a [`WRITING`] slot, which its successor frees (that request was
//! lost in a window of a few instructions; nothing smaller exists without the kernel's help). Requests
//! longer than a slot's payload (none of a read-only server's: a `LOOKUP` name is at most 255 bytes) and
//! requests that find the journal full are served unrecorded, and counted.
//!
//! **Read areas: no window between reading and recording.** A server killed after the kernel handed it
//! a request but before it recorded it would lose that request: the kernel moves a request to the
//! processing queue while it copies it out, and `SIGKILL` takes the process at the read's return. So
//! workers read *into the journal*: after the slots come [`AREAS`] areas of [`AREA`] bytes, one per
//! worker ([`Journal::area`]); a worker zeroes its area's request id, reads the request into the area
//! (the kernel's copy lands in the shared memory before the read returns), records it in a slot and
//! serves it. [`Journal::leftovers`] also takes each area holding a request id no slot holds (it is
//! recorded in a slot first, so a successor that dies too leaves it for the next one). An area may hold
//! a request already answered (the worker died before its next read): answering it again is refused by
//! the kernel, as for slots. A journal of the size older servers made (exactly [`SIZE`]) has no areas.
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
/// Slots in the journal of one layer's tree connection (`fuse` mode: one connection per mounted
/// layer, so the journals together grow with the layers). 256 slots, 128 KiB: a layer's own readers
/// rarely have more in flight (its background reads are capped by `Options::max_background` of the
/// tree session); a request that finds the journal full is served unrecorded and counted.
pub const TREE_SLOTS: usize = 256;
/// Bytes per slot.
pub const SLOT: usize = 512;
const HEADER: usize = 16;
/// Largest request recorded.
pub const MAX_REQUEST: usize = SLOT - HEADER;
/// A slot being written.
pub const WRITING: u64 = u64::MAX;
/// The size in bytes of [`SLOTS`] slots (and of a journal without read areas).
pub const SIZE: usize = SLOTS * SLOT;
/// Read areas, one per worker thread (workers beyond read into memory of their own, unprotected).
pub const AREAS: usize = 16;
/// Bytes per read area: the smallest read buffer the kernel accepts (`FUSE_MIN_READ_BUFFER`); every
/// request to a read-only server fits.
pub const AREA: usize = 8192;
const AREAS_SIZE: usize = AREAS * AREA;
/// Offset of a request header's `unique` (after `len: u32, opcode: u32`).
const UNIQUE_AT: usize = 8;

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
    /// Slots in this journal.
    slots: usize,
    /// Read areas after the slots (0 or [`AREAS`]).
    areas: usize,
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
    /// A new, empty journal of [`SLOTS`] slots (a memfd of [`SIZE`] bytes).
    pub fn create() -> io::Result<Journal> {
        Journal::create_with(SLOTS)
    }

    /// A new, empty journal of `slots` slots (1 to [`SLOTS`]) and [`AREAS`] read areas.
    pub fn create_with(slots: usize) -> io::Result<Journal> {
        let slots = slots.clamp(1, SLOTS);
        let fd = rustix::fs::memfd_create("strata-fuse-journal", MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, (slots * SLOT + AREAS_SIZE) as u64)?;
        Journal::map(fd, slots, AREAS)
    }

    /// Maps the journal behind `fd` (inherited from the holder or systemd's store): its size says how
    /// many slots it has (up to [`SLOTS`]), followed by [`AREAS`] read areas — or exactly [`SIZE`]: an
    /// older server's journal, slots only.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Journal> {
        let st = rustix::fs::fstat(&fd)?;
        let size = usize::try_from(st.st_size).unwrap_or(0);
        let slots = size
            .checked_sub(AREAS_SIZE)
            .filter(|n| *n > 0 && n % SLOT == 0 && *n <= SIZE);
        match (size, slots) {
            (SIZE, _) => Journal::map(fd, SLOTS, 0),
            (_, Some(n)) => Journal::map(fd, n / SLOT, AREAS),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "FUSE request journal is {} bytes: not {SIZE}, nor up to {SLOTS} slots of {SLOT} bytes and {AREAS} read areas of {AREA}",
                    st.st_size
                ),
            )),
        }
    }

    fn len(&self) -> usize {
        self.slots * SLOT + self.areas * AREA
    }

    /// Slots in this journal.
    pub fn slots(&self) -> usize {
        self.slots
    }

    fn map(fd: OwnedFd, slots: usize, areas: usize) -> io::Result<Journal> {
        // SAFETY: a fresh shared mapping of the whole file, which stays open (in `fd`) as long as the
        // mapping; unmapped in Drop.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                slots * SLOT + areas * AREA,
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
            slots,
            areas,
            hint: AtomicUsize::new(0),
            unrecorded: AtomicU64::new(0),
        })
    }

    /// The descriptor (to hand to a successor).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn state(&self, slot: usize) -> &AtomicU64 {
        // SAFETY: slot < self.slots, so the 8-byte aligned word lies inside the mapping (page aligned,
        // SLOT a multiple of 8), which lives as long as `self`.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(slot * SLOT).cast::<u64>()) }
    }

    fn payload(&self, slot: usize) -> *mut u8 {
        // SAFETY: inside the mapping (slot < self.slots).
        unsafe { self.base.as_ptr().add(slot * SLOT + 8) }
    }

    /// Records request `bytes` (id `unique`); returns its slot, or `None` when it is not recorded.
    pub fn record(&self, unique: u64, bytes: &[u8]) -> Option<usize> {
        if bytes.len() > MAX_REQUEST || unique == 0 || unique == WRITING {
            self.unrecorded.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let start = self.hint.load(Ordering::Relaxed);
        for k in 0..self.slots {
            let slot = (start + k) % self.slots;
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
        if slot < self.slots {
            self.state(slot).store(0, Ordering::Release);
        }
    }

    /// What earlier servers left: every published slot (still held, until cleared), and every
    /// half-written one freed; then every read area holding a request no slot holds, recorded in a slot
    /// now (and the area emptied). Call before this server reads its first request.
    pub fn leftovers(&self) -> Vec<Leftover> {
        let mut out = self.slot_leftovers();
        for i in 0..self.areas {
            let area = Area { journal: self, i };
            if let Some((unique, bytes)) = area.request() {
                if !out.iter().any(|l| l.unique == unique) {
                    let slot = self.record(unique, &bytes).unwrap_or(usize::MAX);
                    out.push(Leftover {
                        slot,
                        unique,
                        bytes,
                    });
                }
            }
            area.unique().store(0, Ordering::Release);
        }
        out
    }

    /// Worker `i`'s read area, if this journal has one for it.
    pub fn area(&self, i: usize) -> Option<Area<'_>> {
        (i < self.areas).then_some(Area { journal: self, i })
    }

    /// Every published slot (still held, until cleared), and every half-written one freed — without
    /// looking at the read areas: for a journal whose areas hold something other than FUSE requests
    /// (the fanotify server's event area, `crate::fanotify`).
    pub fn slot_leftovers(&self) -> Vec<Leftover> {
        let mut out = Vec::new();
        for slot in 0..self.slots {
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

/// One worker's read area in the journal: requests are read into it, so a request the kernel handed
/// over is in the journal before the read returns.
pub struct Area<'a> {
    journal: &'a Journal,
    i: usize,
}

impl Area<'_> {
    fn base(&self) -> *mut u8 {
        // SAFETY: i < areas: the area lies inside the mapping, after the slots.
        unsafe {
            self.journal
                .base
                .as_ptr()
                .add(self.journal.slots * SLOT + self.i * AREA)
        }
    }

    fn unique(&self) -> &AtomicU64 {
        // SAFETY: 8-byte aligned (the mapping is page aligned, SLOT and AREA multiples of 8) and inside
        // the area; lives as long as the journal.
        unsafe { AtomicU64::from_ptr(self.base().add(UNIQUE_AT).cast::<u64>()) }
    }

    /// The area as a read buffer, its request id zeroed first (nothing in it is a request until the
    /// kernel writes one). Only this area's worker calls it, and holds the buffer until its next read.
    #[allow(clippy::mut_from_ref)]
    pub fn arm(&self) -> &mut [u8] {
        self.unique().store(0, Ordering::Release);
        // SAFETY: the area belongs to one worker (its index), which uses one buffer at a time; a
        // successor reads it only after this process died.
        unsafe { std::slice::from_raw_parts_mut(self.base(), AREA) }
    }

    /// The whole area as plain bytes, for a server that lays it out itself (the fanotify server's
    /// event area, `crate::fanotify`; its journal's [`Journal::leftovers`] must not be called). The
    /// same rule as [`Area::arm`]: one thread uses it, and a successor only after this process died.
    #[allow(clippy::mut_from_ref)]
    pub fn raw(&self) -> &mut [u8] {
        // SAFETY: as in `arm`.
        unsafe { std::slice::from_raw_parts_mut(self.base(), AREA) }
    }

    /// The request the area holds, if any (its length checked against the area).
    fn request(&self) -> Option<(u64, Vec<u8>)> {
        let unique = self.unique().load(Ordering::Acquire);
        if unique == 0 || unique == WRITING {
            return None;
        }
        // SAFETY: inside the area; `len` is bounded by the area before the slice is made.
        let bytes = unsafe {
            let len = self.base().cast::<u32>().read() as usize;
            if !(16..=AREA).contains(&len) {
                return None;
            }
            std::slice::from_raw_parts(self.base(), len).to_vec()
        };
        Some((unique, bytes))
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe {
            let _ = rustix::mm::munmap(self.base.as_ptr().cast(), self.len());
        }
    }
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
