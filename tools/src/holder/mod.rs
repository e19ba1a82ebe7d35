//! stratad's descriptor holder: the process that keeps the node's FUSE connection (and the control
//! socket) open while the servers that answer it come and go.
//!
//! `stratad` started by hand (not by systemd, not `--no-holder`) becomes the holder. It takes the node's
//! locks ([`locks`]: the state directory's and the runtime directory's), cleans up after a dead node,
//! mounts a new blob-server connection and binds the control socket — then does nothing but keep those
//! descriptors and run a *server*: the same program, started again with the descriptors inherited
//! ([`ENV`] names them). The kernel objects every sandbox uses never notice a server change, and reads
//! a dead server held are resent to the successor.
//!
//! **The holder never exits while sandboxes depend on it** — only on SIGTERM or SIGINT, which tear the
//! node down (the server unmounts everything on SIGUSR1, then the holder closes the connection). It keeps
//! an open descriptor to the binary of the last server that answered ([`server::Binary`]):
//!
//! - a server that dies (`kill -9`, a crash) is replaced at once from that binary — what runs changes
//!   only on an upgrade, never because a file appeared at stratad's path;
//! - on SIGHUP (`strata daemon upgrade`) the binary now at stratad's path is opened and asked for its
//!   version (bounded); if it is missing, not executable, not stratad or hangs, the serving server is
//!   left alone. Otherwise the server hands over (SIGTERM: stop reading requests, exit, leave every
//!   mount) and the new binary is started; if it exits before answering on the control socket, or does
//!   not answer within [`UPGRADE_READY`], it is killed and the last working binary is started again;
//! - servers that keep dying are restarted with a growing pause (up to 5 s), for ever.
//!
//! **Descriptors servers keep.** In `fuse` mount mode every layer is a FUSE connection of its own,
//! mounted by a server: the server hands each one (and its journal) to the holder's descriptor store
//! ([`store`]: systemd's `FDSTORE` protocol on a socket pair the holder gives each server) and every
//! later server inherits them all, named, beside the blob connection.
//!
//! Every outcome goes to the log and to [`report`] (`holder` in `GET /v1/status`). The holder links no
//! store, cache or FUSE code paths of its own beyond the initial mount: the less it does, the less there
//! is to crash or to need an upgrade.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rustix::io::{fcntl_setfd, FdFlags};
use rustix::process::{kill_process, Pid, Signal};
use strata_fs::daemon::Config;

use strata_cli::signals;

pub mod locks;
pub mod report;
pub mod server;
pub mod store;

use report::{Report, Upgrade};
use server::{Binary, StartError};
use store::FdStore;

/// The environment variable that hands a server its inherited descriptors:
/// `fuse=N,api=N,lock=N,rlock=N,journal=N,store=N,holder=PID[,fresh=1]` (`fresh`: the first server on a
/// connection just mounted; `lock`, `rlock`: the state and runtime directories' locks; `journal`: the
/// connection's request journal, `strata_fs::fuse::journal`; `store`: the server's socket to the
/// holder's descriptor store, [`store`]). The kept descriptors themselves are named in
/// [`store::KEPT_ENV`].
pub const ENV: &str = "STRATAD_SERVE";

/// How long a new binary has to answer on the control socket after an upgrade before the holder gives
/// up on it and starts the last working one again. (Adopting a node registers every running sandbox's
/// blobs from local records: well under a second for a thousand sandboxes.)
pub const UPGRADE_READY: Duration = Duration::from_secs(30);

/// How long a candidate binary has to answer `--version`.
pub const PROBE_LIMIT: Duration = Duration::from_secs(10);

/// Descriptors a server inherited from its holder.
pub struct Inherited {
    pub fuse: OwnedFd,
    pub api: OwnedFd,
    /// The state directory's lock (shared with the holder: it stays held while either lives).
    pub lock: OwnedFd,
    /// The runtime directory's lock (absent when started by an older holder).
    pub rlock: Option<OwnedFd>,
    /// The connection's request journal (absent when started by an older holder).
    pub journal: Option<OwnedFd>,
    /// The socket to the holder's descriptor store (absent when started by an older holder).
    pub store: Option<OwnedFd>,
    /// Descriptors kept by earlier servers, with their names.
    pub kept: Vec<(String, OwnedFd)>,
    pub holder: u32,
    /// The holder mounted the connection for this server: nobody served it before.
    pub fresh: bool,
}

/// The descriptors named by [`ENV`], if this process is a server started by a holder.
pub fn take_inherited() -> Result<Option<Inherited>> {
    let Ok(spec) = std::env::var(ENV) else {
        return Ok(None);
    };
    std::env::remove_var(ENV);
    let find = |k: &str| -> Option<i32> {
        spec.split(',')
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    };
    let get = |k: &str| find(k).with_context(|| format!("{ENV}={spec:?}: no {k}"));
    let (fuse, api, lock, holder) = (get("fuse")?, get("api")?, get("lock")?, get("holder")?);
    let (rlock, journal, store) = (find("rlock"), find("journal"), find("store"));
    for fd in [fuse, api, lock]
        .into_iter()
        .chain(rlock)
        .chain(journal)
        .chain(store)
    {
        if fd < 3 {
            bail!("{ENV}={spec:?}: descriptor {fd} is not an inherited one");
        }
    }
    // SAFETY: the holder left these descriptors open across exec for this process and named them in
    // ENV (removed above, so they are taken once); nothing else in this process owns them.
    let own = |fd: i32| unsafe { OwnedFd::from_raw_fd(fd) };
    let inh = Inherited {
        fuse: own(fuse),
        api: own(api),
        lock: own(lock),
        rlock: rlock.map(own),
        journal: journal.map(own),
        store: store.map(own),
        kept: store::take_kept()?,
        holder: holder as u32,
        fresh: spec.split(',').any(|kv| kv == "fresh=1"),
    };
    for fd in [&inh.fuse, &inh.api, &inh.lock]
        .into_iter()
        .chain(&inh.rlock)
        .chain(&inh.journal)
        .chain(&inh.store)
    {
        fcntl_setfd(fd, FdFlags::CLOEXEC)?;
    }
    Ok(Some(inh))
}

/// Signals a child and waits up to `wait` for it to exit, then kills it.
fn stop(child: &mut Child, sig: Signal, wait: Duration) {
    if let Some(pid) = Pid::from_raw(child.id() as i32) {
        let _ = kill_process(pid, sig);
    }
    let start = Instant::now();
    while start.elapsed() < wait {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    tracing::warn!(pid = child.id(), "server did not exit in time: killing it");
    let _ = child.kill();
    let _ = child.wait();
}

/// The holder's running state: the server, the binaries it may start, what it reports.
struct Holder {
    args: Vec<OsString>,
    env: String,
    socket: PathBuf,
    runtime_dir: PathBuf,
    /// stratad's path: where an upgrade installs the new binary.
    exe: PathBuf,
    /// The binary of the last server that answered.
    good: Binary,
    report: Report,
    server: Option<Child>,
    /// Descriptors servers keep for their successors.
    store: FdStore,
}

impl Holder {
    fn publish(&mut self) {
        self.report.server_pid = self.server.as_ref().map(Child::id);
        self.report.kept = self.store.len();
        self.report.publish(&self.runtime_dir);
    }

    /// Starts a server from `bin`, waiting up to `limit` for it to answer; kills it if it does not.
    fn start(&mut self, bin: &Binary, limit: Option<Duration>) -> Result<(), StartError> {
        // Every message of the previous server applied first: what it kept goes to this one.
        self.store.settle();
        let sock = self.store.connect().map_err(StartError::Store)?;
        let env = format!("{},store={}", self.env, sock.as_raw_fd());
        let spawned = bin.spawn(&self.args, &env, &self.store.env());
        // The server's copy only: end of file on the holder's end once the server is gone.
        drop(sock);
        let mut child = spawned?;
        match server::wait_ready(&mut child, &self.socket, limit) {
            Ok(()) => {
                self.server = Some(child);
                Ok(())
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Starts the last working binary again, for as long as it takes: a pause that grows with each
    /// failure in a row (up to 5 s). Never gives up: sandboxes depend on a server.
    fn restart_good(&mut self) {
        let mut failures = 0u64;
        loop {
            let bin = match self.good.try_clone() {
                Ok(b) => b,
                Err(e) => {
                    self.report
                        .fail(format!("duplicating the binary descriptor: {e}"));
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            };
            match self.start(&bin, None) {
                Ok(()) => {
                    self.report.serving = "last working binary".into();
                    self.publish();
                    return;
                }
                Err(e) => self
                    .report
                    .fail(format!("restarting {}: {e}", bin.path.display())),
            }
            failures += 1;
            self.publish();
            // One failure is retried at once (a server killed as it started); then 100 ms more per try.
            std::thread::sleep(Duration::from_millis(100 * (failures - 1).min(50)));
        }
    }

    /// A server exited: record it and start the last working binary again.
    fn on_exit(&mut self, status: std::process::ExitStatus) {
        self.server = None;
        self.report.fail(format!("server exited ({status})"));
        self.publish();
        tracing::warn!(%status, "server exited; starting a successor on the same connection");
        self.restart_good();
    }

    /// SIGHUP: replace the server with the binary now at stratad's path, or keep (or bring back) the
    /// last working one.
    fn upgrade(&mut self) {
        let seq = self.report.upgrade.as_ref().map_or(0, |u| u.seq) + 1;
        let outcome = self.try_upgrade();
        if let Err(e) = &outcome {
            tracing::error!(error = %e, "upgrade failed");
        }
        self.report.upgrade = Some(Upgrade {
            seq,
            ok: outcome.is_ok(),
            version: outcome.as_ref().ok().cloned(),
            error: outcome.err(),
            at: report::now(),
        });
        self.publish();
    }

    /// The upgrade itself: the new version, or why the old binary serves.
    fn try_upgrade(&mut self) -> Result<String, String> {
        let candidate = Binary::open(&self.exe)
            .and_then(|b| b.probe(PROBE_LIMIT).map(|v| (b, v)))
            .map_err(|e| format!("not upgraded, the running server stays: {e}"));
        let (bin, version) = candidate?;
        let old = self.server.as_ref().map(Child::id);
        if let Some(mut s) = self.server.take() {
            stop(&mut s, Signal::TERM, Duration::from_secs(30));
        }
        match self.start(&bin, Some(UPGRADE_READY)) {
            Ok(()) => {
                tracing::info!(?old, new = ?self.report.server_pid, exe = %self.exe.display(), %version, "server upgraded");
                self.good = bin;
                self.report.serving = "installed".into();
                Ok(version)
            }
            Err(e) => {
                let why = format!(
                    "{version} at {} failed: {e}; the last working binary serves again",
                    self.exe.display()
                );
                self.report.fail(why.clone());
                self.restart_good();
                Err(why)
            }
        }
    }
}

/// Runs the holder until SIGTERM or SIGINT. `args` are stratad's own arguments, given to each server.
pub fn hold(config: &Config, args: Vec<OsString>) -> Result<()> {
    let set = signals::block(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGCHLD]);
    let locks = locks::lock_node(&config.state_dir, &config.runtime_dir)?;
    locks::check_stale_mounts(&locks, &config.state_dir, &config.runtime_dir)?;
    let chan = strata_fs::daemon::mount_fresh(config).context("mounting the blob server")?;
    let socket = config.runtime_dir.join("stratad.sock");
    let listener = strata_fs::api::bind(&socket, config.group)
        .with_context(|| format!("control socket {}", socket.display()))?;
    let journal = chan.journal().map(|j| j.fd());
    for fd in [
        chan.fd(),
        listener.as_fd(),
        locks.state.as_fd(),
        locks.runtime.as_fd(),
    ]
    .into_iter()
    .chain(journal)
    {
        fcntl_setfd(fd, FdFlags::empty())?;
    }
    let mut env = format!(
        "fuse={},api={},lock={},rlock={},holder={}",
        chan.fd().as_raw_fd(),
        listener.as_raw_fd(),
        locks.state.as_raw_fd(),
        locks.runtime.as_raw_fd(),
        std::process::id()
    );
    if let Some(j) = journal {
        env.push_str(&format!(",journal={}", j.as_raw_fd()));
    }
    // Resolved now: an upgrade installs the new binary at this path.
    let exe: PathBuf = std::env::current_exe().context("stratad's own path")?;
    let mut h = Holder {
        args,
        env: env.clone(),
        socket: socket.clone(),
        runtime_dir: config.runtime_dir.clone(),
        good: Binary::running(&exe)?,
        exe,
        report: Report {
            holder_pid: std::process::id(),
            serving: "installed".into(),
            ..Report::default()
        },
        server: None,
        store: FdStore::default(),
    };
    h.report.exe = h.exe.clone();
    // The first server: one that cannot start (a bad configuration, an unreachable store URL) ends the
    // holder with an error rather than a restart loop — no sandbox depends on it yet.
    h.env = format!("{env},fresh=1");
    let first = h.good.try_clone()?;
    if let Err(e) = h.start(&first, None) {
        strata_fs::daemon::cleanup_mounts(&config.runtime_dir);
        let _ = std::fs::remove_file(&socket);
        bail!("the stratad server could not start: {e}; see its error above");
    }
    h.env = env;
    h.publish();
    tracing::info!(holder = std::process::id(), server = ?h.report.server_pid, "stratad ready");
    loop {
        match signals::wait(&set) {
            libc::SIGCHLD => {
                if let Some(Ok(Some(status))) = h.server.as_mut().map(Child::try_wait) {
                    h.on_exit(status);
                }
            }
            libc::SIGHUP => h.upgrade(),
            sig => {
                tracing::info!(signal = sig, "stopping: tearing the node down");
                if let Some(mut s) = h.server.take() {
                    stop(&mut s, Signal::USR1, Duration::from_secs(60));
                }
                strata_fs::daemon::cleanup_mounts(&config.runtime_dir);
                let _ = std::fs::remove_file(&socket);
                let _ = std::fs::remove_file(config.runtime_dir.join(report::FILE));
                drop(chan);
                drop(locks);
                return Ok(());
            }
        }
    }
}
