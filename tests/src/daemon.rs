//! A `stratad` under test: started on its own state and runtime directories, its holder and server
//! pids, kills of either or both, restarts, and a check that a stop leaves no mount behind.
//!
//! `STRATA_TEST_MOUNT_MODE=loop` (or `file`, `auto`) runs every daemon test in that mount mode: it is
//! passed as `--mount-mode` unless the test names one itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{cpath, json, scratch, stratad_bin, StoreEnv};

/// A `stratad` started for a test, with its own state and runtime directories; stopped (SIGTERM) when
/// dropped, then checked to have left no mount behind.
pub struct Daemon {
    child: Option<Child>,
    /// The stratad binary started (a copy, for tests that upgrade it in place).
    pub bin: PathBuf,
    pub state: tempfile::TempDir,
    pub runtime: PathBuf,
    pub socket: PathBuf,
    pub store: StoreEnv,
    /// Extra environment for every stratad started (e.g. `STRATAD_NO_RESEND`).
    pub env: Vec<(String, String)>,
    /// The network namespace stratad runs in (`/run/netns/NAME`; see [`crate::machines`]).
    pub netns: Option<PathBuf>,
}

impl Daemon {
    /// Starts stratad on `store` with extra flags; waits for its socket.
    pub fn start(store: &StoreEnv, extra: &[&str]) -> Daemon {
        Daemon::start_in(store, scratch("state"), extra)
    }

    /// [`Daemon::start`] on a prepared state directory.
    pub fn start_in(store: &StoreEnv, state: tempfile::TempDir, extra: &[&str]) -> Daemon {
        Daemon::launch(store, state, extra, Vec::new(), None)
    }

    /// [`Daemon::start`] inside the network namespace `netns` (`/run/netns/NAME`).
    pub fn start_in_netns(store: &StoreEnv, extra: &[&str], netns: &Path) -> Daemon {
        let ns = Some(netns.to_path_buf());
        Daemon::launch(store, scratch("state"), extra, Vec::new(), ns)
    }

    /// [`Daemon::start`] with extra environment variables for stratad.
    pub fn start_with_env(store: &StoreEnv, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Daemon::launch(store, scratch("state"), extra, env, None)
    }

    fn launch(
        store: &StoreEnv,
        state: tempfile::TempDir,
        extra: &[&str],
        env: Vec<(String, String)>,
        netns: Option<PathBuf>,
    ) -> Daemon {
        let runtime = state.path().join("run");
        let mut d = Daemon {
            child: None,
            bin: stratad_bin(),
            socket: runtime.join("stratad.sock"),
            runtime,
            state,
            store: store.clone(),
            env,
            netns,
        };
        d.spawn(extra);
        d
    }

    /// Stops the daemon and starts it again on the same state directory (chunk cache, metadata).
    pub fn restart(&mut self, extra: &[&str]) {
        let left = self.stop();
        assert!(left.is_empty(), "mounts left behind: {left:?}");
        self.spawn(extra);
    }

    /// Starts (another) stratad on this daemon's directories; returns it without waiting for anything.
    pub fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("--config")
            .arg("/dev/null")
            .arg("--store")
            .arg(&self.store.url)
            .arg("--state-dir")
            .arg(self.state.path())
            .arg("--runtime-dir")
            .arg(&self.runtime)
            .args(extra)
            .env("STRATA_LOG", "warn");
        if let Some(mode) = test_mount_mode() {
            if !extra.iter().any(|a| a.starts_with("--mount-mode")) {
                c.arg("--mount-mode").arg(mode);
            }
        }
        for (k, v) in self.store.env.iter().chain(&self.env) {
            c.env(k, v);
        }
        if let Some(ns) = &self.netns {
            crate::machines::enter_netns(&mut c, ns);
        }
        c
    }

    /// Starts stratad again after [`Daemon::kill_all`] (or a stop), on the same directories.
    pub fn start_again(&mut self, extra: &[&str]) {
        self.spawn(extra);
    }

    /// Uses a copy of stratad in the state directory from now on (so a test can install another
    /// binary at that path and upgrade to it).
    pub fn use_copied_bin(&mut self) -> PathBuf {
        let dir = self.state.path().join("bin");
        std::fs::create_dir_all(&dir).expect("bin dir");
        let p = dir.join("stratad");
        std::fs::copy(stratad_bin(), &p).expect("copy stratad");
        self.bin = p.clone();
        p
    }

    /// The pid of the descriptor holder (the process the test started).
    pub fn holder_pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The pid of the process serving the FUSE connection (from `GET /v1/status`).
    pub fn server_pid(&self) -> u32 {
        let v = json(&self.ok(&["daemon", "status"]));
        v["pid"].as_u64().expect("status pid") as u32
    }

    /// Waits until a server other than `old` answers; returns its pid.
    pub fn wait_new_server(&self, old: u32) -> u32 {
        let start = Instant::now();
        loop {
            let o = self.strata(&["daemon", "status"]);
            if o.status.success() {
                let v = json(&String::from_utf8_lossy(&o.stdout));
                match v["pid"].as_u64() {
                    Some(p) if p as u32 != old => return p as u32,
                    _ => {}
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no new server after {old}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the server (not the holder) and waits for the successor the holder starts: its pid.
    pub fn kill_server(&self) -> u32 {
        let old = self.server_pid();
        // SAFETY: killing the server this test's daemon started.
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        self.wait_new_server(old)
    }

    /// SIGKILLs the holder and the server: the node as after a crash (mounts left behind, dead).
    pub fn kill_all(&mut self) {
        let server = self.server_pid();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // SAFETY: sending a signal to a process this test started (through its holder).
        unsafe { libc::kill(server as i32, libc::SIGKILL) };
        let start = Instant::now();
        while Path::new(&format!("/proc/{server}")).exists()
            && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn spawn(&mut self, extra: &[&str]) {
        let _ = std::fs::remove_file(&self.socket);
        let mut c = self.command(extra);
        c.stdout(Stdio::null()).stderr(Stdio::inherit());
        self.child = Some(c.spawn().expect("start stratad"));
        let start = Instant::now();
        while !self.socket.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "stratad did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `strata ARGS` against this daemon and store.
    pub fn strata(&self, args: &[&str]) -> Output {
        let mut full = vec!["--socket", self.socket.to_str().expect("utf8")];
        full.extend_from_slice(args);
        self.store.run(&full)
    }

    /// stratad's `/metrics` text.
    pub fn metrics(&self) -> String {
        let client = strata_api::Client {
            socket: self.socket.clone(),
        };
        let text = client.call("GET", "/metrics", None).expect("GET /metrics");
        text.as_str().expect("metrics are text").to_string()
    }

    /// Like [`Self::strata`], panicking on failure; returns standard output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.strata(args);
        assert!(
            out.status.success(),
            "strata {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The loop devices bound to this daemon's files (blob files, layer metadata).
    pub fn loop_devices(&self) -> Vec<strata_fs::loops::Bound> {
        let dirs = [self.runtime.join("fuse"), self.state.path().join("layers")];
        let dirs: Vec<PathBuf> = dirs
            .iter()
            .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
            .collect();
        strata_fs::loops::devices_under(&dirs)
    }

    /// Waits (up to 10 s) until no loop device is bound to this daemon's files; returns those left.
    pub fn wait_loops_released(&self) -> Vec<strata_fs::loops::Bound> {
        let start = Instant::now();
        loop {
            let left = self.loop_devices();
            if left.is_empty() || start.elapsed() > Duration::from_secs(10) {
                return left;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Mount points below the runtime directory.
    pub fn mounts(&self) -> Vec<String> {
        strata_fs::state::mount_points(&self.runtime)
            .iter()
            .map(|p| p.display().to_string())
            .collect()
    }

    /// Stops with SIGTERM and waits; returns the mounts left behind (should be none).
    pub fn stop(&mut self) -> Vec<String> {
        if let Some(mut c) = self.child.take() {
            // SAFETY: sending a signal to our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                if start.elapsed() > Duration::from_secs(30) {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.mounts()
    }
}

/// The mount mode every daemon test runs in (`STRATA_TEST_MOUNT_MODE`), if set.
pub fn test_mount_mode() -> Option<String> {
    std::env::var("STRATA_TEST_MOUNT_MODE")
        .ok()
        .filter(|m| !m.is_empty())
}

/// The mount mode a test's daemon runs in when started without `--mount-mode`: the one
/// `STRATA_TEST_MOUNT_MODE` forces, else the one `auto` takes on this machine (`stratad --check`,
/// asked once).
pub fn effective_mount_mode() -> String {
    static HERE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(m) = test_mount_mode().filter(|m| m != "auto") {
        return m;
    }
    HERE.get_or_init(|| {
        let state = tempfile::tempdir().expect("a state directory for the probe");
        let (_, r) = stratad_check(state.path(), "auto");
        r["mode"].as_str().unwrap_or("none").to_string()
    })
    .clone()
}

/// `stratad --check --json --mount-mode <mode>` with defaults otherwise, on state directory `state`:
/// whether it passed, and its report.
pub fn stratad_check(state: &std::path::Path, mode: &str) -> (bool, serde_json::Value) {
    let o = Command::new(crate::stratad_bin())
        .args([
            "--config",
            "/dev/null",
            "--check",
            "--json",
            "--mount-mode",
            mode,
        ])
        .arg("--state-dir")
        .arg(state)
        .output()
        .expect("stratad --check");
    (
        o.status.success(),
        crate::json(&String::from_utf8_lossy(&o.stdout)),
    )
}

/// What a node holds of fetched data, from `GET /v1/status`: `(chunks, bytes)` in the chunk cache plus
/// (`fanotify` mode, where the view files are the blobs' cache) the chunks filled in view files and
/// the disk space the view files take. A server that starts on an earlier one's view files counts
/// their chunks only as it checks them, but their bytes at once.
pub fn held(status: &serde_json::Value) -> (u64, u64) {
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let (cache, views) = (&status["cache"], &status["fanotify"]);
    (
        n(&cache["chunks"]) + n(&views["kept_chunks"]),
        n(&cache["used"]) + n(&views["disk_bytes"]),
    )
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let left = self.stop();
        for m in left.iter().rev() {
            let c = cpath(Path::new(m));
            // SAFETY: valid path; MNT_DETACH.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}
