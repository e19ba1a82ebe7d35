//! strata under a real containerd (Debian's 1.6): `strata-snapshotter` as its proxy snapshotter, a
//! strata-exported image in a loopback registry pulled lazily through the CRI plugin (its layers held
//! from stratad, never in containerd's content store) and run with `ctr`; a plain OCI image and a
//! `ctr image pull` beside it; the snapshotter and stratad killed while a container reads; images
//! removed and garbage collected, and stratad's layer mounts released.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_api::Client;
use strata_tests::containerd::{have_containerd, Containerd, Snapshotter};
use strata_tests::registry::Registry;
use strata_tests::{busybox_rootfs, can_mount, json, random_bytes, scratch, Daemon, StoreEnv};

/// Builds a two-layer image `ctd/app:v1` (busybox below, data above: `hello.txt`, 100 small files and
/// a cold 12 MiB file no test reads) and pushes it as `repo` with `strata export … docker://`
/// (strata annotations unless `plain`); returns the exported layer digests (the registry's blobs).
fn publish(store: &StoreEnv, registry: &Registry, repo: &str, plain: bool) -> Vec<String> {
    if store
        .run(&["inspect", "ctd/app:v1", "--json"])
        .status
        .success()
    {
        return export(store, registry, repo, plain);
    }
    let base = scratch("ctd-base");
    busybox_rootfs(base.path());
    store.ok(&[
        "build",
        p(base.path()),
        "-t",
        "ctd/base:v1",
        "--env",
        "PATH=/bin",
    ]);
    let data = scratch("ctd-data");
    let d = data.path().join("data");
    std::fs::create_dir_all(&d).expect("mkdir");
    std::fs::write(d.join("hello.txt"), "hello from strata\n").expect("write");
    for i in 0..100u32 {
        std::fs::write(d.join(format!("f{i:03}")), random_bytes(64 << 10, i + 1)).expect("write");
    }
    std::fs::write(d.join("cold.bin"), random_bytes(12 << 20, 999)).expect("write");
    let layer = store.ok(&["build", p(data.path()), "--kind", "workspace"]);
    store.ok(&[
        "compose",
        "--base",
        "ctd/base:v1",
        "--workspace",
        &layer,
        "-t",
        "ctd/app:v1",
    ]);
    export(store, registry, repo, plain)
}

/// Pushes `ctd/app:v1` to the registry with strata's own push (`strata export … docker://`); returns
/// its layer digests.
fn export(store: &StoreEnv, registry: &Registry, repo: &str, plain: bool) -> Vec<String> {
    let dest = format!("docker://{}/{repo}:v1", registry.host());
    let mut args = vec!["export", "ctd/app:v1", &dest, "--json"];
    if plain {
        args.push("--no-strata-annotations");
    }
    let out = json(&store.ok(&args));
    out["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["digest"].as_str().expect("digest").to_string())
        .collect()
}

/// Drops the page cache, so that reads reach stratad.
fn drop_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf8 path")
}

/// stratad's layer holds.
fn holds(d: &Daemon) -> Vec<Value> {
    let c = Client {
        socket: d.socket.clone(),
    };
    let v = c.call("GET", "/v1/layers", None).expect("GET /v1/layers");
    v.as_array().cloned().unwrap_or_default()
}

/// Compressed bytes stratad fetched from the store so far.
fn fetched(d: &Daemon) -> u64 {
    let c = Client {
        socket: d.socket.clone(),
    };
    let text = c.call("GET", "/metrics", None).expect("metrics");
    text.as_str()
        .unwrap_or("")
        .lines()
        .filter(|l| l.starts_with("strata_fetched_bytes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn stored_bytes(store: &StoreEnv) -> u64 {
    let v = json(&store.ok(&["inspect", "ctd/app:v1", "--json"]));
    v["stored_bytes"].as_u64().expect("stored_bytes")
}

fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

struct Node {
    // Dropped in this order: containers and containerd, the snapshotter, then stratad.
    ctd: Containerd,
    snap: Snapshotter,
    d: Daemon,
    registry: Registry,
    store: StoreEnv,
    _sdir: tempfile::TempDir,
}

fn node() -> Option<Node> {
    node_with(None)
}

/// A node whose registry wants `user` (htpasswd Basic auth), if given.
fn node_with(user: Option<(&str, &str)>) -> Option<Node> {
    if !can_mount() || !have_containerd() {
        return None;
    }
    let registry = Registry::start(user)?;
    let sdir = scratch("ctd-store");
    let store = StoreEnv::local(sdir.path());
    let d = Daemon::start(&store, &["--cache-size", "1G"]);
    let snap = Snapshotter::start(&d.socket);
    let ctd = Containerd::start(&snap.socket, &registry.host());
    Some(Node {
        ctd,
        snap,
        d,
        registry,
        store,
        _sdir: sdir,
    })
}

const RUN: &[&str] = &["run", "--rm", "--snapshotter", "strata"];

fn run(n: &Node, ns: &str, image: &str, id: &str, cmd: &[&str]) -> String {
    let mut args = RUN.to_vec();
    args.extend([image, id]);
    args.extend_from_slice(cmd);
    n.ctd.ok(ns, &args)
}

#[test]
fn strata_images_run_lazily_beside_plain_ones_and_gc_releases_their_layers() {
    let Some(n) = node() else { return };
    let started = Instant::now();
    let lazy_layers = publish(&n.store, &n.registry, "lazy/app", false);
    publish(&n.store, &n.registry, "plain/app", true);
    let lazy = format!("{}/lazy/app:v1", n.registry.host());
    let plain = format!("{}/plain/app:v1", n.registry.host());

    // The CRI plugin's pull: every strata layer held from stratad, none downloaded.
    let before = fetched(&n.d);
    let out = n.snap.pull(&n.ctd, &lazy);
    assert!(
        out.status.success(),
        "lazy pull: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        n.ctd.log_tail()
    );
    let h = holds(&n.d);
    assert_eq!(h.len(), 2, "one hold per layer: {h:?}");
    assert!(h.iter().all(|h| h["holder"]
        .as_str()
        .unwrap_or("")
        .starts_with("snapshotter:")));
    let content = n.ctd.ok("k8s.io", &["content", "ls", "-q"]);
    for l in &lazy_layers {
        assert!(
            !content.contains(l.as_str()),
            "layer {l} reached the content store:\n{content}"
        );
    }
    let got = run(&n, "k8s.io", &lazy, "lazy1", &["cat", "/data/hello.txt"]);
    assert_eq!(got, "hello from strata\n");
    let moved = fetched(&n.d) - before;
    let image = stored_bytes(&n.store);
    eprintln!("lazy run: fetched {moved} bytes of a {image}-byte image");
    assert!(moved * 3 < image, "fetched {moved} of {image} bytes");

    // A plain image through the same pull and snapshotter: unpacked into overlay snapshots.
    let out = n.snap.pull(&n.ctd, &plain);
    assert!(
        out.status.success(),
        "plain pull: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(holds(&n.d).len(), 2, "a plain image takes no strata layer");
    let got = run(
        &n,
        "k8s.io",
        &plain,
        "plain1",
        &["sh", "-c", "wc -c < /data/f007"],
    );
    assert_eq!(got.trim(), "65536");

    // `ctr image pull` (downloads everything, passes no labels): still runs on this snapshotter.
    n.ctd.ok(
        "default",
        &[
            "image",
            "pull",
            "--plain-http",
            "--snapshotter",
            "strata",
            &lazy,
        ],
    );
    let got = run(&n, "default", &lazy, "ctr1", &["cat", "/data/hello.txt"]);
    assert_eq!(got, "hello from strata\n");

    // Removing the images and collecting: the snapshots go, and with them stratad's layer mounts.
    let refs = n.ctd.ok("k8s.io", &["image", "ls", "-q"]);
    let mut args = vec!["image", "rm", "--sync"];
    args.extend(refs.lines());
    n.ctd.ok("k8s.io", &args);
    wait_until("holds released after GC", Duration::from_secs(20), || {
        holds(&n.d).is_empty()
    });
    let layers_dir = n.d.runtime.join("layers");
    let left: Vec<String> =
        n.d.mounts()
            .into_iter()
            .filter(|m| Path::new(m).starts_with(&layers_dir))
            .collect();
    assert!(left.is_empty(), "layer mounts left after GC: {left:?}");
    eprintln!("containerd test took {:?}", started.elapsed());
}

#[test]
fn containers_keep_reading_while_the_snapshotter_and_stratad_restart() {
    let Some(mut n) = node() else { return };
    publish(&n.store, &n.registry, "lazy/app", false);
    let lazy = format!("{}/lazy/app:v1", n.registry.host());
    let out = n.snap.pull(&n.ctd, &lazy);
    assert!(
        out.status.success(),
        "pull: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop_caches();
    // Each file read once, 50 ms apart: first reads, through stratad, across both restarts.
    let script = "n=0; for f in /data/f*; do if cat $f > /dev/null; then n=$((n+1)); \
                  else echo FAIL $f; fi; sleep 0.05; done; echo READ $n";
    let reader = Command::new("ctr")
        .arg("--address")
        .arg(&n.ctd.socket)
        .args(["-n", "k8s.io"])
        .args(RUN)
        .args([lazy.as_str(), "reader", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr run");
    std::thread::sleep(Duration::from_millis(1200));
    n.snap.kill_and_restart();
    std::thread::sleep(Duration::from_millis(800));
    drop_caches();
    let old = n.d.server_pid();
    // SAFETY: killing the stratad server this test started (its holder starts a successor).
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    n.d.wait_new_server(old);
    let out = reader.wait_with_output().expect("reader");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "reader: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("FAIL"), "reads failed: {text}");
    assert!(text.contains("READ 100"), "{text}");

    // Every snapshot is still there: a new container starts from the same committed layers.
    let got = run(&n, "k8s.io", &lazy, "after", &["cat", "/data/hello.txt"]);
    assert_eq!(got, "hello from strata\n");
    assert_eq!(holds(&n.d).len(), 2);
}

#[test]
fn the_cri_pull_takes_credentials_from_the_docker_config() {
    let Some(n) = node_with(Some(("carol", "pa55"))) else {
        return;
    };
    let cfg = scratch("ctd-docker-config");
    let host = n.registry.host();
    let store = StoreEnv {
        url: n.store.url.clone(),
        env: n
            .store
            .env
            .iter()
            .cloned()
            .chain([("DOCKER_CONFIG".into(), p(cfg.path()).to_string())])
            .collect(),
    };
    let login = ["login", host.as_str(), "-u", "carol", "--password-stdin"];
    let o = store.run_with_stdin(&login, Some(b"pa55\n"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    publish(&store, &n.registry, "auth/app", false);
    let image = format!("{host}/auth/app:v1");

    // Without credentials containerd is refused; with the docker config strata login wrote, the
    // PullImage request carries them.
    let out = n.snap.pull(&n.ctd, &image);
    assert!(
        !out.status.success(),
        "an anonymous pull of a private image"
    );
    let out = n
        .snap
        .pull_with_env(&n.ctd, &image, &[("DOCKER_CONFIG", cfg.path())]);
    assert!(
        out.status.success(),
        "pull with the docker config: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        n.ctd.log_tail()
    );
    let got = run(&n, "k8s.io", &image, "auth1", &["cat", "/data/hello.txt"]);
    assert_eq!(got, "hello from strata\n");
}
