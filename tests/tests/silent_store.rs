//! A store that accepts connections and never answers (issue 10: "fails a read after 60 s, twice the
//! documented read_timeout"): how long an uncached read through a sandbox's rootfs takes to fail.
//!
//! The store's range read returns `Timeout` at its deadline (see `store_conformance.rs`), but one 4 KiB
//! `pread` of an uncached file used to fail after 2 × `--read-timeout` (6.0 s with 3 s): the kernel reads
//! the page again after its readahead failed, and each FUSE read waited a whole deadline of its own. The
//! blob server now fails reads of a blob that just timed out at once, for a second.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

#[test]
fn an_uncached_read_from_a_silent_store_fails_at_the_deadline() {
    if !have(&[Need::Mount]) {
        return;
    }
    let Some(s3) = S3Server::start("silent") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let store = s3.store_via("silent", "p", proxy.port);
    let src = scratch("img");
    busybox_rootfs(src.path());
    std::fs::write(src.path().join("data/a.bin"), random_bytes(4 << 20, 3)).expect("write");
    store.ok(&[
        "build",
        src.path().to_str().expect("utf8"),
        "-t",
        "silent:v1",
    ]);
    let deadline = Duration::from_secs(3);
    let d = Daemon::start(&store, &["--read-timeout", "3", "--cache-size", "1G"]);
    let rootfs = d.ok(&["mount", "silent:v1", "--sandbox", "s1"]);
    let file = std::fs::File::open(Path::new(&rootfs).join("data/a.bin")).expect("open");
    proxy.set_silent(true);
    let mut took = Vec::new();
    for (what, at, len) in [
        ("4 KiB inside chunk 0", 0u64, 4096usize),
        ("8 KiB across chunks 1|2", (2 << 20) - 4096, 8192),
    ] {
        let mut buf = vec![0u8; len];
        let t = Instant::now();
        let r = file.read_at(&mut buf, at);
        let e = t.elapsed();
        eprintln!(
            "{what}: {:?} after {e:?}",
            r.as_ref().map_err(|e| e.raw_os_error())
        );
        assert!(r.is_err(), "{what}: read with a silent store");
        took.push((what, e));
    }
    proxy.set_silent(false);
    drop(file);
    d.ok(&["umount", "--sandbox", "s1"]);
    for (what, e) in took {
        assert!(
            e < deadline + Duration::from_millis(1500),
            "{what}: EIO after {e:?} with a read timeout of {deadline:?}"
        );
    }
}

/// Issue 22, item 5: `strata images`, `cat`, `gc` and `build` against a store that accepts and never
/// answers used to wait 120 s (whole-object reads, listings and writes had no deadline of their own).
/// Each now fails with exit 6 soon after `--store-timeout` (a build makes two calls that time out: the
/// index sync's listing, which only costs it dedup, and its first write).
#[test]
fn commands_fail_at_the_store_timeout_against_a_silent_store() {
    let Some(s3) = S3Server::start("quiet") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let store = s3.store_via("quiet", "p", proxy.port);
    build_image(&store, "quiet:v1", &[("a.bin", vec![1u8; 1000])]);
    let src = scratch("quiet-src");
    std::fs::write(src.path().join("f"), b"new").expect("write");
    let src = src.path().to_str().expect("utf8").to_string();
    proxy.set_silent(true);
    let timeout = Duration::from_secs(2);
    let cases: [(&[&str], u32); 4] = [
        (&["images"], 1),
        (&["cat", "quiet:v1", "/data/a.bin"], 1),
        (&["gc", "--grace", "0s"], 1),
        (&["build", &src, "-t", "quiet:v2"], 2),
    ];
    for (args, calls) in cases {
        let all = [&["--store-timeout", "2"], args].concat();
        let t = Instant::now();
        let o = store.run(&all);
        let took = t.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("{args:?}: exit {:?} after {took:?}: {err}", o.status.code());
        assert_eq!(o.status.code(), Some(6), "{args:?}: {err}");
        assert!(err.contains("no answer within"), "{args:?}: {err}");
        assert!(
            took < timeout * calls + Duration::from_secs(3),
            "{args:?}: failed after {took:?} with --store-timeout 2"
        );
    }
    proxy.set_silent(false);
}

/// Issue 22, item 5: `strata mount` of an image against a silent store fails soon after stratad's
/// `--store-timeout` (it waited 120 s), and stratad answers other requests meanwhile.
#[test]
fn a_mount_fails_at_the_store_timeout_and_the_daemon_stays_responsive() {
    if !have(&[Need::Mount]) {
        return;
    }
    let Some(s3) = S3Server::start("quietmount") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let store = s3.store_via("quietmount", "p", proxy.port);
    build_image(&store, "quiet:v1", &[("a.bin", vec![1u8; 1000])]);
    let d = Daemon::start(&store, &["--store-timeout", "2", "--read-timeout", "2"]);
    proxy.set_silent(true);
    let t = Instant::now();
    let took = std::thread::scope(|s| {
        let mount = s.spawn(|| {
            let o = d.strata(&["mount", "quiet:v1", "--sandbox", "q1"]);
            (o, t.elapsed())
        });
        // While the mount waits on the store, stratad answers.
        std::thread::sleep(Duration::from_millis(500));
        let p = Instant::now();
        d.ok(&["ps"]);
        let ps = p.elapsed();
        assert!(ps < Duration::from_secs(1), "ps took {ps:?} during a mount");
        let (o, took) = mount.join().expect("mount thread");
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("mount: exit {:?} after {took:?}: {err}", o.status.code());
        assert_eq!(o.status.code(), Some(6), "{err}");
        took
    });
    proxy.set_silent(false);
    assert!(
        took < Duration::from_secs(5),
        "mount failed after {took:?} with --store-timeout 2"
    );
}
