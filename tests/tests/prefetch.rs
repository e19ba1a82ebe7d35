//! Prefetch for real: `strata trace` records what a command reads in an image as its plan (and in each
//! layer's plan); a node that creates a sandbox of the image — or of a new image sharing a traced layer —
//! warms the plan in the background, so the traced reads are served even once the store is gone, while
//! reads outside the plan still need the store.

use std::path::Path;
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

/// An S3 store behind a proxy that can be taken down, and an image tagged `tag` of busybox with two
/// 3 MiB files, `a.bin` and `b.bin` (seeded with `seed`, `seed + 1`); `None` without an S3 server. Bind
/// `_s3` where it is taken apart: the server stops when it is dropped.
struct Fixture {
    _s3: S3Server,
    proxy: Proxy,
    store: StoreEnv,
    src: tempfile::TempDir,
    a: Vec<u8>,
    b: Vec<u8>,
}

fn fixture(bucket: &str, tag: &str, seed: u32) -> Option<Fixture> {
    let s3 = S3Server::start(bucket)?;
    let proxy = Proxy::start(s3.port);
    let store = s3.store_via(bucket, "p", proxy.port);
    let src = scratch("img");
    busybox_rootfs(src.path());
    let a = random_bytes(3 << 20, seed);
    let b = random_bytes(3 << 20, seed + 1);
    std::fs::write(src.path().join("data/a.bin"), &a).expect("write");
    std::fs::write(src.path().join("data/b.bin"), &b).expect("write");
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
    Some(Fixture {
        _s3: s3,
        proxy,
        store,
        src,
        a,
        b,
    })
}

/// `strata trace IMAGE --json -- cat /data/a.bin` through `d`: its JSON answer.
fn trace_reading_a(d: &Daemon, image: &str) -> serde_json::Value {
    let cmd = ["/bin/sh", "-c", "cat /data/a.bin > /dev/null"];
    json(&d.ok(&[&["trace", image, "--json", "--"][..], &cmd[..]].concat()))
}

/// [`fixture`] whose image was traced once on a node of its own (reading `a.bin`), where the test can
/// mount; the trace wrote one layer plan.
fn traced(bucket: &str, tag: &str, seed: u32) -> Option<Fixture> {
    if !can_mount() {
        return None;
    }
    let f = fixture(bucket, tag, seed)?;
    let d = Daemon::start(&f.store, &[]);
    let out = trace_reading_a(&d, tag);
    assert_eq!(out["layer_plans"].as_u64(), Some(1), "{out}");
    Some(f)
}

#[test]
fn a_traced_plan_is_warmed_when_a_sandbox_is_created() {
    if !can_mount() {
        return;
    }
    let Some(Fixture {
        _s3,
        proxy,
        store,
        a,
        b,
        ..
    }) = fixture("prefetch", "pf:v1", 21)
    else {
        return;
    };

    // Trace a run on one node.
    {
        let d = Daemon::start(&store, &[]);
        let out = trace_reading_a(&d, "pf:v1");
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
        let client = strata_api::Client {
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
        trace_reading_a(&d, "pf:v1");
    }

    // A fresh node (empty cache) warms the plan when a sandbox is created.
    let (d, rootfs, w) = warmed_node(&store, "pf:v1");
    assert!(w["fetched"].as_u64().expect("fetched") >= 1, "{w}");
    assert_eq!(w["errors"].as_u64(), Some(0), "{w}");
    let metrics = strata_api::Client {
        socket: d.socket.clone(),
    }
    .call("GET", "/metrics", None)
    .expect("metrics");
    let metrics = metrics.as_str().expect("text");
    assert!(metrics.contains("strata_prefetch_bytes_total"), "{metrics}");

    // The store goes away: the traced file reads from the cache, another file cannot be read.
    planned_reads_survive_the_store(&proxy, &rootfs, &a);
    let root = Path::new(&rootfs);
    proxy.set_down(false);
    let got = read_when_back(&root.join("data/b.bin"), std::time::Duration::from_secs(10));
    assert_eq!(got, b);
}

/// Polls node `d`'s status until `f` holds (or panics after 30 s); returns the status.
fn wait_status(
    d: &Daemon,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let ps = json(&d.ok(&["ps", "--json"]));
        if f(&ps["status"]) {
            return ps["status"].clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: {}",
            ps["status"]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_plan_recorded_by_one_node_warms_the_next() {
    if !can_mount() {
        return;
    }
    let Some(Fixture {
        _s3,
        proxy,
        store,
        src,
        a,
        ..
    }) = fixture("record", "rec:v1", 31)
    else {
        return;
    };
    std::fs::write(src.path().join("data/c.bin"), b"another image").expect("write");
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "rec2:v1"]);

    // Node 1 records the first two seconds of the image's first sandbox; a.bin is read then.
    {
        let d = Daemon::start(&store, &["--record-plans", "2"]);
        let rootfs = d.ok(&["mount", "rec:v1", "--sandbox", "r1"]);
        wait_status(&d, "recording did not start", |s| {
            s["recording_plan"].is_string()
        });
        let ps = d.ok(&["ps"]);
        assert!(ps.contains("recording a prefetch plan"), "{ps}");
        assert_eq!(
            std::fs::read(Path::new(&rootfs).join("data/a.bin")).expect("a"),
            a
        );
        wait_status(&d, "plan not stored", |s| s["recording_plan"].is_null());
        // An explicit trace takes the recorder from a recording (another image, no plan yet).
        d.ok(&["mount", "rec2:v1", "--sandbox", "r2"]);
        wait_status(&d, "second recording did not start", |s| {
            s["recording_plan"].is_string()
        });
        d.ok(&["trace", "rec2:v1", "--", "/bin/true"]);
        let s = wait_status(&d, "recording not dropped", |s| {
            s["recording_plan"].is_null()
        });
        assert_eq!(s["trace"].as_bool(), Some(false), "{s}");
    }

    // Node 2, empty cache and no recording of its own, warms the recorded plan.
    let (_d, rootfs, w) = warmed_node(&store, "rec:v1");
    assert!(w["fetched"].as_u64().expect("fetched") >= 3, "{w}");
    planned_reads_survive_the_store(&proxy, &rootfs, &a);
}

#[test]
fn a_new_image_inherits_the_plans_of_its_layers() {
    // Image A, the base alone, is traced once.
    let Some(f) = traced("inherit", "base:v1", 41) else {
        return;
    };
    let (proxy, store, a) = (&f.proxy, &f.store, &f.a);
    // Image B: the base and a fresh workspace layer, never traced, with no plan of its own.
    let ws = scratch("inherit-ws");
    std::fs::create_dir_all(ws.path().join("work")).expect("mkdir");
    std::fs::write(ws.path().join("work/notes.txt"), b"a new task").expect("write");
    let layer = store.ok(&[
        "build",
        ws.path().to_str().expect("utf8"),
        "--kind",
        "workspace",
    ]);
    store.ok(&[
        "compose",
        "--base",
        "base:v1",
        "--workspace",
        &layer,
        "-t",
        "new:v1",
    ]);
    // A fresh node warms the base's plan for B's first sandbox.
    let (d, rootfs, w) = warmed_node(store, "new:v1");
    assert_eq!(w["source"].as_str(), Some("layers"), "{w}");
    assert_eq!(w["layers"].as_array().map(Vec::len), Some(1), "{w}");
    assert!(w["fetched"].as_u64().expect("fetched") >= 3, "{w}");
    assert!(d.ok(&["ps"]).contains("inherited: 1 layer plan"));
    // With the store cut, A's traced file reads in B's sandbox.
    planned_reads_survive_the_store(proxy, &rootfs, a);
}

#[test]
fn a_rebuilt_base_inherits_the_plan_of_the_base_it_replaces() {
    let Some(f) = traced("rebuilt", "base:v1", 51) else {
        return;
    };
    let (proxy, store, src, a) = (&f.proxy, &f.store, &f.src, &f.a);
    // The base rebuilt with one file more: a new layer (no plan of its own) whose unchanged chunks the
    // store-wide index found in the first build's blob.
    std::fs::write(src.path().join("data/c.txt"), b"added by the rebuild").expect("write");
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "base:v2"]);
    let layer = |tag: &str| {
        let m = json(&store.ok(&["inspect", tag, "--json"]));
        let blobs: Vec<String> = m["layers"][0]["blobs"]
            .as_array()
            .expect("blobs")
            .iter()
            .filter_map(|b| Some(b["digest"].as_str()?.to_string()))
            .collect();
        (m["layers"][0]["digest"].to_string(), blobs)
    };
    let (old, new) = (layer("base:v1"), layer("base:v2"));
    assert_ne!(old.0, new.0, "a new layer");
    assert!(
        new.1.contains(&old.1[0]),
        "names the first build's blob: {new:?}"
    );
    // The first base goes, and gc with it its layer's plan pointer; the blob's pointer stays.
    store.ok(&["rmi", "base:v1"]);
    store.ok(&["gc", "--grace", "0s"]);
    let (d, rootfs, w) = warmed_node(store, "base:v2");
    assert_eq!(w["source"].as_str(), Some("layers"), "{w}");
    assert!(w["fetched"].as_u64().expect("fetched") >= 3, "{w}");
    assert!(d.ok(&["ps"]).contains("inherited: 1 layer plan"));
    planned_reads_survive_the_store(proxy, &rootfs, a);
}

/// A fresh node (empty cache) creates a sandbox of `tag` and warms its plan; returns the node, the
/// sandbox's rootfs and the warming's status.
fn warmed_node(store: &StoreEnv, tag: &str) -> (Daemon, String, serde_json::Value) {
    let d = Daemon::start(store, &["--read-timeout", "2", "--max-fetch-span", "1M"]);
    let rootfs = d.ok(&["mount", tag, "--sandbox", "warm1"]);
    let s = wait_status(&d, "the plan was not warmed", |s| {
        s["prefetch"]
            .as_object()
            .and_then(|m| m.values().next())
            .is_some_and(|w| w["done"].as_bool() == Some(true))
    });
    let w = s["prefetch"]
        .as_object()
        .and_then(|m| m.values().next())
        .expect("one image")
        .clone();
    let ps = d.ok(&["ps"]);
    assert!(ps.contains("chunks planned") && ps.contains("done"), "{ps}");
    (d, rootfs, w)
}

/// With the store down, `a.bin` (planned) reads from the cache and `b.bin` (not planned) fails with EIO;
/// the store is left down.
fn planned_reads_survive_the_store(proxy: &Proxy, rootfs: &str, a: &[u8]) {
    proxy.set_down(true);
    let root = Path::new(rootfs);
    assert_eq!(
        std::fs::read(root.join("data/a.bin")).expect("a.bin from the cache"),
        a
    );
    let err = std::fs::read(root.join("data/b.bin")).expect_err("b.bin needs the store");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}
