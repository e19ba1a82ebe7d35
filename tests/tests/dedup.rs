//! Store-wide dedup: a build stores only chunks the store does not hold, whoever built them — on a local
//! store and on S3 (moto). The same tree built again (from the directory or from a tar stream) stores
//! almost nothing; a second base sharing packages with a first stores only its own; the layers read back
//! the same (`strata cat`, fsck.erofs of the multi-device layer, a kernel mount when possible). A build
//! whose foreign blob gc condemns meanwhile fails without writing its layer; the next one stores anew.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use strata_builder::{BuildError, BuildOptions};
use strata_registry::model::LayerKind;
use strata_tests::*;

/// Bytes of every object of the store (what a build really added: a metadata object or a blob already
/// there is not written again).
fn store_bytes(store: &StoreEnv) -> u64 {
    let s = store.open();
    ["blobs", "meta", "layers", "manifests", "index", "tags"]
        .iter()
        .flat_map(|p| s.list_info(p).expect("list"))
        .map(|(_, size, _)| size)
        .sum()
}

/// A "package": a few files of random data under `dir`.
fn package(root: &Path, name: &str, seed: u32, files: usize) {
    let dir = root.join("usr/lib").join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for i in 0..files {
        let n = 50_000 + (i * 170_003) % 1_500_000;
        std::fs::write(
            dir.join(format!("f{i}.so")),
            random_bytes(n, seed * 100 + i as u32),
        )
        .expect("write");
    }
    std::fs::write(dir.join("VERSION"), format!("{name} {seed}\n")).expect("write");
}

fn build(store: &StoreEnv, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["build"];
    a.extend_from_slice(args);
    a.push("--json");
    json(&store.ok(&a))
}

fn same_tree_twice(store: &StoreEnv) {
    let src = scratch("dedup-src");
    for (i, p) in ["libc", "python", "perl", "git"].iter().enumerate() {
        package(src.path(), p, i as u32 + 1, 6);
    }
    let p = src.path().to_str().expect("utf8");
    let first = build(store, &[p, "-t", "t:1"]);
    let after_first = store_bytes(store);
    assert!(first["stats"]["new_bytes"].as_u64().expect("new") > 5_000_000);

    // The same directory again, no --parent: the same layer, which the store holds (nothing new but a
    // manifest and a tag).
    let second = build(store, &[p, "-t", "t:2"]);
    assert_eq!(second["digest"], first["digest"], "{second}");
    assert_eq!(second["reused"], true, "{second}");
    let added = store_bytes(store) - after_first;
    assert_eq!(second["stats"]["new_bytes"], 0, "{second}");
    assert_eq!(second["index"]["foreign_blobs"], 1, "{second}");
    assert!(
        added * 100 < after_first,
        "second build added {added} of {after_first}"
    );

    // The same tree as a tar stream: its metadata may differ (tar's own directory entries), its data not.
    let tar = Command::new("tar")
        .args(["-C", p, "-cf", "-", "."])
        .output()
        .expect("tar");
    assert!(tar.status.success());
    let before = store_bytes(store);
    let out = store.run_with_stdin(
        &["build", "--tar", "-", "-t", "t:3", "--json"],
        Some(&tar.stdout),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let third = json(&String::from_utf8_lossy(&out.stdout));
    let added = store_bytes(store) - before;
    assert_eq!(third["stats"]["new_bytes"], 0, "{third}");
    assert!(
        added * 100 < after_first,
        "tar build added {added} of {after_first}"
    );

    for t in ["t:1", "t:2", "t:3"] {
        assert_eq!(store.ok(&["cat", t, "/usr/lib/git/VERSION"]), "git 4");
        let got = store.run(&["cat", t, "/usr/lib/perl/f3.so"]);
        assert_eq!(got.stdout, random_bytes(50_000 + 3 * 170_003, 303));
    }
    // A store written before the index has blobs without segments: `index sync --backfill` writes them.
    let s = store.open();
    let segs = s.list("index").expect("list");
    for k in &segs {
        s.delete(k).expect("delete segment");
    }
    let r = json(&store.ok(&["index", "sync", "--backfill", "--rebuild", "--json"]));
    assert_eq!(r["backfilled"].as_u64(), Some(segs.len() as u64), "{r}");
    assert_eq!(s.list("index").expect("list").len(), segs.len());
    let again = build(store, &[p]);
    assert_eq!(again["stats"]["new_bytes"], 0, "{again}");
    // --no-dedup changes placement, not the layer: the same tree is the layer the store holds.
    let alone = build(store, &[p, "--no-dedup"]);
    assert_eq!(alone["digest"], first["digest"], "{alone}");
    assert_eq!(alone["reused"], true, "{alone}");
    // Another tree with --no-dedup stores everything again (the parents-only behaviour).
    std::fs::write(src.path().join("NEW"), "one more file\n").expect("write");
    let alone = build(store, &[p, "--no-dedup"]);
    assert_eq!(alone["stats"]["new_bytes"], first["stats"]["new_bytes"]);
}

fn two_bases(store: &StoreEnv) {
    let a = scratch("dedup-a");
    let b = scratch("dedup-b");
    for (root, own) in [(a.path(), ("apt", 110)), (b.path(), ("dnf", 120))] {
        package(root, "libc", 101, 5);
        package(root, "openssl", 102, 5);
        package(root, own.0, own.1, 5);
    }
    let pa = a.path().to_str().expect("utf8");
    let pb = b.path().to_str().expect("utf8");
    let ba = build(store, &[pa, "-t", "base-a:1"]);
    let bb = build(store, &[pb, "-t", "base-b:1"]);
    let own: u64 = (0..5)
        .map(|i| 50_000 + (i * 170_003) % 1_500_000)
        .sum::<usize>() as u64;
    let new_b = bb["stats"]["new_bytes"].as_u64().expect("new");
    assert!(
        new_b < own + 4096,
        "base b stored {new_b}, its own packages are {own}: {bb}"
    );
    assert!(ba["stats"]["new_bytes"].as_u64().expect("new") > 2 * own);
    assert_eq!(bb["index"]["foreign_blobs"], 1, "{bb}");
    let layer = bb["digest"].as_str().expect("digest");
    let insp = json(&store.ok(&["inspect", layer, "--json"]));
    assert_eq!(insp["blobs"].as_array().map(Vec::len), Some(2), "{insp}");
    for (t, f, want) in [
        (
            "base-b:1",
            "/usr/lib/openssl/f4.so",
            random_bytes(50_000 + 4 * 170_003, 10204),
        ),
        (
            "base-b:1",
            "/usr/lib/dnf/f1.so",
            random_bytes(50_000 + 170_003, 12001),
        ),
        (
            "base-a:1",
            "/usr/lib/apt/f1.so",
            random_bytes(50_000 + 170_003, 11001),
        ),
    ] {
        assert_eq!(store.run(&["cat", t, f]).stdout, want, "{t} {f}");
    }
    // The two-device layer is a valid EROFS image that reads back the tree (fsck, kernel mount).
    if let Some(m) = materialize_checked(store, layer) {
        assert_eq!(materialized_devices(m.path()).len(), 2);
        if have(&[Need::KernelErofs]) {
            let mnt = scratch("dedup-mnt");
            let _mounted = KernelMount::new(m.path(), mnt.path());
            let diffs = diff(&snapshot(b.path()), &snapshot(mnt.path()));
            assert!(diffs.is_empty(), "{diffs:?}");
        }
    }
}

#[test]
fn dedup_on_a_local_store() {
    let dir = scratch("dedup-store");
    let store = StoreEnv::local(dir.path());
    same_tree_twice(&store);
    two_bases(&store);
}

#[test]
fn dedup_on_s3() {
    let Some(s3) = S3Server::start("dedup") else {
        return;
    };
    let store = s3.store("dedup", "p");
    same_tree_twice(&store);
    two_bases(&store);
}

/// The cap on foreign blobs: chunks of blobs beyond it are stored again; the layer reads back the same.
#[test]
fn foreign_blobs_are_capped() {
    let dir = scratch("dedup-cap");
    let store = StoreEnv::local(dir.path());
    let parts: Vec<_> = (0..3).map(|i| scratch(&format!("dedup-part{i}"))).collect();
    let all = scratch("dedup-all");
    for (i, d) in parts.iter().enumerate() {
        package(d.path(), &format!("p{i}"), 40 + i as u32, 3);
        package(all.path(), &format!("p{i}"), 40 + i as u32, 3);
        build(&store, &[d.path().to_str().expect("utf8")]);
    }
    let pa = all.path().to_str().expect("utf8");
    let capped = build(&store, &[pa, "--max-foreign-blobs", "2", "-t", "all:1"]);
    assert_eq!(capped["index"]["foreign_blobs"], 2, "{capped}");
    assert!(capped["index"]["capped_chunks"].as_u64().expect("capped") >= 3);
    assert!(capped["stats"]["new_bytes"].as_u64().expect("new") > 0);
    let got = store.run(&["cat", "all:1", "/usr/lib/p2/f2.so"]).stdout;
    assert_eq!(got, random_bytes(50_000 + 2 * 170_003, 42 * 100 + 2));
    let free = build(&store, &[pa]);
    assert_eq!(free["index"]["foreign_blobs"], 3, "{free}");
}

/// A blob of another build that would give a layer only a small file is not referenced: the file's
/// chunk is read back from it and stored in the new blob (one device less for a few bytes).
#[test]
fn small_foreign_blobs_are_copied() {
    let dir = scratch("dedup-small");
    let store = StoreEnv::local(dir.path());
    let a = scratch("dedup-small-a");
    let b = scratch("dedup-small-b");
    let tiny = random_bytes(100_000, 77);
    package(a.path(), "big", 60, 3);
    std::fs::write(a.path().join("tiny.so"), &tiny).expect("write");
    package(b.path(), "other", 61, 3);
    std::fs::write(b.path().join("tiny.so"), &tiny).expect("write");
    build(&store, &[a.path().to_str().expect("utf8")]);
    let out = build(&store, &[b.path().to_str().expect("utf8"), "-t", "b:1"]);
    assert_eq!(out["index"]["foreign_blobs"], 0, "{out}");
    assert_eq!(out["index"]["pruned_blobs"], 1, "{out}");
    assert_eq!(out["index"]["pruned_bytes"], 100_000, "{out}");
    assert_eq!(store.run(&["cat", "b:1", "/tiny.so"]).stdout, tiny);
    // With a lower threshold nothing is given up (the tiny file may come from either blob now).
    let low = build(
        &store,
        &[
            b.path().to_str().expect("utf8"),
            "--min-foreign-bytes",
            "4096",
        ],
    );
    assert_eq!(low["index"]["pruned_blobs"], 0, "{low}");
    assert_eq!(low["stats"]["new_bytes"], 0, "{low}");
}

/// gc condemns the blob a build is deduplicating against while the build runs: the build fails before
/// writing its layer, naming the blob; the next build does not use it and stores the chunks anew.
#[test]
fn build_against_a_blob_gc_condemns_meanwhile() {
    let dir = scratch("dedup-race");
    let store = StoreEnv::local(dir.path());
    let src = scratch("dedup-race-src");
    package(src.path(), "orphan", 7, 3);
    // An untagged build: its blob is unreachable, but indexed.
    build(&store, &[src.path().to_str().expect("utf8")]);
    let s = store.open();
    let cache = dir.path().join(".index-cache");
    let mut opts = BuildOptions::new(LayerKind::Base);
    opts.index = Some(cache.clone());
    let err = strata_builder::build_with(&s, opts.clone(), |sink| {
        strata_builder::source::dir::walk_dir(src.path(), sink)?;
        // gc runs while the build reads its source: the blob is old enough to be condemned.
        let later = SystemTime::now() + Duration::from_secs(7200);
        let mut o = strata_registry::gc::GcOptions::new(Duration::from_secs(3600));
        o.now = later;
        let r = strata_registry::gc::collect(&s, &o).expect("gc");
        // The blob, the first build's metadata and layer descriptor: condemned, not yet deleted.
        assert_eq!(r.condemned, 3, "{r:?}");
        Ok(())
    })
    .expect_err("a layer on a condemned blob");
    assert!(matches!(err, BuildError::BlobGone { .. }), "{err}");
    // Only the untagged first layer (condemned) is there: the failed build wrote none.
    assert_eq!(
        s.list("layers").expect("list").len(),
        1,
        "the failed build wrote a layer"
    );
    let again = strata_builder::build_with(&s, opts, |sink| {
        strata_builder::source::dir::walk_dir(src.path(), sink)
    })
    .expect("build again");
    assert_eq!(again.dedup.foreign_blobs, 0);
    assert!(again.descriptor.stats.new_bytes > 0);
    assert_eq!(again.descriptor.blobs.len(), 1);
}

/// Issue 22, item 6: a damaged index cache (one byte of a table file flipped) used to cost every later
/// build 60 s ("index cache busy") and its dedup (4x the bytes) until `strata index sync --rebuild`. The
/// next build moves it aside, rebuilds it from the store's segments with one warning, and deduplicates.
#[test]
fn a_damaged_index_cache_heals_at_the_next_build() {
    let dir = scratch("dedup-heal");
    let store = StoreEnv::local(dir.path());
    let src = scratch("dedup-heal-src");
    package(src.path(), "libc", 1, 6);
    let p = src.path().to_str().expect("utf8");
    let first = build(&store, &[p, "-t", "h:1"]);
    assert!(first["stats"]["new_bytes"].as_u64().expect("new") > 1_000_000);
    // The cache learns of the first build's blob at the next sync (a table file is written).
    store.ok(&["index", "sync"]);
    let cache = dir.path().join(".index-cache");
    let mut damaged = 0;
    for e in walkdir::WalkDir::new(&cache)
        .into_iter()
        .filter_map(Result::ok)
    {
        if e.path().extension().is_some_and(|x| x == "sst") {
            let mut b = std::fs::read(e.path()).expect("read");
            let mid = b.len() / 2;
            b[mid] ^= 0xff;
            let last = b.len() - 1;
            b[last] ^= 0xff;
            std::fs::write(e.path(), b).expect("write");
            damaged += 1;
        }
    }
    assert!(damaged > 0, "no table file under {}", cache.display());
    std::fs::write(src.path().join("new"), b"one more file").expect("write");
    let t = std::time::Instant::now();
    let out = store.run(&["build", p, "-t", "h:2", "--json"]);
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let second = json(&String::from_utf8_lossy(&out.stdout));
    eprintln!("rebuild took {took:?}: {err}");
    assert!(took < Duration::from_secs(20), "the build took {took:?}");
    let new = second["stats"]["new_bytes"].as_u64().expect("new_bytes");
    assert!(new < 100_000, "{new} bytes stored again: {second}");
    assert_eq!(err.matches("WARN").count(), 1, "one warning: {err}");
    assert!(err.contains("index cache is damaged"), "{err}");
    // Healed: the next build neither warns nor stores anything again.
    let out = store.run(&["build", p, "--json"]);
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("WARN"));
    let third = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(third["stats"]["new_bytes"], 0, "{third}");
}
