//! `strata bundle`: a sandbox and the OCI runtime bundle (`DIR/config.json`) that `runc run` starts in
//! it; [`runtime_config`] is also what `strata run --runtime runc` writes.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use strata_api::{Client, Process};

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
    let c = Client::at(socket);
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
