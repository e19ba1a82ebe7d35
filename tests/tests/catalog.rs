//! Images as CI pipelines manage them, on a local store and on S3: a broken tag stops gc before anything
//! is deleted and `strata images` names it; `strata rmi` deletes tags by compare-and-swap and gc then
//! reclaims; tags move only with --force; gc condemns first and deletes a run later, and a build that
//! takes a condemned object up keeps it; read-only commands never create a store; progress shows in
//! logs.

use std::time::Duration;

use bytes::Bytes;
use strata_registry::store::PutMode;
use strata_tests::*;

fn objects(store: &StoreEnv) -> usize {
    let s = store.open();
    ["blobs", "index", "meta", "layers", "manifests"]
        .iter()
        .map(|p| s.list(p).expect("list").len())
        .sum()
}

fn tree(label: &str, seed: u32) -> tempfile::TempDir {
    let d = scratch(label);
    std::fs::write(d.path().join("data.bin"), random_bytes(200_000, seed)).expect("write");
    std::fs::write(d.path().join("small"), format!("seed {seed}")).expect("write");
    d
}

fn path(d: &tempfile::TempDir) -> &str {
    d.path().to_str().expect("utf8")
}

fn put(store: &StoreEnv, key: &str, value: &[u8]) {
    store
        .open()
        .backend()
        .put(key, Bytes::copy_from_slice(value), PutMode::Overwrite)
        .expect("put");
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Each way a tag can break: gc deletes nothing and names it, images lists the rest and names it.
fn broken_tags_stop_gc(store: &StoreEnv) {
    let (a, b) = (tree("cat-a", 1), tree("cat-b", 2));
    store.ok(&["build", path(&a), "-t", "good:v1"]);
    store.ok(&["build", path(&b), "-t", "victim:v1"]);
    let layer = json(&store.ok(&["inspect", "victim:v1", "--json"]))["layers"][0]["digest"]
        .as_str()
        .expect("digest")
        .to_string();
    let layer_key = format!("layers/{}.json", layer.trim_start_matches("blake3:"));
    let good_tag = store.open().backend().get("tags/victim/v1").expect("tag").0;
    let good_layer = store.open().backend().get(&layer_key).expect("layer").0;
    // An orphan that a working gc would delete.
    store.ok(&["build", path(&tree("cat-orphan", 3))]);
    std::thread::sleep(Duration::from_millis(1100));
    let before = objects(store);
    let missing = format!("blake3:{}\n", "0".repeat(64));
    let breakages: [(&str, &[u8]); 4] = [
        ("tags/victim/v1", b""),
        ("tags/victim/v1", b"\x00garbage"),
        ("tags/victim/v1", missing.as_bytes()),
        (&layer_key, b"{\"schema\": 1, broken"),
    ];
    for (key, value) in breakages {
        put(store, key, value);
        let o = store.run(&["gc", "--grace", "0s"]);
        assert_eq!(o.status.code(), Some(5), "gc with {key}={value:?}: {o:?}");
        assert!(stderr(&o).contains("victim:v1"), "{}", stderr(&o));
        assert!(stderr(&o).contains("Nothing was deleted"), "{}", stderr(&o));
        assert_eq!(objects(store), before, "gc deleted with {key} broken");
        let o = store.run(&["images"]);
        assert_eq!(o.status.code(), Some(5), "images with {key} broken: {o:?}");
        assert!(String::from_utf8_lossy(&o.stdout).contains("good:v1"));
        assert!(stderr(&o).contains("victim:v1"), "{}", stderr(&o));
        let j = store.run(&["images", "--json"]);
        let v = json(&String::from_utf8_lossy(&j.stdout));
        let broken: Vec<_> = v
            .as_array()
            .expect("array")
            .iter()
            .filter(|r| r.get("broken").is_some())
            .collect();
        assert_eq!(broken.len(), 1, "{v}");
        put(store, "tags/victim/v1", &good_tag);
        put(store, &layer_key, &good_layer);
    }
    // The restored image is whole; an explicit --skip-broken collects around a broken tag.
    assert_eq!(store.ok(&["cat", "victim:v1", "/small"]), "seed 2");
    put(store, "tags/victim/v1", b"garbage");
    let r = json(&store.ok(&["gc", "--grace", "0s", "--skip-broken", "--json"]));
    assert_eq!(r["broken"].as_array().map(Vec::len), Some(1), "{r}");
    assert!(r["deleted"].as_u64().expect("deleted") >= 4, "{r}");
    assert_eq!(store.ok(&["cat", "good:v1", "/small"]), "seed 1");
}

#[test]
fn broken_tags_stop_gc_on_a_local_store() {
    let dir = scratch("cat-store");
    broken_tags_stop_gc(&StoreEnv::local(dir.path()));
}

#[test]
fn broken_tags_stop_gc_on_s3() {
    let Some(s3) = S3Server::start("catbroken") else {
        return;
    };
    broken_tags_stop_gc(&s3.store("catbroken", "p"));
}

/// rmi by compare-and-swap, then gc reclaims; tags move only on purpose.
fn rmi_and_tags(store: &StoreEnv) {
    let (a, b) = (tree("rmi-a", 11), tree("rmi-b", 12));
    let da = store.ok(&["build", path(&a), "-t", "app:v1", "--json"]);
    let image_a = json(&da)["image"].as_str().expect("image").to_string();
    // The bytes reported are the bytes the store holds (metadata compressed, as stored).
    let held: u64 = ["blobs", "meta"]
        .iter()
        .flat_map(|p| store.open().list_info(p).expect("list"))
        .map(|(_, size, _)| size)
        .sum();
    let images = json(&store.ok(&["images", "--json"]));
    assert_eq!(images[0]["stored_bytes"].as_u64(), Some(held), "{images}");
    // Same content again: the tag already names it, nothing moves.
    store.ok(&["build", path(&a), "-t", "app:v1"]);
    // Other content: refused without --force (conflict, exit 4), the tag unchanged.
    let o = store.run(&["build", path(&b), "-t", "app:v1"]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(store.ok(&["cat", "app:v1", "/small"]), "seed 11");
    let o = store.run(&["compose", "--base", "app:v1", "-t", "other:v1"]);
    assert!(o.status.success(), "{o:?}");
    let o = store.run(&["build", path(&b), "-t", "other:v1"]);
    assert_eq!(o.status.code(), Some(4), "compose's tag moved: {o:?}");
    store.ok(&["build", path(&b), "-t", "app:v1", "--force"]);
    assert_eq!(store.ok(&["cat", "app:v1", "/small"]), "seed 12");

    // rmi with a stale --expect is a conflict and deletes nothing.
    let o = store.run(&["rmi", "app:v1", "--expect", &image_a]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    assert_eq!(store.ok(&["cat", "app:v1", "/small"]), "seed 12");
    let o = store.run(&["rmi", "nothing:here"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    std::thread::sleep(Duration::from_millis(1100));
    let before = objects(store);
    store.ok(&["rmi", "app:v1", "other:v1"]);
    assert_eq!(
        store.run(&["cat", "app:v1", "/small"]).status.code(),
        Some(3)
    );
    let images = json(&store.ok(&["images", "--json"]));
    assert_eq!(images.as_array().map(Vec::len), Some(0), "{images}");
    let r = json(&store.ok(&["gc", "--grace", "0s", "--json"]));
    assert_eq!(r["deleted"].as_u64(), Some(before as u64), "{r}");
    assert_eq!(objects(store), 0);
    // A deleted tag can be created again.
    store.ok(&["build", path(&a), "-t", "app:v1"]);
    assert_eq!(store.ok(&["cat", "app:v1", "/small"]), "seed 11");
}

#[test]
fn rmi_and_tags_on_a_local_store() {
    let dir = scratch("rmi-store");
    rmi_and_tags(&StoreEnv::local(dir.path()));
}

#[test]
fn rmi_and_tags_on_s3() {
    let Some(s3) = S3Server::start("catrmi") else {
        return;
    };
    rmi_and_tags(&s3.store("catrmi", "p"));
}

/// With a grace period, gc condemns first and deletes a run later; a build that takes a condemned
/// object up writes it again and keeps it. (Store times are whole seconds, which gc rounds up: 2.1 s
/// is certainly past a 1 s grace.)
#[test]
fn gc_condemns_then_deletes_and_a_rebuild_keeps_what_it_reuses() {
    let dir = scratch("condemn-store");
    let store = StoreEnv::local(dir.path());
    let (a, b) = (tree("condemn-a", 21), tree("condemn-b", 22));
    store.ok(&["build", path(&a), "-t", "keep:v1"]);
    store.ok(&["build", path(&b), "-t", "gone:v1"]);
    store.ok(&["rmi", "gone:v1"]);
    std::thread::sleep(Duration::from_millis(2100));
    let r = json(&store.ok(&["gc", "--grace", "1s", "--json"]));
    assert_eq!(r["deleted"].as_u64(), Some(0), "{r}");
    assert!(r["condemned"].as_u64().expect("condemned") >= 4, "{r}");
    let again = json(&store.ok(&["gc", "--grace", "1s", "--json"]));
    assert_eq!(again["deleted"].as_u64(), Some(0), "{again}");
    assert_eq!(again["pending"], r["condemned"], "{again}");
    // The same tree built again takes the condemned objects up: they are written anew.
    store.ok(&["build", path(&b), "-t", "back:v1"]);
    std::thread::sleep(Duration::from_millis(2100));
    let r = json(&store.ok(&["gc", "--grace", "1s", "--json"]));
    assert_eq!(r["deleted"].as_u64(), Some(0), "{r}");
    assert_eq!(store.ok(&["cat", "back:v1", "/small"]), "seed 22");
    assert_eq!(store.ok(&["cat", "keep:v1", "/small"]), "seed 21");
    // Untagged again: condemned, then deleted once the mark is older than the grace period.
    store.ok(&["rmi", "back:v1"]);
    std::thread::sleep(Duration::from_millis(2100));
    let r = json(&store.ok(&["gc", "--grace", "1s", "--json"]));
    assert!(r["condemned"].as_u64().expect("condemned") >= 4, "{r}");
    std::thread::sleep(Duration::from_millis(2100));
    let r = json(&store.ok(&["gc", "--grace", "1s", "--json"]));
    assert!(r["deleted"].as_u64().expect("deleted") >= 4, "{r}");
    assert_eq!(store.ok(&["cat", "keep:v1", "/small"]), "seed 21");
}

#[test]
fn read_only_commands_never_create_a_store() {
    let dir = scratch("no-store");
    let missing = dir.path().join("not-there");
    let store = StoreEnv::local(&missing);
    for args in [
        &["images"][..],
        &["inspect", "x:v1"],
        &["gc", "--dry-run"],
        &["rmi", "x:v1"],
        &["cat", "x:v1", "/etc/passwd"],
    ] {
        let o = store.run(args);
        assert_eq!(o.status.code(), Some(3), "{args:?}: {o:?}");
        assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
        assert!(!missing.exists(), "{args:?} created the store");
    }
    // A build creates it.
    store.ok(&["build", path(&tree("no-store-src", 31)), "-t", "x:v1"]);
    assert!(missing.is_dir());
}

#[test]
fn progress_lines_in_a_log() {
    let dir = scratch("progress-store");
    let mut store = StoreEnv::local(dir.path());
    store
        .env
        .push(("STRATA_PROGRESS_SECS".into(), "0.05".into()));
    let src = scratch("progress-src");
    std::fs::write(src.path().join("big.bin"), random_bytes(64 << 20, 41)).expect("write");
    let o = store.run(&["build", path(&src), "--progress", "plain"]);
    assert!(o.status.success(), "{o:?}");
    let err = stderr(&o);
    // Done of the total (the directory's size, summed beside the build) with a rate.
    assert!(
        err.lines()
            .any(|l| l.contains(" of 64.0 MiB (") && l.contains("/s")),
        "no progress line: {err}"
    );
    assert!(
        err.lines()
            .last()
            .is_some_and(|l| l.starts_with("build: done, 64.0 MiB in ")),
        "no last line: {err}"
    );
    // A short build says it is done too.
    let o = store.run(&[
        "build",
        path(&tree("progress-small", 42)),
        "--progress",
        "plain",
    ]);
    let err = stderr(&o);
    assert!(
        err.lines()
            .last()
            .is_some_and(|l| l.starts_with("build: done, ")),
        "{err}"
    );
    // A build that fails says so, not "done", before its error; a zstd fast level is taken.
    let small = tree("progress-level", 43);
    let o = store.run(&[
        "build",
        path(&small),
        "--level",
        "-8",
        "--progress",
        "plain",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = stderr(&o);
    assert!(
        err.contains("build: failed, ") && !err.contains("build: done"),
        "{err}"
    );
    assert!(err.contains("zstd level -8 must be"), "{err}");
    store.ok(&["build", path(&small), "--level", "-3"]);
    let o = store.run(&["build", path(&src), "--progress", "none"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!stderr(&o).contains("build:"), "{}", stderr(&o));
}
