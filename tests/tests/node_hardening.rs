//! A node an operator cannot take down by mistake (issue 22): bad binaries at stratad's path (missing,
//! not executable, one that exits as it starts) under reading sandboxes — no failed read, the upgrade
//! exits non-zero within its timeout with the reason, the holder stays; a second daemon on the same
//! runtime directory is refused and the first keeps serving; node state is not readable by other users;
//! `/v1/status` names the live holder only.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_tests::readers::*;
use strata_tests::*;

/// Installs `from` at `bin` the way an operator would (copy, then rename over).
fn install(from: &Path, bin: &Path) {
    let tmp = bin.with_extension("new");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, bin).expect("install");
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `strata daemon upgrade --timeout T`: must fail, within T plus a little, saying why.
fn failed_upgrade(d: &Daemon, timeout: &str, says: &str) {
    let t = Instant::now();
    let out = d.strata(&["daemon", "upgrade", "--timeout", timeout]);
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the upgrade reported success: {err}");
    assert!(err.contains(says), "{says:?} not in: {err}");
    let limit: f64 = timeout.parse().expect("timeout");
    assert!(
        took < Duration::from_secs_f64(limit + 5.0),
        "upgrade took {took:?}"
    );
}

#[test]
fn bad_binaries_at_stratads_path_never_take_the_node_down() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = Arc::new(build_tree_image(&store, "tree:v1", 12));
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    let bin = d.use_copied_bin();
    d.stop();
    d.start_again(&["--cache-size", "1G"]);
    let holder = d.holder_pid();
    let rootfs: Vec<PathBuf> = (0..4)
        .map(|i| PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", &format!("s{i}")])))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let readers = start_readers(&rootfs, &files, &stop, &counts, Pages::Kept);
    let first = d.server_pid();

    // Not executable: refused before the serving server is touched.
    std::fs::write(bin.with_extension("new"), b"not a program").expect("write");
    std::fs::rename(bin.with_extension("new"), &bin).expect("install");
    failed_upgrade(&d, "10", "not upgraded");
    assert_eq!(d.server_pid(), first, "the serving server was replaced");
    // Missing.
    std::fs::remove_file(&bin).expect("rm");
    failed_upgrade(&d, "10", "not upgraded");
    // A crash with nothing at the path: the last working binary takes over.
    drop_caches();
    // SAFETY: killing the server this test's daemon started.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let second = d.wait_new_server(first);
    // Exits at once when started (it passes the version probe): the upgrade fails and says so, the
    // last working binary serves again.
    install(&broken_stratad_bin(), &bin);
    failed_upgrade(&d, "20", "upgrade failed");
    let third = d.wait_new_server(second);
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(
        status["holder_pid"].as_u64(),
        Some(u64::from(holder)),
        "{status}"
    );
    assert_eq!(status["holder"]["upgrade"]["ok"], false, "{status}");
    assert_eq!(
        status["holder"]["serving"], "last working binary",
        "{status}"
    );
    assert!(status["holder"]["failures"].as_u64() >= Some(2), "{status}");
    // A crash now (the broken binary still installed) is also survived.
    drop_caches();
    // SAFETY: as above.
    unsafe { libc::kill(third as i32, libc::SIGKILL) };
    d.wait_new_server(third);
    // A good binary again: the upgrade goes through.
    install(&stratad_bin(), &bin);
    let out = json(&d.ok(&["daemon", "upgrade", "--json", "--timeout", "30"]));
    assert!(out["pid"].as_u64().is_some(), "{out}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader");
    }
    let (reads, failed, wrong) = counts.get();
    eprintln!("bad binaries: {reads} reads, {failed} failed, {wrong} wrong");
    assert!(reads > 4 * files.len() as u64, "too few reads: {reads}");
    assert_eq!(
        (failed, wrong),
        (0, 0),
        "reads failed or returned wrong bytes"
    );
    assert!(alive(holder), "the holder exited");
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["holder"]["upgrade"]["ok"], true, "{status}");
    assert_eq!(status["holder"]["serving"], "installed", "{status}");
}

#[test]
fn a_second_daemon_on_the_same_runtime_dir_is_refused_and_the_first_keeps_serving() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = build_tree_image(&store, "tree:v1", 4);
    let d = Daemon::start(&store, &[]);
    let r = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a"]));
    let other_state = scratch("state2");
    for extra in [&[][..], &["--no-holder"][..]] {
        let out = std::process::Command::new(stratad_bin())
            .args([
                "--config",
                "/dev/null",
                "--store",
                &store.url,
                "--state-dir",
            ])
            .arg(other_state.path())
            .arg("--runtime-dir")
            .arg(&d.runtime)
            .args(extra)
            .output()
            .expect("second stratad");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a second stratad started: {err}");
        assert!(
            err.contains("runtime directory") && err.contains(&d.holder_pid().to_string()),
            "{err}"
        );
    }
    assert!(d.socket.exists(), "the first daemon's socket was removed");
    drop_caches();
    for (name, data) in &files {
        assert!(std::fs::read(r.join("data").join(name)).expect("read") == *data);
    }
    d.ok(&["daemon", "status"]);
}

#[test]
fn node_state_is_private_and_status_names_only_a_live_holder() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = scratch("img");
    busybox_rootfs(src.path());
    store.ok(&[
        "build",
        src.path().to_str().expect("utf8"),
        "-t",
        "sec:v1",
        "--env",
        "API_TOKEN=s3cr3t",
    ]);
    let d = Daemon::start(&store, &[]);
    d.ok(&["mount", "sec:v1", "--sandbox", "a"]);
    // The state directory open to everyone, as /var/lib/strata usually is.
    for p in [d.state.path().to_path_buf(), d.state.path().join("run")] {
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    }
    let mut secrets = 0;
    for e in walkdir::WalkDir::new(d.state.path().join("node")) {
        let e = e.expect("walk");
        if !e.file_type().is_file() {
            continue;
        }
        let p = e.path().to_str().expect("utf8");
        if std::fs::read_to_string(p).is_ok_and(|t| t.contains("s3cr3t")) {
            secrets += 1;
        }
        assert!(!as_nobody(&["cat", p]), "nobody read {p}");
    }
    assert!(
        secrets > 0,
        "the sandbox record (with the image's env) was not found"
    );
    for f in ["stratad.lock", "run/stratad.lock", "run/holder.json"] {
        let p = d.state.path().join(f);
        assert!(
            !as_nobody(&["cat", p.to_str().expect("utf8")]),
            "nobody read {f}"
        );
    }
    // The holder killed: the server keeps serving and stops naming it.
    let holder = d.holder_pid();
    let server = d.server_pid();
    // SAFETY: killing the holder this test started.
    unsafe { libc::kill(holder as i32, libc::SIGKILL) };
    let t = Instant::now();
    let status = loop {
        let s = json(&d.ok(&["daemon", "status"]));
        if s["holder_alive"] == false || t.elapsed() > Duration::from_secs(10) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status["holder_alive"], false, "{status}");
    assert!(status["holder_pid"].is_null(), "{status}");
    let out = d.strata(&["daemon", "upgrade", "--timeout", "5"]);
    assert!(
        !out.status.success(),
        "an upgrade without a holder succeeded"
    );
    // Clean up: the server tears the node down on SIGUSR1.
    // SAFETY: the server this test's holder started.
    unsafe { libc::kill(server as i32, libc::SIGUSR1) };
    let t = Instant::now();
    while alive(server) && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_upgrade_of_a_daemon_without_a_holder_is_refused_as_a_conflict() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let d = Daemon::start(&store, &["--no-holder"]);
    let out = d.strata(&["daemon", "upgrade", "--timeout", "5"]);
    let err = String::from_utf8_lossy(&out.stderr);
    // The control API's kind (conflict) is the exit code, and the message says why.
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("--no-holder"), "{err}");
}
