//! Prefetch for real: `strata trace` records what a command reads in an image as its plan; a node that
//! creates a sandbox of the image warms the plan in the background, so the traced reads are served even
//! once the store is gone, while reads outside the plan still need the store.

use std::path::Path;
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

#[test]
fn a_traced_plan_is_warmed_when_a_sandbox_is_created() {
    if !can_mount() {
        return;
    }
    let Some(s3) = S3Server::start("prefetch") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let mut store = s3.store("prefetch", "p");
    store.env[0].1 = format!("http://127.0.0.1:{}", proxy.port);
    let src = scratch("img");
    busybox_rootfs(src.path());
    let a = random_bytes(3 << 20, 21);
    let b = random_bytes(3 << 20, 22);
    std::fs::write(src.path().join("data/a.bin"), &a).expect("write");
    std::fs::write(src.path().join("data/b.bin"), &b).expect("write");
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "pf:v1"]);

    // Trace a run on one node.
    {
        let d = Daemon::start(&store, &[]);
        let out = json(&d.ok(&[
            "trace",
            "pf:v1",
            "--json",
            "--",
            "/bin/sh",
            "-c",
            "cat /data/a.bin > /dev/null",
        ]));
        assert_eq!(out["exit_code"].as_i64(), Some(0), "{out}");
        let chunks = out["chunks"].as_u64().expect("chunks");
        assert!(chunks >= 3, "a.bin alone is 3 chunks: {out}");
        assert!(out["bytes"].as_u64().expect("bytes") >= 3 << 20, "{out}");
        let ps = json(&d.ok(&["ps", "--json"]));
        assert_eq!(
            ps["sandboxes"].as_array().map(Vec::len),
            Some(0),
            "trace sandbox left: {ps}"
        );
        // One trace at a time per node.
        let client = strata_fs::api::Client {
            socket: d.socket.clone(),
        };
        client.call("POST", "/v1/trace/start", None).expect("start");
        let o = d.strata(&["trace", "pf:v1", "--", "/bin/true"]);
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("already running"),
            "{o:?}"
        );
        client.call("POST", "/v1/trace/stop", None).expect("stop");
        // A failing command still stores a plan, and reports the failure.
        let o = d.strata(&["trace", "pf:v1", "--", "/bin/sh", "-c", "exit 3"]);
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("status 3"),
            "{o:?}"
        );
        // Restore the plan of the first run.
        d.ok(&[
            "trace",
            "pf:v1",
            "--",
            "/bin/sh",
            "-c",
            "cat /data/a.bin > /dev/null",
        ]);
    }

    // A fresh node (empty cache) warms the plan when a sandbox is created.
    let d = Daemon::start(&store, &["--read-timeout", "2", "--max-fetch-span", "1M"]);
    let rootfs = d.ok(&["mount", "pf:v1", "--sandbox", "p1"]);
    let start = Instant::now();
    let warmed = loop {
        let ps = json(&d.ok(&["ps", "--json"]));
        let pf = ps["status"]["prefetch"].clone();
        let done = pf
            .as_object()
            .and_then(|m| m.values().next())
            .is_some_and(|w| w["done"].as_bool() == Some(true));
        if done {
            break pf;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "prefetch did not finish: {pf}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let w = warmed
        .as_object()
        .and_then(|m| m.values().next())
        .expect("one image");
    assert!(w["fetched"].as_u64().expect("fetched") >= 1, "{warmed}");
    assert_eq!(w["errors"].as_u64(), Some(0), "{warmed}");
    let metrics = strata_fs::api::Client {
        socket: d.socket.clone(),
    }
    .call("GET", "/metrics", None)
    .expect("metrics");
    let metrics = metrics.as_str().expect("text");
    assert!(metrics.contains("strata_prefetch_bytes_total"), "{metrics}");

    // The store goes away: the traced file reads from the cache, another file cannot be read.
    proxy.set_down(true);
    let root = Path::new(&rootfs);
    assert_eq!(
        std::fs::read(root.join("data/a.bin")).expect("a.bin from the cache"),
        a
    );
    let err = std::fs::read(root.join("data/b.bin")).expect_err("b.bin needs the store");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    proxy.set_down(false);
    assert_eq!(std::fs::read(root.join("data/b.bin")).expect("b.bin"), b);
}
