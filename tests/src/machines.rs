//! Many machines on one machine: simulated builders and nodes, each a network namespace of its own
//! with its own client of the shared store (issue 23, points 3 and 4).
//!
//! `scripts/cluster/moosefs start` with `STRATA_MFS_BRIDGE=NAME` puts the MooseFS master and chunk
//! servers behind a bridge `NAME` (host address `NET.1`, master `NET.2`) and says so in its env lines
//! (`STRATA_MFS_BRIDGE`, `STRATA_MFS_NET`, `STRATA_MFS_MASTER`, `STRATA_MFS_DIR`, `STRATA_MFS_NETNS`;
//! [`Cluster::from_env`]).
//! A [`Machine`] is then:
//!
//! - a network namespace `NAME-ROLE` with a veth pair whose host end is a port of the bridge and whose
//!   other end holds `NET.(20 + index)/24`: its own address and route to the cluster;
//! - its own `mfsmount` of the volume, started inside the namespace (by `setns(2)` before `exec`, so the
//!   client's connections to the master and chunk servers leave from the machine's address) but mounted
//!   in the host's mount namespace, where the test reads it; its store is `file://MOUNT/SUBDIR`;
//! - its own local disk (a scratch directory): the builder's index cache, the node's stratad state,
//!   chunk cache and runtime directory; a node's stratad runs in the namespace too ([`Machine::daemon`]).
//!
//! Everything a machine starts is ended by its PID when it is dropped (also when a test panics): the
//! mount is unmounted, `mfsmount` ended, the veth and the namespace deleted. So that a run killed outright
//! leaves nothing behind either, each machine records its namespace, host interface, mount point and
//! the PIDs of its `mfsmount` and stratads in `STRATA_MFS_DIR/machines/NAME`, which
//! `scripts/cluster/moosefs stop` undoes.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{require, scratch, Daemon, S3Server, StoreEnv};

/// The MooseFS cluster the machines join, as `scripts/cluster/moosefs` describes it.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// The bridge the cluster's namespace is a port of.
    pub bridge: String,
    /// The first three octets of the cluster's /24 (e.g. `10.23.7`).
    pub net: String,
    /// The master's address.
    pub master: String,
    /// The cluster's directory (PIDs of its processes, its chunk servers' data).
    pub dir: PathBuf,
    /// The network namespace of the master and chunk servers.
    pub netns: String,
}

/// Set by `scripts/test-clusters`: the machine tests must run, so a missing cluster fails under CI.
const REQUIRED: &str = "STRATA_MACHINES_REQUIRED";

impl Cluster {
    /// The cluster named by the environment. Without one the machine tests do not run: they belong to
    /// the multi-client tier (`scripts/test-clusters`), which starts it; there (`STRATA_MACHINES_REQUIRED=1`)
    /// a missing cluster is a skip, or a failure under `CI=true`.
    pub fn from_env() -> Option<Cluster> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        match (
            var("STRATA_MFS_BRIDGE"),
            var("STRATA_MFS_NET"),
            var("STRATA_MFS_MASTER"),
            var("STRATA_MFS_DIR"),
            var("STRATA_MFS_NETNS"),
        ) {
            (Some(bridge), Some(net), Some(master), Some(dir), Some(netns)) if crate::is_root() => {
                Some(Cluster {
                    bridge,
                    net,
                    master,
                    dir: PathBuf::from(dir),
                    netns,
                })
            }
            _ if std::env::var_os(REQUIRED).is_some() => {
                require(
                    "root and a MooseFS cluster on a bridge (scripts/cluster/moosefs start with \
                     STRATA_MFS_BRIDGE; its env lines)",
                    false,
                );
                None
            }
            _ => {
                eprintln!(
                    "not run here: the machine tests run in scripts/test-clusters (MooseFS on a bridge)"
                );
                None
            }
        }
    }

    /// [`Cluster::from_env`], for a test that also mounts (root, kernel EROFS, /dev/fuse; see
    /// [`crate::have`]).
    pub fn for_nodes() -> Option<Cluster> {
        let c = Cluster::from_env()?;
        crate::have(&[crate::Need::Mount]).then_some(c)
    }

    /// The PID of chunk server `n` (1 or 2) as the cluster script recorded it.
    pub fn chunkserver_pid(&self, n: u8) -> i32 {
        let f = self.dir.join(format!("pid.cs{n}"));
        std::fs::read_to_string(&f)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no PID in {}", f.display()))
    }

    /// Starts chunk server `n` again (`scripts/cluster/moosefs start-cs`).
    pub fn start_chunkserver(&self, n: u8) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster/moosefs");
        let o = Command::new(script)
            .args(["start-cs", &self.dir.display().to_string(), &n.to_string()])
            .env("STRATA_MFS_NETNS", &self.netns)
            .env("STRATA_MFS_NET", &self.net)
            .output()
            .expect("run scripts/cluster/moosefs start-cs");
        assert!(
            o.status.success(),
            "start-cs {n}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// Runs `cmd` inside the network namespace at `netns` (`/run/netns/NAME`): `setns(2)` in the child
/// before `exec`, so its PID is the program's own.
pub fn enter_netns(cmd: &mut Command, netns: &Path) {
    let ns = std::fs::File::open(netns)
        .unwrap_or_else(|e| panic!("network namespace {}: {e}", netns.display()));
    // SAFETY: the closure only calls setns(2), which is async-signal-safe, on a descriptor it owns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Runs `ip ARGS`, panicking with its error output.
fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A simulated machine (see the module documentation).
pub struct Machine {
    /// The network namespace's name (`BRIDGE-ROLE`).
    pub name: String,
    /// The machine's address.
    pub addr: String,
    netns: PathBuf,
    host_if: String,
    record: PathBuf,
    /// The machine's local disk.
    pub disk: tempfile::TempDir,
    mfsmount: Option<Child>,
    mount: PathBuf,
}

impl Machine {
    /// Creates machine `role` (e.g. `n1`) with address `NET.(20 + index)` and mounts the volume.
    pub fn new(cluster: &Cluster, role: &str, index: u8) -> Machine {
        let mut m = Machine::without_volume(cluster, role, index);
        m.mount_volume(cluster);
        m
    }

    /// [`Machine::new`] without a MooseFS client: a machine whose store is the S3 server
    /// ([`Machine::s3_store`]).
    pub fn without_volume(cluster: &Cluster, role: &str, index: u8) -> Machine {
        let name = format!("{}-{role}", cluster.bridge);
        let short: String = cluster.bridge.chars().take(9).collect();
        let (host_if, ns_if) = (format!("{short}{index:02}h"), format!("{short}{index:02}n"));
        let addr = format!("{}.{}", cluster.net, 20 + u32::from(index));
        let disk = scratch(&format!("machine-{role}"));
        let record = cluster.dir.join("machines").join(&name);
        std::fs::create_dir_all(&record).expect("machine record dir");
        let m = Machine {
            netns: PathBuf::from("/run/netns").join(&name),
            mount: disk.path().join("mfs"),
            name,
            addr,
            host_if,
            record,
            disk,
            mfsmount: None,
        };
        // Recorded first, so that a stop after a failure below undoes what was done.
        m.note("netns", &m.name);
        m.note("hostif", &m.host_if);
        ip(&["netns", "add", &m.name]);
        ip(&[
            "link", "add", &m.host_if, "type", "veth", "peer", "name", &ns_if,
        ]);
        ip(&["link", "set", &ns_if, "netns", &m.name]);
        ip(&["link", "set", &m.host_if, "master", &cluster.bridge, "up"]);
        let cidr = format!("{}/24", m.addr);
        ip(&["-n", &m.name, "addr", "add", &cidr, "dev", &ns_if]);
        ip(&["-n", &m.name, "link", "set", &ns_if, "up"]);
        ip(&["-n", &m.name, "link", "set", "lo", "up"]);
        m
    }

    fn note(&self, what: &str, value: &str) {
        std::fs::write(self.record.join(what), value).expect("machine record");
    }

    /// Mounts the MooseFS volume with a client running in this machine's namespace.
    fn mount_volume(&mut self, cluster: &Cluster) {
        std::fs::create_dir_all(&self.mount).expect("mount point");
        let log = std::fs::File::create(self.disk.path().join("mfsmount.log")).expect("log");
        let mut c = Command::new("mfsmount");
        c.arg("-f")
            .arg(&self.mount)
            .args(["-H", &cluster.master, "-P", "9421"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        enter_netns(&mut c, &self.netns);
        let child = c.spawn().expect("start mfsmount");
        self.note("pid", &child.id().to_string());
        self.note("mount", &self.mount.display().to_string());
        self.mfsmount = Some(child);
        let start = Instant::now();
        while !is_mountpoint(&self.mount) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{}: mfsmount not up after 30 s (log: {})",
                self.name,
                self.disk.path().join("mfsmount.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// This machine's view of directory `sub` of the shared volume.
    pub fn shared(&self, sub: &str) -> PathBuf {
        self.mount.join(sub)
    }

    /// The store `file://MOUNT/SUB` as this machine sees it, with an index cache on its local disk.
    pub fn store(&self, sub: &str) -> StoreEnv {
        let mut s = StoreEnv::local(&self.shared(sub));
        s.env = vec![(
            "STRATA_INDEX_CACHE".into(),
            self.disk.path().join("index-cache").display().to_string(),
        )];
        s
    }

    /// The store `s3://BUCKET/PREFIX` of `server`, reached at `endpoint` (an address of the S3 server
    /// this machine's namespace can reach), with an index cache on the machine's local disk.
    pub fn s3_store(
        &self,
        server: &S3Server,
        bucket: &str,
        prefix: &str,
        endpoint: &str,
    ) -> StoreEnv {
        let mut s = server.store(bucket, prefix);
        for (k, v) in s.env.iter_mut() {
            match k.as_str() {
                "AWS_ENDPOINT_URL" => *v = endpoint.to_string(),
                "STRATA_INDEX_CACHE" => {
                    *v = self.disk.path().join("index-cache").display().to_string()
                }
                _ => {}
            }
        }
        s
    }

    /// A command that runs in this machine's namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        enter_netns(&mut c, &self.netns);
        c
    }

    /// Runs `strata ARGS` on this machine against `store`.
    pub fn strata(&self, store: &StoreEnv, args: &[&str]) -> Output {
        let mut c = store.command(args);
        enter_netns(&mut c, &self.netns);
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.output().expect("run strata")
    }

    /// A stratad of this machine on `store` (state, cache and runtime on the machine's disk).
    pub fn daemon(&self, store: &StoreEnv, extra: &[&str]) -> Daemon {
        let d = Daemon::start_in_netns(store, extra, &self.netns);
        // For `scripts/cluster/moosefs stop` after a run killed outright (SIGTERM: stratad unmounts).
        let pids = self.record.join("stratad");
        let mut all = std::fs::read_to_string(&pids).unwrap_or_default();
        all.push_str(&format!("{}\n", d.holder_pid()));
        std::fs::write(&pids, all).expect("machine record");
        d
    }
}

/// Takes machines down all at once (an `mfsmount` takes 1.5 to 3 s to exit after its unmount; one
/// after the other, eight machines would take 20 s).
pub fn teardown(machines: impl IntoIterator<Item = Machine>) {
    std::thread::scope(|s| {
        for m in machines {
            s.spawn(move || drop(m));
        }
    });
}

/// True when `p` is a mount point (its device differs from its parent's).
fn is_mountpoint(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(p), p.parent().map(std::fs::metadata)) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).output();
        if is_mountpoint(&self.mount) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).output();
        }
        if let Some(mut c) = self.mfsmount.take() {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while !matches!(c.try_wait(), Ok(Some(_))) {
                if start.elapsed() > Duration::from_secs(5) {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = std::fs::remove_dir_all(&self.record);
    }
}
