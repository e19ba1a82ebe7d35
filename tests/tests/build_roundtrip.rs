//! Build → store → read back, against a local store and a real S3 server (moto) on loopback.
//!
//! A generated tree with every kind of entry and metadata is built, materialized, checked by
//! `fsck.erofs`, mounted by the kernel and compared entry by entry with its source; the same tree is
//! compared through `strata ls` and `strata cat`. Dedup against a parent stores only what changed.

use std::collections::BTreeMap;

use strata_tests::*;

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("bad JSON {out:?}: {e}"))
}

/// What `strata ls --json` and `strata cat` show of an entry: mode, uid, gid, mtime, nanoseconds, size,
/// content digest.
type CliEntry = (u32, u32, u32, i64, i64, u64, Option<String>);

/// The merged view through `strata ls --json` and `strata cat`, as a snapshot like [`snapshot`]'s.
fn snapshot_via_cli(store: &StoreEnv, image: &str) -> BTreeMap<Vec<u8>, CliEntry> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![String::new()];
    while let Some(dir) = dirs.pop() {
        let listing = json(&store.ok(&["ls", "--json", image, &format!("/{dir}")]));
        for e in listing.as_array().expect("array") {
            let name = e["name"].as_str().expect("name");
            if name.contains('\u{fffd}') {
                let hex = e["name_hex"]
                    .as_str()
                    .expect("name_hex for a non-UTF-8 name");
                assert!(hex.starts_with("62696eff"), "{hex}"); // "bin\xff..."
            }
            let rel = if dir.is_empty() {
                name.to_string()
            } else {
                format!("{dir}/{name}")
            };
            let mode = e["mode"].as_u64().expect("mode") as u32;
            // Names that are not UTF-8 come back lossy in JSON: list them, do not cat them.
            let content = if mode & 0o170000 == 0o100000
                && !rel.starts_with("many/")
                && !rel.contains('\u{fffd}')
            {
                let o = store.run(&["cat", image, &format!("/{rel}")]);
                assert!(
                    o.status.success(),
                    "cat {rel}: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                Some(blake3::hash(&o.stdout).to_hex().to_string())
            } else {
                None
            };
            if mode & 0o170000 == 0o040000 {
                dirs.push(rel.clone());
            }
            out.insert(
                rel.into_bytes(),
                (
                    mode,
                    e["uid"].as_u64().expect("uid") as u32,
                    e["gid"].as_u64().expect("gid") as u32,
                    e["mtime"].as_i64().expect("mtime"),
                    e["mtime_nsec"].as_i64().expect("nsec"),
                    if mode & 0o170000 == 0o040000 {
                        0
                    } else {
                        e["size"].as_u64().expect("size")
                    },
                    content,
                ),
            );
        }
    }
    out
}

fn roundtrip(store: &StoreEnv) {
    let work = scratch("roundtrip");
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).expect("src");
    generate_tree(&src);
    add_files_the_layout_moves(&src);
    // Without store-wide dedup, so that a second build stores its own blob rather than referencing the
    // first one's (which gives another, equally valid, layer).
    let build = |layout: &str, tag: &str| {
        let src = src.to_str().expect("utf8");
        let args = [
            "build",
            src,
            "--kind",
            "base",
            "--layout",
            layout,
            "--no-dedup",
        ];
        json(&store.ok(&[&args[..], &["-t", tag, "--json"]].concat()))
    };
    let out = build("run-first", "test/tree:v1");
    let layer = out["digest"].as_str().expect("digest").to_string();
    assert!(out["stats"]["new_chunks"].as_u64().expect("n") > 0);
    // Deterministic: the same input gives the same layer, stored once. The layout orders the blob, which
    // is placement, not identity: another layout names the same layer, which the store holds already.
    let again = build("run-first", "test/tree:again");
    assert_eq!(again["digest"], out["digest"]);
    assert_eq!(again["reused"], true, "{again}");
    let other_layout = build("source", "test/tree:source");
    assert_eq!(other_layout["digest"], out["digest"]);
    assert_eq!(other_layout["stats"]["stored_bytes"], 0, "{other_layout}");

    // Inspect names the layer.
    let insp = json(&store.ok(&["inspect", "test/tree:v1", "--json"]));
    assert_eq!(insp["layers"][0]["digest"].as_str(), Some(layer.as_str()));

    // Materialize, fsck, kernel mount, compare.
    let mat = work.path().join("mat");
    store.ok(&["materialize", &layer, mat.to_str().expect("utf8")]);
    let fsck = fsck_erofs(&mat);
    assert!(
        fsck.status.success(),
        "fsck.erofs: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let source = snapshot(&src);
    if have(&[Need::KernelErofs]) {
        let target = work.path().join("mnt");
        let m = KernelMount::new(&mat, &target);
        let mounted = snapshot(&m.target);
        let d = diff(&source, &mounted);
        assert!(
            d.is_empty(),
            "kernel view differs from source:\n{}",
            d.join("\n")
        );
    }

    the_cli_shows_the_source(store, &source);
}

/// Files the run-first layout moves, added to the generated tree at `src`.
fn add_files_the_layout_moves(src: &std::path::Path) {
    // Files the run-first layout moves (usr/share/doc is in the tree already): a Python package with
    // bytecode, a source without, tests, a stub.
    for (rel, text) in [
        ("pkg/__init__.py", "source "),
        ("pkg/__pycache__/__init__.cpython-311.pyc", "bytecode "),
        ("pkg/plain.py", "plain "),
        ("pkg/tests/test_pkg.py", "test "),
        ("pkg/stub.pyi", "stub "),
    ] {
        let p = src.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, text.repeat(1000)).expect("write");
    }
    // Real ELF files the run-first layout reorders: a program, and the library it loads (placed after
    // it), larger than a chunk (its loader-touched chunks stored right after its first).
    let lib = src.join("usr/lib/x86_64-linux-gnu/libc.so.6");
    std::fs::create_dir_all(lib.parent().expect("parent")).expect("mkdir");
    std::fs::copy("/lib/x86_64-linux-gnu/libc.so.6", &lib).expect("copy libc");
    std::fs::create_dir_all(src.join("usr/bin")).expect("mkdir");
    std::fs::copy("/bin/ls", src.join("usr/bin/ls")).expect("copy ls");
}

/// `strata ls` and `strata cat` show every entry of `source` (the tree built as test/tree:v1).
fn the_cli_shows_the_source(store: &StoreEnv, source: &BTreeMap<Vec<u8>, EntryInfo>) {
    // The same through strata ls / cat.
    let via = snapshot_via_cli(store, "test/tree:v1");
    for (path, e) in source {
        if path.is_empty() {
            continue;
        }
        // Names that are not UTF-8 come back lossy in JSON.
        let lossy = String::from_utf8_lossy(path).into_owned();
        let odd = lossy.contains('\u{fffd}');
        let got = via
            .get(lossy.as_bytes())
            .unwrap_or_else(|| panic!("ls misses {lossy}"));
        let want = (
            e.mode,
            e.uid,
            e.gid,
            e.mtime.0,
            e.mtime.1,
            e.size,
            if path.starts_with(b"many/") || odd {
                None
            } else {
                e.content.clone()
            },
        );
        assert_eq!(
            got,
            &want,
            "ls/cat differ for {}",
            String::from_utf8_lossy(path)
        );
    }
    assert_eq!(via.len() + 1, source.len(), "entry counts differ");
}

fn dedup(store: &StoreEnv) {
    let work = scratch("dedup");
    let v1 = work.path().join("v1");
    std::fs::create_dir_all(&v1).expect("v1");
    for i in 0..4u32 {
        let data: Vec<u8> = (0..(6u32 << 20))
            .map(|j| (j.wrapping_mul(2654435761).wrapping_add(i * 7) >> 11) as u8)
            .collect();
        std::fs::write(v1.join(format!("f{i}")), data).expect("write");
    }
    for i in 0..50 {
        std::fs::write(
            v1.join(format!("small{i}")),
            format!("small file {i}\n").repeat(200),
        )
        .expect("small");
    }
    let out1 = json(&store.ok(&[
        "build",
        v1.to_str().expect("utf8"),
        "-t",
        "test/dedup:v1",
        "--json",
    ]));
    let v2 = work.path().join("v2");
    let cp = std::process::Command::new("cp")
        .args(["-a", v1.to_str().expect("utf8"), v2.to_str().expect("utf8")])
        .status()
        .expect("cp");
    assert!(cp.success());
    // Change 100 KiB in the middle of one file.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(v2.join("f2"))
            .expect("open");
        f.write_all_at(&vec![0x5a; 100 << 10], 3 << 20)
            .expect("write");
    }
    let out2 = json(&store.ok(&[
        "build",
        v2.to_str().expect("utf8"),
        "--parent",
        "test/dedup:v1",
        "-t",
        "test/dedup:v2",
        "--json",
    ]));
    let new_bytes = out2["stats"]["new_bytes"].as_u64().expect("new_bytes");
    let stored = out2["stats"]["stored_bytes"].as_u64().expect("stored");
    let stored1 = out1["stats"]["stored_bytes"].as_u64().expect("stored");
    // One 1 MiB chunk changed.
    assert_eq!(new_bytes, 1 << 20, "{out2}");
    assert!(
        stored < 1_200_000,
        "v2 stored {stored} bytes (v1: {stored1})"
    );
    // v2 reads back right, through the parent's blob.
    let o = store.run(&["cat", "test/dedup:v2", "/f2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout, std::fs::read(v2.join("f2")).expect("read"));
    let o = store.run(&["cat", "test/dedup:v2", "/f1"]);
    assert_eq!(o.stdout, std::fs::read(v2.join("f1")).expect("read"));
}

#[test]
fn local_store_roundtrip_every_kind() {
    let dir = scratch("store");
    roundtrip(&StoreEnv::local(dir.path()));
}

#[test]
fn local_store_dedup_against_parent() {
    let dir = scratch("store");
    dedup(&StoreEnv::local(dir.path()));
}

#[test]
fn s3_roundtrip_and_dedup() {
    let Some(s3) = S3Server::start("strata") else {
        return;
    };
    let store = s3.store("strata", "rt");
    roundtrip(&store);
    dedup(&s3.store("strata", "dd"));
}

#[test]
fn tar_stream_from_stdin_keeps_whiteouts_in_upper_layers() {
    let dir = scratch("store");
    let store = StoreEnv::local(dir.path());
    let work = scratch("tar");
    let t = work.path().join("layer.tar");
    let py = format!(
        r#"
import tarfile, io
with tarfile.open({t:?}, "w", format=tarfile.PAX_FORMAT) as tf:
    def add(name, data=b"", **kw):
        ti = tarfile.TarInfo(name)
        for k, v in kw.items(): setattr(ti, k, v)
        ti.size = len(data) if ti.type == tarfile.REGTYPE else 0
        tf.addfile(ti, io.BytesIO(data) if ti.type == tarfile.REGTYPE else None)
    add("./etc/", type=tarfile.DIRTYPE, mode=0o755)
    add("./etc/.wh.gone")
    add("./opt/.wh..wh..opq")
    add("./opt/new", b"new file", mode=0o644)
    add("./etc/conf", b"x" * 100000, mode=0o600, uid=1234, gid=99)
"#,
        t = t.display().to_string()
    );
    let o = std::process::Command::new("python3")
        .args(["-c", &py])
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let data = std::fs::read(&t).expect("tar");
    let out = store.run_with_stdin(
        &["build", "--tar", "-", "--kind", "toolkit", "--json"],
        Some(&data),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["stats"]["whiteouts"].as_u64(), Some(1), "{v}");
    let layer = v["digest"].as_str().expect("digest");
    // The toolkit layer cannot be an image's bottom layer...
    let bad = store.run(&["compose", "--base", layer, "-t", "bad:v1"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    // ...but composes above a base, where the whiteout hides the base's file.
    let base = work.path().join("base");
    std::fs::create_dir_all(base.join("etc")).expect("mkdir");
    std::fs::create_dir_all(base.join("opt/old")).expect("mkdir");
    std::fs::write(base.join("etc/gone"), b"old").expect("write");
    std::fs::write(base.join("etc/kept"), b"kept").expect("write");
    let b = store.ok(&["build", base.to_str().expect("utf8")]);
    store.ok(&["compose", "--base", &b, "--toolkit", layer, "-t", "img:v1"]);
    let ls = store.ok(&["ls", "img:v1", "/etc"]);
    assert!(
        ls.contains("kept") && ls.contains("conf") && !ls.contains("gone"),
        "{ls}"
    );
    let ls = store.ok(&["ls", "img:v1", "/opt"]);
    assert!(ls.contains("new") && !ls.contains("old"), "{ls}");
    assert_eq!(store.ok(&["cat", "img:v1", "/etc/conf"]).len(), 100000);
    let e = json(&store.ok(&["ls", "--json", "img:v1", "/etc/conf"]));
    assert_eq!(
        (e[0]["uid"].as_u64(), e[0]["mode"].as_u64()),
        (Some(1234), Some(0o100600))
    );
}
