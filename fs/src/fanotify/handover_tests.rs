//! Survival in this mode: a server dies with reads taken and not answered; its successor finds
//! them (in the journal, or only in the event area) and answers each — filled, or denied by its
//! deadline when the store is stuck — never with a hole behind it.

use super::*;

/// A server about to "die" with a reader (`cat`) waiting on its group, and what its successor needs.
struct Handover {
    t: Served,
    reader: std::thread::JoinHandle<std::process::Output>,
}

fn handover() -> Option<Handover> {
    handover_within(Duration::from_secs(5))
}

fn handover_within(deadline: Duration) -> Option<Handover> {
    let t = unstarted_within(deadline)?;
    let path = t.path.clone();
    let reader = std::thread::spawn(move || cat(&path));
    Some(Handover { t, reader })
}

/// A successor, what the reader waiting through the handover got, and what it must outlive.
struct Successor {
    next: Server,
    out: std::process::Output,
    want: Vec<u8>,
    faults: Arc<strata_registry::store::FaultyStore>,
    _kit: Kit,
    _dir: tempfile::TempDir,
}

impl Handover {
    /// The dead server's next batch of events, read as its event loop reads them (into its area).
    fn read(&self) -> Vec<Event> {
        let area = EventArea::of(&self.t.s.journal).expect("event area");
        loop {
            assert!(self.t.s.group.wait(5000).expect("poll"), "no event");
            match read_batch(&self.t.s.group, Some(&area), std::process::id(), &mut []) {
                Ok(evs) if !evs.is_empty() => return evs,
                Ok(_) => {}
                Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}"),
            }
        }
    }

    /// The server dies (its event descriptors close as a dead process's would) and a successor
    /// starts on what it kept; returns once the waiting reader is done.
    fn die(self, evs: &[Event]) -> Successor {
        for ev in evs {
            drop(unsafe { OwnedFd::from_raw_fd(ev.fd.expect("event fd")) });
        }
        let Served {
            _dir,
            kit,
            s,
            views,
            h,
            want,
            ..
        } = self.t;
        let kept = (
            rustix::io::dup(s.group.fd()).expect("dup group"),
            rustix::io::dup(s.journal.fd()).expect("dup journal"),
        );
        let next = Server::new(
            &views,
            Some(kept),
            kit.fetcher.clone(),
            kit.metrics.clone(),
            Arc::default(),
        )
        .expect("successor");
        drop(s);
        next.view(&h).expect("view file again");
        next.run();
        Successor {
            next,
            out: self.reader.join().expect("reader"),
            want,
            faults: kit.faults.clone(),
            _kit: kit,
            _dir,
        }
    }

    /// [`Handover::die`]: the waiting reader gets the view's bytes and the journal is left empty.
    fn die_after(self, evs: &[Event]) -> Server {
        let Successor {
            next, out, want, ..
        } = self.die(evs);
        assert!(out.status.success(), "{out:?}");
        let diff = out.stdout.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            out.stdout == want,
            "the waiting reader got the bytes: len {} vs {}, first difference at {diff:?}",
            out.stdout.len(),
            want.len()
        );
        // Cleared after the answer: the reader may be done first.
        crate::testkit::wait_until("journal cleared", || {
            next.journal.slot_leftovers().is_empty()
        });
        next
    }
}

#[test]
fn a_successor_answers_what_a_dead_server_read() {
    let Some(t) = handover() else { return };
    // The "dead" server reads and records its event, then never answers.
    let evs = t.read();
    let ev = &evs[0];
    let (offset, count) = ev.range.expect("range");
    let record = encode(&t.t.blob, offset, count, ev.pid);
    let number = ev.fd.expect("event fd");
    assert!(t.t.s.journal.record(number as u64 + 1, &record).is_some());
    let next = t.die_after(&evs);
    assert_eq!(next.stats.adopted.load(Ordering::Relaxed), evs.len() as u64);
    next.stop();
}

#[test]
fn a_successor_denies_a_left_read_by_its_deadline_when_its_store_is_stuck() {
    let Some(t) = handover_within(Duration::from_millis(500)) else {
        return;
    };
    let evs = t.read();
    let (offset, count) = evs[0].range.expect("range");
    let record = encode(&t.t.blob, offset, count, evs[0].pid);
    let number = evs[0].fd.expect("event fd");
    assert!(t.t.s.journal.record(number as u64 + 1, &record).is_some());
    let stuck = t.t.kit.faults.inject(Fault::stuck().key(&t.t.key));
    let start = std::time::Instant::now();
    let s = t.die(&evs);
    let took = start.elapsed();
    assert!(!s.out.status.success(), "{:?}", s.out);
    assert!(
        took < DENIED_WITHIN,
        "denied by the deadline, not by the store: {took:?}"
    );
    assert!(s.next.stats.denied.load(Ordering::Relaxed) > 0);
    crate::testkit::wait_until("journal cleared", || {
        s.next.journal.slot_leftovers().is_empty()
    });
    s.faults.remove(stuck);
    std::thread::sleep(crate::deadline::FAIL_FAST);
    let path = s
        .next
        .views
        .get(&s.next.views.all()[0].blob.blob.digest)
        .expect("view")
        .path
        .clone();
    assert!(
        cat(&path).stdout == s.want,
        "and read once the store answers"
    );
    s.next.stop();
}

/// A server killed right after a read returned: nothing recorded, its batch only in the event area
/// (with its blob found, or not even that). Its successor finds the event there and answers it.
fn successor_answers_an_unrecorded_event(blob_known: bool) {
    let Some(t) = handover() else { return };
    let evs = t.read();
    if blob_known {
        let area = EventArea::of(&t.t.s.journal).expect("event area");
        area.resolve(0, &t.t.blob);
    }
    let next = t.die_after(&evs);
    assert_eq!(next.stats.adopted.load(Ordering::Relaxed), evs.len() as u64);
    next.stop();
}

#[test]
fn a_successor_answers_an_event_the_dead_server_read_but_never_recorded() {
    successor_answers_an_unrecorded_event(true);
}

#[test]
fn a_successor_answers_an_event_whose_blob_the_dead_server_never_knew() {
    successor_answers_an_unrecorded_event(false);
}

proptest! {
    /// Whole events written into a zeroed buffer are found again, however many, and nothing past them.
    #[test]
    fn the_written_events_of_a_zeroed_buffer_are_found(n in 0usize..area::BATCH, extra in 0usize..100) {
        let mut buf = vec![0u8; area::EVENTS_LEN + extra];
        let ev = |i: usize| Event { mask: sys::FAN_PRE_ACCESS, fd: Some(i as i32 + 3), pid: 7, range: Some((i as u64, 4096)) };
        let mut at = 0;
        for i in 0..n {
            let b = sys::encode(&ev(i));
            buf[at..at + b.len()].copy_from_slice(&b);
            at += b.len();
        }
        prop_assert_eq!(area::written(&buf), at);
        let got = sys::parse(&buf[..at]).expect("parse");
        prop_assert_eq!(got, (0..n).map(ev).collect::<Vec<_>>());
    }
}
