//! `strata mount`, `umount`, `bundle` and `ps` exit with the codes of docs/CLI.md for failures stratad
//! reports: the kind of each error crosses the control socket.

use std::path::Path;

use strata_tests::proxy::Proxy;
use strata_tests::*;

/// The exit code of `strata ARGS` against `d`, asserting it failed with `stderr` naming `needle`.
fn code(d: &Daemon, args: &[&str], needle: &str) -> i32 {
    let o = d.strata(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(needle), "strata {args:?}: {err}");
    o.status.code().expect("exit code")
}

#[test]
fn daemon_errors_map_to_the_documented_exit_codes() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "ok:v1", &[("x.bin", random_bytes(1 << 20, 1))]);
    // A second image whose manifest is corrupt in the store.
    build_image(&store, "rot:v1", &[("y.bin", random_bytes(1 << 20, 2))]);
    let manifest = store.ok(&["inspect", "rot:v1", "--json"]);
    let digest = json(&manifest)["digest"]
        .as_str()
        .expect("manifest digest")
        .trim_start_matches("blake3:")
        .to_string();
    let mpath = sdir.path().join(format!("manifests/{digest}.json"));
    let mut m = std::fs::read(&mpath).expect("manifest file");
    m.push(b' ');
    std::fs::write(&mpath, m).expect("corrupt manifest");

    let d = Daemon::start(&store, &[]);
    d.ok(&["mount", "ok:v1", "--sandbox", "a"]);
    assert_eq!(code(&d, &["mount", "nope:v1", "--sandbox", "b"], "nope"), 3);
    assert_eq!(
        code(&d, &["mount", "ok:v1", "--sandbox", ".bad"], ".bad"),
        2
    );
    assert_eq!(
        code(&d, &["mount", "Not A Ref!", "--sandbox", "b"], "Not A Ref"),
        2
    );
    assert_eq!(code(&d, &["mount", "ok:v1", "--sandbox", "a"], "a"), 4);
    assert_eq!(
        code(&d, &["mount", "rot:v1", "--sandbox", "b"], "corrupt"),
        5
    );
    assert_eq!(code(&d, &["umount", "--sandbox", "zz"], "zz"), 3);
    let bdir = scratch("bundle");
    let bundle = [
        "bundle",
        "ok:v1",
        "--sandbox",
        "a",
        bdir.path().to_str().expect("utf8"),
    ];
    assert_eq!(code(&d, &bundle, "a"), 4);
    d.ok(&["umount", "--sandbox", "a", "--purge"]);
    // Several sandboxes in one call: a rootfs a line, in order; --upper goes with one sandbox only.
    let out = d.ok(&["mount", "ok:v1", "--sandbox", "m1", "--sandbox", "m2"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].ends_with("m1/rootfs") && lines[1].ends_with("m2/rootfs"),
        "{out}"
    );
    assert!(Path::new(lines[1]).join("data/x.bin").exists());
    let two = [
        "mount",
        "ok:v1",
        "--sandbox",
        "m3",
        "--sandbox",
        "m4",
        "--upper",
        "/tmp/u",
    ];
    assert_eq!(code(&d, &two, "--upper"), 2);
}

#[test]
fn a_store_down_behind_the_daemon_exits_6() {
    if !can_mount() {
        return;
    }
    let Some(s3) = S3Server::start("down") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let mut store = s3.store("down", "p");
    store.env[0].1 = format!("http://127.0.0.1:{}", proxy.port);
    build_image(&store, "down:v1", &[("x.bin", random_bytes(1 << 20, 3))]);
    let d = Daemon::start(&store, &["--read-timeout", "2"]);
    proxy.set_down(true);
    let t = std::time::Instant::now();
    assert_eq!(code(&d, &["mount", "down:v1", "--sandbox", "s"], "down"), 6);
    eprintln!("store down reported after {:?}", t.elapsed());
    proxy.set_down(false);
    let rootfs = d.ok(&["mount", "down:v1", "--sandbox", "s"]);
    assert!(Path::new(&rootfs).join("data/x.bin").exists());
}

#[test]
fn no_daemon_is_a_plain_failure() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let o = store.run(&["--socket", "/nonexistent/stratad.sock", "ps"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot reach stratad"));
}
