//! Tags move and are deleted only by compare-and-swap: of concurrent updates from one state, exactly one
//! wins, the others get a conflict, and no tag is lost — on a local store (lock file) and on S3
//! (conditional put; a deleted tag is a tombstone).

use std::sync::{Arc, Barrier};

use strata_registry::digest::Digest;
use strata_registry::model::TagName;
use strata_registry::store::{Store, StoreError};
use strata_tests::*;

/// Builds three tiny images and returns their manifest digests.
fn three_images(store: &StoreEnv) -> Vec<Digest> {
    let work = scratch("tags");
    (0..3)
        .map(|i| {
            let d = work.path().join(format!("t{i}"));
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("f"), format!("image {i}")).expect("write");
            let out = store.ok(&[
                "build",
                d.to_str().expect("utf8"),
                "-t",
                &format!("seed/s{i}:v"),
                "--json",
            ]);
            let v: serde_json::Value = serde_json::from_str(&out).expect("json");
            v["image"].as_str().expect("image").parse().expect("digest")
        })
        .collect()
}

fn race(store: Arc<Store>, images: &[Digest], rounds: usize) {
    let tag = TagName::parse("race/img:latest").expect("tag");
    let prev = store.tag_get(&tag).expect("get");
    store
        .tag_set(&tag, prev.as_ref(), &images[0])
        .expect("seed tag");
    for round in 0..rounds {
        let state = store.tag_get(&tag).expect("get").expect("present");
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = [images[1], images[2]]
            .into_iter()
            .map(|new| {
                let (store, barrier, state, tag) =
                    (store.clone(), barrier.clone(), state.clone(), tag.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (new, store.tag_set(&tag, Some(&state), &new))
                })
            })
            .collect();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        let winners: Vec<_> = results
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(d, _)| *d)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        for (_, r) in &results {
            if let Err(e) = r {
                assert!(matches!(e, StoreError::TagConflict { .. }), "{e}");
                assert!(e.to_string().contains("race/img:latest"), "{e}");
            }
        }
        let now = store.tag_get(&tag).expect("get").expect("tag lost");
        assert_eq!(now.digest, winners[0]);
        // Reset for the next round.
        store.tag_set(&tag, Some(&now), &images[0]).expect("reset");
    }
}

/// `rmi` racing a move, and then two creates racing from "absent" (on S3, from the tombstone): exactly
/// one of each pair wins and the tag ends as the winner left it.
fn race_delete(store: Arc<Store>, images: &[Digest], rounds: usize) {
    let tag = TagName::parse("race/del:latest").expect("tag");
    for round in 0..rounds {
        let prev = store.tag_get(&tag).expect("get");
        store
            .tag_set(&tag, prev.as_ref(), &images[0])
            .expect("seed");
        let state = store.tag_get(&tag).expect("get").expect("present");
        let barrier = Arc::new(Barrier::new(2));
        let (s1, b1, st1, t1) = (store.clone(), barrier.clone(), state.clone(), tag.clone());
        let deleter = std::thread::spawn(move || {
            b1.wait();
            s1.tag_delete(&t1, &st1)
        });
        let (s2, b2, t2, new) = (store.clone(), barrier.clone(), tag.clone(), images[1]);
        let mover = std::thread::spawn(move || {
            b2.wait();
            s2.tag_set(&t2, Some(&state), &new)
        });
        let (d, m) = (deleter.join().expect("join"), mover.join().expect("join"));
        assert!(d.is_ok() != m.is_ok(), "round {round}: {d:?} {m:?}");
        let now = store.tag_get(&tag).expect("get").map(|s| s.digest);
        assert_eq!(now, m.is_ok().then_some(images[1]), "round {round}");
        if let Some(s) = store.tag_get(&tag).expect("get") {
            store.tag_delete(&tag, &s).expect("delete");
        }
        let barrier = Arc::new(Barrier::new(2));
        let creators: Vec<_> = [images[1], images[2]]
            .into_iter()
            .map(|new| {
                let (store, barrier, tag) = (store.clone(), barrier.clone(), tag.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (new, store.tag_set(&tag, None, &new))
                })
            })
            .collect();
        let results: Vec<_> = creators
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        let winners: Vec<_> = results.iter().filter(|(_, r)| r.is_ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let now = store.tag_get(&tag).expect("get").map(|s| s.digest);
        assert_eq!(now, Some(winners[0].0), "round {round}");
    }
}

#[test]
fn local_tags_compare_and_swap() {
    let dir = scratch("store");
    let env = StoreEnv::local(dir.path());
    let images = three_images(&env);
    race(Arc::new(env.open()), &images, 10);
    race_delete(Arc::new(env.open()), &images, 10);
    // The CLI's --expect.
    let o = env.run(&[
        "tag",
        &images[1].to_string(),
        "race/img:latest",
        "--expect",
        &images[2].to_string(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    env.ok(&[
        "tag",
        &images[1].to_string(),
        "race/img:latest",
        "--expect",
        &images[0].to_string(),
    ]);
    let listing = env.ok(&["images", "--json"]);
    assert!(
        listing.contains("race/img") && listing.contains("seed/s2"),
        "{listing}"
    );
}

#[test]
fn s3_tags_compare_and_swap() {
    let Some(s3) = S3Server::start("tags") else {
        return;
    };
    let env = s3.store("tags", "p");
    let images = three_images(&env);
    race(Arc::new(env.open()), &images, 5);
    race_delete(Arc::new(env.open()), &images, 5);
    let listing = env.ok(&["images", "--json"]);
    assert!(listing.contains("race/img"), "{listing}");
}
