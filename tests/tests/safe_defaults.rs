//! Safe by default, for real: image data the daemon keeps is unreadable for other users, device nodes and
//! setuid bits from an image are inert, and a chunk changed on disk under a running daemon is never
//! served.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use strata_tests::*;

/// Files below `dir` (not following links), for the unprivileged reads below.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let t = e.file_type().expect("type");
        if t.is_dir() {
            out.extend(files_below(&e.path()));
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    out
}

#[test]
fn image_data_is_unreadable_for_other_users() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "priv:v1", &[("x.bin", random_bytes(1 << 20, 5))]);
    for group in [None, Some("65534")] {
        let extra: Vec<&str> = group.map_or(vec![], |g| vec!["--group", g]);
        let d = Daemon::start(&store, &extra);
        let r1 = d.ok(&["mount", "priv:v1", "--sandbox", "p1"]);
        d.ok(&["mount", "priv:v1", "--sandbox", "p2"]);
        std::fs::write(Path::new(&r1).join("root/secret"), "p1's\n").expect("write in p1");
        assert!(std::fs::read(Path::new(&r1).join("data/x.bin")).is_ok());
        // The test's scratch directory is 0700: open it, so that only the daemon's modes decide.
        std::fs::set_permissions(d.state.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let state = d.state.path();
        // The chunk cache, and in `fanotify` mode the view files (the blobs' cache there).
        let mut secret = files_below(&state.join("cache"));
        let views = state.join("views");
        if views.exists() {
            secret.extend(files_below(&views));
        }
        secret.extend(files_below(&state.join("layers")));
        secret.push(state.join("sandboxes/p1/upper/root/secret"));
        if group.is_none() {
            // With a group, the rootfs paths are the group's to reach (a launcher that is not root).
            secret.push(PathBuf::from(&r1).join("data/x.bin"));
        }
        assert!(secret.len() >= 4, "{secret:?}");
        for f in &secret {
            assert!(f.exists(), "{}", f.display());
            let path = f.to_str().expect("utf8");
            assert!(
                !as_nobody(&["head", "-c", "1", path]),
                "nobody read {path} (group {group:?})"
            );
        }
        for dir in [
            state.join("cache"),
            state.join("layers"),
            state.join("sandboxes"),
        ]
        .into_iter()
        .chain(Some(state.join("views")).filter(|v| v.exists()))
        {
            let path = dir.to_str().expect("utf8");
            assert!(!as_nobody(&["ls", path]), "nobody listed {path}");
        }
        // The runtime directory: closed without a group; with one, the group reaches the control socket
        // and the rootfs paths a launcher is given, not the layer mounts.
        let run = d.runtime.to_str().expect("utf8");
        assert_eq!(as_nobody(&["ls", run]), group.is_some(), "listing {run}");
        let layers = d.runtime.join("layers");
        assert!(!as_nobody(&["ls", layers.to_str().expect("utf8")]));
    }
}

#[test]
fn device_nodes_and_setuid_bits_from_an_image_are_inert() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = scratch("img");
    busybox_rootfs(src.path());
    // A /dev/null-like node, and a setuid-root copy of busybox.
    mknod(&src.path().join("data/null"), libc::S_IFCHR | 0o666, 1, 3);
    let suid = src.path().join("bin/suid-busybox");
    std::fs::copy(src.path().join("bin/busybox"), &suid).expect("copy");
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", "dev:v1"]);
    let d = Daemon::start(&store, &[]);
    let rootfs = PathBuf::from(d.ok(&["mount", "dev:v1", "--sandbox", "d1"]));
    let node = rootfs.join("data/null");
    let meta = std::fs::symlink_metadata(&node).expect("the node is shown");
    assert!(meta.file_type().is_char_device());
    let err = std::fs::File::open(&node).expect_err("opened a device node from an image");
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    // The setuid bit is kept in the tree but grants nothing: the rootfs is mounted nosuid (and nodev).
    let m = std::fs::metadata(rootfs.join("bin/suid-busybox")).expect("suid file");
    assert_eq!(m.permissions().mode() & 0o7777, 0o4755);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let root = rootfs.to_str().expect("utf8");
    let line = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(root))
        .expect("rootfs mount");
    let opts: Vec<&str> = line
        .split(' ')
        .nth(5)
        .expect("options")
        .split(',')
        .collect();
    for want in ["nodev", "nosuid"] {
        assert!(opts.contains(&want), "rootfs mounted {opts:?}");
    }
    assert!(!opts.contains(&"noexec"), "rootfs mounted {opts:?}");
    // Programs from the image still run.
    let o = bwrap(&rootfs, &["/bin/cat", "/etc/os-release"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ID=strata-test\n",
        "{o:?}"
    );
}

#[test]
fn a_byte_flipped_in_a_cached_chunk_is_never_served() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let data = random_bytes(6 << 20, 11);
    build_image(&store, "flip:v1", &[("x.bin", data.clone())]);
    // A 16 MiB cache keeps at most 1 MiB of verified chunks in memory: the rest is read from disk.
    // The chunk cache's modes (`file`, `loop`, `fuse`) check every chunk they read back; `fanotify`
    // mode's view files are read by the kernel unchecked, protected at rest by their modes and checked
    // by the scrub (tests/tests/view_files.rs, fs/src/fanotify/tests.rs).
    let mode = match strata_tests::effective_mount_mode().as_str() {
        "fanotify" => "file".to_string(),
        m => m.to_string(),
    };
    let d = Daemon::start(&store, &["--cache-size", "16M", "--mount-mode", &mode]);
    let rootfs = PathBuf::from(d.ok(&["mount", "flip:v1", "--sandbox", "f1"]));
    let path = rootfs.join("data/x.bin");
    assert_eq!(std::fs::read(&path).expect("first read"), data);
    // Flip a byte in every 4 KiB of every segment, with the daemon running.
    let segs: Vec<PathBuf> = std::fs::read_dir(d.state.path().join("cache"))
        .expect("cache dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| !p.to_string_lossy().ends_with(".idx"))
        .collect();
    assert!(!segs.is_empty());
    for seg in &segs {
        let mut b = std::fs::read(seg).expect("read segment");
        for i in (100..b.len()).step_by(4096) {
            b[i] ^= 0x5a;
        }
        std::fs::write(seg, b).expect("write segment");
    }
    for round in 0..2 {
        std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches");
        match std::fs::read(&path) {
            Ok(got) => assert!(got == data, "round {round}: wrong bytes served"),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "round {round}: {e}"),
        }
    }
    // Refetched, the chunks read right again.
    assert_eq!(std::fs::read(&path).expect("read after refetch"), data);
}
