//! Writers on several stores (several clients of one store: mounts of one shared filesystem, or
//! backends of one bucket) moving one tag at once, and the check that compare-and-swap held.
//!
//! Each writer reads the tag and moves it to a manifest of its own, `rounds` times; every successful
//! move is recorded as (from, to). With a true compare-and-swap no two moves start from the same value
//! (that would be a lost update), the moves form one chain from the first value to the last, and every
//! client reads the last.

use std::collections::HashMap;
use std::sync::Arc;

use strata_registry::digest::Digest;
use strata_registry::model::TagName;
use strata_registry::store::{Store, StoreError};

use crate::numbered_manifest;

/// Runs `writers` writers spread over `stores` for `rounds` each on tag `tag` and checks the result
/// (see the module documentation). Returns the number of successful moves.
pub fn race(stores: &[Arc<Store>], tag: &str, writers: usize, rounds: usize) -> usize {
    let t = TagName::parse(tag).expect("tag");
    let first = numbered_manifest(&stores[0], 0);
    stores[0].tag_set(&t, None, &first).expect("create");
    let moves: Vec<(Digest, Digest)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..writers)
            .map(|w| {
                let (store, t) = (stores[w % stores.len()].clone(), t.clone());
                s.spawn(move || moves_of(&store, &t, w, rounds))
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().expect("join"))
            .collect()
    });
    let mut next: HashMap<Digest, Digest> = HashMap::new();
    for (from, to) in &moves {
        assert!(
            next.insert(*from, *to).is_none(),
            "two moves from {from}: an update was lost"
        );
    }
    let (mut at, mut steps) = (first, 0);
    while let Some(n) = next.get(&at) {
        at = *n;
        steps += 1;
    }
    assert_eq!(steps, moves.len(), "the moves do not form one chain");
    for s in stores {
        assert_eq!(s.tag_get(&t).expect("get").expect("tag").digest, at);
    }
    eprintln!(
        "{tag}: {} moves of {} attempts",
        moves.len(),
        writers * rounds
    );
    moves.len()
}

/// Writer `w`'s successful moves.
fn moves_of(store: &Store, t: &TagName, w: usize, rounds: usize) -> Vec<(Digest, Digest)> {
    let mut won = Vec::new();
    for r in 0..rounds {
        let m = numbered_manifest(store, 1000 * (w + 1) + r);
        let seen = store.tag_get(t).expect("get").expect("tag");
        match store.tag_set(t, Some(&seen), &m) {
            Ok(()) => won.push((seen.digest, m)),
            Err(StoreError::TagConflict { .. }) => {}
            Err(e) => panic!("writer {w}: {e}"),
        }
    }
    won
}
