//! Store garbage collection: what no tag reaches goes (after the grace period), what a tag reaches stays
//! readable — including metadata a live layer's patch is based on — on a local store and on S3.

use std::time::Duration;

use strata_tests::*;

fn count(store: &StoreEnv) -> usize {
    let s = store.open();
    ["blobs", "meta", "layers", "manifests", "index"]
        .iter()
        .map(|p| s.list(p).expect("list").len())
        .sum()
}

fn collects(store: &StoreEnv) {
    let src = scratch("gc-src");
    std::fs::write(src.path().join("a.bin"), random_bytes(300_000, 1)).expect("write");
    std::fs::write(src.path().join("small"), b"v1").expect("write");
    let p = src.path().to_str().expect("utf8");
    store.ok(&["build", p, "-t", "x:v1"]);
    std::fs::write(src.path().join("small"), b"v2").expect("write");
    // v2's metadata is stored as a patch against v1's.
    store.ok(&["build", p, "-t", "x:v2", "--parent", "x:v1"]);
    // An orphan: a layer no tag names.
    let orphan = scratch("gc-orphan");
    std::fs::write(orphan.path().join("o.bin"), random_bytes(200_000, 9)).expect("write");
    store.ok(&["build", orphan.path().to_str().expect("utf8")]);
    // x:v1 now names v2's image: v1's layer is garbage, but its metadata is v2's patch base.
    store.ok(&["tag", "x:v2", "x:v1"]);
    std::thread::sleep(Duration::from_millis(1100));

    let before = count(store);
    let dry = json(&store.ok(&["gc", "--grace", "0s", "--dry-run", "--json"]));
    assert!(dry["deleted"].as_u64().expect("deleted") >= 3, "{dry}");
    assert_eq!(count(store), before, "a dry run deleted something");
    let young = json(&store.ok(&["gc", "--json"]));
    assert_eq!(young["deleted"].as_u64(), Some(0), "{young}");
    assert!(young["young"].as_u64().expect("young") >= 3, "{young}");

    let done = json(&store.ok(&["gc", "--grace", "0s", "--json"]));
    assert_eq!(done["deleted"], dry["deleted"], "{done}");
    assert_eq!(
        count(store),
        before - dry["deleted"].as_u64().expect("n") as usize
    );
    for t in ["x:v1", "x:v2"] {
        assert_eq!(store.ok(&["cat", t, "/small"]), "v2");
        assert!(!store.ok(&["cat", t, "/a.bin"]).is_empty());
    }
    let again = json(&store.ok(&["gc", "--grace", "0s", "--json"]));
    assert_eq!(again["deleted"].as_u64(), Some(0), "{again}");
    let o = store.run(&["gc", "--grace", "soon"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

#[test]
fn gc_on_a_local_store() {
    let dir = scratch("gc-store");
    collects(&StoreEnv::local(dir.path()));
}

#[test]
fn gc_on_s3() {
    let Some(s3) = S3Server::start("gcbucket") else {
        return;
    };
    collects(&s3.store("gcbucket", "p"));
}
