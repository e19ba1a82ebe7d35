//! A real containerd for the snapshotter tests: Debian's containerd 1.6 on its own root, state
//! directory and socket, with a config naming strata's snapshotter as a proxy plugin and as the CRI
//! plugin's snapshotter (annotations passed through), a loopback registry reachable over plain HTTP;
//! and `strata-snapshotter` itself, on its own root, talking to a test's stratad.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{have, scratch, sibling_bin, Need};

/// Path of the snapshotter built for these tests.
pub fn snapshotter_bin() -> PathBuf {
    sibling_bin("strata-snapshotter-under-test")
}

fn wait_for_socket(p: &Path, what: &str, child: &mut Child) {
    let start = Instant::now();
    while !p.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited at start: {st}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        // SAFETY: signalling a process this test started.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while !matches!(c.try_wait(), Ok(Some(_))) {
            if start.elapsed() > Duration::from_secs(10) {
                let _ = c.kill();
                let _ = c.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `strata-snapshotter` on its own root and socket.
pub struct Snapshotter {
    child: Option<Child>,
    pub root: tempfile::TempDir,
    pub socket: PathBuf,
    strata_socket: PathBuf,
}

impl Snapshotter {
    /// Starts it against stratad's control socket; waits for its socket.
    pub fn start(strata_socket: &Path) -> Snapshotter {
        let root = scratch("snapshotter");
        let socket = root.path().join("snapshotter.sock");
        let mut s = Snapshotter {
            child: None,
            root,
            socket,
            strata_socket: strata_socket.to_path_buf(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let mut child = Command::new(snapshotter_bin())
            .arg("--address")
            .arg(&self.socket)
            .arg("--root")
            .arg(self.root.path().join("root"))
            .env("STRATA_SOCKET", &self.strata_socket)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start strata-snapshotter");
        wait_for_socket(&self.socket, "strata-snapshotter", &mut child);
        self.child = Some(child);
    }

    /// SIGKILLs it (nothing it leaves behind may break a running container) and starts it again.
    pub fn kill_and_restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn();
    }

    /// `strata-snapshotter pull IMAGE` through containerd's CRI plugin.
    pub fn pull(&self, containerd: &Containerd, image: &str) -> Output {
        self.pull_with_env(containerd, image, &[])
    }

    /// [`Snapshotter::pull`] with more environment (`DOCKER_CONFIG`, say).
    pub fn pull_with_env(
        &self,
        containerd: &Containerd,
        image: &str,
        env: &[(&str, &std::path::Path)],
    ) -> Output {
        Command::new(snapshotter_bin())
            .arg("pull")
            .arg(image)
            .arg("--containerd")
            .arg(&containerd.socket)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .output()
            .expect("run strata-snapshotter pull")
    }
}

impl Drop for Snapshotter {
    fn drop(&mut self) {
        stop(&mut self.child);
    }
}

/// containerd on its own directories.
pub struct Containerd {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

/// True when containerd, ctr and the runc shim are installed (else skips, or fails in CI).
pub fn have_containerd() -> bool {
    have(&[Need::Containerd])
}

impl Containerd {
    /// Starts containerd with `snapshotter` as its `strata` proxy plugin and the CRI plugin's
    /// snapshotter; `registry` (`HOST:PORT`) is reached over plain HTTP.
    pub fn start(snapshotter: &Path, registry: &str) -> Containerd {
        let dir = scratch("containerd");
        let d = dir.path();
        let socket = d.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"

[proxy_plugins]
  [proxy_plugins.strata]
    type = "snapshot"
    address = "{snap}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "strata"
    disable_snapshot_annotations = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/cni/bin"
    conf_dir = "{d}/cni/conf"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{registry}"]
    endpoint = ["http://{registry}"]
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            sock = socket.display(),
            snap = snapshotter.display(),
            d = d.display(),
        );
        let cfg = d.join("config.toml");
        std::fs::write(&cfg, config).expect("write containerd config");
        let log = std::fs::File::create(d.join("containerd.log")).expect("log file");
        let mut child = Command::new("containerd")
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        wait_for_socket(&socket, "containerd", &mut child);
        let c = Containerd {
            child: Some(child),
            dir,
            socket,
        };
        // Ready when it answers.
        let start = Instant::now();
        while !c.ctr("default", &["version"]).status.success() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "containerd not answering"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    /// `ctr --address SOCK -n NS ARGS`.
    pub fn ctr(&self, ns: &str, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", ns])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run ctr")
    }

    /// [`Containerd::ctr`], panicking on failure; returns standard output.
    pub fn ok(&self, ns: &str, args: &[&str]) -> String {
        let o = self.ctr(ns, args);
        assert!(
            o.status.success(),
            "ctr {args:?} failed: {}{}\ncontainerd log tail: {}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The end of containerd's log (for failure messages).
    pub fn log_tail(&self) -> String {
        let log =
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Containers this test left: their tasks killed and removed before containerd stops.
        for ns in ["default", "k8s.io"] {
            let out = self.ctr(ns, &["task", "ls", "-q"]);
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = self.ctr(ns, &["task", "kill", "-s", "SIGKILL", id]);
                let _ = self.ctr(ns, &["task", "rm", "-f", id]);
            }
            let out = self.ctr(ns, &["container", "ls", "-q"]);
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = self.ctr(ns, &["container", "rm", id]);
            }
        }
        stop(&mut self.child);
        // Mounts containerd made under its root or state (rootfs of killed tasks) go too.
        for m in strata_fs::state::mount_points(self.dir.path()).iter().rev() {
            let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
        }
    }
}
