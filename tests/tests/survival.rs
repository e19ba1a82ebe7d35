//! Sandboxes outlive stratad: its server killed with SIGKILL at random moments and upgraded in place
//! while sandboxes read every file of their image (cached and uncached) — no failed read, no wrong byte;
//! one daemon per state directory; a restart after the whole node died lists the sandboxes it left,
//! upper directories intact; sandbox ids reused safely (`--resume`, `--fresh`, `strata rm`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_tests::readers::*;
use strata_tests::*;

#[test]
fn sandboxes_survive_kill_9_of_the_server_and_an_upgrade() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = Arc::new(build_tree_image(&store, "tree:v1", 24));
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    let bin = d.use_copied_bin();
    d.stop();
    d.start_again(&["--cache-size", "1G"]);
    let rootfs: Vec<PathBuf> = (0..20)
        .map(|i| PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", &format!("s{i}")])))
        .collect();
    // Half the files cached before the first kill; the others are first read while servers die.
    for name in files.keys().step_by(2) {
        std::fs::read(rootfs[0].join("data").join(name)).expect("warm read");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let readers = start_readers(&rootfs, &files, &stop, &counts, Pages::Kept);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut stalls = Vec::new();
    for round in 0..6 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(150 + x % 500));
        drop_caches();
        let old = d.server_pid();
        if round == 5 {
            // An upgrade to another build: a new file installed at the binary's path.
            let tmp = bin.with_extension("new");
            std::fs::copy(stratad_bin(), &tmp).expect("copy");
            std::fs::rename(&tmp, &bin).expect("install");
        }
        let t = Instant::now();
        if round == 5 {
            let out = json(&d.ok(&["daemon", "upgrade", "--json"]));
            assert_eq!(out["old_pid"].as_u64(), Some(old as u64), "{out}");
        } else {
            // SAFETY: killing the server this test's daemon started.
            unsafe { libc::kill(old as i32, libc::SIGKILL) };
        }
        let new = d.wait_new_server(old);
        stalls.push(t.elapsed());
        assert_ne!(new, old);
    }
    std::thread::sleep(Duration::from_millis(500));
    drop_caches();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader");
    }
    let (reads, failed, wrong) = (
        counts.reads.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed),
        counts.wrong.load(Ordering::Relaxed),
    );
    eprintln!(
        "survival: {reads} reads, {failed} failed, {wrong} wrong; successor up after {stalls:?}"
    );
    assert!(reads > 20 * files.len() as u64, "too few reads: {reads}");
    assert_eq!(
        (failed, wrong),
        (0, 0),
        "reads failed or returned wrong bytes"
    );
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["adopted"], true, "{status}");
    assert_eq!(status["running"], 20, "{status}");
    // The cache and layer metadata were reused: with the store gone, a new successor still serves
    // every file from the cache.
    d.kill_server();
    let gone = sdir.path().with_extension("gone");
    std::fs::rename(sdir.path(), &gone).expect("take the store away");
    drop_caches();
    for (name, data) in files.iter() {
        let got = std::fs::read(rootfs[3].join("data").join(name)).expect("read from the cache");
        assert!(got == *data, "{name}: wrong bytes");
    }
    std::fs::rename(&gone, sdir.path()).expect("store back");
    assert!(
        d.stop().is_empty(),
        "mounts left after the holder's SIGTERM"
    );
}

#[test]
fn a_second_daemon_refuses_to_start_and_the_first_keeps_serving() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = build_tree_image(&store, "tree:v1", 4);
    let d = Daemon::start(&store, &[]);
    let r = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a"]));
    let out = d.command(&[]).output().expect("second stratad");
    assert!(!out.status.success(), "a second stratad started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("another stratad") && err.contains(&d.holder_pid().to_string()),
        "{err}"
    );
    // Also with --no-holder.
    let out = d
        .command(&["--no-holder"])
        .output()
        .expect("second stratad");
    assert!(!out.status.success());
    drop_caches();
    for (name, data) in &files {
        assert!(std::fs::read(r.join("data").join(name)).expect("read") == *data);
    }
}

fn stopped_ids(d: &Daemon) -> Vec<String> {
    let ps = json(&d.ok(&["ps", "--json"]));
    ps["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .filter(|s| s["state"] == "stopped")
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

#[test]
fn after_the_whole_node_dies_stratad_restarts_and_lists_what_was_left() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_tree_image(&store, "tree:v1", 4);
    build_tree_image(&store, "other:v1", 2);
    let mut d = Daemon::start(&store, &[]);
    let r1 = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a"]));
    d.ok(&["mount", "tree:v1", "--sandbox", "b"]);
    std::fs::write(r1.join("root/work.txt"), "progress").expect("write in sandbox");
    // A busy reader while everything is killed.
    let busy = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while cat {}/data/* >/dev/null 2>&1; do :; done",
            r1.display()
        ))
        .spawn()
        .expect("reader");
    std::thread::sleep(Duration::from_millis(300));
    d.kill_all();
    d.start_again(&[]);
    let mut stopped = stopped_ids(&d);
    stopped.sort();
    assert_eq!(stopped, ["a", "b"]);
    // Reusing an id with leftovers needs a decision.
    let o = d.strata(&["mount", "tree:v1", "--sandbox", "a"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--resume"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = d.strata(&["mount", "other:v1", "--sandbox", "a", "--resume"]);
    assert!(!o.status.success(), "resumed onto another image");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("tree:v1"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let ra = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a", "--resume"]));
    assert_eq!(
        std::fs::read_to_string(ra.join("root/work.txt")).expect("kept"),
        "progress"
    );
    let r = PathBuf::from(d.ok(&["mount", "other:v1", "--sandbox", "b", "--fresh"]));
    assert!(!r.join("root/work.txt").exists());
    d.ok(&["umount", "--sandbox", "b"]);
    assert_eq!(stopped_ids(&d), ["b"]);
    d.ok(&["rm", "--stopped"]);
    assert!(stopped_ids(&d).is_empty());
    // A purge refuses while a process runs in the rootfs, naming it.
    let mut sleeper = std::process::Command::new("chroot")
        .arg(&ra)
        .args(["/bin/sleep", "30"])
        .spawn()
        .expect("chroot sleep");
    std::thread::sleep(Duration::from_millis(300));
    let o = d.strata(&["rm", "a"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(!o.status.success(), "purged under a running process");
    assert!(err.contains(&sleeper.id().to_string()), "{err}");
    d.ok(&["rm", "a"]);
    let mut busy = busy;
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(d.stop().is_empty());
}

/// systemd's side of `Type=notify` with a file-descriptor store, played by the test: a datagram socket
/// that keeps the descriptors stratad parks in it, and a restart that passes them back (`LISTEN_FDS`).
struct FakeSystemd {
    sock: std::os::unix::net::UnixDatagram,
    path: PathBuf,
    store: Vec<(String, std::os::fd::OwnedFd)>,
}

impl FakeSystemd {
    fn new(dir: &std::path::Path) -> FakeSystemd {
        let path = dir.join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).expect("notify socket");
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        FakeSystemd {
            sock,
            path,
            store: Vec::new(),
        }
    }

    /// Receives notifications until `READY=1`, keeping stored descriptors.
    fn wait_ready(&mut self) {
        while self.receive(rustix::net::RecvFlags::empty()) != Some(true) {}
    }

    /// Applies the notifications already sent (the descriptors kept and removed since `READY=1`).
    fn drain(&mut self) {
        while self.receive(rustix::net::RecvFlags::DONTWAIT).is_some() {}
    }

    /// Receives one notification, keeping (`FDSTORE=1`) or closing (`FDSTOREREMOVE=1`) stored
    /// descriptors; whether it said `READY=1` (`None`: nothing to receive without waiting).
    fn receive(&mut self, flags: rustix::net::RecvFlags) -> Option<bool> {
        use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let mut buf = [0u8; 4096];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        // Close-on-exec here: only the copies placed at 3, 4, ... reach the restarted stratad.
        let r = match recvmsg(
            &self.sock,
            &mut iov,
            &mut control,
            flags | RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::AGAIN) => return None,
            r => r.expect("notification"),
        };
        let text = String::from_utf8_lossy(&buf[..r.bytes]).to_string();
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(f) = m {
                fds.extend(f);
            }
        }
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("FDNAME="))
            .unwrap_or("stored")
            .to_string();
        if text.lines().any(|l| l == "FDSTORE=1") {
            for fd in fds {
                self.store.push((name.clone(), fd));
            }
        }
        if text.lines().any(|l| l == "FDSTOREREMOVE=1") {
            self.store.retain(|(n, _)| *n != name);
        }
        Some(text.contains("READY=1"))
    }

    /// Starts stratad as the unit would: the stored descriptors at 3, 4, ... named in LISTEN_FDNAMES,
    /// LISTEN_PID its own pid (a shell that execs stratad keeps its pid).
    fn start(&mut self, d: &Daemon) -> std::process::Child {
        use std::os::fd::AsRawFd;
        self.drain();
        use std::os::unix::process::CommandExt;
        let raw: Vec<i32> = self.store.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        let names: Vec<&str> = self.store.iter().map(|(n, _)| n.as_str()).collect();
        let args: Vec<String> = d
            .command(&[])
            .get_args()
            .map(|a| format!("'{}'", a.to_string_lossy()))
            .collect();
        let script = format!(
            "LISTEN_PID=$$ LISTEN_FDS={} LISTEN_FDNAMES={} exec '{}' {}",
            raw.len(),
            names.join(":"),
            d.bin.display(),
            args.join(" ")
        );
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(script).env("NOTIFY_SOCKET", &self.path);
        for (k, v) in &d.store.env {
            c.env(k, v);
        }
        // SAFETY: between fork and exec only dup2 runs (async-signal-safe), on descriptors this process
        // owns; the copies at 3, 4, ... are not close-on-exec.
        unsafe {
            c.pre_exec(move || {
                // Out of the way first, so that placing one cannot overwrite another.
                let mut high = [0i32; 32];
                for (i, fd) in raw.iter().enumerate().take(32) {
                    high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 100);
                }
                for (i, fd) in high.iter().enumerate().take(raw.len().min(32)) {
                    if *fd < 0 || libc::dup2(*fd, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        c.env("STRATA_LOG", "warn").spawn().expect("start stratad")
    }
}

#[test]
fn under_systemd_the_connection_waits_in_the_fd_store_across_a_crash() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = Arc::new(build_tree_image(&store, "tree:v1", 8));
    // A Daemon value for its directories and commands; the process is started as systemd would.
    let mut d = Daemon::start(&store, &[]);
    d.stop();
    let mut sd = FakeSystemd::new(d.state.path());
    let mut first = d.command(&[]);
    first.env("NOTIFY_SOCKET", &sd.path);
    let mut p1 = first.spawn().expect("stratad under systemd");
    sd.wait_ready();
    let mut names: Vec<&str> = sd.store.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    let want: &[&str] = match strata_tests::effective_mount_mode().as_str() {
        // `fanotify` mode parks its group and the group's event journal too.
        "fanotify" => &[
            "api",
            "fanotify-group",
            "fanotify-journal",
            "fuse",
            "journal",
        ],
        _ => &["api", "fuse", "journal"],
    };
    assert_eq!(names, want, "descriptors parked in the store");
    let r = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a"]));
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let readers = start_readers(
        std::slice::from_ref(&r),
        &files,
        &stop,
        &counts,
        Pages::Kept,
    );
    std::thread::sleep(Duration::from_millis(300));
    drop_caches();
    let _ = p1.kill();
    let _ = p1.wait();
    // systemd's Restart=always: the stored descriptors come back.
    let mut p2 = sd.start(&d);
    sd.wait_ready();
    std::thread::sleep(Duration::from_millis(500));
    drop_caches();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for t in readers {
        t.join().expect("reader");
    }
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["pid"].as_u64(), Some(u64::from(p2.id())), "{status}");
    assert_eq!(status["adopted"], true);
    assert_eq!(counts.failed.load(Ordering::Relaxed), 0);
    assert_eq!(counts.wrong.load(Ordering::Relaxed), 0);
    assert!(counts.reads.load(Ordering::Relaxed) > 8);
    // A stop as systemd does it (SIGTERM) hands over; tear the node down for the test's sake.
    let _ = p2.kill();
    let _ = p2.wait();
    drop(sd);
    strata_fs::daemon::cleanup_mounts(&d.runtime);
}

/// On a kernel without `FUSE_NOTIFY_RESEND` (< 6.9: Debian 12's and AL2023's 6.1) nothing brings a dead
/// server's requests back but its journal: forced here (`STRATAD_NO_RESEND`), with a store 100 ms away,
/// a cache too small for the image and readers that drop the pages they read (reads keep missing), the
/// server is killed under readers until successors have answered requests from the journal — and no
/// read fails, hangs or is wrong.
#[test]
fn without_kernel_resend_a_successor_answers_from_the_journal() {
    if !can_mount() {
        return;
    }
    let Some(s3) = S3Server::start("journal") else {
        return;
    };
    let proxy = strata_tests::proxy::Proxy::start(s3.port);
    let mut store = s3.store("journal", "p");
    store.env[0].1 = format!("http://127.0.0.1:{}", proxy.port);
    let files = Arc::new(build_tree_image(&store, "tree:v1", 8));
    proxy.delay_us.store(100_000, Ordering::Relaxed);
    let d = Daemon::start_with_env(
        &store,
        &[
            "--cache-size",
            "4M",
            "--read-timeout",
            "30",
            "--no-prefetch",
        ],
        &[("STRATAD_NO_RESEND", "1")],
    );
    let rootfs: Vec<PathBuf> = (0..4)
        .map(|i| PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", &format!("s{i}")])))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    // Pages dropped after each read: in `loop` mode the image's page cache would otherwise hold the
    // whole tree after the first pass, and no later kill could find a request in flight.
    let readers = start_readers(&rootfs, &files, &stop, &counts, Pages::Dropped);
    let mut replayed = 0;
    for round in 0..10 {
        std::thread::sleep(Duration::from_millis(150 + 40 * round));
        let old = d.server_pid();
        // SAFETY: killing the server this test's daemon started.
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        d.wait_new_server(old);
        std::thread::sleep(Duration::from_millis(400));
        let status = json(&d.ok(&["daemon", "status"]));
        let fuse = &status["fuse"];
        assert_eq!(fuse["journal"], true, "{status}");
        // In `fuse` mode the readers' requests go to the layers' tree connections, each journaled.
        assert_eq!(
            fuse["trees"]["journals"], fuse["trees"]["connections"],
            "{status}"
        );
        replayed += fuse["replayed"].as_u64().unwrap_or(0);
        replayed += fuse["trees"]["replayed"].as_u64().unwrap_or(0);
        // In `fanotify` mode the readers wait on the fanotify group: reads a killed server took are
        // answered by its successor from the group's journal.
        replayed += status["fanotify"]["adopted"].as_u64().unwrap_or(0);
        if replayed > 0 && round >= 2 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let t = Instant::now();
    for r in readers {
        r.join().expect("reader");
    }
    let (reads, failed, wrong) = counts.get();
    eprintln!(
        "no resend: {reads} reads, {failed} failed, {wrong} wrong, {replayed} answered from the journal; readers ended in {:?}",
        t.elapsed()
    );
    assert_eq!(
        (failed, wrong),
        (0, 0),
        "reads failed or returned wrong bytes"
    );
    assert!(replayed > 0, "no successor answered from the journal");
}

/// `/dev/fuse` descriptors and FUSE request journals process `pid` has open.
fn fuse_fds(pid: u32) -> (usize, usize) {
    let (mut fuse, mut journals) = (0, 0);
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd"));
    for e in dir.into_iter().flatten().flatten() {
        let target = std::fs::read_link(e.path()).unwrap_or_default();
        let target = target.to_string_lossy();
        if target == "/dev/fuse" {
            fuse += 1;
        } else if target.starts_with("/memfd:strata-fuse-journal") {
            journals += 1;
        }
    }
    (fuse, journals)
}

/// Waits up to 10 s for `f` to hold.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// In `fuse` mode every layer is a FUSE connection of its own: the holder keeps each one (and its
/// journal) beside the blob server's, every successor serves those very connections (no new
/// descriptor per restart), and a released layer's connection is closed in the holder and the server.
#[test]
fn fuse_mode_tree_connections_are_kept_by_the_holder_and_closed_on_release() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let files = build_tree_image(&store, "tree:v1", 4);
    let d = Daemon::start(&store, &["--mount-mode", "fuse"]);
    let holder = d.holder_pid();
    // The blob server's connection and journal.
    assert_eq!(fuse_fds(holder), (1, 1));
    assert_eq!(fuse_fds(d.server_pid()), (1, 1));
    let r = PathBuf::from(d.ok(&["mount", "tree:v1", "--sandbox", "a"]));
    let status = json(&d.ok(&["daemon", "status"]));
    let layers = status["layers"].as_array().expect("layers").len();
    assert!(layers > 0, "{status}");
    assert_eq!(status["fuse"]["trees"]["connections"], layers, "{status}");
    let want = (1 + layers, 1 + layers);
    eventually("the holder keeps every tree connection", || {
        fuse_fds(holder) == want
    });
    for _ in 0..3 {
        let old = d.server_pid();
        // SAFETY: killing the server this test's daemon started.
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        let new = d.wait_new_server(old);
        assert_eq!(
            fuse_fds(new),
            want,
            "the successor serves the kept connections"
        );
        assert_eq!(fuse_fds(holder), want, "no descriptor gained or lost");
        drop_caches();
        for (name, data) in &files {
            assert!(std::fs::read(r.join("data").join(name)).expect("read") == *data);
        }
    }
    let status = json(&d.ok(&["daemon", "status"]));
    assert_eq!(status["holder"]["kept"], 2 * layers, "{status}");
    d.ok(&["umount", "--sandbox", "a"]);
    eventually("the holder closes released connections", || {
        fuse_fds(holder) == (1, 1)
    });
    eventually("the server closes released connections", || {
        fuse_fds(d.server_pid()) == (1, 1)
    });
}
