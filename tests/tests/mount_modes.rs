//! Mount modes for real: `stratad --check` on this kernel, and `loop` mode (EROFS on loop devices of the
//! blob files, as 6.1 kernels need) forced on this one — mounts, reads, overlays, loop devices shared
//! between layers and released when unused, and sandboxes that survive `kill -9` of the server, the
//! successor finding the devices again by their backing files.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_tests::*;

#[test]
fn check_reports_the_modes_of_this_kernel_without_starting() {
    if !can_mount() || !require("Linux 6.12+ (file-backed EROFS)", kernel_at_least(6, 12)) {
        return;
    }
    let state = scratch("state");
    let (ok, r) = stratad_check(state.path(), "auto");
    assert!(ok, "{r}");
    // `fanotify` where pre-content events are (6.14+; the state directory here is on ext4), else
    // `file`, saying why not `fanotify`.
    let pre_content = kernel_at_least(6, 14);
    let want = if pre_content { "fanotify" } else { "file" };
    assert_eq!(r["mode"], want, "{r}");
    assert_eq!(
        r["passed_over"].as_array().map(Vec::len),
        Some(usize::from(!pre_content)),
        "{r}"
    );
    for cap in ["fuse", "erofs", "file_backed", "loop_devices"] {
        assert!(r["capabilities"][cap].is_null(), "{cap}: {r}");
    }
    assert_eq!(
        r["capabilities"]["pre_content"].is_null(),
        pre_content,
        "{r}"
    );
    assert!(r["probe_ms"].as_f64().expect("probe_ms") < 2000.0, "{r}");
    let (ok, r) = stratad_check(state.path(), "loop");
    assert!(ok, "{r}");
    assert_eq!(r["mode"], "loop");
    assert_eq!(r["passed_over"][0]["reason"], "mount_mode is loop");
    // fuse forced: taken (FUSE is here), the kernel modes passed over as forced.
    let (ok, r) = stratad_check(state.path(), "fuse");
    assert!(ok, "{r}");
    assert_eq!(r["mode"], "fuse");
    assert_eq!(r["passed_over"][1]["reason"], "mount_mode is fuse", "{r}");
    // The report for people, and nothing left behind by the probe.
    let o = Command::new(stratad_bin())
        .args(["--config", "/dev/null", "--check", "--state-dir"])
        .arg(state.path())
        .output()
        .expect("stratad --check");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(&format!("mount mode    {want} (requested auto)")),
        "{text}"
    );
    let left: Vec<_> = std::fs::read_dir(state.path())
        .expect("ls")
        .flatten()
        .collect();
    assert!(left.is_empty(), "probe left {left:?}");
}

/// Image `tag`: `base` and a workspace layer above it holding `files` under /data (chunks the base
/// holds are referenced: the layer's device table names the base's blob).
fn image_on(store: &StoreEnv, base: &str, tag: &str, files: &[(&str, Vec<u8>)]) {
    let src = scratch("ws");
    std::fs::create_dir_all(src.path().join("data")).expect("mkdir");
    for (name, data) in files {
        std::fs::write(src.path().join("data").join(name), data).expect("write");
    }
    let dir = src.path().to_str().expect("utf8");
    let layer = store.ok(&[
        "build",
        dir,
        "--kind",
        "workspace",
        "--parent",
        base,
        "--on",
        base,
    ]);
    store.ok(&[
        "compose",
        "--base",
        base,
        "--workspace",
        layer.trim(),
        "-t",
        tag,
    ]);
}

fn devices(d: &Daemon) -> BTreeSet<PathBuf> {
    d.loop_devices().into_iter().map(|b| b.device).collect()
}

#[test]
fn loop_mode_mounts_reads_shares_devices_and_survives_kill_9() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let big = random_bytes(6 << 20, 7);
    build_image(
        &store,
        "lp:v1",
        &[("big.bin", big.clone()), ("small", b"hi\n".to_vec())],
    );
    image_on(
        &store,
        "lp:v1",
        "lp:v2",
        &[
            ("big.copy", big.clone()),
            ("more", random_bytes(1 << 20, 8)),
        ],
    );
    let mut d = Daemon::start(&store, &["--mount-mode", "loop", "--cache-size", "1G"]);
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["mount_mode"], "loop", "{status}");
    assert_eq!(status["mount_modes"]["passed_over"][1]["mode"], "file");
    let ps = d.ok(&["ps"]);
    assert!(
        ps.contains("mount mode: loop (not fanotify: ")
            && ps.contains("; not file: mount_mode is loop)"),
        "{ps}"
    );

    let r1 = PathBuf::from(d.ok(&["mount", "lp:v1", "--sandbox", "a"]));
    let after_one = devices(&d);
    // One device for the layer's metadata, one per blob; every layer mount on one.
    let layers = json(&d.ok(&["daemon", "status"]))["layers"]
        .as_array()
        .expect("layers")
        .len();
    assert!(after_one.len() > layers, "{after_one:?}");
    for m in strata_fs::state::mount_points(&d.runtime.join("layers")) {
        let src = mount_source(&m).expect("layer mount source");
        assert!(src.starts_with("/dev/loop"), "{} on {src}", m.display());
    }
    assert_eq!(std::fs::read(r1.join("data/big.bin")).expect("read"), big);
    assert_eq!(std::fs::read(r1.join("data/small")).expect("read"), b"hi\n");
    // The overlay takes writes; a second sandbox shares every device.
    std::fs::write(r1.join("data/new"), b"mine").expect("write");
    let r2 = PathBuf::from(d.ok(&["mount", "lp:v1", "--sandbox", "b"]));
    assert!(!r2.join("data/new").exists());
    assert_eq!(devices(&d), after_one, "a second sandbox bound new devices");
    // A layer naming the base's blob shares its device: one device per file, never two.
    let r4 = PathBuf::from(d.ok(&["mount", "lp:v2", "--sandbox", "w"]));
    assert_eq!(std::fs::read(r4.join("data/big.copy")).expect("read"), big);
    let bound = d.loop_devices();
    let files: BTreeSet<&PathBuf> = bound.iter().map(|b| &b.backing).collect();
    assert!(bound.iter().all(|b| b.direct_io), "{bound:?}");
    assert_eq!(files.len(), bound.len(), "a file bound twice: {bound:?}");
    let blobs = std::fs::read_dir(d.runtime.join("fuse/blobs"))
        .expect("blobs")
        .count();
    assert_eq!(bound.len(), 2 + blobs, "{bound:?}");
    d.ok(&["umount", "--sandbox", "w"]);

    // kill -9 of the server while a sandbox reads uncached data: no read fails, the successor
    // finds the devices again (a new sandbox binds none).
    reads_survive_three_kills(&mut d, &r2.join("data/big.bin"), &big);
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(
        (status["adopted"].as_bool(), status["mount_mode"].as_str()),
        (Some(true), Some("loop"))
    );
    let r3 = PathBuf::from(d.ok(&["mount", "lp:v1", "--sandbox", "c"]));
    assert_eq!(std::fs::read(r3.join("data/big.bin")).expect("read"), big);
    assert_eq!(devices(&d), after_one, "the successor bound new devices");

    // Released when unused: the last sandbox of the layer gone, its devices go too.
    for id in ["a", "b", "c"] {
        d.ok(&["umount", "--sandbox", id]);
    }
    assert_eq!(
        d.wait_loops_released(),
        vec![],
        "loop devices left after the last umount"
    );
    // A stop with sandboxes running leaves neither mounts nor devices.
    d.ok(&["mount", "lp:v1", "--sandbox", "a", "--resume"]);
    assert!(!devices(&d).is_empty());
    assert!(d.stop().is_empty(), "mounts left behind");
    assert_eq!(
        d.wait_loops_released(),
        vec![],
        "loop devices left after the stop"
    );
}

/// A thread reads `path` (page cache dropped before each read) while the server is killed with SIGKILL
/// three times: every read returns `want`.
fn reads_survive_three_kills(d: &mut Daemon, path: &Path, want: &[u8]) {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, bad) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let reader = {
        let (stop, reads, bad, r, big) = (
            stop.clone(),
            reads.clone(),
            bad.clone(),
            path.to_path_buf(),
            want.to_vec(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match std::fs::read(&r) {
                    Ok(b) if b == big => {}
                    _ => {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                }
                reads.fetch_add(1, Ordering::Relaxed);
                let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
            }
        })
    };
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        let old = d.server_pid();
        // SAFETY: killing the server this test's daemon started.
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        d.wait_new_server(old);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    reader.join().expect("reader");
    assert!(reads.load(Ordering::Relaxed) > 0);
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "reads failed across kill -9"
    );
}

/// The source of the mount at `point` (`/proc/self/mountinfo`, the field after ` - fstype`).
fn mount_source(point: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        (pre.split(' ').nth(4)? == point.to_str()?)
            .then(|| post.split(' ').nth(1).map(str::to_string))?
    })
}

/// `fuse` mode forced (what a kernel without usable EROFS gets): each layer's whole tree is served by
/// stratad from its metadata, sandboxes are overlays of those trees, every file reads as built, writes go
/// to the upper directory, and a stop leaves no mount behind.
#[test]
fn fuse_mode_serves_whole_trees_under_the_overlay() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = strata_tests::readers::build_tree_image(&store, "tree:v1", 8);
    let mut d = Daemon::start(&store, &["--mount-mode", "fuse"]);
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["mount_mode"], "fuse", "{status}");
    let roots: Vec<PathBuf> = (0..2)
        .map(|i| PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", &format!("f{i}")])))
        .collect();
    for r in &roots {
        for (name, data) in &files {
            assert!(
                std::fs::read(r.join("data").join(name)).expect("read") == *data,
                "{name} in {}",
                r.display()
            );
        }
        let ls = std::fs::read_dir(r.join("bin")).expect("bin").count();
        assert!(ls > 3, "bin has {ls} entries");
    }
    std::fs::write(roots[0].join("data/new"), b"x").expect("write through the overlay");
    assert!(
        !roots[1].join("data/new").exists(),
        "a write leaked between sandboxes"
    );
    let ps = d.ok(&["ps"]);
    assert!(ps.contains("mount mode: fuse"), "{ps}");
    for i in 0..2 {
        d.ok(&["umount", "--sandbox", &format!("f{i}")]);
    }
    assert!(d.stop().is_empty(), "mounts left after the stop");
}
