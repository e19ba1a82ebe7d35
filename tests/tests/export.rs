//! `strata export IMAGE oci:DIR[:REF]` read back by tools we did not write.
//!
//! A built layer of every kind of entry ([`generate_tree`]) exports to a layout that `umoci unpack`
//! extracts as the original tree; the five-layer umoci image (whiteouts, an opaque directory, hard
//! links, xattrs), imported then exported, unpacks with umoci as the original image does; `skopeo copy`
//! takes the exported layout into a registry, and importing it from there gives back the same tree.

use std::path::Path;

use strata_tests::oci::*;
use strata_tests::registry::Registry;
use strata_tests::*;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn export(store: &StoreEnv, image: &str, dest: &str) -> serde_json::Value {
    json(&store.ok(&["export", image, dest, "--json"]))
}

#[test]
fn a_built_layer_exports_as_its_tree() {
    if !have_umoci() {
        return;
    }
    let work = scratch("export-built");
    let tree = work.path().join("tree");
    std::fs::create_dir_all(&tree).expect("mkdir");
    generate_tree(&tree);
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    store.ok(&["build", s(&tree), "-t", "gen:v1"]);
    let layout = work.path().join("out");
    // umoci 0.4 reads gzip and plain layers.
    for compress in ["gzip", "none"] {
        let reference = format!("v1-{compress}");
        let out = json(&store.ok(&[
            "export",
            "gen:v1",
            &format!("oci:{}:{reference}", s(&layout)),
            "--compress",
            compress,
            "--json",
        ]));
        assert_eq!(out["layers"].as_array().expect("layers").len(), 1);
        assert_eq!(out["layers"][0]["skipped_sockets"], 1, "{out}");
        let unpacked = umoci_unpack(work.path(), &layout, &reference);
        // A socket has no tar form: left out, as GNU tar does.
        let mut want = snapshot(&tree);
        assert!(want.remove(&b"var/sock"[..]).is_some());
        assert_same_tree(
            want,
            snapshot(&unpacked.join("rootfs")),
            &[],
            &format!("umoci unpack of the {compress} export differs from the built tree"),
        );
    }
    // zstd, which umoci 0.4 does not read: imported back by strata, exported as gzip, unpacked.
    let zstd = format!("oci:{}:v1-zstd", s(&layout));
    store.ok(&["export", "gen:v1", &zstd, "--compress", "zstd"]);
    store.ok(&["import", &zstd, "-t", "gen:zstd"]);
    store.ok(&["export", "gen:zstd", &format!("oci:{}:again", s(&layout))]);
    let unpacked = umoci_unpack(work.path(), &layout, "again");
    let mut want = snapshot(&tree);
    want.remove(&b"var/sock"[..]);
    assert_same_tree(
        want,
        snapshot(&unpacked.join("rootfs")),
        &[],
        "a zstd export imported and exported again differs from the built tree",
    );
    // The layout keeps every exported reference.
    let index = json(&std::fs::read_to_string(layout.join("index.json")).expect("index"));
    assert_eq!(index["manifests"].as_array().expect("manifests").len(), 4);
}

#[test]
fn an_imported_image_exports_as_it_was() {
    if !have_umoci() {
        return;
    }
    let work = scratch("export-umoci");
    let layout = umoci_image(work.path());
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    store.ok(&["import", &format!("oci:{}:t", s(&layout)), "-t", "imp:v1"]);
    let out_layout = work.path().join("exported");
    let out = export(&store, "imp:v1", &format!("oci:{}:back", s(&out_layout)));
    let layers = out["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 5, "{out}");
    // Layers 2 to 4 hide entries below: their whiteouts and the opaque marker are OCI files again.
    assert!(layers[1]["whiteouts"].as_u64().expect("n") >= 2, "{out}");
    assert!(layers[2]["whiteouts"].as_u64().expect("n") >= 1, "{out}");
    let original = umoci_unpack(work.path(), &layout, "t");
    let exported = umoci_unpack(work.path(), &out_layout, "back");
    assert_same_tree(
        snapshot(&original.join("rootfs")),
        snapshot(&exported.join("rootfs")),
        &CROSS_LAYER_LINKS,
        "umoci unpack of the export differs from umoci unpack of the original",
    );
    // The runtime config umoci derives is the same.
    let cfg = |dir: &Path| json(&std::fs::read_to_string(dir.join("config.json")).expect("read"));
    let (a, b) = (cfg(&original), cfg(&exported));
    for field in ["args", "cwd", "env", "user"] {
        assert_eq!(a["process"][field], b["process"][field], "process.{field}");
    }
}

#[test]
fn skopeo_takes_an_export_to_a_registry() {
    if !have_umoci() {
        return;
    }
    let Some(reg) = Registry::start(None) else {
        return;
    };
    let work = scratch("export-skopeo");
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "bb:v1", &[("hello", b"hello from strata".to_vec())]);
    let layout = work.path().join("L");
    export(&store, "bb:v1", &format!("oci:{}", s(&layout)));
    reg.push(
        &format!("oci:{}:latest", s(&layout)),
        "exp/bb:v1",
        None,
        false,
    );
    let src = format!("docker://{}/exp/bb:v1", reg.host());
    store.ok(&["import", &src, "-t", "bb:back"]);
    assert_eq!(
        store.ok(&["cat", "bb:back", "/data/hello"]),
        "hello from strata"
    );
    // A registry reference without a repository is bad usage.
    let o = store.run(&["export", "bb:v1", "docker://x"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
