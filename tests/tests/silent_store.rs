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
