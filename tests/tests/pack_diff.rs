//! pack_diff and flatten for real: a sandbox of stratad is changed in every way an agent changes a
//! rootfs (through the kernel's overlay), packed, and a new sandbox from the new tag must show exactly the
//! first one's merged tree, entry by entry with all metadata; so must the flattened image. Excludes,
//! freezing, and bad input (unknown sandbox, an upper directory of another image, tag conflicts).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use strata_tests::*;

/// A store holding a busybox image tagged `tag`, and a daemon on it.
fn busybox_daemon(tag: &str) -> (tempfile::TempDir, Daemon) {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = scratch("src");
    busybox_rootfs(src.path());
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
    let d = Daemon::start(&store, &[]);
    (sdir, d)
}

/// Runs the `pack_diff` program against the daemon's store and socket.
fn pack_diff(d: &Daemon, args: &[&str]) -> Output {
    let mut c = Command::new(pack_diff_bin());
    c.arg("--store")
        .arg(&d.store.url)
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .stdin(Stdio::null());
    for (k, v) in &d.store.env {
        c.env(k, v);
    }
    c.output().expect("run pack_diff")
}

fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed ({}): {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// A merged rootfs, entry by entry (the root included: a new sandbox's upper directory takes the
/// attributes of the image's root).
fn tree(root: &Path) -> BTreeMap<Vec<u8>, EntryInfo> {
    snapshot(root)
}

fn assert_same(want: &BTreeMap<Vec<u8>, EntryInfo>, root: &Path, what: &str) {
    let got = tree(root);
    let d = diff(want, &got);
    assert!(d.is_empty(), "{what} differs:\n{}", d.join("\n"));
}

/// A minimal wheel (no network, no build backend): pip installs it as it would any package.
fn make_wheel(dir: &Path) -> std::path::PathBuf {
    let whl = dir.join("strata_probe-1.0-py3-none-any.whl");
    let script = format!(
        r#"
import zipfile
files = {{
    "strata_probe/__init__.py": "VALUE = 42\n",
    "strata_probe/data.txt": "x" * 5000,
    "strata_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: strata-probe\nVersion: 1.0\n",
    "strata_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}}
rec = "".join(f"{{k}},,\n" for k in files) + "strata_probe-1.0.dist-info/RECORD,,\n"
files["strata_probe-1.0.dist-info/RECORD"] = rec
with zipfile.ZipFile("{}", "w") as z:
    for k, v in files.items():
        z.writestr(k, v)
"#,
        whl.display()
    );
    let o = Command::new("python3")
        .args(["-c", &script])
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    whl
}

/// Changes a sandbox's rootfs in every way the issue lists; returns the bytes of new data written.
fn mutate(r: &Path, wheel: &Path) -> usize {
    let w = |rel: &str, data: &[u8]| std::fs::write(r.join(rel), data).expect("write");
    let big = random_bytes(3 << 20, 7);
    // Create (a new file, a new directory tree, a copy of an image file's bytes: deduplicated).
    w("root/new.txt", b"created in the sandbox\n");
    std::fs::create_dir_all(r.join("opt/work/sub")).expect("mkdir");
    w("opt/work/sub/big.bin", &big);
    let lower_big = std::fs::read(r.join("usr/lib/big.bin")).expect("read");
    w("opt/work/dup.bin", &lower_big);
    // Modify, append, truncate.
    w("etc/small.conf", b"rewritten");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(r.join("usr/share/doc/file03.txt"))
        .expect("open");
    std::io::Write::write_all(&mut f, b"appended line\n").expect("append");
    drop(f);
    std::fs::OpenOptions::new()
        .write(true)
        .open(r.join("usr/share/doc/file04.txt"))
        .expect("open")
        .set_len(10)
        .expect("truncate");
    std::fs::OpenOptions::new()
        .write(true)
        .open(r.join("usr/share/doc/file05.txt"))
        .expect("open")
        .set_len(0)
        .expect("truncate");
    // Delete a file and a directory tree.
    std::fs::remove_file(r.join("usr/share/doc/file06.txt")).expect("rm");
    std::fs::remove_dir_all(r.join("deep/d0/d1/d2")).expect("rm -r");
    // A directory replaced by a file, a file by a directory.
    std::fs::remove_dir_all(r.join("names")).expect("rm -r");
    w("names", b"now a file");
    std::fs::remove_file(r.join("etc/hostname.hard")).expect("rm");
    std::fs::create_dir(r.join("etc/hostname.hard")).expect("mkdir");
    w("etc/hostname.hard/inside", b"in");
    // chmod, chown.
    std::fs::set_permissions(
        r.join("usr/bin/tool"),
        std::fs::Permissions::from_mode(0o700),
    )
    .expect("chmod");
    lchown(&r.join("usr/share/doc/file07.txt"), 4242, 4343);
    // xattrs: set on an image file, remove one the image has.
    xattr::set(r.join("usr/share/doc/file08.txt"), "user.agent", b"set").expect("setxattr");
    xattr::remove(r.join("etc/hostname"), "user.origin").expect("removexattr");
    // Hard link to an image file, hard links between new files, symlinks.
    std::fs::hard_link(
        r.join("usr/share/doc/file09.txt"),
        r.join("root/file09.link"),
    )
    .expect("link");
    std::fs::hard_link(r.join("root/new.txt"), r.join("opt/work/new.link")).expect("link");
    std::os::unix::fs::symlink("/opt/work/sub/big.bin", r.join("root/big.sym")).expect("symlink");
    // A whole image directory deleted and recreated (opaque).
    std::fs::remove_dir_all(r.join("many")).expect("rm -r");
    std::fs::create_dir(r.join("many")).expect("mkdir");
    w("many/only-one", b"the rest is gone");
    // Residue to scrub: a new answer file, and a change to an image file.
    w("root/answer.txt", b"42");
    w("usr/share/doc/file10.txt", b"secret edit");
    // A Python package installed with pip into the rootfs.
    let o = Command::new("python3")
        .args(["-m", "pip", "install", "--no-index", "--no-deps", "--quiet"])
        .args(["--disable-pip-version-check", "--no-compile", "--target"])
        .arg(r.join("opt/pylib"))
        .arg(wheel)
        .output()
        .expect("pip (scripts/setup installs it)");
    assert!(
        o.status.success(),
        "pip: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    big.len() + (64 << 10)
}

#[test]
fn a_new_sandbox_from_pack_diff_sees_exactly_the_first_ones_tree() {
    if !have(&[Need::Mount, Need::Bwrap]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = scratch("src");
    generate_tree(src.path());
    busybox_rootfs(src.path());
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "pd:base"]);
    let d = Daemon::start(&store, &[]);
    let r1 = d.ok(&["mount", "pd:base", "--sandbox", "s1"]);
    let r1 = Path::new(&r1);
    let f10 = b"usr/share/doc/file10.txt".to_vec();
    let orig_file10 = std::fs::read(r1.join("usr/share/doc/file10.txt")).expect("read");
    // The image's own entry: an excluded edit of it must leave exactly this in the new sandbox.
    let image_f10 = tree(r1).remove(&f10).expect("file10 in the image");
    let wheel_dir = scratch("wheel");
    let delta = mutate(r1, &make_wheel(wheel_dir.path()));
    // A change made by a process inside the sandbox, too.
    let o = bwrap(
        r1,
        &["/bin/sh", "-c", "echo from-inside >> /etc/os-release"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut want = tree(r1);

    let out = json(&ok(
        pack_diff(
            &d,
            &[
                "--sandbox",
                "s1",
                "-t",
                "pd:snap",
                "--exclude",
                "answer.txt",
                "--exclude",
                "/usr/share/doc/file10.txt",
                "--json",
            ],
        ),
        "pack_diff",
    ));
    assert_eq!(out["excluded"].as_u64(), Some(2), "{out}");
    let stats = &out["stats"];
    let stored = stats["stored_bytes"].as_u64().expect("stored");
    assert!(
        stored < delta as u64,
        "stored {stored} bytes for a delta of about {delta}: {out}"
    );
    // The copy of an image file was deduplicated: only the 3 MiB of noise and small files are new.
    assert!(
        stats["new_bytes"].as_u64().expect("new") < (3 << 20) + (256 << 10),
        "{out}"
    );

    // Excluded: the answer file is absent, the edited image file shows the image's version.
    want.remove(b"root/answer.txt".as_slice());
    let r2 = d.ok(&["mount", "pd:snap", "--sandbox", "s2"]);
    let r2 = Path::new(&r2);
    assert!(!r2.join("root/answer.txt").exists());
    assert_eq!(
        std::fs::read(r2.join("usr/share/doc/file10.txt")).expect("read"),
        orig_file10
    );
    want.insert(f10, image_f10);
    assert_same(&want, r2, "sandbox from pd:snap");
    let o = bwrap(
        r2,
        &["/bin/sh", "-c", "cat /opt/pylib/strata_probe/__init__.py"],
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "VALUE = 42\n");

    a_second_snapshot_then_flattened_two_ways(&d, r2);
}

/// A second snapshot of sandbox s2 (at `r2`) on top of pd:snap, undoing part of the first; then
/// flattened whole and from its second layer: every image shows the same tree, and the flattened layer
/// passes fsck.erofs.
fn a_second_snapshot_then_flattened_two_ways(d: &Daemon, r2: &Path) {
    std::fs::remove_file(r2.join("opt/work/sub/big.bin")).expect("rm");
    std::fs::write(r2.join("etc/small.conf"), b"second").expect("write");
    std::fs::remove_dir_all(r2.join("opt/pylib")).expect("rm -r");
    let want2 = tree(r2);
    ok(
        pack_diff(d, &["--sandbox", "s2", "-t", "pd:snap2"]),
        "second pack_diff",
    );
    let full = json(&d.ok(&["flatten", "pd:snap2", "-t", "pd:flat", "--json"]));
    assert_eq!(full["layers"].as_u64(), Some(1), "{full}");
    assert_eq!(
        full["stats"]["new_chunks"].as_u64(),
        Some(0),
        "flatten stored data again: {full}"
    );
    assert_eq!(full["stats"]["whiteouts"].as_u64(), Some(0), "{full}");
    let top = json(&d.ok(&[
        "flatten", "pd:snap2", "--from", "1", "-t", "pd:top", "--json",
    ]));
    assert_eq!(top["layers"].as_u64(), Some(2), "{top}");
    for (tag, sb) in [("pd:snap2", "s3"), ("pd:flat", "s4"), ("pd:top", "s5")] {
        let r = d.ok(&["mount", tag, "--sandbox", sb]);
        assert_same(&want2, Path::new(&r), tag);
    }
    // The flattened layers pass fsck.erofs.
    let inspect = json(&d.ok(&["inspect", "pd:flat", "--json"]));
    let layer = inspect["layers"][0]["digest"]
        .as_str()
        .expect("layer")
        .to_string();
    let mat = scratch("mat");
    d.ok(&["materialize", &layer, mat.path().to_str().expect("utf8")]);
    let f = fsck_erofs(mat.path());
    assert!(f.status.success(), "{}", String::from_utf8_lossy(&f.stderr));
}

#[test]
fn freeze_pauses_the_sandbox_and_resumes_it() {
    if !can_mount() {
        return;
    }
    let (_store, d) = busybox_daemon("fz:v1");
    let r = d.ok(&["mount", "fz:v1", "--sandbox", "f1"]);
    let mut child = Command::new("bwrap")
        .arg("--bind")
        .arg(&r)
        .arg("/")
        .args([
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--die-with-parent",
            "--",
        ])
        .args([
            "/bin/sh",
            "-c",
            "while true; do echo tick >> /root/log; sleep 0.05; done",
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("bwrap");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = json(&ok(
        pack_diff(
            &d,
            &["--sandbox", "f1", "-t", "fz:snap", "--freeze", "--json"],
        ),
        "pack_diff --freeze",
    ));
    let pids = out["frozen"]["pids"].as_array().expect("pids").clone();
    assert!(!pids.is_empty(), "no sandbox process found: {out}");
    // Resumed: the log keeps growing.
    let n1 = std::fs::read(Path::new(&r).join("root/log"))
        .expect("log")
        .len();
    std::thread::sleep(std::time::Duration::from_millis(400));
    let n2 = std::fs::read(Path::new(&r).join("root/log"))
        .expect("log")
        .len();
    let _ = child.kill();
    let _ = child.wait();
    assert!(n2 > n1, "sandbox still paused after pack_diff: {out}");
    eprintln!("frozen: {}", out["frozen"]);
    for p in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", p)).unwrap_or_default();
        let state = stat.rsplit_once(')').map(|x| x.1.trim_start().to_string());
        assert!(
            !state.unwrap_or_default().starts_with('T'),
            "process {p} left stopped"
        );
    }
    // The sandbox's shell dies with bwrap; wait for it before the daemon stops.
    let gone = || {
        pids.iter()
            .all(|p| !Path::new(&format!("/proc/{p}")).exists())
    };
    let start = std::time::Instant::now();
    while !gone() && start.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    d.ok(&["umount", "--sandbox", "f1"]);
}

#[test]
fn bad_input_is_named_and_nothing_half_written_is_referenced() {
    if !can_mount() {
        return;
    }
    let (_store, d) = busybox_daemon("bad:v1");
    let tags = || d.ok(&["images", "--json"]);
    let before = tags();

    // A sandbox that does not exist.
    let o = pack_diff(&d, &["--sandbox", "nope", "-t", "bad:x"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"), "{o:?}");

    // `strata pack-diff --upper DIR --image bad:v1 -t TAG [EXTRA]`.
    let pack_upper = |dir: &str, tag: &str, extra: &[&str]| {
        let mut args = vec!["pack-diff", "--upper", dir, "--image", "bad:v1", "-t", tag];
        args.extend_from_slice(extra);
        d.strata(&args)
    };

    // An upper directory made over another image: it deletes a path this image does not have.
    let upper = scratch("upper");
    mknod(&upper.path().join("not-in-this-image"), libc::S_IFCHR, 0, 0);
    std::fs::write(upper.path().join("file"), b"x").expect("write");
    let up = upper.path().to_str().expect("utf8");
    let o = pack_upper(up, "bad:x", &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("not-in-this-image") && err.contains("another image"),
        "{err}"
    );

    // A missing upper directory; an upper of a mount with metacopy.
    let o = pack_upper("/nonexistent/up", "bad:x", &[]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    let meta = scratch("upper-meta");
    std::fs::write(meta.path().join("f"), b"").expect("write");
    xattr::set(meta.path().join("f"), "trusted.overlay.metacopy", b"").expect("xattr");
    let mp = meta.path().to_str().expect("utf8");
    let o = pack_upper(mp, "bad:x", &[]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("metacopy"),
        "{o:?}"
    );
    assert_eq!(tags(), before, "a failed pack_diff changed the tags");

    // A tag conflict: an existing tag is not moved without --force.
    let good = scratch("upper-good");
    std::fs::write(good.path().join("new"), b"new").expect("write");
    let gp = good.path().to_str().expect("utf8");
    let o = pack_upper(gp, "bad:v1", &[]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--force"),
        "{o:?}"
    );
    assert_eq!(tags(), before);
    let o = pack_upper(gp, "bad:v1", &["--force"]);
    assert!(o.status.success(), "{o:?}");
    assert_ne!(tags(), before);
    assert_eq!(d.ok(&["cat", "bad:v1", "/new"]), "new");
}
