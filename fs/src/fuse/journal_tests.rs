use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

/// The journal as a successor sees it: the same memfd, mapped again.
fn successor(j: &Journal) -> Journal {
    let fd = j.fd().try_clone_to_owned().expect("dup");
    Journal::from_fd(fd).expect("map again")
}

#[test]
fn a_successor_finds_what_was_recorded_and_not_cleared() {
    let j = Journal::create().expect("journal");
    let a = j.record(10, b"read a").expect("slot");
    let b = j.record(12, b"lookup b").expect("slot");
    let c = j.record(14, &[7u8; MAX_REQUEST]).expect("slot");
    j.clear(b);
    let s = successor(&j);
    let left = s.leftovers();
    assert_eq!(
        left,
        vec![
            Leftover {
                slot: a,
                unique: 10,
                bytes: b"read a".to_vec()
            },
            Leftover {
                slot: c,
                unique: 14,
                bytes: vec![7u8; MAX_REQUEST]
            },
        ]
    );
    // Still held until the successor answers them.
    assert_eq!(s.leftovers().len(), 2);
    s.clear(a);
    s.clear(c);
    assert!(s.leftovers().is_empty());
}

#[test]
fn half_written_slots_are_freed_and_oversized_requests_not_recorded() {
    let j = Journal::create().expect("journal");
    // A server that died between claiming a slot and publishing it.
    j.state(5).store(WRITING, Ordering::Release);
    assert!(successor(&j).leftovers().is_empty());
    assert_eq!(j.state(5).load(Ordering::Acquire), 0);
    assert_eq!(j.record(3, &[0u8; MAX_REQUEST + 1]), None);
    assert_eq!(j.unrecorded.load(Ordering::Relaxed), 1);
}

#[test]
fn a_full_journal_serves_unrecorded_and_a_wrong_sized_one_is_refused() {
    let j = Journal::create().expect("journal");
    for u in 1..=SLOTS as u64 {
        assert!(j.record(u, b"x").is_some());
    }
    assert_eq!(j.record(SLOTS as u64 + 1, b"x"), None);
    for size in [
        0,
        4000,
        (AREAS * AREA) as u64,
        (SIZE + AREAS * AREA + SLOT) as u64,
    ] {
        let fd = rustix::fs::memfd_create("odd", MemfdFlags::CLOEXEC).expect("memfd");
        rustix::fs::ftruncate(&fd, size).expect("truncate");
        assert!(Journal::from_fd(fd).is_err(), "{size} bytes taken");
    }
}

#[test]
fn a_tree_journal_is_smaller_and_its_successor_knows_its_size() {
    let j = Journal::create_with(TREE_SLOTS).expect("journal");
    for u in 1..=TREE_SLOTS as u64 {
        assert!(j.record(u, &u.to_le_bytes()).is_some());
    }
    assert_eq!(j.record(TREE_SLOTS as u64 + 1, b"x"), None);
    j.clear(7);
    let s = successor(&j);
    assert_eq!(s.slots(), TREE_SLOTS);
    let left = s.leftovers();
    assert_eq!(left.len(), TREE_SLOTS - 1);
    assert!(left.iter().all(|l| l.bytes == l.unique.to_le_bytes()));
}

#[test]
fn concurrent_recorders_and_clearers_leave_exactly_the_unanswered() {
    let j = Arc::new(Journal::create().expect("journal"));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let j = j.clone();
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for i in 0..2000u64 {
                    let unique = (t << 32) | (i + 1);
                    let slot = j.record(unique, &unique.to_le_bytes()).expect("slot");
                    // Every third request is left unanswered (its server "died").
                    if i % 3 == 0 {
                        kept.push(unique);
                    } else {
                        j.clear(slot);
                    }
                }
                kept
            })
        })
        .collect();
    let mut expected: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    expected.sort_unstable();
    let mut got: Vec<u64> = successor(&j).leftovers().iter().map(|l| l.unique).collect();
    got.sort_unstable();
    assert_eq!(got, expected);
    for l in successor(&j).leftovers() {
        assert_eq!(l.bytes, l.unique.to_le_bytes());
    }
}

proptest! {
    /// Model: a map from unique to bytes; record inserts, clear removes; leftovers equal the model.
    #[test]
    fn leftovers_follow_the_model(ops in prop::collection::vec((any::<bool>(), 1u64..200, prop::collection::vec(any::<u8>(), 0..40)), 1..200)) {
        let j = Journal::create().expect("journal");
        let mut model: BTreeMap<u64, (usize, Vec<u8>)> = BTreeMap::new();
        for (record, unique, bytes) in ops {
            if record && !model.contains_key(&unique) {
                let slot = j.record(unique, &bytes).expect("slot");
                model.insert(unique, (slot, bytes));
            } else if let Some((slot, _)) = model.remove(&unique) {
                j.clear(slot);
            }
        }
        let got: BTreeMap<u64, (usize, Vec<u8>)> = successor(&j)
            .leftovers()
            .into_iter()
            .map(|l| (l.unique, (l.slot, l.bytes)))
            .collect();
        prop_assert_eq!(got, model);
    }
}

#[test]
fn a_request_read_into_an_area_but_not_recorded_is_left_over_once() {
    let j = Journal::create_with(TREE_SLOTS).expect("journal");
    let request = |unique: u64| {
        let mut r = vec![0u8; 64];
        r[..4].copy_from_slice(&64u32.to_le_bytes());
        r[8..16].copy_from_slice(&unique.to_le_bytes());
        r
    };
    // Worker 0 read request 41 and died before recording it; worker 1 read 42 and recorded it.
    j.area(0).expect("area").arm()[..64].copy_from_slice(&request(41));
    j.area(1).expect("area").arm()[..64].copy_from_slice(&request(42));
    j.record(42, &request(42)).expect("recorded");
    // Worker 2 armed its area and was waiting in read().
    j.area(2).expect("area").arm();
    assert!(j.area(AREAS).is_none());
    let s = successor(&j);
    let mut left = s.leftovers();
    left.sort_by_key(|l| l.unique);
    let got: Vec<(u64, bool)> = left
        .iter()
        .map(|l| (l.unique, l.bytes == request(l.unique)))
        .collect();
    assert_eq!(got, [(41, true), (42, true)]);
    // 41 now has a slot of its own: a successor of the successor finds it there.
    assert!(left[0].slot < TREE_SLOTS);
    let again = successor(&s).leftovers();
    assert_eq!(again.len(), 2);
}

#[test]
fn an_older_servers_journal_has_slots_only() {
    let fd = rustix::fs::memfd_create("old", MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&fd, SIZE as u64).expect("truncate");
    let j = Journal::from_fd(fd).expect("old journal");
    assert_eq!(j.slots(), SLOTS);
    assert!(j.area(0).is_none());
}
