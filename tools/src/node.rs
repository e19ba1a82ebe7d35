//! Commands that talk to the node daemon: `mount`, `umount`, `ps`, `bundle`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use strata_fs::api::Client;
use strata_registry::model::ImageConfig;
use strata_registry::store::Store;

use crate::images::{human, resolve_image};

/// Default control socket.
pub const DEFAULT_SOCKET: &str = "/run/strata/stratad.sock";

fn client(socket: &Path) -> Client {
    Client {
        socket: socket.to_path_buf(),
    }
}

/// `strata mount`: prints the rootfs path.
pub fn mount(
    socket: &Path,
    image: &str,
    id: &str,
    upper: Option<&Path>,
    json_out: bool,
) -> Result<()> {
    let mut body = json!({"image": image, "id": id});
    if let Some(u) = upper {
        body["dir"] = json!(std::path::absolute(u)?);
    }
    let v = client(socket).call("POST", "/v1/sandboxes", Some(&body))?;
    if json_out {
        println!("{v}");
    } else {
        println!("{}", v["rootfs"].as_str().unwrap_or_default());
    }
    Ok(())
}

/// `strata umount`.
pub fn umount(socket: &Path, id: &str, purge: bool) -> Result<()> {
    let q = if purge { "?purge=1" } else { "" };
    client(socket).call("DELETE", &format!("/v1/sandboxes/{id}{q}"), None)?;
    Ok(())
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
        "{:<24} {:<32} {:>6} {:>12} {:>12}  ROOTFS",
        "SANDBOX", "IMAGE", "LAYERS", "FETCHED", "IMAGE SIZE"
    );
    for s in sandboxes.as_array().into_iter().flatten() {
        println!(
            "{:<24} {:<32} {:>6} {:>12} {:>12}  {}",
            s["id"].as_str().unwrap_or(""),
            s["image"].as_str().unwrap_or(""),
            s["layers"].as_array().map_or(0, |l| l.len()),
            human(s["fetched_bytes"].as_u64().unwrap_or(0)),
            human(s["image_bytes"].as_u64().unwrap_or(0)),
            s["rootfs"].as_str().unwrap_or("")
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
    Ok(())
}

/// An OCI runtime config for `rootfs` from the image config.
pub fn runtime_config(rootfs: &Path, cfg: &ImageConfig, hostname: &str) -> Value {
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
    let (uid, gid) = cfg
        .user
        .as_deref()
        .and_then(|u| {
            let (a, b) = u.split_once(':').unwrap_or((u, u));
            Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?))
        })
        .unwrap_or((0, 0));
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
    })
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
    let cfg = runtime_config(&rootfs, &manifest.config, id);
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("{}", dir.display());
    Ok(())
}
