//! The event loop: reads the group's events in batches, allows at once what is filled (and the
//! server's own accesses), and hands every other read to a fill thread ([`Context::hand`]), recorded in
//! the journal first and armed with its deadline ([`super::deadline`]). The loop keeps to its
//! readers' CPU ([`super::follow`]).

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::area::{self, EventArea};
use super::follow::Follow;
use super::sys::{self, Answer, Group};
use super::views::Views;
use super::{deadline, encode, Context, Job, Pending, POLL_MS};
use crate::workers::Workers;

/// Reads the next batch of events: into the journal's event area when it has one (so that a
/// successor finds them, see [`area`], which records `me`, this process), else into `fallback`.
pub(super) fn read_batch(
    group: &Group,
    area: Option<&EventArea<'_>>,
    me: u32,
    fallback: &mut [u8],
) -> std::io::Result<Vec<sys::Event>> {
    let buf = match area {
        Some(a) => a.arm(me),
        None => fallback,
    };
    let n = group.read(buf)?;
    sys::parse(&buf[..n]).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

pub(super) fn event_loop(
    ctx: &Arc<Context>,
    views: &Views,
    stop: &AtomicBool,
    fills: &Workers,
    reaper: Option<&deadline::Reaper<Arc<Pending>>>,
) {
    let me = std::process::id();
    let mut follow = Follow::new(ctx.follow);
    let area = EventArea::of(&ctx.journal);
    if area.is_none() {
        tracing::warn!("the fanotify journal has no event area: a kill between reading and recording an event strands its reader");
    }
    // Only without an area (a journal of an older layout) is a buffer of this process read into.
    let mut fallback = match area {
        Some(_) => Vec::new(),
        None => vec![0u8; area::EVENTS_LEN],
    };
    while !stop.load(Ordering::Acquire) {
        match ctx.group.wait(POLL_MS) {
            Ok(true) => {}
            Ok(false) => {
                follow.idle();
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "polling the fanotify group");
                std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
                continue;
            }
        }
        let events = match read_batch(&ctx.group, area.as_ref(), me, &mut fallback) {
            Ok(ev) => ev,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::error!(error = %e, "reading fanotify events: their readers wait");
                continue;
            }
        };
        let reader = events.iter().rev().map(|e| e.pid).find(|&p| p != me);
        for (i, ev) in events.into_iter().enumerate() {
            let Some(number) = ev.fd else { continue };
            // SAFETY: the kernel installed this descriptor in this process for this event alone.
            let fd = unsafe { OwnedFd::from_raw_fd(number) };
            let Some((offset, count)) = ev.range.filter(|_| ev.mask & sys::FAN_PRE_ACCESS != 0)
            else {
                ctx.answer(number, Answer::Allow);
                continue;
            };
            let view = match views.by_fd(fd.as_fd()) {
                Ok(v) => v,
                Err(e) => {
                    tracing::error!(error = %e, "read of a watched file the server does not serve: denied");
                    ctx.answer(number, Answer::Deny(libc::EIO));
                    continue;
                }
            };
            if let Some(a) = &area {
                a.resolve(i, &view.blob.blob.digest);
            }
            let own = ev.pid == me && view.is_own(offset, count);
            let range = view.chunks_in(offset, count);
            if !own && ctx.table.trace.is_on() {
                for i in range.clone() {
                    ctx.table.trace.record(&view.blob.blob.digest, i as u32);
                }
            }
            if own || view.filled(range.clone()) {
                ctx.stats.hits.fetch_add(1, Ordering::Relaxed);
                ctx.answer(number, Answer::Allow);
                if !own {
                    view.touched.note(offset, count, false);
                    view.note_used(range);
                }
                continue;
            }
            let record = encode(&view.blob.blob.digest, offset, count, ev.pid);
            let slot = ctx.journal.record(number as u64 + 1, &record);
            let read = Pending {
                number,
                slot,
                views: vec![view],
                offset,
                count,
                pid: ev.pid,
                adopted: false,
                once: deadline::Once::default(),
            };
            let due = std::time::Instant::now() + ctx.fetcher.deadline;
            ctx.hand(fills, Job::armed(read, Some(fd), reaper, due));
        }
        follow.answered(reader);
    }
}
