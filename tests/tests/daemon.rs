//! The node daemon for real: kernel EROFS layers over the FUSE blob server, overlays per sandbox,
//! bubblewrap and runc running commands in them, a local store and a real S3 server (moto) behind a
//! proxy that can be taken down, corrupted blobs, a cache smaller than the working set, clean stops.

use std::path::Path;
use std::time::{Duration, Instant};

use strata_tests::proxy::Proxy;
use strata_tests::*;

#[test]
fn sandboxes_share_layers_and_run_bwrap_and_runc() {
    if !have(&[Need::Mount, Need::Bwrap, Need::Runc]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "bb:v1", &[("blob.bin", random_bytes(3 << 20, 1))]);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    let r1 = d.ok(&["mount", "bb:v1", "--sandbox", "sb1"]);
    let r2 = d.ok(&["mount", "bb:v1", "--sandbox", "sb2"]);
    let o = bwrap(Path::new(&r1), &["/bin/cat", "/etc/os-release"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ID=strata-test\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = bwrap(Path::new(&r1), &["/bin/md5sum", "/data/blob.bin"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Writes land in the sandbox's upper directory only.
    let o = bwrap(
        Path::new(&r1),
        &[
            "/bin/sh",
            "-c",
            "echo mine > /root/new && rm /etc/os-release",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ps = json(&d.ok(&["ps", "--json"]));
    let sb1 = &ps["sandboxes"].as_array().expect("sandboxes")[0];
    let upper = Path::new(sb1["upper"].as_str().expect("upper"));
    assert_eq!(
        std::fs::read_to_string(upper.join("root/new")).expect("upper file"),
        "mine\n"
    );
    assert!(
        !Path::new(&r2).join("root/new").exists(),
        "write leaked into another sandbox"
    );
    assert!(Path::new(&r2).join("etc/os-release").exists());
    // One layer mount shared by both.
    let layers = ps["status"]["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1);
    assert_eq!(layers[0]["refs"].as_u64(), Some(2));
    assert!(held(&ps["status"]).1 > 0, "nothing held: {}", ps["status"]);
    scrubs_find_nothing_bad(&d);
    fetches_are_charged_to_the_reader(sb1, &ps["status"]);
    reads_waits_are_measured(&d);

    runc_runs_a_bundle(&d, "sb3");

    for sb in ["sb1", "sb3"] {
        d.ok(&["umount", "--sandbox", sb]);
    }
    assert!(
        upper.exists(),
        "umount without --purge keeps the upper directory"
    );
    let up2 = ps["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"] == "sb2"))
        .and_then(|s| s["upper"].as_str())
        .map(std::path::PathBuf::from)
        .expect("sb2 upper");
    d.ok(&["umount", "--sandbox", "sb2", "--purge"]);
    assert!(!up2.exists(), "--purge left {}", up2.display());
    let ps = json(&d.ok(&["ps", "--json"]));
    assert_eq!(ps["status"]["layers"].as_array().map(|l| l.len()), Some(0));
    let o = d.strata(&["umount", "--sandbox", "sb1"]);
    assert!(!o.status.success());
    let o = d.strata(&["mount", "nope:v1", "--sandbox", "x"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nope"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A stop with a sandbox mounted leaves no mounts.
    d.ok(&["mount", "bb:v1", "--sandbox", "sb4"]);
    assert_eq!(
        d.stop(),
        Vec::<String>::new(),
        "mounts left behind after SIGTERM"
    );
}

/// What the node holds checks out at rest (the chunk cache, or the view files in fanotify mode), and the
/// status keeps the last report; scrubs asked for at once run one at a time, each a whole report.
fn scrubs_find_nothing_bad(d: &Daemon) {
    let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
    assert!(scrub["chunks"].as_u64().unwrap_or(0) > 0, "{scrub}");
    assert_eq!(scrub["bad"].as_u64(), Some(0), "{scrub}");
    // The status keeps the last scrub's report (what the daily one found, for an operator).
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["scrub"], scrub, "{status}");
    // Scrubs asked for at once run one at a time, each answering a whole report.
    let both: Vec<serde_json::Value> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| json(&d.ok(&["daemon", "scrub", "--json"]))))
            .collect();
        hs.into_iter().map(|h| h.join().expect("scrub")).collect()
    });
    for r in &both {
        assert_eq!(r["bad"].as_u64(), Some(0), "{r}");
        assert!(r["chunks"].as_u64() >= scrub["chunks"].as_u64(), "{r}");
    }
}

/// Charged to `sb1` (bytes fetched and reads' waits), whose process read (file and fuse modes: the FUSE
/// request carries its pid); in loop
/// mode the kernel's loop workers read, so the misses are the node's unattributed fetches (docs/API.md,
/// fetched_unattributed).
fn fetches_are_charged_to_the_reader(sb1: &serde_json::Value, status: &serde_json::Value) {
    let charged = sb1["fetched_bytes"].as_u64().expect("fetched");
    let unattributed = status["fetched_unattributed"].as_u64().unwrap_or(0);
    if status["mount_mode"] == "loop" {
        assert!(charged + unattributed > 0, "nothing fetched");
    } else {
        assert!(
            charged > 0,
            "nothing charged to sb1 in {} mode",
            status["mount_mode"]
        );
        // Its reads waited for those fetches: charged to it too.
        let waited = sb1["read_wait_seconds"]
            .as_f64()
            .expect("read_wait_seconds");
        assert!(waited > 0.0, "no wait charged to sb1: {sb1}");
        assert!(sb1.get("read_wait_us").is_none(), "{sb1}");
    }
}

/// Every read that fetched a chunk itself is one miss and one `led` wait in `/metrics`.
fn reads_waits_are_measured(d: &Daemon) {
    let text = d.metrics();
    let sum = |prefix: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let led = sum("strata_read_wait_seconds_count{outcome=\"led\"}");
    assert!(led >= 1, "no led wait: {text}");
    assert_eq!(led, sum("strata_cache_misses_total{"), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
}

/// `strata bundle` writes a bundle runc runs from.
fn runc_runs_a_bundle(d: &Daemon, sandbox: &str) {
    let bdir = scratch("bundle");
    d.ok(&[
        "bundle",
        "bb:v1",
        "--sandbox",
        sandbox,
        bdir.path().to_str().expect("utf8"),
    ]);
    let cfg_path = bdir.path().join("config.json");
    let mut cfg = json(&std::fs::read_to_string(&cfg_path).expect("config.json"));
    cfg["process"]["args"] = serde_json::json!(["/bin/cat", "/etc/os-release"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let o = std::process::Command::new("runc")
        .args([
            "run",
            "--bundle",
            bdir.path().to_str().expect("utf8"),
            &format!("strata-test-{sandbox}"),
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("runc (apt-get install runc)");
    assert!(
        o.status.success(),
        "runc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ID=strata-test\n");
}

#[test]
fn merged_rootfs_equals_source_entry_by_entry() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = scratch("src");
    generate_tree(src.path());
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "tree:v1"]);
    let d = Daemon::start(&store, &[]);
    let rootfs = d.ok(&["mount", "tree:v1", "--sandbox", "t1"]);
    let mut want = snapshot(src.path());
    let mut got = snapshot(Path::new(&rootfs));
    // The overlay's root shows the upper directory's attributes, which the daemon took from the image's
    // root; xattrs of the image's root are not carried over.
    for t in [&mut want, &mut got] {
        if let Some(r) = t.get_mut(&Vec::new()) {
            r.xattrs.clear();
        }
    }
    let d2 = diff(&want, &got);
    assert!(d2.is_empty(), "merged rootfs differs:\n{}", d2.join("\n"));
}

#[test]
fn s3_lazy_reads_survive_a_store_outage_within_the_deadline() {
    if !have(&[Need::Mount, Need::Bwrap, Need::Runc]) {
        return;
    }
    let Some(s3) = S3Server::start("lazy") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let mut store = s3.store("lazy", "p");
    store.env[0].1 = format!("http://127.0.0.1:{}", proxy.port);
    let a = random_bytes(2 << 20, 7);
    let b = random_bytes(2 << 20, 8);
    build_image(
        &store,
        "lazy:v1",
        &[
            ("a.bin", a.clone()),
            ("b.bin", b.clone()),
            ("big.bin", random_bytes(16 << 20, 9)),
        ],
    );
    let flags = ["--read-timeout", "2", "--max-fetch-span", "1M"];
    let mut d = Daemon::start(&store, &flags);
    let rootfs = d.ok(&["mount", "lazy:v1", "--sandbox", "l1"]);
    let root = Path::new(&rootfs);
    assert_eq!(std::fs::read(root.join("data/a.bin")).expect("read a"), a);
    // bubblewrap and runc run the image's busybox, fetched from S3 on first use.
    let o = bwrap(root, &["/bin/cat", "/etc/os-release"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ID=strata-test\n",
        "{o:?}"
    );
    runc_reads_a_bundle_of_the_lazy_image(&d);
    // Lazy: far less than the image was fetched.
    let ps = json(&d.ok(&["ps", "--json"]));
    let s = &ps["sandboxes"][0];
    let (fetched, size) = (
        s["fetched_bytes"].as_u64().expect("f"),
        s["image_bytes"].as_u64().expect("s"),
    );
    assert!(fetched < size / 3, "fetched {fetched} of {size}");

    an_outage_fails_uncached_reads_in_time_only(&proxy, root, &a, &b);
    let m = d.strata(&["ps"]);
    assert!(m.status.success());

    // The chunk cache outlives the daemon: after a restart, what was read before reads with the store
    // down (the mount itself needs the store: tag, manifest, tables of contents).
    d.restart(&flags);
    let ps = json(&d.ok(&["ps", "--json"]));
    assert!(
        held(&ps["status"]).1 > 0,
        "cache empty after a restart: {ps}"
    );
    let rootfs = d.ok(&["mount", "lazy:v1", "--sandbox", "l3"]);
    let root = Path::new(&rootfs);
    proxy.set_down(true);
    std::fs::write("/proc/sys/vm/drop_caches", "3").ok();
    assert_eq!(
        std::fs::read(root.join("data/a.bin")).expect("read from the cache of the last run"),
        a
    );
    let err = std::fs::read(root.join("data/big.bin")).expect_err("never read, store down");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    proxy.set_down(false);
}

/// runc runs the image's busybox through `strata bundle`, reading a file fetched from S3.
fn runc_reads_a_bundle_of_the_lazy_image(d: &Daemon) {
    let bdir = scratch("bundle");
    let bpath = bdir.path().to_str().expect("utf8");
    d.ok(&["bundle", "lazy:v1", "--sandbox", "l2", bpath]);
    let cfg_path = bdir.path().join("config.json");
    let mut cfg = json(&std::fs::read_to_string(&cfg_path).expect("config.json"));
    cfg["process"]["args"] = serde_json::json!(["/bin/md5sum", "/data/a.bin"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let o = std::process::Command::new("runc")
        .args(["run", "--bundle", bpath, "strata-test-s3-l2"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("runc");
    assert!(
        o.status.success(),
        "runc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    d.ok(&["umount", "--sandbox", "l2"]);
}

/// Store down: an uncached read fails with EIO within the deadline, cached data still reads; store back:
/// reads work again.
fn an_outage_fails_uncached_reads_in_time_only(proxy: &Proxy, root: &Path, a: &[u8], b: &[u8]) {
    // Store down: an uncached read fails with EIO within the deadline; cached data still reads.
    proxy.set_down(true);
    let t = Instant::now();
    let err = std::fs::read(root.join("data/b.bin")).expect_err("read with the store down");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "EIO took {:?}",
        t.elapsed()
    );
    // Drop the page cache so that the cached read goes through the daemon's chunk cache.
    std::fs::write("/proc/sys/vm/drop_caches", "3").ok();
    assert_eq!(
        std::fs::read(root.join("data/a.bin")).expect("cached read with store down"),
        a
    );
    // Store back: reads work again — after at most a second: a blob whose read missed its deadline
    // fails fast for FAIL_FAST (strata_fs::slowread), and the outage's last timeout may be that recent.
    proxy.set_down(false);
    let until = Instant::now() + strata_fs::deadline::FAIL_FAST * 5;
    let got = loop {
        match std::fs::read(root.join("data/b.bin")) {
            Ok(got) => break got,
            Err(e) if e.raw_os_error() == Some(libc::EIO) && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("read after outage: {e}"),
        }
    };
    assert_eq!(got, b);
}

#[test]
fn corrupted_blob_gives_eio_never_wrong_bytes() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "bad:v1", &[("x.bin", random_bytes(3 << 20, 3))]);
    let blobs: Vec<_> = std::fs::read_dir(sdir.path().join("blobs"))
        .expect("blobs")
        .map(|e| e.expect("e").path())
        .collect();
    // Corrupt the first half of every blob (busybox's chunks, then the data file's first chunk), not its
    // table of contents at the end.
    for p in &blobs {
        let mut bytes = std::fs::read(p).expect("read");
        let n = bytes.len() / 2;
        for i in (0..n).step_by(4096) {
            bytes[i] ^= 0xa5;
        }
        std::fs::write(p, bytes).expect("write");
    }
    let d = Daemon::start(&store, &["--read-timeout", "5"]);
    let rootfs = d.ok(&["mount", "bad:v1", "--sandbox", "c1"]);
    let r = std::fs::read(Path::new(&rootfs).join("data/x.bin"));
    let err = r.expect_err("corrupt data was served");
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    // The failure is counted, through the control socket's /metrics.
    let text = d.metrics();
    assert!(
        text.contains("strata_errors_total{kind=\"corrupt\"}"),
        "{text}"
    );
}

#[test]
fn cache_bound_holds_under_a_larger_working_set() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| (format!("f{i}"), random_bytes(1 << 20, 100 + i)))
        .collect();
    let refs: Vec<(&str, Vec<u8>)> = files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    build_image(&store, "cache:v1", &refs);
    let d = Daemon::start(&store, &["--cache-size", "4M", "--max-fetch-span", "1M"]);
    let rootfs = d.ok(&["mount", "cache:v1", "--sandbox", "k1"]);
    for round in 0..2 {
        for (n, b) in &files {
            assert_eq!(
                &std::fs::read(Path::new(&rootfs).join("data").join(n)).expect("read"),
                b,
                "round {round}"
            );
            let ps = json(&d.ok(&["ps", "--json"]));
            let used = ps["status"]["cache"]["used"].as_u64().expect("used");
            assert!(used <= 4 << 20, "cache holds {used} bytes, bound 4 MiB");
        }
        std::fs::write("/proc/sys/vm/drop_caches", "3").ok();
    }
    // The misses' background work (slow reads, followers) ran on reused threads: before the pool, each
    // of the 24 reads' misses started one or two.
    let ps = json(&d.ok(&["ps", "--json"]));
    let w = &ps["status"]["workers"];
    let started = w["started"].as_u64().expect("workers.started");
    eprintln!("workers after 24 missing reads: {w}");
    assert!(started < 12, "threads started for 24 missing reads: {w}");
}

#[test]
fn reads_go_on_when_the_cache_disk_is_full() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let data = random_bytes(6 << 20, 21);
    build_image(&store, "full:v1", &[("big.bin", data.clone())]);
    // The chunk cache on a 512 KiB filesystem: most chunks cannot be cached. In `fanotify` mode the
    // view files are the blobs' cache (and the kernel reads them): they get a small filesystem, an
    // ext4 one (tmpfs refuses pre-content marks).
    let fanotify = strata_tests::effective_mount_mode() == "fanotify";
    let state = scratch("state");
    let cache = state.path().join(if fanotify { "views" } else { "cache" });
    std::fs::create_dir_all(&cache).expect("mkdir");
    // Unmounted however the test ends (after the daemon, which is dropped first).
    let small = match fanotify {
        true => strata_tests::smallfs::small_ext4(&cache, 2 << 20),
        false => {
            let st = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=512k", "tmpfs"])
                .arg(&cache)
                .status()
                .expect("mount");
            assert!(st.success(), "mount the small tmpfs");
            strata_tests::smallfs::Umount(cache.clone())
        }
    };
    let mut d = Daemon::start_in(&store, state, &["--max-fetch-span", "256K"]);
    let rootfs = d.ok(&["mount", "full:v1", "--sandbox", "f1"]);
    let got = std::fs::read(Path::new(&rootfs).join("data/big.bin"));
    let text = d.metrics();
    d.stop();
    drop(small);
    match fanotify {
        // The kernel reads what is in the view file, so a chunk that cannot be written there cannot
        // be read: an error, never a hole (docs/DAEMON.md, "The view files are the cache").
        true => assert_eq!(
            got.expect_err("read with the view files' disk full")
                .raw_os_error(),
            Some(libc::EIO)
        ),
        false => assert_eq!(got.expect("read with the cache disk full"), data),
    }
    assert!(
        text.contains("strata_errors_total{kind=\"cache\"}"),
        "no cache error counted:\n{text}"
    );
}

#[test]
fn layer_metadata_of_released_layers_is_trimmed_to_its_bound() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "md:v1", &[("x.bin", random_bytes(1 << 20, 3))]);
    let d = Daemon::start(&store, &["--metadata-cache-size", "1"]);
    let layers = d.state.path().join("layers");
    let count = || {
        std::fs::read_dir(&layers)
            .expect("layers dir")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "erofs"))
            })
            .count()
    };
    d.ok(&["mount", "md:v1", "--sandbox", "m1"]);
    assert_eq!(count(), 1, "metadata of a mounted layer is on disk");
    d.ok(&["umount", "--sandbox", "m1", "--purge"]);
    assert_eq!(count(), 0, "metadata over the bound kept after release");
    let r = d.ok(&["mount", "md:v1", "--sandbox", "m2"]);
    assert!(
        Path::new(&r).join("data/x.bin").exists(),
        "remount after trim"
    );
}

#[test]
fn control_socket_and_blob_files_are_root_only_unless_a_group_is_allowed() {
    if !can_mount() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "acl:v1", &[("x.bin", random_bytes(1 << 20, 4))]);
    for (extra, allowed) in [(&[][..], false), (&["--group", "65534"][..], true)] {
        let d = Daemon::start(&store, extra);
        d.ok(&["mount", "acl:v1", "--sandbox", "a1"]);
        // Let nobody reach the runtime directory, so that only the daemon's own modes decide.
        for p in [d.state.path(), d.runtime.as_path()] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        let blobs = d.runtime.join("fuse/blobs");
        let blob = std::fs::read_dir(&blobs)
            .expect("blob dir")
            .next()
            .expect("one blob")
            .expect("entry")
            .path();
        let socket = d.socket.to_str().expect("utf8").to_string();
        let read = as_nobody(&["head", "-c", "1", blob.to_str().expect("utf8")]);
        let status = "http://stratad/v1/status";
        let talk = as_nobody(&["curl", "-sf", "--unix-socket", &socket, status]);
        assert_eq!(
            read,
            allowed,
            "nobody reading {} (group {allowed})",
            blob.display()
        );
        assert_eq!(
            talk, allowed,
            "nobody connecting to the control socket (group {allowed})"
        );
        let mode = std::fs::metadata(&d.socket)
            .expect("socket")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, if allowed { 0o660 } else { 0o600 });
    }
}

/// Bytes the daemon fetched (settled) for a sandbox of `image` that read the last 4 KiB of `path`,
/// with `--max-fetch-span 64K`, no streaming unless `flags` set it, and `flags`; and the chunks then
/// in its cache.
fn fetched_after_reading_the_tail(
    store: &StoreEnv,
    image: &str,
    path: &str,
    flags: &[&str],
) -> (u64, u64) {
    let stream: &[&str] = match flags.contains(&"--max-fetch-stream") {
        true => &[],
        false => &["--max-fetch-stream", "0"],
    };
    let flags = [&["--max-fetch-span", "64K"], stream, flags].concat();
    let d = Daemon::start(store, &flags);
    let rootfs = d.ok(&["mount", image, "--sandbox", "b1"]);
    // With `--max-fetch-group` the layer's directories are walked in the background after the mount:
    // a read before the walk ends fetches no group (as on a node; here it would fail the comparison).
    for _ in 0..100 {
        let groups = &json(&d.ok(&["daemon", "status"]))["groups"];
        if groups.is_null() || groups["blobs_walked"].as_u64() > Some(0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(Path::new(&rootfs).join(path)).expect("open");
        f.seek(SeekFrom::End(-4096)).expect("seek");
        let mut buf = vec![0u8; 4096];
        f.read_exact(&mut buf).expect("read the tail");
    }
    // Background fetches settle: the count stops moving. The reader is this test, outside every
    // sandbox: its misses are the node's unattributed fetches (plus any charged to the sandbox).
    let fetched = || {
        let status = json(&d.ok(&["daemon", "status"]));
        let sandbox = json(&d.ok(&["ps", "--json"]))["sandboxes"][0]["fetched_bytes"].as_u64();
        Some(status["fetched_unattributed"].as_u64()? + sandbox.unwrap_or(0))
    };
    // Settled: unchanged over three samples 200 ms apart (a background fetch queued behind other work
    // on a busy machine may start late).
    let (mut last, mut same) = (fetched(), 0);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let now = fetched();
        same = if now == last { same + 1 } else { 0 };
        last = now;
        if same == 3 {
            break;
        }
    }
    let status = json(&d.ok(&["daemon", "status"]));
    let chunks = held(&status).0;
    (last.expect("fetched_bytes"), chunks)
}

#[test]
fn a_miss_also_fetches_what_lies_behind_it_with_max_fetch_behind() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = [
        ("a.bin", random_bytes(4 << 20, 31)),
        ("b.bin", random_bytes(4 << 20, 32)),
    ];
    build_image(&store, "behind:v1", &files);
    let tail =
        |flags: &[&str]| fetched_after_reading_the_tail(&store, "behind:v1", "data/b.bin", flags);
    let (without, _) = tail(&[]);
    let (with, _) = tail(&["--max-fetch-behind", "8M"]);
    // 8 MiB behind b's last chunk: the rest of b and of a (random data: stored as is), in one
    // background request.
    assert!(
        with >= without + (4 << 20),
        "fetched {with} bytes with 8 MiB behind, {without} without"
    );
}

#[test]
fn a_miss_streams_what_follows_it_with_max_fetch_stream() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = [
        ("a.bin", random_bytes(256 << 10, 33)),
        ("b.bin", random_bytes(4 << 20, 34)),
        ("c.bin", random_bytes(4 << 20, 35)),
    ];
    build_image(&store, "stream:v1", &files);
    let tail =
        |flags: &[&str]| fetched_after_reading_the_tail(&store, "stream:v1", "data/a.bin", flags);
    let (without, alone) = tail(&[]);
    let (with, cached) = tail(&["--max-fetch-stream", "4M"]);
    // About 4 MiB after a's tail came too (random data: stored as is), in the background; not c.
    assert!(
        with >= without + (3 << 20) && with < without + (6 << 20),
        "fetched {with} bytes with 4 MiB streamed, {without} without"
    );
    assert!(
        cached >= alone + 3,
        "chunks cached: {cached} against {alone}"
    );
}

#[test]
fn a_miss_also_fetches_its_directorys_small_files_with_max_fetch_group() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    // Eight small files (the directory's members) and a large one, which is no member.
    let mut files: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| (format!("m{i}.bin"), random_bytes(128 << 10, 40 + i)))
        .collect();
    files.push(("z.bin".into(), random_bytes(4 << 20, 49)));
    let refs: Vec<(&str, Vec<u8>)> = files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    build_image(&store, "group:v1", &refs);
    let tail =
        |flags: &[&str]| fetched_after_reading_the_tail(&store, "group:v1", "data/m0.bin", flags);
    let (without, alone) = tail(&[]);
    let (with, cached) = tail(&["--max-fetch-group", "8M"]);
    // The seven other members came with the miss (random data: stored as is); the large file did not.
    assert!(
        with >= without + 7 * (128 << 10) && with < without + (4 << 20),
        "fetched {with} bytes with the group, {without} without"
    );
    assert_eq!(
        (alone, cached),
        (1, 8),
        "chunks cached without and with the group"
    );
}

/// A burst of sandboxes of two images that share a base layer: each sandbox sees its own image, each
/// of the three layers is mounted once and fetched once (the layers of one image side by side, one
/// layer once however many sandboxes ask for it at the same moment).
#[test]
fn a_burst_of_sandboxes_fetches_each_layer_once() {
    if !have(&[Need::Mount]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "base:v1", &[("base.bin", random_bytes(2 << 20, 7))]);
    for name in ["a", "b"] {
        let ws = scratch("ws");
        std::fs::create_dir_all(ws.path().join("work")).expect("mkdir");
        std::fs::write(ws.path().join("work/name"), name).expect("write");
        store.workspace_image(ws.path(), "base:v1", &format!("{name}:v1"));
    }
    let mut d = Daemon::start(&store, &[]);
    let roots: Vec<(&str, String)> = std::thread::scope(|s| {
        let d = &d;
        let made: Vec<_> = (0..8)
            .map(|i| {
                let image = ["a", "b"][i % 2];
                s.spawn(move || {
                    let sandbox = format!("s{i}");
                    (
                        image,
                        d.ok(&["mount", &format!("{image}:v1"), "--sandbox", &sandbox]),
                    )
                })
            })
            .collect();
        made.into_iter().map(|h| h.join().expect("mount")).collect()
    });
    for (image, root) in &roots {
        let root = Path::new(root);
        let name = std::fs::read_to_string(root.join("work/name")).expect("work/name");
        assert_eq!(name, *image, "{}", root.display());
        let base = std::fs::metadata(root.join("data/base.bin")).expect("base.bin");
        assert_eq!(base.len(), 2 << 20);
    }
    let ps = json(&d.ok(&["ps", "--json"]));
    let layers = ps["status"]["layers"].as_array().expect("layers");
    let mut refs: Vec<u64> = layers.iter().filter_map(|l| l["refs"].as_u64()).collect();
    refs.sort_unstable();
    assert_eq!(refs, [4, 4, 8], "{}", ps["status"]);
    let text = d.metrics();
    let fetches = "strata_layer_fetch_seconds_count 3";
    assert!(text.lines().any(|l| l == fetches), "{text}");
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}
