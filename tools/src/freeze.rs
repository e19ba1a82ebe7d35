//! Pausing a sandbox's processes while its upper directory is packed (`pack_diff --freeze`).
//!
//! A sandbox's processes are found by their root directory: every process whose `/proc/PID/root` is the
//! sandbox's rootfs (same device and inode: the overlay's root, however the runtime bound it). They are
//! paused with the cgroup freezer when each of their cgroups (with its descendants) holds only them —
//! runc and crun give a container a cgroup of its own: on cgroup v2 by writing `1` to `cgroup.freeze` and
//! waiting for `cgroup.events` to say `frozen 1`, on a v1 (or hybrid) hierarchy by writing `FROZEN` to the
//! freezer controller's `freezer.state` and waiting until it reads `FROZEN`. Processes sharing a cgroup with others (bubblewrap started from a
//! shell, say) are stopped with `SIGSTOP` instead, and we wait until each is in state `T`. Whatever was
//! paused is resumed when the [`Frozen`] value is dropped — on success and on every error path — with
//! `0` to `cgroup.freeze`, `THAWED` to `freezer.state`, or `SIGCONT`. The process running `pack_diff` is never paused.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const WAIT: Duration = Duration::from_secs(5);

/// A cgroup with a freezer: its directory and which interface it has.
struct Freezer {
    dir: PathBuf,
    v1: bool,
}

impl Freezer {
    /// The freezer cgroup of `pid`: cgroup v2 when `/sys/fs/cgroup` is the unified hierarchy, else the
    /// v1 `freezer` controller. `None` for the root cgroup or without a freezer.
    fn of(pid: i32) -> Option<Freezer> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let unified = Path::new(CGROUP_ROOT).join("cgroup.controllers").exists();
        let (path, v1) = if unified {
            (s.lines().find_map(|l| l.strip_prefix("0::"))?, false)
        } else {
            let line = s.lines().find(|l| {
                l.split(':')
                    .nth(1)
                    .is_some_and(|c| c.split(',').any(|c| c == "freezer"))
            })?;
            (line.splitn(3, ':').nth(2)?, true)
        };
        if path == "/" {
            return None;
        }
        let rel = path.trim_start_matches('/');
        let dir = match v1 {
            true => Path::new(CGROUP_ROOT).join("freezer").join(rel),
            false => Path::new(CGROUP_ROOT).join(rel),
        };
        let control = if v1 { "freezer.state" } else { "cgroup.freeze" };
        dir.join(control).exists().then_some(Freezer { dir, v1 })
    }

    fn set(&self, frozen: bool) -> std::io::Result<()> {
        match (self.v1, frozen) {
            (true, true) => std::fs::write(self.dir.join("freezer.state"), "FROZEN"),
            (true, false) => std::fs::write(self.dir.join("freezer.state"), "THAWED"),
            (false, f) => std::fs::write(self.dir.join("cgroup.freeze"), if f { "1" } else { "0" }),
        }
    }

    fn is_frozen(&self) -> bool {
        match self.v1 {
            true => std::fs::read_to_string(self.dir.join("freezer.state"))
                .is_ok_and(|s| s.trim() == "FROZEN"),
            false => std::fs::read_to_string(self.dir.join("cgroup.events"))
                .is_ok_and(|s| s.lines().any(|l| l == "frozen 1")),
        }
    }
}

/// Paused processes; resumed on drop.
pub struct Frozen {
    cgroups: Vec<Freezer>,
    stopped: Vec<i32>,
    pids: Vec<i32>,
}

/// The processes whose root directory is `rootfs`.
pub fn sandbox_pids(rootfs: &Path) -> Result<Vec<i32>> {
    let m = std::fs::metadata(rootfs).with_context(|| format!("rootfs {}", rootfs.display()))?;
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").context("reading /proc")? {
        let Ok(e) = e else { continue };
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A process may exit while we look: skip it.
        if let Ok(r) = std::fs::metadata(e.path().join("root")) {
            if (r.dev(), r.ino()) == (m.dev(), m.ino()) {
                out.push(pid);
            }
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Every process in `dir` and its descendant cgroups.
fn procs_below(dir: &Path, out: &mut BTreeSet<i32>) -> std::io::Result<()> {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
    out.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            procs_below(&e.path(), out)?;
        }
    }
    Ok(())
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > WAIT {
            bail!("{what} did not happen within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn state_of(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which is in parentheses and may hold anything.
    s.rsplit_once(')')?.1.trim_start().chars().next()
}

impl Frozen {
    /// Pauses every process of the sandbox whose rootfs is `rootfs`.
    pub fn freeze(rootfs: &Path) -> Result<Frozen> {
        let pids = sandbox_pids(rootfs)?;
        let me = std::process::id() as i32;
        let set: BTreeSet<i32> = pids.iter().copied().collect();
        let mut by_cgroup: BTreeMap<PathBuf, (Freezer, Vec<i32>)> = BTreeMap::new();
        let mut loose = Vec::new();
        for &p in &pids {
            match Freezer::of(p) {
                Some(fz) => by_cgroup
                    .entry(fz.dir.clone())
                    .or_insert((fz, Vec::new()))
                    .1
                    .push(p),
                None => loose.push(p),
            }
        }
        let mut f = Frozen {
            cgroups: Vec::new(),
            stopped: Vec::new(),
            pids: pids.clone(),
        };
        for (dir, (fz, members)) in by_cgroup {
            let mut inside = BTreeSet::new();
            let own = procs_below(&dir, &mut inside).is_ok()
                && !inside.contains(&me)
                && inside.is_subset(&set);
            if !own {
                loose.extend(members);
                continue;
            }
            fz.set(true)
                .with_context(|| format!("freezing cgroup {}", dir.display()))?;
            let what = format!("freezing cgroup {}", dir.display());
            f.cgroups.push(fz);
            if let Some(fz) = f.cgroups.last() {
                wait_for(&what, || fz.is_frozen())?;
            }
        }
        for p in loose {
            // SAFETY: kill has no memory preconditions; a pid that exited gives ESRCH, ignored.
            if unsafe { libc::kill(p, libc::SIGSTOP) } == 0 {
                f.stopped.push(p);
            }
        }
        for &p in &f.stopped {
            wait_for(&format!("stopping process {p}"), || {
                matches!(
                    state_of(p),
                    None | Some('T') | Some('t') | Some('Z') | Some('X')
                )
            })?;
        }
        Ok(f)
    }

    /// What was paused, for `--json`.
    pub fn describe(&self) -> Value {
        json!({
            "pids": self.pids,
            "cgroups": self.cgroups.iter().map(|c| &c.dir).collect::<Vec<_>>(),
            "stopped": self.stopped,
        })
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for fz in &self.cgroups {
            if let Err(e) = fz.set(false) {
                eprintln!("strata: warning: thawing cgroup {}: {e}", fz.dir.display());
            }
        }
        for &p in &self.stopped {
            // SAFETY: as above.
            unsafe { libc::kill(p, libc::SIGCONT) };
        }
    }
}
