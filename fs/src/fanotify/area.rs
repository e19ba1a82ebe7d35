//! The event area: fanotify events are read straight into memory the keeper holds, so none is lost
//! between the read and its record.
//!
//! A permission event the kernel hands to a reader of the group waits for an answer by descriptor
//! number. The server records each event it cannot answer at once in the journal ([`super::JOURNAL`]),
//! but a batch of events arrives in one `read`, and a server killed after the read and before the last
//! record would strand the rest: their readers wait until the group is closed. So the event loop reads
//! into the journal's first read area (shared memory kept with the group) instead of a buffer of its
//! own, as the FUSE workers do ([`crate::fuse::journal`]): the kernel's copy is in the shared memory
//! before `read` returns, and `SIGKILL` takes a process only at that return.
//!
//! **Layout** (in the journal's area 0, [`crate::fuse::journal::AREA`] bytes): `pid: u32` of the
//! server reading into it; at [`DIGESTS_AT`], one 32-byte blob digest per event of the batch, written
//! as soon as the event's view file is known (all zeros: not known); at [`EVENTS_AT`], the events as
//! the kernel wrote them. Before each read the loop zeroes the digests and the events ([`EventArea::arm`]);
//! by then every event of the batch before was answered or recorded in the journal. A successor
//! reads what is there ([`EventArea::stranded`]): the events up to the first zero length (the kernel
//! writes whole events, one after the other), each with its blob if it was known.

use std::marker::PhantomData;
use std::ptr::NonNull;

use strata_registry::digest::Digest;

use super::sys::{self, Event};
use crate::fuse::journal::{Journal, AREA};

/// Events read at a time.
pub const BATCH: usize = 64;
/// Where the digests start.
pub const DIGESTS_AT: usize = 64;
/// Where the events start.
pub const EVENTS_AT: usize = DIGESTS_AT + BATCH * 32;
/// Bytes of events read at a time.
pub const EVENTS_LEN: usize = BATCH * sys::EVENT_WITH_RANGE;
const _: () = assert!(EVENTS_AT + EVENTS_LEN <= AREA);
const _: () = assert!(EVENTS_AT.is_multiple_of(8));

/// The event area of a fanotify server's journal.
pub struct EventArea<'a> {
    base: NonNull<u8>,
    _journal: PhantomData<&'a Journal>,
}

/// What a dead server left in its area: its pid and the events of its last batch, each with its
/// blob when the server had found it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stranded {
    pub pid: u32,
    pub events: Vec<(Event, Option<Digest>)>,
}

impl<'a> EventArea<'a> {
    /// The area of `journal` (its first read area), if it has read areas.
    pub fn of(journal: &'a Journal) -> Option<EventArea<'a>> {
        let base = journal.area(0)?.raw().as_mut_ptr();
        Some(EventArea {
            base: NonNull::new(base)?,
            _journal: PhantomData,
        })
    }

    fn at(&self, offset: usize, len: usize) -> *mut u8 {
        debug_assert!(offset + len <= AREA);
        // SAFETY: inside the area (the layout's asserts), which lives as long as the journal.
        unsafe { self.base.as_ptr().add(offset) }
    }

    /// Empties the area for a new batch read by process `pid` and returns the buffer to read into.
    /// Only the event loop calls it, and holds the buffer until its next call.
    #[allow(clippy::mut_from_ref)]
    pub fn arm(&self, pid: u32) -> &mut [u8] {
        // SAFETY: the digests and events lie inside the area and do not overlap the pid; no other
        // reference to them exists while the loop runs (see `resolve`, which writes the digests
        // through the pointer, never through this slice).
        unsafe {
            std::ptr::write_bytes(
                self.at(DIGESTS_AT, 0),
                0,
                EVENTS_AT - DIGESTS_AT + EVENTS_LEN,
            );
            self.at(0, 4).cast::<u32>().write(pid);
            std::slice::from_raw_parts_mut(self.at(EVENTS_AT, EVENTS_LEN), EVENTS_LEN)
        }
    }

    /// Event `i` of the batch concerns blob `d`.
    pub fn resolve(&self, i: usize, d: &Digest) {
        if i < BATCH {
            // SAFETY: slot `i` of the digests, inside the area and apart from the events buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(d.0.as_ptr(), self.at(DIGESTS_AT + i * 32, 32), 32)
            }
        }
    }

    /// What the area holds: the events of the last batch read into it (up to the first zero length,
    /// or the first record that does not parse), each with its blob if known.
    pub fn stranded(&self) -> Stranded {
        // SAFETY: inside the area; read only by a successor, after the writer died.
        let (pid, events, digests) = unsafe {
            (
                self.at(0, 4).cast::<u32>().read(),
                std::slice::from_raw_parts(self.at(EVENTS_AT, EVENTS_LEN), EVENTS_LEN).to_vec(),
                std::slice::from_raw_parts(self.at(DIGESTS_AT, BATCH * 32), BATCH * 32).to_vec(),
            )
        };
        let parsed = match sys::parse(&events[..written(&events)]) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "the fanotify event area does not parse: ignored");
                Vec::new()
            }
        };
        let digest = |i: usize| {
            let mut d = [0u8; 32];
            d.copy_from_slice(&digests[i * 32..i * 32 + 32]);
            (d != [0u8; 32]).then_some(Digest(d))
        };
        Stranded {
            pid,
            events: parsed
                .into_iter()
                .enumerate()
                .map(|(i, ev)| (ev, (i < BATCH).then(|| digest(i)).flatten()))
                .collect(),
        }
    }
}

/// The length of the whole events at the start of `buf` (a zeroed buffer the kernel wrote into).
pub fn written(buf: &[u8]) -> usize {
    let mut at = 0;
    while at + sys::METADATA_LEN <= buf.len() {
        let len = u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
        if len < sys::METADATA_LEN || at + len > buf.len() {
            break;
        }
        at += len;
    }
    at
}
