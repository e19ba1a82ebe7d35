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

/// Issue 22, item 7: the spool files of writers that were killed (`tmp/blob-<pid>-<nanos>.tmp`, 6.5 GB
/// of them after a killed import) are removed by gc once older than the grace period; a young one, and
/// one a live process owns, stay.
#[test]
fn gc_removes_old_leftovers_of_dead_writers_from_tmp() {
    let dir = scratch("gc-tmp");
    let store = StoreEnv::local(dir.path());
    build_image(&store, "keep:v1", &[("a", b"a".to_vec())]);
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).expect("tmp");
    // Pids above the kernel's limit: no process owns these.
    let old = tmp.join("blob-2147483600-1700000000000000000.tmp");
    let young = tmp.join("blob-2147483601-1700000000000000001.tmp");
    let live = tmp.join(format!(
        "blob-{}-1700000000000000002.tmp",
        std::process::id()
    ));
    for f in [&old, &young, &live] {
        std::fs::write(f, vec![0u8; 4096]).expect("write");
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_secs() as i64;
    set_mtime(&old, now - 3 * 3600, 0);
    set_mtime(&live, now - 3 * 3600, 0);
    let dry = json(&store.ok(&["gc", "--grace", "1h", "--dry-run", "--json"]));
    assert_eq!(dry["spool"]["files"], 1, "{dry}");
    assert!(old.exists(), "a dry run removed a file");
    let r = json(&store.ok(&["gc", "--grace", "1h", "--json"]));
    assert_eq!(r["spool"]["files"], 1, "{r}");
    assert_eq!(r["spool"]["bytes"], 4096, "{r}");
    assert!(!old.exists(), "an old leftover of a dead writer was kept");
    assert!(young.exists(), "a young spool file was removed");
    assert!(live.exists(), "a live writer's spool file was removed");
    store.ok(&["cat", "keep:v1", "/data/a"]);
}
