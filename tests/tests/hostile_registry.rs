//! Imports from a hostile registry (issue 22, item 3: "a hostile registry fills the disk"): a layer
//! served without `Content-Length` used to be read past its declared size (11 GB in 26 s), a registry
//! trickling a byte now and then held an import forever, and a layer that claims more than the disk
//! holds was downloaded until the disk was full. Each case runs the CLI with a time limit (the child is
//! killed past it), so a regression fails instead of hanging or filling the disk.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use strata_tests::hostile::{Blob, HostileRegistry};
use strata_tests::*;

/// What a bounded run of the CLI did.
struct Run {
    /// `None`: killed at the limit.
    code: Option<i32>,
    stderr: String,
    took: Duration,
}

/// Runs `strata import REF -t hostile:v1 --plain-http ARGS` against `store`, killed after `limit`.
fn import(store: &StoreEnv, reg: &HostileRegistry, args: &[&str], limit: Duration) -> Run {
    let r = reg.reference();
    let mut c = Command::new(strata_bin());
    c.arg("--store").arg(&store.url);
    c.args(["import", &r, "-t", "hostile:v1", "--plain-http"])
        .args(args);
    for (k, v) in &store.env {
        c.env(k, v);
    }
    let err = scratch("stderr");
    let err_file = err.path().join("stderr");
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_file).expect("stderr file"));
    let start = Instant::now();
    let mut child = c.spawn().expect("spawn strata");
    let code = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st.code();
        }
        if start.elapsed() > limit {
            // Our own child, by its handle.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err_file).unwrap_or_default();
    Run {
        code,
        stderr,
        took: start.elapsed(),
    }
}

/// Bytes of the files in `dir` (not recursive; 0 when missing).
fn bytes_in(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn an_endless_body_is_cut_at_the_declared_size() {
    let sdir = scratch("hostile-store");
    let store = StoreEnv::local(sdir.path());
    let reg = HostileRegistry::start(Blob::Endless);
    let r = import(&store, &reg, &[], Duration::from_secs(60));
    let sent = reg.sent.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "endless: exit {:?} after {:?}, {sent} bytes of zeros sent: {}",
        r.code, r.took, r.stderr
    );
    assert_eq!(r.code, Some(5), "{}", r.stderr);
    assert!(
        r.stderr.contains("declared size"),
        "the error names the cause: {}",
        r.stderr
    );
    assert!(
        bytes_in(&sdir.path().join("tmp")) < 16 << 20,
        "the store's tmp/ holds {} bytes",
        bytes_in(&sdir.path().join("tmp"))
    );
    assert_eq!(store.run(&["inspect", "hostile:v1"]).status.code(), Some(3));
}

#[test]
fn a_trickling_registry_fails_at_the_request_deadline() {
    let sdir = scratch("hostile-store");
    let store = StoreEnv::local(sdir.path());
    let reg = HostileRegistry::start(Blob::Trickle(Duration::from_millis(500)));
    let r = import(
        &store,
        &reg,
        &["--registry-timeout", "3"],
        Duration::from_secs(60),
    );
    eprintln!(
        "trickle: exit {:?} after {:?}: {}",
        r.code, r.took, r.stderr
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("deadline"), "{}", r.stderr);
    assert!(
        r.took < Duration::from_secs(10),
        "failed after {:?} with a 3 s deadline",
        r.took
    );
}

#[test]
fn a_layer_claiming_more_than_the_disk_holds_is_refused_before_it_is_read() {
    let sdir = scratch("hostile-store");
    let store = StoreEnv::local(sdir.path());
    // A manifest and Content-Length that both claim a petabyte.
    let reg = HostileRegistry::start(Blob::Claims(1 << 50));
    let r = import(&store, &reg, &[], Duration::from_secs(60));
    let sent = reg.sent.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "claims: exit {:?} after {:?}, {sent} bytes sent: {}",
        r.code, r.took, r.stderr
    );
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("free"), "{}", r.stderr);
    assert_eq!(sent, 0, "the layer was downloaded");
}

#[test]
fn an_import_removes_what_killed_imports_left_in_tmp() {
    let sdir = scratch("hostile-store");
    let store = StoreEnv::local(sdir.path());
    let tmp = sdir.path().join("tmp");
    std::fs::create_dir_all(&tmp).expect("tmp");
    // A pid above the kernel's limit: no process owns these.
    let old = tmp.join("blob-2147483600-1700000000000000000.tmp");
    let young = tmp.join("blob-2147483601-1700000000000000001.tmp");
    std::fs::write(&old, vec![0u8; 1 << 20]).expect("write");
    std::fs::write(&young, vec![0u8; 1 << 10]).expect("write");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("time")
        .as_secs() as i64;
    set_mtime(&old, now - 2 * 3600, 0);
    let reg = HostileRegistry::start(Blob::Honest);
    let r = import(&store, &reg, &[], Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!old.exists(), "a leftover two hours old was kept");
    assert!(
        young.exists(),
        "a file younger than the grace period was removed"
    );
    store.ok(&["cat", "hostile:v1", "/etc/hello"]);
}
