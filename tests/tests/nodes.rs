//! Several nodes on one store (issue 23, point 4): what one node's trouble does to the others. Each node
//! is a stratad of its own (state, cache, FUSE connection) reaching the store through a proxy of its own
//! — its network route, which a test can cut.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

#[test]
fn a_node_cut_from_the_store_fails_fast_and_the_others_read_on() {
    if !have(&[Need::Mount]) {
        return;
    }
    let Some(s3) = S3Server::start("nodes") else {
        return;
    };
    let direct = s3.store("nodes", "p");
    let files = [
        ("a.bin", random_bytes(2 << 20, 21)),
        ("b.bin", random_bytes(2 << 20, 22)),
    ];
    build_image(&direct, "n:v1", &files);
    let (route_a, route_b) = (Proxy::start(s3.port), Proxy::start(s3.port));
    let via = |p: &Proxy| {
        let mut s = direct.clone();
        s.env[0].1 = format!("http://127.0.0.1:{}", p.port);
        s
    };
    let flags = ["--read-timeout", "2", "--max-fetch-span", "1M"];
    let (a, b) = (
        Daemon::start(&via(&route_a), &flags),
        Daemon::start(&via(&route_b), &flags),
    );
    let root_a = PathBuf::from(a.ok(&["mount", "n:v1", "--sandbox", "a"]));
    let root_b = PathBuf::from(b.ok(&["mount", "n:v1", "--sandbox", "b"]));
    // Node A's network is cut: its uncached read fails with EIO by the deadline, never hangs.
    route_a.set_down(true);
    let t = Instant::now();
    let err = std::fs::read(root_a.join("data/a.bin")).expect_err("read on the cut node");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "EIO took {:?}",
        t.elapsed()
    );
    // Nothing changes for node B, reading the same image meanwhile.
    for (name, want) in &files {
        let got = std::fs::read(root_b.join("data").join(name)).expect("read on the other node");
        assert!(got == *want, "{name} on node B");
    }
    // A's route back: it reads again, the same bytes.
    route_a.set_down(false);
    let got = std::fs::read(root_a.join("data/a.bin")).expect("read after the cut");
    assert!(got == files[0].1, "a.bin on node A after the cut");
}
