//! Commands that talk to the node daemon: `mount`, `umount`, `ps`, `bundle`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use strata_fs::api::Client;
use strata_registry::model::ImageConfig;
use strata_registry::store::Store;

use crate::exit::Usage;
use crate::images::{human, resolve_image};

/// Default control socket.
pub const DEFAULT_SOCKET: &str = "/run/strata/stratad.sock";

fn client(socket: &Path) -> Client {
    Client {
        socket: socket.to_path_buf(),
    }
}

/// `strata mount`: creates a sandbox of `image` for each id, in order, and prints each rootfs path (or,
/// with `json_out`, each sandbox as a JSON line). Stops at the first failure; the sandboxes created before
/// it stay (and were printed).
pub fn mount(
    socket: &Path,
    image: &str,
    ids: &[String],
    upper: Option<&Path>,
    reuse: &str,
    json_out: bool,
) -> Result<()> {
    if upper.is_some() && ids.len() > 1 {
        return Err(Usage(
            "--upper takes one --sandbox (each sandbox needs its own directory)".into(),
        )
        .into());
    }
    let c = client(socket);
    let mut out = std::io::stdout().lock();
    for id in ids {
        let mut body = json!({"image": image, "id": id, "reuse": reuse});
        if let Some(u) = upper {
            body["dir"] = json!(std::path::absolute(u)?);
        }
        let v = c.call("POST", "/v1/sandboxes", Some(&body))?;
        match json_out {
            true => writeln!(out, "{v}")?,
            false => writeln!(out, "{}", v["rootfs"].as_str().unwrap_or_default())?,
        }
    }
    Ok(())
}

/// `strata umount`.
pub fn umount(socket: &Path, id: &str, purge: bool, force: bool) -> Result<()> {
    let q = match (purge, force) {
        (true, true) => "?purge=1&force=1",
        (true, false) => "?purge=1",
        _ => "",
    };
    client(socket).call("DELETE", &format!("/v1/sandboxes/{id}{q}"), None)?;
    Ok(())
}

/// `strata rm`: purges the named sandboxes (or every stopped one); all are tried, the first failure
/// is reported.
pub fn rm(socket: &Path, ids: &[String], stopped: bool, force: bool, json_out: bool) -> Result<()> {
    let c = client(socket);
    let mut ids = ids.to_vec();
    if stopped {
        let all = c.call("GET", "/v1/sandboxes", None)?;
        ids.extend(
            all.as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["state"] == "stopped")
                .filter_map(|s| s["id"].as_str().map(str::to_string)),
        );
    }
    let q = if force {
        "?purge=1&force=1"
    } else {
        "?purge=1"
    };
    let mut removed = Vec::new();
    let mut first_err = None;
    for id in &ids {
        match c.call("DELETE", &format!("/v1/sandboxes/{id}{q}"), None) {
            Ok(_) => removed.push(id.clone()),
            Err(e) => {
                eprintln!("strata: {id}: {e}");
                first_err.get_or_insert(e);
            }
        }
    }
    if json_out {
        println!("{}", json!({"removed": removed}));
    } else {
        for id in &removed {
            println!("{id}");
        }
    }
    match first_err {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// `strata daemon ...`.
#[derive(clap::Subcommand)]
pub enum DaemonCmd {
    /// Replace the serving stratad with the binary now installed, without disturbing sandboxes: the
    /// descriptor holder starts the new server on the same FUSE connection. Waits until it serves.
    Upgrade {
        /// Seconds to wait for the new server.
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
        #[arg(long)]
        json: bool,
    },
    /// The daemon's status document (JSON).
    Status,
}

/// Runs a `strata daemon` command.
pub fn daemon(socket: &Path, cmd: DaemonCmd) -> Result<()> {
    let c = client(socket);
    match cmd {
        DaemonCmd::Status => {
            println!("{}", c.call("GET", "/v1/status", None)?);
            Ok(())
        }
        DaemonCmd::Upgrade { timeout, json } => {
            let before = c.call("GET", "/v1/status", None)?;
            let old = before["pid"].as_u64().unwrap_or(0);
            c.call("POST", "/v1/upgrade", None)?;
            let start = std::time::Instant::now();
            let after = loop {
                // Connections made while no server runs wait in the socket's backlog.
                if let Ok(v) = c.call("GET", "/v1/status", None) {
                    if v["pid"].as_u64().is_some_and(|p| p != old) {
                        break v;
                    }
                }
                if start.elapsed().as_secs_f64() > timeout {
                    anyhow::bail!(
                        "stratad did not come back within {timeout} s after the upgrade request"
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            };
            let out = json!({
                "old_pid": old,
                "pid": after["pid"],
                "old_version": before["version"],
                "version": after["version"],
                "seconds": start.elapsed().as_secs_f64(),
            });
            match json {
                true => println!("{out}"),
                false => println!(
                    "stratad upgraded: pid {old} -> {}, version {} -> {}",
                    after["pid"], before["version"], after["version"]
                ),
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
        "{:<24} {:<32} {:<8} {:>6} {:>12} {:>12}  ROOTFS (A VM: ITS SCRATCH DRIVE)",
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
            match s["vm"]["scratch"].as_str() {
                // A microVM has no rootfs on the host: its scratch drive.
                Some(scratch) => format!("(vm) {scratch}"),
                None => s["rootfs"].as_str().unwrap_or("").to_string(),
            }
        );
    }
    let cache = &status["cache"];
    println!(
        "layers mounted: {}  cache: {} of {} ({} chunks)",
        status["layers"].as_array().map_or(0, |l| l.len()),
        human(cache["used"].as_u64().unwrap_or(0)),
        human(cache["capacity"].as_u64().unwrap_or(0)),
        cache["chunks"].as_u64().unwrap_or(0)
    );
    for (image, w) in status["prefetch"].as_object().into_iter().flatten() {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        println!(
            "prefetch {image}: {} chunks planned, {} fetched ({}){}{}",
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

/// Reads `rootfs/etc/NAME` as the image has it: a symlink there (which would lead out of the image) or a
/// missing file reads as empty.
fn image_etc(rootfs: &Path, name: &str) -> String {
    let dir = rootfs.join("etc");
    let file = dir.join(name);
    let plain = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| !m.file_type().is_symlink());
    if !plain(&dir) || !plain(&file) {
        return String::new();
    }
    std::fs::read_to_string(file).unwrap_or_default()
}

/// The id of `name` in a passwd or group file (`name:x:id:...`), or the number `name` is.
fn lookup_id(db: &str, name: &str) -> Option<(u32, Vec<String>)> {
    db.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && (f[0] == name || f[2] == name))
            .then(|| {
                Some((
                    f[2].parse().ok()?,
                    f.iter().map(|s| s.to_string()).collect(),
                ))
            })
            .flatten()
    })
}

/// The uid and gid of an image's `user` (`""`, `uid`, `uid:gid`, `name`, `name:group`, ...) as a container
/// runtime resolves them: names in the image's own `/etc/passwd` and `/etc/group`, the group by default the
/// user's primary group (0 when the user has no entry). A name the image does not define is an error: it
/// never silently becomes root.
pub fn resolve_user(rootfs: &Path, user: Option<&str>) -> Result<(u32, u32)> {
    let Some(user) = user.filter(|u| !u.is_empty()) else {
        return Ok((0, 0));
    };
    let (name, group) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = image_etc(rootfs, "passwd");
    let entry = lookup_id(&passwd, name);
    let uid = match (name.parse::<u32>(), &entry) {
        (Ok(n), _) => n,
        (Err(_), Some((n, _))) => *n,
        (Err(_), None) => anyhow::bail!("the image's user {name:?} is not in its /etc/passwd"),
    };
    let gid = match group {
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => lookup_id(&image_etc(rootfs, "group"), g)
                .map(|(n, _)| n)
                .with_context(|| format!("the image's group {g:?} is not in its /etc/group"))?,
        },
        None => entry
            .and_then(|(_, f)| f.get(3).and_then(|g| g.parse().ok()))
            .unwrap_or(0),
    };
    Ok((uid, gid))
}

/// An OCI runtime config for `rootfs` from the image config.
pub fn runtime_config(rootfs: &Path, cfg: &ImageConfig, hostname: &str) -> Result<Value> {
    let mut args: Vec<String> = cfg
        .entrypoint
        .iter()
        .chain(cfg.cmd.iter())
        .cloned()
        .collect();
    if args.is_empty() {
        args = vec!["/bin/sh".into()];
    }
    let mut env = cfg.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    let (uid, gid) = resolve_user(rootfs, cfg.user.as_deref())?;
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
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": uid, "gid": gid},
            "args": args,
            "env": env,
            "cwd": cfg.working_dir.clone().unwrap_or_else(|| "/".into()),
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
    }))
}

/// `strata bundle`: mounts a sandbox and writes `DIR/config.json` pointing at its rootfs.
pub fn bundle(store: &Store, socket: &Path, image: &str, id: &str, dir: &Path) -> Result<()> {
    let (_, manifest) = resolve_image(store, image)?;
    let v = client(socket).call(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"image": image, "id": id})),
    )?;
    let rootfs = PathBuf::from(v["rootfs"].as_str().unwrap_or_default());
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg = runtime_config(&rootfs, &manifest.config, id)?;
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("{}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_resolve_in_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        assert_eq!(resolve_user(root, None).unwrap(), (0, 0));
        assert_eq!(resolve_user(root, Some("1000")).unwrap(), (1000, 0));
        assert_eq!(resolve_user(root, Some("1000:50")).unwrap(), (1000, 50));
        assert!(resolve_user(root, Some("www-data")).is_err());
        std::fs::create_dir(root.join("etc")).unwrap();
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nwww-data:x:33:34::/var/www:/bin/false\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\nstaff:x:50:\n").unwrap();
        assert_eq!(resolve_user(root, Some("www-data")).unwrap(), (33, 34));
        assert_eq!(resolve_user(root, Some("33")).unwrap(), (33, 34));
        assert_eq!(
            resolve_user(root, Some("www-data:staff")).unwrap(),
            (33, 50)
        );
        assert!(resolve_user(root, Some("www-data:nogroup")).is_err());
        // A symlinked passwd (it could point out of the image) is not read.
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/passwd")).unwrap();
        assert!(resolve_user(root, Some("root")).is_err());
    }
}
