//! `strata import` against images written by a tool we did not write.
//!
//! `umoci` builds a multi-layer OCI image: a first layer with every kind of entry ([`generate_tree`]: hard
//! links, symlinks, devices, a fifo, `user.`/`trusted.`/`security.` xattrs, setuid and sticky bits, owners,
//! large, sparse and many files, long and non-UTF-8 names, a deep tree), a
//! second made by `umoci repack` from a changed rootfs (deleted files and directories, a directory
//! replaced by a file and the reverse, a rewritten large file, changed modes), a third from
//! `umoci insert --opaque` (an opaque directory), a fourth from `umoci insert --whiteout` and a fifth,
//! added verbatim, of whiteouts that hide nothing. The strata
//! import, layer by layer and `--flatten`ed, mounted by the node daemon (kernel EROFS layers under
//! overlay), is compared entry by entry with
//! the rootfs `umoci unpack` extracts from the same image, and the runtime config `strata bundle` writes
//! with the one `umoci unpack` writes. Also: a `docker save` archive of the same image, reuse of imported
//! layers, platform choice in a nested multi-platform index, zstd layers, an S3 store, and bad input.
//!
//! The layout surgery (a docker archive, a broken manifest, an extra layer) is done by a small Python
//! helper (`strata_tests::oci::HELPER`) that rewrites blobs and the digests that name them, as a hostile
//! writer would; the umoci image itself is built by `strata_tests::oci::umoci_image`.

use std::path::{Path, PathBuf};
use std::process::Output;

use strata_tests::oci::*;
use strata_tests::*;

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("bad JSON {s:?}: {e}"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

/// The `reused` flag of each layer of an import's JSON.
fn reused_flags(v: &serde_json::Value) -> Vec<bool> {
    v["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["reused"].as_bool().expect("bool"))
        .collect()
}

fn import_json(store: &StoreEnv, args: &[&str]) -> serde_json::Value {
    let mut full = vec!["import"];
    full.extend_from_slice(args);
    full.push("--json");
    json(&store.ok(&full))
}

/// A umoci image in a scratch directory and an empty local store.
struct Fixture {
    work: tempfile::TempDir,
    layout: PathBuf,
    sdir: tempfile::TempDir,
    store: StoreEnv,
}

/// The fixture, or `None` (after saying why) when umoci is missing.
fn fixture(label: &str) -> Option<Fixture> {
    if !have_umoci() {
        return None;
    }
    let work = scratch(label);
    let layout = umoci_image(work.path());
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    Some(Fixture {
        work,
        layout,
        sdir,
        store,
    })
}

/// umoci's own rootfs has what the layers say, so comparing with it is not vacuous.
fn umoci_rootfs_is_not_vacuous(rootfs: &Path) {
    let want = snapshot(rootfs);
    let tool = &want[&b"usr/bin/tool"[..]];
    assert_eq!(tool.xattrs, [(b"trusted.note".to_vec(), b"t".to_vec())]);
    assert_eq!(tool.mode, 0o104755);
    let sgid = &want[&b"usr/bin/sgid"[..]].xattrs;
    assert_eq!(sgid[0].0, b"security.capability");
    assert_eq!(
        want[&b"new/b"[..]].link_group.as_deref(),
        Some(&b"new/a"[..])
    );
    assert_eq!(want[&b"dev-blk"[..]].rdev, libc::makedev(259, 70000));
    assert_eq!(want[&b"var/sparse.img"[..]].size, 5 << 20);
    assert!(want[&b"repl"[..]].content.is_some(), "repl is a file");
    assert!(want.contains_key(&b"opq/fresh-dir"[..]));
    // Whiteouts never hide entries of their own layer (the fifth layer has both orders).
    for kept in ["ghostdir/same", "data/keep", "f2d/new", "ghostdir/kept"] {
        assert!(want.contains_key(kept.as_bytes()), "{kept} is missing");
    }
    // Hard links to files of the layers below: one inode once extracted.
    let big = &want[&b"usr/lib/big.bin"[..]];
    assert_eq!(want[&b"ghostdir/biglink"[..]].link_group, big.link_group);
    assert!(big.content.is_some() && big.size > 2 << 20);
    for gone in [
        "opq/old",
        "data/gone",
        "etc/link-abs",
        "usr/share/doc",
        "f2d/inside",
    ] {
        assert!(!want.contains_key(gone.as_bytes()), "{gone} is still there");
    }
}

/// `--flatten` makes one layer of the same tree and config; importing again reuses every layer and
/// stores nothing but the tag.
fn flatten_and_again_reuse_the_layers(
    store: &StoreEnv,
    store_dir: &Path,
    src: &str,
    out: &serde_json::Value,
    cfg: &serde_json::Value,
    rootfs: &Path,
) {
    // --flatten: one layer without whiteouts, the same tree; the layers themselves are reused.
    let flat = import_json(store, &[src, "-t", "umoci/img:flat", "--flatten"]);
    assert_eq!(flat["flattened"]["whiteouts"], 0, "{flat}");
    assert!(flat["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .all(|l| l["reused"] == true));
    let insp = json(&store.ok(&["inspect", "umoci/img:flat", "--json"]));
    assert_eq!(insp["layers"].as_array().expect("layers").len(), 1);
    assert_eq!(insp["manifest"]["config"], cfg.clone());
    if can_mount() {
        compare_mounted(store, "umoci/img:flat", rootfs, None);
    }

    // Importing again reuses every layer and stores nothing.
    let files_before = walkdir::WalkDir::new(store_dir).into_iter().count();
    let again = import_json(store, &[src, "-t", "umoci/img:again"]);
    assert!(again["flattened"].is_null());
    assert_eq!(again["digest"], out["digest"], "same image, same manifest");
    assert_eq!(again["stored_bytes"], 0);
    assert!(again["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .all(|l| l["reused"] == true));
    let files_after = walkdir::WalkDir::new(store_dir).into_iter().count();
    assert_eq!(
        files_before + 1,
        files_after,
        "only the new tag was written"
    );
}

/// An image on top of the imported one, and the same OCI layers on other lower layers.
fn derived_and_rebased_images(store: &StoreEnv, work: &Path, layout: &Path) {
    // An image on top of it: the shared layers are reused, only the new one is built.
    let bundle = work.join("B2");
    let image = format!("{}:t", s(layout));
    run("umoci", &["unpack", "--image", &image, s(&bundle)]);
    std::fs::write(bundle.join("rootfs/data/added"), b"layer five").expect("write");
    run(
        "umoci",
        &[
            "repack",
            "--image",
            &format!("{}:t2", s(layout)),
            s(&bundle),
        ],
    );
    let derived = import_json(
        store,
        &[&format!("oci:{}:t2", s(layout)), "-t", "umoci/img:v2"],
    );
    let reused = reused_flags(&derived);
    assert_eq!(reused, [true, true, true, true, true, false]);

    // The same OCI layers on other lower layers are other strata layers (whiteouts kept, implied
    // directories, links below depend on them): without layer 2, only layer 1 is reused.
    let rebased = work.join("rebased");
    run("cp", &["-a", s(layout), s(&rebased)]);
    helper(&rebased, "t", &["drop-layer", "1"]);
    let other = import_json(
        store,
        &[&format!("oci:{}:t", s(&rebased)), "-t", "umoci/img:rebased"],
    );
    assert_eq!(reused_flags(&other), [true, false, false, false]);
    assert_eq!(
        store.ok(&["cat", "umoci/img:rebased", "/opq/fresh"]),
        "only this is left"
    );
}

#[test]
fn umoci_image_imports_as_umoci_unpacks_it() {
    let Some(Fixture {
        work,
        layout,
        sdir,
        store,
    }) = fixture("oci-umoci")
    else {
        return;
    };
    let unpacked = umoci_unpack(work.path(), &layout, "t");
    let src = format!("oci:{}:t", s(&layout));
    let out = import_json(&store, &[&src, "-t", "umoci/img:v1"]);
    let layers = out["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 5, "{out}");
    assert_eq!(
        layers[4]["whiteouts"], 0,
        "whiteouts that hide nothing: {out}"
    );
    assert_eq!(
        layers[0]["whiteouts"], 0,
        "the bottom layer holds whiteouts"
    );
    assert!(layers[1]["whiteouts"].as_u64().expect("n") >= 2, "{out}");
    assert!(layers.iter().all(|l| l["reused"] == false));
    // Dedup against the layers below: layer 2 rewrote 100 bytes of a 3 MiB file.
    let l1 = layers[0]["stored_bytes"].as_u64().expect("n");
    let l2 = layers[1]["stored_bytes"].as_u64().expect("n");
    assert!(l2 * 3 < l1, "layer 2 stored {l2} bytes, layer 1 {l1}");
    let insp = json(&store.ok(&["inspect", "umoci/img:v1", "--json"]));
    let cfg = &insp["manifest"]["config"];
    assert_eq!(cfg["working_dir"], "/data");
    assert_eq!(cfg["user"], "app");
    assert_eq!(cfg["labels"]["org.example.kind"], "test");
    assert_eq!(
        insp["layers"][1]["labels"]["org.opencontainers.image.diff_id"],
        layers[1]["diff_id"]
    );

    umoci_rootfs_is_not_vacuous(&unpacked.join("rootfs"));
    if can_mount() {
        compare_mounted(
            &store,
            "umoci/img:v1",
            &unpacked.join("rootfs"),
            Some(&unpacked.join("config.json")),
        );
    }
    flatten_and_again_reuse_the_layers(
        &store,
        sdir.path(),
        &src,
        &out,
        cfg,
        &unpacked.join("rootfs"),
    );
    derived_and_rebased_images(&store, work.path(), &layout);

    // An import record whose layer is gone is not trusted: that layer is built again.
    let third = layers[2]["digest"].as_str().expect("digest");
    let desc = sdir.path().join(format!("layers/{}.json", &third[7..]));
    std::fs::remove_file(&desc).expect("rm layer descriptor");
    let rebuilt = import_json(&store, &[&src, "-t", "umoci/img:rebuilt"]);
    let reused = reused_flags(&rebuilt);
    assert_eq!(reused, [true, true, false, true, true]);
    assert!(desc.exists() || rebuilt["layers"][2]["digest"] != layers[2]["digest"]);
    assert_eq!(
        store.ok(&["cat", "umoci/img:rebuilt", "/opq/fresh"]),
        "only this is left"
    );
    assert_eq!(
        store.ok(&["cat", "umoci/img:v2", "/data/added"]),
        "layer five"
    );
}

#[test]
fn docker_archive_and_zstd_layers_round_trip() {
    let Some(Fixture {
        work,
        layout,
        sdir: _sdir,
        store,
    }) = fixture("oci-docker")
    else {
        return;
    };
    let unpacked = umoci_unpack(work.path(), &layout, "t");
    let archive = work.path().join("image.tar");
    helper(
        &layout,
        "t",
        &["docker-archive", s(&archive), "example/umoci:v1", "classic"],
    );
    let src = format!("docker-archive:{}:example/umoci:v1", s(&archive));
    let out = import_json(&store, &[&src, "-t", "docker/img:v1"]);
    assert_eq!(out["layers"].as_array().expect("layers").len(), 5);
    assert!(out["oci_manifest"].is_null());
    if can_mount() {
        compare_mounted(&store, "docker/img:v1", &unpacked.join("rootfs"), None);
    }
    // The Docker 25+ archive layout (blobs named by digest, verified as such) into a fresh store.
    let archive25 = work.path().join("image25.tar");
    helper(
        &layout,
        "t",
        &["docker-archive", s(&archive25), "example/umoci:v1", "oci"],
    );
    let fresh_dir = scratch("store");
    let fresh = StoreEnv::local(fresh_dir.path());
    let src25 = format!("docker-archive:{}", s(&archive25));
    let out25 = import_json(&fresh, &[&src25, "-t", "docker/img:v25"]);
    let summary = |v: &serde_json::Value| -> Vec<(String, u64, u64)> {
        v["layers"]
            .as_array()
            .expect("layers")
            .iter()
            .map(|l| {
                let n = |k: &str| l[k].as_u64().expect("number");
                let d = l["diff_id"].as_str().expect("diff_id").to_string();
                (d, n("entries"), n("whiteouts"))
            })
            .collect()
    };
    assert_eq!(summary(&out25), summary(&out), "not the same layers");

    // The same image from the layout: same diff IDs, so every layer is reused.
    let from_layout = import_json(
        &store,
        &[&format!("oci:{}:t", s(&layout)), "-t", "docker/img:layout"],
    );
    assert_eq!(from_layout["stored_bytes"], 0, "{from_layout}");
    let m = |t: &str| json(&store.ok(&["inspect", t, "--json"]))["manifest"]["config"].clone();
    assert_eq!(m("docker/img:v1"), m("docker/img:layout"));

    // zstd-compressed layers: same diff IDs (reused), and in a fresh store the same tree.
    helper(&layout, "t", &["zstd"]);
    let zsrc = format!("oci:{}:t", s(&layout));
    let z = import_json(&store, &[&zsrc, "-t", "docker/img:zstd"]);
    assert_eq!(z["stored_bytes"], 0, "{z}");
    let fresh_dir = scratch("store");
    let fresh = StoreEnv::local(fresh_dir.path());
    let z = import_json(&fresh, &[&zsrc, "-t", "zstd/img:v1"]);
    assert!(z["stored_bytes"].as_u64().expect("n") > 0);
    assert_eq!(
        fresh.ok(&["cat", "zstd/img:v1", "/opq/fresh"]),
        "only this is left"
    );
}

#[test]
fn gc_keeps_what_a_flattened_import_needs() {
    let Some(Fixture {
        work,
        layout,
        sdir: _sdir,
        store,
    }) = fixture("oci-gc")
    else {
        return;
    };
    let unpacked = umoci_unpack(work.path(), &layout, "t");
    let src = format!("oci:{}:t", s(&layout));
    let flat = import_json(&store, &[&src, "-t", "gc/img:flat", "--flatten"]);
    // Only the flattened image is tagged: the per-layer imports (descriptors, metadata, records) go,
    // the blobs the flattened layer references stay.
    let report = json(&store.ok(&["gc", "--grace", "0s", "--json"]));
    assert!(report["deleted"].as_u64().expect("n") > 0, "{report}");
    let want = std::fs::read(unpacked.join("rootfs/usr/lib/big.bin")).expect("read");
    let o = store.run(&["cat", "gc/img:flat", "/usr/lib/big.bin"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(o.stdout == want, "big.bin differs after gc");
    // A stale record is never trusted: importing again rebuilds the layers and works.
    let again = import_json(&store, &[&src, "-t", "gc/img:again"]);
    assert_eq!(reused_flags(&again), [false; 5], "{again}");
    assert_ne!(again["digest"], flat["digest"]);
    assert_eq!(
        store.ok(&["cat", "gc/img:again", "/opq/fresh"]),
        "only this is left"
    );
}

#[test]
fn platform_is_chosen_from_a_nested_index() {
    let Some(Fixture {
        work: _work,
        layout,
        sdir: _sdir,
        store,
    }) = fixture("oci-platform")
    else {
        return;
    };
    // A single-platform image must be the platform asked for.
    let single = format!("oci:{}:t", s(&layout));
    let o = store.run(&[
        "import",
        &single,
        "-t",
        "p:x",
        "--platform",
        "linux/riscv64",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("linux/riscv64"), "{}", stderr(&o));
    helper(&layout, "t", &["platforms"]);
    let src = format!("oci:{}:t", s(&layout));
    let platform_of = |tag: &str| {
        json(&store.ok(&["inspect", tag, "--json"]))["manifest"]["annotations"]
            ["org.strata.oci.platform"]
            .clone()
    };
    let host = host_platform();
    import_json(&store, &[&src, "-t", "p:default"]);
    assert_eq!(platform_of("p:default"), host);
    import_json(&store, &[&src, "-t", "p:arm", "--platform", "linux/arm64"]);
    assert_eq!(platform_of("p:arm"), "linux/arm64");
    let o = store.run(&["import", &src, "-t", "p:s390x", "--platform", "linux/s390x"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("linux/s390x") && stderr(&o).contains("linux/arm64"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn s3_store_import() {
    if !have_umoci() {
        return;
    }
    let Some(server) = S3Server::start("oci") else {
        return;
    };
    let work = scratch("oci-s3");
    let layout = umoci_image(work.path());
    let store = server.store("oci", "imports");
    let src = format!("oci:{}:t", s(&layout));
    let out = import_json(&store, &[&src, "-t", "s3/img:v1"]);
    assert!(out["stored_bytes"].as_u64().expect("n") > 0);
    assert_eq!(
        store.ok(&["cat", "s3/img:v1", "/opq/fresh"]),
        "only this is left"
    );
    let o = store.run(&["cat", "s3/img:v1", "/data/gone/a"]);
    assert_eq!(o.status.code(), Some(3), "a deleted file is visible");
    let again = import_json(&store, &[&src, "-t", "s3/img:v2"]);
    assert_eq!(again["stored_bytes"], 0, "{again}");
}

/// Asserts a failed import left no tag and no manifest.
fn nothing_referenced(store: &StoreEnv, dir: &Path, tag: &str) {
    let o = store.run(&["inspect", tag]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let manifests = std::fs::read_dir(dir.join("manifests"))
        .map(|r| r.count())
        .unwrap_or(0);
    assert_eq!(manifests, 0, "a failed import wrote a manifest");
}

/// A layout case: its name, the layout, the exit code expected, what the message must name.
type Case = (String, PathBuf, i32, Vec<String>);

/// A copy of the layout `pristine` named `name` in `work`.
fn copy_layout(work: &Path, pristine: &Path, name: &str) -> PathBuf {
    let dst = work.join(name);
    run("cp", &["-a", s(pristine), s(&dst)]);
    dst
}

/// Copies of the pristine layout with a blob removed, flipped or edited.
fn edited_layouts(work: &Path, pristine: &Path) -> Vec<Case> {
    let copy = |name: &str| copy_layout(work, pristine, name);
    let manifest_of = |l: &Path| -> serde_json::Value {
        let idx = json(&std::fs::read_to_string(l.join("index.json")).expect("index"));
        let d = idx["manifests"][0]["digest"].as_str().expect("digest");
        let p = l.join("blobs/sha256").join(&d[7..]);
        json(&std::fs::read_to_string(p).expect("manifest"))
    };
    let layer_blob = |l: &Path, n: usize| {
        let d = manifest_of(l)["layers"][n]["digest"]
            .as_str()
            .expect("digest")
            .to_string();
        (l.join("blobs/sha256").join(&d[7..]), d)
    };
    let mut cases: Vec<Case> = Vec::new();
    let l = copy("missing");
    let (blob, digest) = layer_blob(&l, 1);
    std::fs::remove_file(&blob).expect("rm");
    cases.push((
        "missing blob".into(),
        l,
        5,
        vec!["layer 2".into(), digest, "missing".into()],
    ));

    let l = copy("flipped");
    let (blob, digest) = layer_blob(&l, 0);
    let mut b = std::fs::read(&blob).expect("read");
    let mid = b.len() / 2;
    b[mid] ^= 0x40;
    std::fs::write(&blob, b).expect("write");
    cases.push((
        "flipped byte".into(),
        l,
        5,
        vec!["layer 1".into(), "digest mismatch".into(), digest],
    ));

    let l = copy("config");
    let cfg = manifest_of(&l)["config"]["digest"]
        .as_str()
        .expect("d")
        .to_string();
    let p = l.join("blobs/sha256").join(&cfg[7..]);
    let text = std::fs::read_to_string(&p)
        .expect("config")
        .replace("FOO=bar", "FOO=baz");
    std::fs::write(&p, text).expect("write");
    cases.push((
        "edited config".into(),
        l,
        5,
        vec!["config".into(), "digest mismatch".into(), cfg],
    ));
    cases
}

/// Copies of the pristine layout the test helper made wrong (a diff ID, a media type, an unsafe path),
/// and one asked for a reference it lacks.
fn wrong_layouts(work: &Path, pristine: &Path) -> Vec<Case> {
    let copy = |name: &str| copy_layout(work, pristine, name);
    let mut cases: Vec<Case> = Vec::new();
    let l = copy("diffid");
    helper(&l, "t", &["diff-id", "2"]);
    cases.push((
        "wrong diff ID".into(),
        l,
        5,
        vec!["layer 3 diff ID".into(), "digest mismatch".into()],
    ));

    let l = copy("media");
    helper(
        &l,
        "t",
        &[
            "media-type",
            "1",
            "application/vnd.oci.image.layer.v1.tar+bzip2",
        ],
    );
    cases.push((
        "media type".into(),
        l,
        1,
        vec![
            "unsupported media type".into(),
            "layer 2".into(),
            "bzip2".into(),
        ],
    ));

    let l = copy("dotdot");
    let evil = work.join("evil.tar");
    run(
        "python3",
        &[
            "-c",
            "import tarfile, io, sys\nwith tarfile.open(sys.argv[1], 'w') as t:\n    for n in ['ok', '../../etc/evil']:\n        ti = tarfile.TarInfo(n); ti.size = 1; t.addfile(ti, io.BytesIO(b'x'))\n",
            s(&evil),
        ],
    );
    helper(&l, "t", &["add-tar", s(&evil)]);
    cases.push((
        "dot-dot path".into(),
        l,
        5,
        vec!["../../etc/evil".into(), "unsafe".into()],
    ));

    let l = copy("noref");
    cases.push((
        "unknown ref".into(),
        l.clone(),
        3,
        vec!["nope".into(), "t".into()],
    ));
    cases
}

#[test]
fn bad_oci_sources_are_refused_clearly() {
    if !have_umoci() {
        return;
    }
    let work = scratch("oci-bad");
    let pristine = umoci_image(work.path());
    let mut cases = edited_layouts(work.path(), &pristine);
    cases.extend(wrong_layouts(work.path(), &pristine));
    for (name, layout, code, needles) in &cases {
        let sdir = scratch("store");
        let store = StoreEnv::local(sdir.path());
        let reference = if name == "unknown ref" { "nope" } else { "t" };
        let o = store.run(&[
            "import",
            &format!("oci:{}:{reference}", s(layout)),
            "-t",
            "bad:x",
        ]);
        assert_eq!(o.status.code(), Some(*code), "{name}: {}", stderr(&o));
        for n in needles {
            assert!(
                stderr(&o).contains(n.as_str()),
                "{name}: {n:?} not in {}",
                stderr(&o)
            );
        }
        nothing_referenced(&store, sdir.path(), "bad:x");
    }
    // A docker archive whose config no longer matches the digest it is named by.
    let archive = work.path().join("bad.tar");
    helper(
        &pristine,
        "t",
        &["docker-archive", s(&archive), "bad/img:v1", "classic"],
    );
    run(
        "python3",
        &[
            "-c",
            "import tarfile, io, sys\nsrc = tarfile.open(sys.argv[1]); out = tarfile.open(sys.argv[2], 'w')\nfor m in src.getmembers():\n    data = src.extractfile(m).read()\n    if m.name.endswith('.json') and m.name != 'manifest.json':\n        data = data.replace(b'FOO=bar', b'FOO=baz')\n    out.addfile(m, io.BytesIO(data))\nout.close()\n",
            s(&archive),
            s(&work.path().join("bad2.tar")),
        ],
    );
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let bad = format!("docker-archive:{}", s(&work.path().join("bad2.tar")));
    let o = store.run(&["import", &bad, "-t", "bad:x"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("config") && stderr(&o).contains("digest mismatch"),
        "{}",
        stderr(&o)
    );
    nothing_referenced(&store, sdir.path(), "bad:x");
}

#[test]
fn missing_and_malformed_sources_are_refused() {
    // Missing source, bad source syntax.
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let o = store.run(&["import", "oci:/nonexistent/layout", "-t", "bad:x"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let o = store.run(&["import", "/just/a/path", "-t", "bad:x"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("oci:DIR"), "{}", stderr(&o));
}
