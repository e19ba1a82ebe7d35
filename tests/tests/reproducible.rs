//! Reproducible layers through the CLI: a CI job builds the same tree twice with the same `-t` (both
//! succeed, one digest, the second stores nothing), a store that held other builds names it the same, and
//! the rebuilt image reads back right (materialized, `fsck.erofs`, a kernel mount, `strata cat`). A tag
//! naming another image is refused as such, not blamed on concurrency. `build --exclude` leaves paths out.

use std::path::Path;

use strata_tests::*;

fn build(store: &StoreEnv, src: &Path, tag: &str) -> serde_json::Value {
    let src = src.to_str().expect("utf8");
    json(&store.ok(&["build", src, "-t", tag, "--json"]))
}

/// A tree with every kind of entry, and files large enough to be chunked into a blob.
fn source(root: &Path) {
    generate_tree(root);
    for i in 0..3u32 {
        std::fs::write(
            root.join(format!("big{i}.bin")),
            random_bytes(1_500_000 + i as usize * 77_777, 900 + i),
        )
        .expect("write");
    }
}

#[test]
fn the_same_tree_built_twice_with_one_tag_is_one_layer() {
    let work = scratch("repro");
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).expect("src");
    source(&src);
    let sdir = scratch("repro-store");
    let store = StoreEnv::local(sdir.path());

    let first = build(&store, &src, "ci/app:main");
    let second = build(&store, &src, "ci/app:main");
    assert_eq!(second["digest"], first["digest"], "{first}\n{second}");
    assert_eq!(second["image"], first["image"]);
    assert_eq!(second["reused"], true, "{second}");
    assert_eq!(second["stats"]["stored_bytes"], 0, "{second}");

    // Another store that already holds an unrelated build sharing a file: other placement, same layer.
    let other = work.path().join("other");
    std::fs::create_dir_all(&other).expect("other");
    std::fs::copy(src.join("big1.bin"), other.join("shared.bin")).expect("copy");
    std::fs::write(other.join("own"), random_bytes(300_000, 5)).expect("write");
    let busy_dir = scratch("repro-busy");
    let busy = StoreEnv::local(busy_dir.path());
    build(&busy, &other, "other:1");
    let third = build(&busy, &src, "ci/app:main");
    assert_eq!(third["digest"], first["digest"], "{third}");
    assert_eq!(third["reused"], false, "{third}");
    assert!(
        third["index"]["index_chunks"].as_u64().expect("index") > 0,
        "{third}"
    );

    // The second build's image reads back right.
    let tree = snapshot(&src);
    let layer = second["digest"].as_str().expect("digest");
    if let Some(m) = materialize_checked(&store, layer) {
        if have(&[Need::KernelErofs]) {
            let mnt = scratch("repro-mnt");
            let mounted = KernelMount::new(m.path(), mnt.path());
            let d = diff(&tree, &snapshot(&mounted.target));
            assert!(d.is_empty(), "kernel view differs:\n{}", d.join("\n"));
        }
    }
    for (s, tag) in [(&store, "ci/app:main"), (&busy, "ci/app:main")] {
        for i in 0..3u32 {
            let got = s.run(&["cat", tag, &format!("/big{i}.bin")]);
            assert!(got.status.success(), "{got:?}");
            assert!(
                got.stdout == random_bytes(1_500_000 + i as usize * 77_777, 900 + i),
                "big{i}.bin differs"
            );
        }
    }

    // Another tree under the same tag: refused (exit 4) as a tag naming another image, not a race.
    std::fs::write(src.join("changed"), "a change\n").expect("write");
    let o = store.run(&["build", src.to_str().expect("utf8"), "-t", "ci/app:main"]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("already names another image") && err.contains("--force"),
        "{err}"
    );
    assert!(!err.contains("concurrently"), "{err}");
}

/// `build --exclude` / `--exclude-from` (the matcher pack_diff uses): a repository's `.git` stays out, a
/// `!` pattern re-includes a file, the same from a directory and from a tar stream; a bad pattern is a
/// usage error (exit 2) naming it.
#[test]
fn build_excludes_paths_as_a_dockerignore_says() {
    let work = scratch("exclude");
    let src = work.path().join("repo");
    for (p, body) in [
        (".git/HEAD", "ref: refs/heads/main\n"),
        (".git/objects/ab/cdef", "object"),
        ("src/main.c", "int main(void) { return 0; }\n"),
        ("build.log", "noise"),
        ("logs/old.log", "noise"),
        ("important.log", "keep me"),
    ] {
        let path = src.join(p);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, body).expect("write");
    }
    let ignore = work.path().join(".dockerignore");
    std::fs::write(&ignore, "# the build context\n\n*.log\n!important.log\n").expect("write");
    let sdir = scratch("exclude-store");
    let store = StoreEnv::local(sdir.path());
    let s = src.to_str().expect("utf8");
    let from = ignore.to_str().expect("utf8");
    let check = |tag: &str| {
        for gone in ["/.git", "/.git/HEAD", "/build.log", "/logs/old.log"] {
            let o = store.run(&["cat", tag, gone]);
            assert_eq!(o.status.code(), Some(3), "{gone} is in {tag}: {o:?}");
        }
        assert_eq!(store.ok(&["cat", tag, "/important.log"]), "keep me");
        assert!(store.ok(&["cat", tag, "/src/main.c"]).contains("main"));
        assert!(
            store.run(&["ls", tag, "/logs"]).status.success(),
            "the directory stays"
        );
    };
    let dir = json(&store.ok(&[
        "build",
        s,
        "--exclude",
        ".git",
        "--exclude-from",
        from,
        "-t",
        "ex:dir",
        "--json",
    ]));
    check("ex:dir");
    let tar = std::process::Command::new("tar")
        .args(["-C", s, "-cf", "-", "."])
        .output()
        .expect("tar");
    let o = store.run_with_stdin(
        &[
            "build",
            "--tar",
            "-",
            "--exclude",
            ".git",
            "--exclude-from",
            from,
            "-t",
            "ex:tar",
        ],
        Some(&tar.stdout),
    );
    assert!(o.status.success(), "{o:?}");
    check("ex:tar");
    assert!(dir["digest"].is_string());

    let o = store.run(&["build", s, "--exclude", "src/[z-a]"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("exclude pattern \"src/[z-a]\""), "{err}");
    let o = store.run(&["build", s, "--exclude-from", "/nonexistent/.dockerignore"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
}
