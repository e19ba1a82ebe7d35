//! `strata gc --compact` on a local store and on S3 (moto): a base rebuilt with `--parent` several times,
//! each rebuild deleting and changing files, leaves its first blobs mostly dead. Compaction rewrites them,
//! re-points the live layers and moves the tag; every file reads the same (`strata cat`, fsck.erofs and a
//! kernel mount of the re-pointed layer); a stratad sandbox holding the old layers keeps reading through
//! the compaction; after the old objects are collected the store holds about the live data only.

use std::path::Path;

use strata_tests::*;

fn store_blob_bytes(store: &StoreEnv) -> u64 {
    let s = store.open();
    s.list_info("blobs")
        .expect("list")
        .iter()
        .map(|(_, n, _)| n)
        .sum()
}

/// How many of the store's blobs hold pieced chunks (their tables of contents record pieces).
fn pieced_blobs(store: &StoreEnv) -> usize {
    let s = store.open();
    let keys = s.list_info("blobs").expect("list");
    keys.iter()
        .filter(|(k, size, _)| {
            let hex = k.rsplit('/').next().unwrap_or("");
            let d = strata_registry::digest::Digest::from_hex(hex).expect("blob key");
            let f = s.get_footer(&d).expect("footer");
            assert_eq!(f.toc_offset + f.toc_len + 64, *size);
            let toc = s.get_range(k, f.toc_offset..f.toc_offset + f.toc_len);
            let toc = strata_registry::toc::Toc::decode(&toc.expect("toc")).expect("decode");
            !toc.pieces.is_empty()
        })
        .count()
}

/// Version `v` of the tree: file `i` is missing from the versions where `(i + v) % 6 == 0` (each upgrade
/// deletes some files and brings back others) and its content changes every third version, at staggered
/// versions: the latest version's chunks lie in the blobs of several builds, and the first builds' blobs
/// are mostly dead.
fn write_version(root: &Path, v: u32) {
    let _ = std::fs::remove_dir_all(root);
    std::fs::create_dir_all(root.join("pkgs")).expect("mkdir");
    for i in 0..30u32 {
        if (i + v).is_multiple_of(6) {
            continue;
        }
        let size = 60_000 + (i as usize * 37_001) % 400_000;
        let seed = i * 1000 + (v + i) / 3;
        std::fs::write(
            root.join(format!("pkgs/f{i}.deb")),
            random_bytes(size, seed),
        )
        .expect("write");
    }
    std::fs::write(root.join("VERSION"), format!("v{v}\n")).expect("write");
}

fn files_of(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = walkdir::WalkDir::new(root)
        .into_iter()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_file())
        .map(|e| {
            let rel = e.path().strip_prefix(root).expect("prefix");
            (
                format!("/{}", rel.display()),
                std::fs::read(e.path()).expect("read"),
            )
        })
        .collect();
    out.sort();
    out
}

fn reads_the_same(store: &StoreEnv, tag: &str, files: &[(String, Vec<u8>)]) {
    for (p, want) in files {
        let got = store.run(&["cat", tag, p]);
        assert!(got.status.success(), "cat {tag} {p}: {got:?}");
        assert_eq!(&got.stdout, want, "{tag} {p}");
    }
}

/// `piece_size`: what every build passes as `--piece-size` (0: whole chunks).
fn compacts(store: &StoreEnv, piece_size: &str) {
    let src = scratch("compact-src");
    let root = src.path().join("t");
    let r = root.to_str().expect("utf8");
    let ps = ["--piece-size", piece_size];
    write_version(&root, 0);
    store.ok(&[&["build", r, "-t", "base:latest"][..], &ps].concat());
    store.ok(&[&["build", r, "-t", "base:v0"][..], &ps].concat());
    for v in 1..=6 {
        write_version(&root, v);
        let args = ["build", r, "--parent", "base:latest", "-t", "base:latest"];
        store.ok(&[&args[..], &["--force"], &ps].concat());
    }
    let files = files_of(&root);
    // v0 is dropped: only v6 is live, and it references every blob of the chain for a few chunks each.
    let rm = store.open().delete("tags/base/v0");
    rm.expect("drop tag v0");
    let old_manifest = store.ok(&["inspect", "base:latest", "--json"]);
    let old_manifest = json(&old_manifest)["digest"].clone();

    // A node holds the old layers: a sandbox of base:latest mounted before the compaction.
    let node = can_mount().then(|| {
        let d = Daemon::start(store, &[]);
        let rootfs = d.ok(&["mount", "base:latest", "--sandbox", "old"]);
        (d, rootfs)
    });

    store.ok(&["gc", "--grace", "0s"]);
    let before = store_blob_bytes(store);
    let out = json(&store.ok(&["gc", "--compact", "--grace", "24h", "--json"]));
    let c = &out["compact"];
    assert!(c["compacted"].as_u64().expect("compacted") >= 1, "{out}");
    assert_eq!(c["tags_moved"], 1, "{out}");
    assert_eq!(
        out["deleted"], 0,
        "nothing is deleted within the grace period: {out}"
    );
    let insp = json(&store.ok(&["inspect", "base:latest", "--json"]));
    assert_ne!(
        insp["digest"], old_manifest,
        "the tag moved to the new manifest"
    );
    reads_the_same(store, "base:latest", &files);
    // CI rebuilds the unchanged tree with the same tag: the layer the tag's image holds, compacted; the
    // tag stays where compaction put it, without --force.
    let rebuilt = json(&store.ok(&[
        "build",
        r,
        "--parent",
        "base:latest",
        "-t",
        "base:latest",
        "--json",
    ]));
    let tagged = json(&store.ok(&["inspect", "base:latest", "--json"]));
    assert_eq!(tagged["digest"], insp["digest"], "{rebuilt}");

    // The node's sandbox on the old layers reads everything, uncached chunks included.
    if let Some((d, rootfs)) = &node {
        let got = files_of(Path::new(rootfs));
        assert_eq!(got.len(), files.len());
        assert!(
            got == files,
            "the old sandbox reads differently after compaction"
        );
        let fresh = d.ok(&["mount", "base:latest", "--sandbox", "new"]);
        assert!(files_of(Path::new(&fresh)) == files);
    }
    drop(node);

    the_repointed_layer_reads_in_the_kernel(store, &insp, &files);

    collected_blobs_hold_the_live_data(store, r, &ps, piece_size, before, &files);
    // Compacting again finds nothing to do.
    let again = json(&store.ok(&["gc", "--compact", "--json"]));
    assert_eq!(again["compact"]["compacted"], 0, "{again}");
}

/// The re-pointed layer of `insp` (base:latest after compaction) is a valid EROFS image that reads the
/// tree.
fn the_repointed_layer_reads_in_the_kernel(
    store: &StoreEnv,
    insp: &serde_json::Value,
    files: &[(String, Vec<u8>)],
) {
    let layer = insp["layers"][0]["digest"]
        .as_str()
        .expect("layer")
        .to_string();
    if let Some(m) = materialize_checked(store, &layer) {
        if have(&[Need::KernelErofs]) {
            let mnt = scratch("compact-mnt");
            let _mounted = KernelMount::new(m.path(), mnt.path());
            assert!(
                files_of(mnt.path()) == files,
                "the kernel reads the re-pointed layer differently"
            );
        }
    }
}

/// Once gc has collected the old objects, the blobs hold about the live data only (a fresh build of the
/// tree at `r`), stored as before (pieced or not).
fn collected_blobs_hold_the_live_data(
    store: &StoreEnv,
    r: &str,
    ps: &[&str],
    piece_size: &str,
    before: u64,
    files: &[(String, Vec<u8>)],
) {
    store.ok(&["gc", "--grace", "0s"]);
    let after = store_blob_bytes(store);
    let fresh_dir = scratch("compact-fresh");
    let fresh = StoreEnv::local(fresh_dir.path());
    fresh.ok(&[&["build", r][..], ps].concat());
    let live = store_blob_bytes(&fresh);
    assert!(
        after < before,
        "compaction reclaimed nothing: {before} -> {after}"
    );
    assert!(
        (after as f64) <= 1.3 * live as f64,
        "store blobs {after} vs live data {live} (before compaction {before})"
    );
    reads_the_same(store, "base:latest", files);
    // Compaction keeps how chunks are stored: pieced blobs are rewritten pieced.
    let pieced = pieced_blobs(store);
    match piece_size {
        "0" => assert_eq!(pieced, 0),
        _ => assert!(pieced > 0, "no pieced blob after compaction"),
    }
}

#[test]
fn compact_on_a_local_store() {
    let dir = scratch("compact-store");
    compacts(&StoreEnv::local(dir.path()), "0");
}

/// Blobs whose chunks are stored as 64 KiB pieces are rewritten as pieces, and read the same.
#[test]
fn compact_pieced_blobs_on_a_local_store() {
    let dir = scratch("compact-pieced");
    compacts(&StoreEnv::local(dir.path()), "65536");
}

#[test]
fn compact_on_s3() {
    let Some(s3) = S3Server::start("compact") else {
        return;
    };
    compacts(&s3.store("compact", "p"), "0");
}
