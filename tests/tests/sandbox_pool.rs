//! Sandboxes made ahead (`stratad --sandbox-pool N`, `fs/src/control/pool.rs`), for real: a create
//! takes one (its directories where a sandbox's belong, the image's files, its own writes), the pool
//! is topped up again, a server that starts afresh leaves none of an earlier one's behind, and the
//! last sandbox's removal takes them with it so that the layer goes at once too; a create whose
//! record cannot be written fails and leaves nothing behind, made ahead or made anew.

use std::path::Path;
use std::time::{Duration, Instant};

use strata_tests::*;

/// Waits up to 20 s for `ok` on the daemon's status.
fn until(d: &Daemon, what: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let s = json(&d.ok(&["daemon", "status"]));
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ready sandboxes of any image.
fn ready(s: &serde_json::Value) -> u64 {
    s["pool"]["ready"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum())
}

/// Mount points below `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|p| p.starts_with(&dir))
        .collect()
}

/// A store holding `bb:v1` (its blob made from `seed`) and a daemon keeping two sandboxes made ahead:
/// its first sandbox, `a`, is made as always, then two more are made ahead. `None` without mounts and
/// bubblewrap.
fn two_made_ahead(seed: u32) -> Option<(tempfile::TempDir, StoreEnv, Daemon)> {
    if !have(&[Need::Mount, Need::Bwrap]) {
        return None;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(
        &store,
        "bb:v1",
        &[("blob.bin", random_bytes(1 << 20, seed))],
    );
    let d = Daemon::start(&store, &["--sandbox-pool", "2"]);
    d.ok(&["mount", "bb:v1", "--sandbox", "a"]);
    until(&d, "two made ahead", |s| ready(s) == 2);
    Some((sdir, store, d))
}

#[test]
fn creates_take_sandboxes_made_ahead_and_the_last_removal_takes_the_rest() {
    let Some((_sdir, _store, mut d)) = two_made_ahead(7) else {
        return;
    };
    let pool_run = d.runtime.join("sandboxes/.pool");
    let pool_state = d.state.path().join("sandboxes/.pool");
    assert_eq!(mounts_under(&pool_run).len(), 2);

    // The next create takes one: where a sandbox's directories belong, with the image's files.
    let rb = d.ok(&["mount", "bb:v1", "--sandbox", "b"]);
    assert_eq!(Path::new(&rb), d.runtime.join("sandboxes/b/rootfs"));
    let o = bwrap(Path::new(&rb), &["/bin/cat", "/etc/os-release"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ID=strata-test\n");
    let o = bwrap(Path::new(&rb), &["/bin/sh", "-c", "echo mine > /root/new"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let upper = d.state.path().join("sandboxes/b/upper");
    assert_eq!(
        std::fs::read_to_string(upper.join("root/new")).expect("written in b's upper"),
        "mine\n"
    );
    let ps = json(&d.ok(&["ps", "--json"]));
    let b = ps["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"] == "b"))
        .cloned()
        .expect("b listed");
    assert_eq!(b["upper"].as_str(), upper.to_str());
    assert_eq!(b["state"], "running");
    assert_eq!(ps["sandboxes"].as_array().map(Vec::len), Some(2), "{ps}");
    let ra = d.runtime.join("sandboxes/a/rootfs");
    assert!(!ra.join("root/new").exists(), "b's write showed in a");
    // And it was replaced.
    until(&d, "the pool topped up", |s| ready(s) == 2);

    // Eight creates at once: some take ready ones, the rest are made; each its own.
    let roots: Vec<String> = std::thread::scope(|t| {
        let d = &d;
        let made: Vec<_> = (0..8)
            .map(|i| t.spawn(move || d.ok(&["mount", "bb:v1", "--sandbox", &format!("p{i}")])))
            .collect();
        made.into_iter()
            .map(|h| h.join().expect("create"))
            .collect()
    });
    for (i, r) in roots.iter().enumerate() {
        let o = bwrap(
            Path::new(r),
            &[
                "/bin/sh",
                "-c",
                &format!("echo {i} > /root/me && cat /etc/os-release"),
            ],
        );
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            "ID=strata-test\n",
            "p{i}"
        );
    }
    for (i, r) in roots.iter().enumerate() {
        let me = std::fs::read_to_string(Path::new(r).join("root/me")).expect("own file");
        assert_eq!(me.trim(), i.to_string(), "p{i} saw another sandbox's write");
    }
    d.ok(&["rm", "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"]);
    until(&d, "the pool topped up after the eight", |s| ready(s) == 2);

    // A successor of a killed server detaches and deletes what the dead one made ahead, keeps its
    // sandboxes running, and makes its own once asked for one.
    d.kill_server();
    let s = until(&d, "the successor", |s| s["pool"]["size"] == 2);
    assert_eq!(ready(&s), 0, "{s}");
    assert_eq!(s["running"].as_u64(), Some(2), "{s}");
    assert!(mounts_under(&pool_run).is_empty());
    let o = bwrap(Path::new(&rb), &["/bin/cat", "/root/new"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "mine\n");
    d.ok(&["mount", "bb:v1", "--sandbox", "c"]);
    until(&d, "made ahead again", |s| ready(s) == 2);

    // A stop tears the node down with the ready ones.
    let left = d.stop();
    assert!(left.is_empty(), "a stop left mounts: {left:?}");
    d.start_again(&["--sandbox-pool", "2"]);
    d.ok(&["mount", "bb:v1", "--sandbox", "c", "--resume"]);
    until(&d, "made ahead after the stop", |s| ready(s) == 2);

    // Removing the last sandbox of the image takes the ready ones with it, and the layer goes with
    // it: by the time the removal answers.
    d.ok(&["rm", "a", "b", "c"]);
    let s = json(&d.ok(&["daemon", "status"]));
    assert_eq!(ready(&s), 0, "{s}");
    assert_eq!(s["layers"].as_array().map(Vec::len), Some(0), "{s}");
    assert!(mounts_under(&pool_run).is_empty(), "{s}");
    let end = Instant::now() + Duration::from_secs(10);
    while pool_state.read_dir().is_ok_and(|mut r| r.next().is_some()) {
        assert!(Instant::now() < end, "ready sandboxes' directories left");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_create_whose_record_cannot_be_written_leaves_nothing_in_the_way() {
    let Some((_sdir, store, mut d)) = two_made_ahead(8) else {
        return;
    };
    let pool_run = d.runtime.join("sandboxes/.pool");
    let refs = |s: &serde_json::Value| s["layers"][0]["refs"].as_u64();
    let before = json(&d.ok(&["daemon", "status"]));

    // A directory where x's record goes: the record's rename fails, and only it.
    let record = d.state.path().join("node/sandboxes/x.json");
    std::fs::create_dir_all(record.join("in-the-way")).expect("a directory in the record's place");
    let out = d.strata(&["mount", "bb:v1", "--sandbox", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the create succeeded without its record"
    );
    assert!(err.contains("x.json"), "the error names the record: {err}");

    // The ready sandbox it took is gone whole: not mounted under x, not listed, its directories and
    // its hold on the layer released; the pool makes another.
    assert!(mounts_under(&d.runtime.join("sandboxes/x")).is_empty());
    assert!(!d.state.path().join("sandboxes/x").exists());
    let ps = json(&d.ok(&["ps", "--json"]));
    assert_eq!(ps["sandboxes"].as_array().map(Vec::len), Some(1), "{ps}");
    let s = until(&d, "the pool topped up", |s| ready(s) == 2);
    assert_eq!(refs(&s), refs(&before), "{s}");
    assert_eq!(mounts_under(&pool_run).len(), 2);

    // With the way clear, the same create works.
    std::fs::remove_dir_all(&record).expect("clear the record's place");
    let rx = d.ok(&["mount", "bb:v1", "--sandbox", "x"]);
    let o = bwrap(Path::new(&rx), &["/bin/cat", "/etc/os-release"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ID=strata-test\n");

    // A sandbox made anew (an image with none running: none made ahead) fails the same way and
    // leaves nothing that stops the create from being tried again.
    build_image(&store, "cc:v1", &[("other.bin", random_bytes(1 << 16, 9))]);
    let record = d.state.path().join("node/sandboxes/y.json");
    std::fs::create_dir_all(record.join("in-the-way")).expect("a directory in the record's place");
    let out = d.strata(&["mount", "cc:v1", "--sandbox", "y"]);
    assert!(
        !out.status.success(),
        "the create succeeded without its record"
    );
    std::fs::remove_dir_all(&record).expect("clear the record's place");
    let ry = d.ok(&["mount", "cc:v1", "--sandbox", "y"]);
    let o = bwrap(Path::new(&ry), &["/bin/cat", "/etc/os-release"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ID=strata-test\n");

    // A resume of a sandbox whose record is gone (its upper directory left) that cannot write its
    // record keeps what the sandbox wrote: only what a create made is undone.
    let o = bwrap(Path::new(&ry), &["/bin/sh", "-c", "echo kept > /root/kept"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    d.ok(&["umount", "--sandbox", "y"]);
    let left = d.stop();
    assert!(left.is_empty(), "a stop left mounts: {left:?}");
    std::fs::remove_file(&record).expect("the stopped sandbox's record");
    std::fs::create_dir_all(record.join("in-the-way")).expect("a directory in the record's place");
    d.start_again(&["--sandbox-pool", "2"]);
    let out = d.strata(&["mount", "cc:v1", "--sandbox", "y", "--resume"]);
    assert!(
        !out.status.success(),
        "the resume succeeded without its record"
    );
    let kept = d.state.path().join("sandboxes/y/upper/root/kept");
    assert!(
        kept.exists(),
        "a failed resume deleted the sandbox's writes"
    );
    std::fs::remove_dir_all(&record).expect("clear the record's place");
    let ry = d.ok(&["mount", "cc:v1", "--sandbox", "y", "--resume"]);
    let o = bwrap(Path::new(&ry), &["/bin/cat", "/root/kept"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "kept\n");
    d.ok(&["rm", "a", "x", "y"]);
    let left = d.stop();
    assert!(left.is_empty(), "a stop left mounts: {left:?}");
}
