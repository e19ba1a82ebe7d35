//! `strata run`: a sandbox of an image, started as the image's config says, through stratad.
//!
//! stratad creates the sandbox and reports its process ([`strata_api::Process`]: entrypoint and
//! cmd, env with a `PATH`, working directory, user resolved in the image's own `/etc/passwd`); a command
//! after `--` replaces the cmd (the entrypoint stays, as `docker run IMAGE CMD…` does). The process runs
//! in the foreground with this program's standard input, output and error:
//!
//! - **bubblewrap** (the default): the rootfs bound at `/`, its own `/proc`, `/dev`, `/tmp`, pid, ipc
//!   and uts namespaces. For a user other than root, bubblewrap itself runs as that user and gid
//!   (supplementary groups dropped), in a user namespace that maps only them: the sandbox's processes
//!   have no more rights than that user, and files the image gives root show as `nobody`. That user
//!   cannot enter stratad's runtime directory (root's only), so the rootfs is bound for the run on a
//!   temporary directory only that user can enter.
//! - **runc** (`--runtime runc`): the OCI runtime config `strata bundle` writes, in a temporary bundle.
//!
//! The exit status is the process's (128+N when signal N ended it). SIGINT, SIGTERM and SIGHUP sent to
//! this program are passed to the runtime; this program itself waits, then removes the sandbox — also
//! when the runtime failed or a signal came — unless `--keep`, which stops it instead (rootfs unmounted,
//! upper directory and record kept for `pack_diff`, `mount --resume` or `strata rm`).

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use strata_api::{Client, Process};

use crate::SandboxState;

/// The runtime that starts the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Runtime {
    Bwrap,
    Runc,
}

/// Arguments of `strata run`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Image (tag or manifest digest).
    pub image: String,
    /// Sandbox id (default: run-<pid>).
    #[arg(long)]
    pub sandbox: Option<String>,
    #[arg(long, value_enum, default_value = "bwrap")]
    pub runtime: Runtime,
    /// Keep the sandbox afterwards, stopped (its upper directory), instead of removing it.
    #[arg(long)]
    pub keep: bool,
    /// Command and arguments replacing the image's cmd (its entrypoint stays).
    #[arg(last = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// The signal that came last (0: none) and the runtime's pid once started (0: not yet).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static CHILD: AtomicI32 = AtomicI32::new(0);

/// Takes SIGINT, SIGTERM and SIGHUP on a thread that passes them to the runtime (children start with
/// an empty signal mask: std resets it).
fn watch_signals() {
    let set = crate::signals::block(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP]);
    let _ = std::thread::Builder::new()
        .name("strata-signals".into())
        .spawn(move || loop {
            let sig = crate::signals::wait(&set);
            SIGNALLED.store(sig, Ordering::SeqCst);
            forward(sig);
        });
}

fn forward(sig: i32) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, sig) };
    }
}

/// A sandbox this command created: removed (or, kept, stopped) when dropped.
pub(crate) struct Created<'a> {
    client: &'a Client,
    id: String,
    keep: bool,
    /// False once handed on ([`Created::hand_on`]): dropping it then does nothing.
    armed: bool,
}

impl<'a> Created<'a> {
    /// Creates sandbox `id` of `image`; returns it with stratad's answer.
    pub(crate) fn new(
        client: &'a Client,
        image: &str,
        id: &str,
        keep: bool,
    ) -> Result<(Self, Value)> {
        let v = client.call(
            "POST",
            "/v1/sandboxes",
            Some(&json!({"image": image, "id": id})),
        )?;
        let me = Created {
            client,
            id: id.to_string(),
            keep,
            armed: true,
        };
        Ok((me, v))
    }

    /// The sandbox is someone else's now (a bundle's): it stays.
    pub(crate) fn hand_on(mut self) {
        self.armed = false;
    }
}

impl Drop for Created<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (q, what) = match self.keep {
            true => ("", "stopping"),
            false => ("?purge=1&force=1", "removing"),
        };
        let path = format!("/v1/sandboxes/{}{q}", self.id);
        if let Err(e) = self.client.call("DELETE", &path, None) {
            eprintln!("strata: {what} sandbox {}: {e}", self.id);
        }
    }
}

/// The process stratad reports in `v`, its cmd replaced by `cmd` (when given).
pub(crate) fn process_of(v: &Value, id: &str, cmd: &[String]) -> Result<Process> {
    let mut p: Process = match (&v["process"], v["process_error"].as_str()) {
        (_, Some(e)) => bail!(SandboxState(format!("sandbox {id}: {e}"))),
        (p, None) => serde_json::from_value(p.clone())
            .with_context(|| format!("stratad's answer for sandbox {id} has no process: {v}"))?,
    };
    if !cmd.is_empty() {
        let entrypoint: Vec<String> =
            serde_json::from_value(v["config"]["entrypoint"].clone()).unwrap_or_default();
        p.args = entrypoint.into_iter().chain(cmd.iter().cloned()).collect();
    }
    Ok(p)
}

/// `strata run`.
pub fn run(socket: &Path, a: RunArgs) -> Result<()> {
    watch_signals();
    let client = Client::at(socket);
    let id = a
        .sandbox
        .clone()
        .unwrap_or_else(|| format!("run-{}", std::process::id()));
    let (sandbox, v) = Created::new(&client, &a.image, &id, a.keep)?;
    let process = process_of(&v, &id, &a.cmd)?;
    let rootfs = PathBuf::from(v["rootfs"].as_str().unwrap_or_default());
    let code = match SIGNALLED.load(Ordering::SeqCst) {
        0 => start(a.runtime, &rootfs, &process, &id)?,
        sig => 128 + sig,
    };
    drop(sandbox);
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// Runs the process with `runtime`; its exit status.
fn start(runtime: Runtime, rootfs: &Path, p: &Process, id: &str) -> Result<i32> {
    let (mut cmd, _keep) = match runtime {
        Runtime::Bwrap => {
            let view = UserView::new(rootfs, p)?;
            (bwrap(view.path(), p, id), Keep::View(view))
        }
        Runtime::Runc => {
            let dir = tempfile::Builder::new()
                .prefix("strata-run-")
                .tempdir()
                .context("creating a bundle directory")?;
            let cfg = crate::bundle::runtime_config(rootfs, p, id);
            std::fs::write(dir.path().join("config.json"), serde_json::to_vec(&cfg)?)
                .context("writing the bundle's config.json")?;
            let mut c = Command::new("runc");
            c.args(["run", "--bundle"])
                .arg(dir.path())
                .arg(format!("strata-{id}"));
            (c, Keep::Bundle(dir))
        }
    };
    let name = format!("{runtime:?}").to_lowercase();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {name} (is it installed?)"))?;
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    // A signal that came while it started.
    if let s @ 1.. = SIGNALLED.load(Ordering::SeqCst) {
        forward(s);
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for {name}"))?;
    CHILD.store(0, Ordering::SeqCst);
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 1,
    })
}

/// What must live until the runtime exits.
enum Keep {
    View(#[allow(dead_code)] UserView),
    Bundle(#[allow(dead_code)] tempfile::TempDir),
}

/// The rootfs where the process's user can reach it. stratad's runtime directory is root's only, and
/// bubblewrap run as a user resolves the rootfs by path: for a user other than root, the rootfs is
/// bound on a directory only that user (and root) can enter, unmounted when dropped.
struct UserView {
    dir: Option<tempfile::TempDir>,
    rootfs: PathBuf,
}

impl UserView {
    fn new(rootfs: &Path, p: &Process) -> Result<UserView> {
        // bubblewrap run as a user cannot make its mount points in a root-owned rootfs; runc makes
        // them as root, in the sandbox's upper directory: so do we.
        for (d, mode) in [("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777)] {
            let at = rootfs.join(d);
            if std::fs::symlink_metadata(&at).is_err() {
                std::fs::create_dir(&at).with_context(|| format!("creating {}", at.display()))?;
                let perm = std::os::unix::fs::PermissionsExt::from_mode(mode);
                std::fs::set_permissions(&at, perm)?;
            }
        }
        if p.user.uid == 0 {
            return Ok(UserView {
                dir: None,
                rootfs: rootfs.to_path_buf(),
            });
        }
        let dir = tempfile::Builder::new()
            .prefix("strata-run-")
            .tempdir()
            .context("creating a directory for the rootfs")?;
        std::os::unix::fs::chown(dir.path(), Some(p.user.uid), Some(p.user.gid))
            .context("giving the rootfs directory to the image's user")?;
        rustix::mount::mount_bind(rootfs, dir.path())
            .with_context(|| format!("binding {} for the image's user", rootfs.display()))?;
        Ok(UserView {
            rootfs: dir.path().to_path_buf(),
            dir: Some(dir),
        })
    }

    fn path(&self) -> &Path {
        &self.rootfs
    }
}

impl Drop for UserView {
    fn drop(&mut self) {
        if let Some(d) = &self.dir {
            let _ = rustix::mount::unmount(d.path(), rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// The bubblewrap command for `p` in `rootfs`.
fn bwrap(rootfs: &Path, p: &Process, id: &str) -> Command {
    let mut c = Command::new("bwrap");
    c.arg("--bind").arg(rootfs).arg("/");
    c.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
    c.args([
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
    ]);
    c.args(["--hostname", id, "--chdir", &p.cwd, "--clearenv"]);
    for kv in &p.env {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        c.args(["--setenv", k, v]);
    }
    c.arg("--").args(&p.args);
    if (p.user.uid, p.user.gid) != (0, 0) {
        // bubblewrap runs as the user, in a user namespace mapping only that uid and gid (std drops
        // the supplementary groups when root sets a uid).
        c.uid(p.user.uid).gid(p.user.gid);
    }
    c
}
