//! Commands that talk to the node daemon: `mount`, `umount`, `ps`, `bundle`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use strata_api::{Client, ClientError};
use strata_cli::args::UmountArgs;
use strata_cli::node::{failures, is_no_route};
use strata_fs::process::Process;
use strata_fs::teardown::{Candidate, DeleteRequest};

use crate::images::human;

fn client(socket: &Path) -> Client {
    Client {
        socket: socket.to_path_buf(),
    }
}

/// `strata umount` (as the full CLI runs it): stops the sandboxes (one batch request), or with
/// `--purge` removes them; against a daemon without the batch route, one by one.
pub fn umount(socket: &Path, a: &UmountArgs) -> Result<()> {
    let body = json!({"ids": a.sandbox, "purge": a.purge, "force": a.force});
    let (_, failed) = delete(socket, body)?;
    failed.map_or(Ok(()), Err)
}

/// `strata rm`: purges the sandboxes `selection` names (ids, `all`, `image`, `stopped`: see
/// `POST /v1/sandboxes/delete` in docs/API.md) in one request; all are tried, the first failure is
/// reported after the removed ones are listed.
pub fn rm(socket: &Path, mut selection: Value, force: bool, json_out: bool) -> Result<()> {
    selection["purge"] = json!(true);
    selection["force"] = json!(force);
    let (removed, failed) = delete(socket, selection)?;
    let ids: Vec<&str> = removed.iter().filter_map(|s| s["id"].as_str()).collect();
    match json_out {
        true => println!("{}", json!({"removed": ids})),
        false => ids.iter().for_each(|id| println!("{id}")),
    }
    failed.map_or(Ok(()), Err)
}

/// One batch delete: the sandboxes done, and the first failure (each failure is printed). A daemon
/// older than the batch route (it answers `404`, "no route") gets the same selection made here and one
/// `DELETE` per sandbox: a CLI upgraded before its node's daemon still tears down.
fn delete(socket: &Path, body: Value) -> Result<(Vec<Value>, Option<anyhow::Error>)> {
    let c = client(socket);
    let v = match c.call("POST", "/v1/sandboxes/delete", Some(&body)) {
        Err(e) if is_no_route(&e) => one_by_one(&c, &body)?,
        r => r?,
    };
    let first = failures(&v).map(anyhow::Error::from);
    Ok((v["removed"].as_array().cloned().unwrap_or_default(), first))
}

/// The batch delete `body` asks for, done against a daemon without the batch route: the selection made
/// from `GET /v1/sandboxes` as the daemon would make it, then one `DELETE` per sandbox; answers as the
/// batch route does.
fn one_by_one(c: &Client, body: &Value) -> Result<Value> {
    let req: DeleteRequest =
        serde_json::from_value(body.clone()).context("batch delete request")?;
    let purge = req.purge.unwrap_or(true);
    let list = c.call("GET", "/v1/sandboxes", None)?;
    let candidates = list.as_array().into_iter().flatten().filter_map(|s| {
        Some(Candidate {
            id: s["id"].as_str()?,
            image: s["image"].as_str()?,
            manifest: s["manifest"].as_str()?,
            stopped: s["state"] == "stopped",
        })
    });
    let query = match (purge, req.force) {
        (true, true) => "?purge=1&force=1",
        (true, false) => "?purge=1",
        (false, _) => "",
    };
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    for id in req.select_among(candidates, purge) {
        match c.call("DELETE", &format!("/v1/sandboxes/{id}{query}"), None) {
            Ok(v) => removed.push(v),
            Err(ClientError::Api { kind, message, .. }) => {
                failed.push(json!({"id": id, "error": message, "kind": kind}))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(json!({"removed": removed, "failed": failed, "purge": purge}))
}

/// `strata daemon ...`.
#[derive(clap::Subcommand)]
pub enum DaemonCmd {
    /// Replace the serving stratad with the binary now installed, without disturbing sandboxes: the
    /// descriptor holder starts the new server on the same FUSE connection. Waits until it serves.
    Upgrade {
        /// Seconds the whole upgrade may take (every call to stratad included); exits non-zero, with
        /// the reason, when the upgrade did not happen within it.
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
        #[arg(long)]
        json: bool,
    },
    /// The daemon's status document (JSON).
    Status,
    /// Check the node's cached data at rest: every chunk of the chunk cache and (fanotify mode) every
    /// filled chunk of every view file is read back and hashed; a bad one is fetched again on its next
    /// read. Prints files, chunks, bytes, bad chunks and seconds.
    Scrub {
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `strata daemon` command.
pub fn daemon(socket: &Path, cmd: DaemonCmd) -> Result<()> {
    let c = client(socket);
    match cmd {
        DaemonCmd::Status => {
            println!("{}", c.call("GET", "/v1/status", None)?);
            Ok(())
        }
        DaemonCmd::Upgrade { timeout, json } => crate::upgrade::upgrade(&c, timeout, json),
        DaemonCmd::Scrub { json } => {
            let r = c.call("POST", "/v1/scrub", None)?;
            if json {
                println!("{r}");
            } else {
                let n = |k: &str| r[k].as_u64().unwrap_or(0);
                let secs = r["seconds"].as_f64().unwrap_or(0.0);
                println!(
                    "scrubbed the chunk cache and {} view files: {} chunks, {} in {:.2} s ({:.0} MB/s); {} bad, fetched again when read",
                    n("files"),
                    n("chunks"),
                    human(n("bytes")),
                    secs,
                    n("bytes") as f64 / secs.max(1e-9) / 1e6,
                    n("bad"),
                );
            }
            if r["bad"].as_u64().unwrap_or(0) > 0 {
                return Err(anyhow::anyhow!(
                    "scrub found {} bad chunks (now refetched on read)",
                    r["bad"]
                ));
            }
            Ok(())
        }
    }
}

/// `strata ps`.
pub fn ps(socket: &Path, json_out: bool) -> Result<()> {
    let c = client(socket);
    let sandboxes = c.call("GET", "/v1/sandboxes", None)?;
    let status = c.call("GET", "/v1/status", None)?;
    if json_out {
        println!("{}", json!({"sandboxes": sandboxes, "status": status}));
        return Ok(());
    }
    println!(
        "{:<24} {:<32} {:<8} {:>6} {:>12} {:>12}  ROOTFS (STOPPED: UPPER DIRECTORY; VM: SCRATCH DRIVE)",
        "SANDBOX", "IMAGE", "STATE", "LAYERS", "FETCHED", "IMAGE SIZE"
    );
    for s in sandboxes.as_array().into_iter().flatten() {
        println!(
            "{:<24} {:<32} {:<8} {:>6} {:>12} {:>12}  {}",
            s["id"].as_str().unwrap_or(""),
            s["image"].as_str().unwrap_or(""),
            s["state"].as_str().unwrap_or(""),
            s["layers"].as_array().map_or(0, |l| l.len()),
            human(s["fetched_bytes"].as_u64().unwrap_or(0)),
            human(s["image_bytes"].as_u64().unwrap_or(0)),
            match (s["vm"]["scratch"].as_str(), s["state"].as_str()) {
                // A microVM has no rootfs on the host: its scratch drive.
                (Some(scratch), _) => format!("(vm) {scratch}"),
                // A stopped sandbox's rootfs is gone: what it keeps is its upper directory.
                (None, Some("stopped")) => format!("(upper) {}", s["upper"].as_str().unwrap_or("")),
                (None, _) => s["rootfs"].as_str().unwrap_or("").to_string(),
            }
        );
    }
    let cache = &status["cache"];
    println!(
        "fetched for no sandbox: {}  layers mounted: {}  cache: {} of {} ({} chunks)",
        human(status["fetched_unattributed"].as_u64().unwrap_or(0)),
        status["layers"].as_array().map_or(0, |l| l.len()),
        human(cache["used"].as_u64().unwrap_or(0)),
        human(cache["capacity"].as_u64().unwrap_or(0)),
        cache["chunks"].as_u64().unwrap_or(0)
    );
    if let Some(mode) = status["mount_mode"].as_str() {
        let passed = status["mount_modes"]["passed_over"].as_array().cloned();
        let why: Vec<String> = passed
            .into_iter()
            .flatten()
            .map(|p| {
                format!(
                    "not {}: {}",
                    p["mode"].as_str().unwrap_or("?"),
                    p["reason"].as_str().unwrap_or("")
                )
            })
            .collect();
        match why.is_empty() {
            true => println!("mount mode: {mode}"),
            false => println!("mount mode: {mode} ({})", why.join("; ")),
        }
    }
    for (image, w) in status["prefetch"].as_object().into_iter().flatten() {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        let source = match w["source"].as_str() {
            Some("layers") => format!(
                " (inherited: {} layer plan(s))",
                w["layers"].as_array().map_or(0, Vec::len)
            ),
            _ => String::new(),
        };
        println!(
            "prefetch {image}{source}: {} chunks planned, {} fetched ({}){}{}",
            n("planned"),
            n("fetched"),
            human(n("bytes")),
            match n("errors") {
                0 => String::new(),
                e => format!(", {e} errors"),
            },
            if w["done"].as_bool() == Some(true) {
                ", done"
            } else {
                ""
            }
        );
    }
    if let Some(image) = status["recording_plan"].as_str() {
        println!("recording a prefetch plan for {image}");
    }
    Ok(())
}

/// An OCI runtime config for `rootfs` running `p` (the process stratad reports for the sandbox).
pub fn runtime_config(rootfs: &Path, p: &Process, hostname: &str) -> Value {
    let caps = json!([
        "CAP_AUDIT_WRITE",
        "CAP_KILL",
        "CAP_NET_BIND_SERVICE",
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FOWNER",
        "CAP_FSETID",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETPCAP",
        "CAP_SYS_CHROOT",
        "CAP_MKNOD"
    ]);
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": p.user,
            "args": p.args,
            "env": p.env,
            "cwd": p.cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        },
        "annotations": {"org.strata.image": hostname}
    })
}

/// `strata bundle`: mounts a sandbox and writes `DIR/config.json` pointing at its rootfs, running the
/// process stratad reports for it (the image's config, its user resolved in the image), its cmd
/// replaced by `cmd` when given. A failure after the sandbox was created removes it again.
pub fn bundle(socket: &Path, image: &str, id: &str, dir: &Path, cmd: &[String]) -> Result<()> {
    let c = client(socket);
    let (sandbox, v) = crate::run::Created::new(&c, image, id, false)?;
    let rootfs = PathBuf::from(v["rootfs"].as_str().unwrap_or_default());
    let process = crate::run::process_of(&v, id, cmd)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg = runtime_config(&rootfs, &process, id);
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)
        .with_context(|| format!("writing {}", path.display()))?;
    sandbox.hand_on();
    println!("{}", dir.display());
    Ok(())
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
