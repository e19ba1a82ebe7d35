//! Pausing a sandbox's processes while its upper directory is packed (`pack_diff --freeze`).
//!
//! A sandbox's processes are found by their root directory: every process whose `/proc/PID/root` is the
//! sandbox's rootfs (same device and inode: the overlay's root, however the runtime bound it). They are
//! paused with the cgroup v2 freezer when each of their cgroups (with its descendants) holds only them —
//! runc and crun give a container a cgroup of its own — by writing `1` to `cgroup.freeze` and waiting for
//! `cgroup.events` to say `frozen 1`. Processes sharing a cgroup with others (bubblewrap started from a
//! shell, say) are stopped with `SIGSTOP` instead, and we wait until each is in state `T`. Whatever was
//! paused is resumed when the [`Frozen`] value is dropped — on success and on every error path — with
//! `0` to `cgroup.freeze` or `SIGCONT`. The process running `pack_diff` is never paused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const WAIT: Duration = Duration::from_secs(5);

/// Paused processes; resumed on drop.
pub struct Frozen {
    cgroups: Vec<PathBuf>,
    stopped: Vec<i32>,
    pids: Vec<i32>,
}

/// The processes whose root directory is `rootfs`.
pub fn sandbox_pids(rootfs: &Path) -> Result<Vec<i32>> {
    strata_fs::state::sandbox_pids(rootfs).with_context(|| format!("rootfs {}", rootfs.display()))
}

fn cgroup_of(pid: i32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
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
        let mut by_cgroup: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        let mut loose = Vec::new();
        for &p in &pids {
            match cgroup_of(p) {
                Some(c) => by_cgroup.entry(c).or_default().push(p),
                None => loose.push(p),
            }
        }
        let mut f = Frozen {
            cgroups: Vec::new(),
            stopped: Vec::new(),
            pids: pids.clone(),
        };
        for (cg, members) in by_cgroup {
            let dir = Path::new(CGROUP_ROOT).join(cg.trim_start_matches('/'));
            let mut inside = BTreeSet::new();
            let own = cg != "/"
                && dir.join("cgroup.freeze").exists()
                && procs_below(&dir, &mut inside).is_ok()
                && !inside.contains(&me)
                && inside.is_subset(&set);
            if !own {
                loose.extend(members);
                continue;
            }
            std::fs::write(dir.join("cgroup.freeze"), "1")
                .with_context(|| format!("freezing cgroup {}", dir.display()))?;
            f.cgroups.push(dir.clone());
            let events = dir.join("cgroup.events");
            wait_for(&format!("freezing cgroup {}", dir.display()), || {
                std::fs::read_to_string(&events).is_ok_and(|s| s.lines().any(|l| l == "frozen 1"))
            })?;
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
            "cgroups": self.cgroups,
            "stopped": self.stopped,
        })
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for dir in &self.cgroups {
            if let Err(e) = std::fs::write(dir.join("cgroup.freeze"), "0") {
                eprintln!("strata: warning: thawing cgroup {}: {e}", dir.display());
            }
        }
        for &p in &self.stopped {
            // SAFETY: as above.
            unsafe { libc::kill(p, libc::SIGCONT) };
        }
    }
}
