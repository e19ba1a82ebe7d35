//! One failing blob never stalls the rest: a real stratad on a real S3 server (moto) behind a proxy
//! that hangs every request for one blob — accepted, never answered.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

/// Builds an image of busybox and `n` files of `size` bytes named `<prefix>NN`; returns its blob's hex.
fn build(store: &StoreEnv, tag: &str, prefix: &str, n: usize, size: usize, seed: u32) -> String {
    let src = scratch("img");
    busybox_rootfs(src.path());
    for i in 0..n {
        let data = random_bytes(size, seed + i as u32);
        std::fs::write(
            src.path().join("data").join(format!("{prefix}{i:02}")),
            data,
        )
        .expect("write");
    }
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
    let v = json(&store.ok(&["inspect", tag, "--json"]));
    let d = v["layers"][0]["blobs"][0]["digest"]
        .as_str()
        .expect("blob digest");
    d.trim_start_matches("blake3:").to_string()
}

fn read_all(root: &Path, prefix: &str, n: usize) -> Duration {
    let t = Instant::now();
    for i in 0..n {
        std::fs::read(root.join("data").join(format!("{prefix}{i:02}"))).expect("healthy read");
    }
    t.elapsed()
}

#[test]
fn a_hung_blob_never_delays_another_and_fails_at_the_deadline() {
    if !can_mount() {
        return;
    }
    let Some(s3) = S3Server::start("hang") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let mut store = s3.store("hang", "p");
    store.env[0].1 = format!("http://127.0.0.1:{}", proxy.port);
    // One file per reader: a second reader of a file whose read failed would read it again.
    let hung = build(&store, "hung:v1", "h", 256, 16 << 10, 100);
    build(&store, "base:v1", "b", 16, 256 << 10, 300);
    build(&store, "healthy:v1", "b", 16, 256 << 10, 500);
    let deadline = 4.0;
    let d = Daemon::start(
        &store,
        &[
            "--read-timeout",
            "4",
            "--max-fetch-span",
            "1",
            "--no-prefetch",
        ],
    );
    let rh = PathBuf::from(d.ok(&["mount", "hung:v1", "--sandbox", "h"]));
    let rb = PathBuf::from(d.ok(&["mount", "base:v1", "--sandbox", "b"]));
    let rg = PathBuf::from(d.ok(&["mount", "healthy:v1", "--sandbox", "g"]));
    // The normal time of cold reads of a healthy blob, before anything hangs.
    let normal = read_all(&rb, "b", 16);
    proxy.set_hang(Some(hung.as_bytes()));
    let readers: Vec<_> = (0..256)
        .map(|i| {
            let p = rh.join("data").join(format!("h{i:02}"));
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = std::fs::read(&p);
                (t.elapsed(), r.map_err(|e| e.raw_os_error()))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = read_all(&rg, "b", 16);
    let results: Vec<_> = readers
        .into_iter()
        .map(|r| r.join().expect("reader"))
        .collect();
    eprintln!("healthy blob: {normal:?} alone, {during:?} beside 256 hung reads");
    assert!(
        during <= normal * 2 + Duration::from_millis(250),
        "a hung blob delayed another: {normal:?} alone, {during:?} beside it"
    );
    for (took, r) in &results {
        assert_eq!(r, &Err(Some(libc::EIO)), "a read of the hung blob");
        let s = took.as_secs_f64();
        assert!(
            s >= deadline * 0.9 && s < deadline + 3.0,
            "EIO after {s:.2} s, deadline {deadline} s"
        );
    }
    // The store back: once the fetches the hang held have timed out (the store's own deadline) and the
    // fail-fast second is over, the same files read.
    proxy.set_hang(None);
    read_when_back(
        &rh.join("data/h00"),
        Duration::from_secs_f64(deadline * 3.0),
    );
}
