//! stratad's descriptor holder: the process that keeps the node's FUSE connection (and the control
//! socket) open while the servers that answer it come and go.
//!
//! `stratad` started by hand (not by systemd, not `--no-holder`) becomes the holder. It takes the state
//! directory's lock, cleans up after a dead node, mounts a new blob-server connection and binds the
//! control socket — then does nothing but keep those descriptors and run a *server*: the same binary,
//! started again with the descriptors inherited ([`ENV`] names them). When the server dies (`kill -9`,
//! a crash) the holder starts a successor at once; the kernel objects every sandbox uses never notice,
//! and reads the dead server held are resent to the successor. On SIGHUP (`strata daemon upgrade`) the
//! holder asks the server to hand over (SIGTERM: stop reading requests, exit, leave every mount), then
//! starts the binary now installed at the path stratad was started from. On SIGTERM or SIGINT it tears
//! the node down: the server unmounts everything (SIGUSR1), then the holder closes the connection.
//!
//! The holder links no store, cache or FUSE code paths of its own beyond the initial mount: the less it
//! does, the less there is to crash or to need an upgrade.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rustix::fs::{flock, FlockOperation};
use rustix::io::{fcntl_setfd, FdFlags};
use rustix::process::{kill_process, Pid, Signal};
use strata_fs::daemon::Config;

use crate::signals;

/// The environment variable that hands a server its inherited descriptors:
/// `fuse=N,api=N,lock=N,holder=PID[,fresh=1]` (`fresh`: the first server on a connection just mounted).
pub const ENV: &str = "STRATAD_SERVE";

/// Descriptors a server inherited from its holder.
pub struct Inherited {
    pub fuse: OwnedFd,
    pub api: OwnedFd,
    /// The state directory's lock (shared with the holder: it stays held while either lives).
    pub lock: OwnedFd,
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
    let get = |k: &str| -> Result<i32> {
        spec.split(',')
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{ENV}={spec:?}: no {k}"))
    };
    let (fuse, api, lock, holder) = (get("fuse")?, get("api")?, get("lock")?, get("holder")?);
    for fd in [fuse, api, lock] {
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
        holder: holder as u32,
        fresh: spec.split(',').any(|kv| kv == "fresh=1"),
    };
    for fd in [&inh.fuse, &inh.api, &inh.lock] {
        fcntl_setfd(fd, FdFlags::CLOEXEC)?;
    }
    Ok(Some(inh))
}

/// Takes the state directory's lock: one daemon per state directory. A second one fails, naming the
/// process that holds it.
pub fn lock_state(state_dir: &Path) -> Result<File> {
    std::fs::create_dir_all(state_dir)
        .with_context(|| format!("state directory {}", state_dir.display()))?;
    let path = state_dir.join("stratad.lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("lock {}", path.display()))?;
    if flock(&f, FlockOperation::NonBlockingLockExclusive).is_err() {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        bail!(
            "another stratad serves state directory {} (pid {}); stop it first, or use `strata daemon upgrade` to replace it",
            state_dir.display(),
            holder.trim()
        );
    }
    f.set_len(0)?;
    writeln!(f, "{}", std::process::id())?;
    Ok(f)
}

fn spawn(exe: &Path, args: &[OsString], env: &str) -> Result<Child> {
    Command::new(exe)
        .args(args)
        .env(ENV, env)
        .spawn()
        .with_context(|| format!("starting the server {}", exe.display()))
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

/// Waits until the first server answers on the control socket. A server that exits before (a bad
/// configuration, an unreachable store URL) ends the holder with an error rather than a restart loop.
fn first_ready(server: &mut Child, socket: &Path) -> Result<()> {
    let client = strata_fs::api::Client {
        socket: socket.to_path_buf(),
    };
    let start = Instant::now();
    loop {
        if let Some(status) = server.try_wait()? {
            bail!("the stratad server exited while starting ({status}); see its error above");
        }
        let probe = Some(Duration::from_millis(500));
        if client.call_within("GET", "/v1/status", None, probe).is_ok() {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!("the stratad server did not answer within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the holder until SIGTERM or SIGINT. `args` are stratad's own arguments, given to each server.
pub fn hold(config: &Config, args: Vec<OsString>) -> Result<()> {
    let set = signals::block(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGCHLD]);
    let lock = lock_state(&config.state_dir)?;
    let chan = strata_fs::daemon::mount_fresh(config).context("mounting the blob server")?;
    let socket = config.runtime_dir.join("stratad.sock");
    let listener = strata_fs::api::bind(&socket, config.group)
        .with_context(|| format!("control socket {}", socket.display()))?;
    for fd in [chan.fd(), listener.as_fd(), lock.as_fd()] {
        fcntl_setfd(fd, FdFlags::empty())?;
    }
    let env = format!(
        "fuse={},api={},lock={},holder={}",
        chan.fd().as_raw_fd(),
        listener.as_raw_fd(),
        lock.as_raw_fd(),
        std::process::id()
    );
    // Resolved now: an upgrade installs the new binary at this path.
    let exe: PathBuf = std::env::current_exe().context("stratad's own path")?;
    let mut server = spawn(&exe, &args, &format!("{env},fresh=1"))?;
    if let Err(e) = first_ready(&mut server, &socket) {
        strata_fs::daemon::cleanup_mounts(&config.runtime_dir);
        let _ = std::fs::remove_file(&socket);
        return Err(e);
    }
    let mut started = Instant::now();
    let mut quick_deaths = 0u32;
    tracing::info!(
        holder = std::process::id(),
        server = server.id(),
        "stratad ready"
    );
    loop {
        match signals::wait(&set) {
            libc::SIGCHLD => {
                let Ok(Some(status)) = server.try_wait() else {
                    continue;
                };
                // A server that keeps dying as it starts is given a growing pause (up to 5 s), but
                // only after three in a row: one killed soon after it started must be replaced at once.
                quick_deaths = match started.elapsed() < Duration::from_secs(1) {
                    true => quick_deaths + 1,
                    false => 0,
                };
                let pause =
                    Duration::from_millis(100 * u64::from(quick_deaths.saturating_sub(3).min(50)));
                tracing::warn!(%status, ?pause, "server exited; starting a successor on the same connection");
                std::thread::sleep(pause);
                server = spawn(&exe, &args, &env)?;
                started = Instant::now();
            }
            libc::SIGHUP => {
                let old = server.id();
                stop(&mut server, Signal::TERM, Duration::from_secs(30));
                server = spawn(&exe, &args, &env)?;
                started = Instant::now();
                tracing::info!(old, new = server.id(), exe = %exe.display(), "server upgraded");
            }
            sig => {
                tracing::info!(signal = sig, "stopping: tearing the node down");
                stop(&mut server, Signal::USR1, Duration::from_secs(60));
                strata_fs::daemon::cleanup_mounts(&config.runtime_dir);
                let _ = std::fs::remove_file(&socket);
                drop(chan);
                return Ok(());
            }
        }
    }
}
