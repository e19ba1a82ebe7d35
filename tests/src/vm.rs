//! MicroVMs under test: the guest kernel and initramfs (built once per run by `scripts/vm-guest`), the
//! accelerator (KVM when it boots a guest here, TCG otherwise), and a VM run whose console is read line
//! by line, with a deadline after which the VM is killed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{have, Need};

/// A Debian 12 minbase root filesystem made by debootstrap (from the mirror apt uses here), kept in
/// /var/tmp/strata-tests/minbase across runs; `None` (a recorded skip) when debootstrap is missing or
/// fails.
pub fn minbase() -> Option<PathBuf> {
    static MINBASE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = MINBASE.get_or_init(|| {
        let root = PathBuf::from("/var/tmp/strata-tests/minbase");
        let done = root.with_extension("done");
        if done.exists() {
            return Ok(root);
        }
        let _ = std::fs::remove_dir_all(&root);
        let o = Command::new("debootstrap")
            .args(["--variant=minbase", "bookworm"])
            .arg(&root)
            .arg("http://deb.debian.org/debian")
            .output()
            .map_err(|e| format!("debootstrap: {e}"))?;
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).into_owned());
        }
        std::fs::write(&done, b"").map_err(|e| e.to_string())?;
        Ok(root)
    });
    let ok = strata_registry::testing::require(
        "a Debian minbase tree (debootstrap --variant=minbase bookworm, from deb.debian.org)",
        built.is_ok(),
    );
    if let Err(e) = built {
        eprintln!("debootstrap: {e}");
    }
    built.as_ref().ok().filter(|_| ok).cloned()
}

/// The guest kernel and initramfs, or `None` when the test must skip (no qemu, or the guest could not
/// be built: `scripts/vm-guest` needs apt's package lists).
pub fn guest() -> Option<(PathBuf, PathBuf)> {
    static GUEST: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    if !have(&[Need::Mount, Need::Qemu]) {
        return None;
    }
    let built = GUEST.get_or_init(|| {
        let out = PathBuf::from("/var/tmp/strata-tests/vm-guest");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/vm-guest");
        let o = Command::new(script)
            .arg("--out")
            .arg(&out)
            .arg("--cache")
            .arg("/var/tmp/strata-tests/vm-guest-cache")
            .output()
            .map_err(|e| e.to_string())?;
        match o.status.success() {
            true => Ok(out),
            false => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        }
    });
    let ok = strata_registry::testing::require(
        "the guest kernel and initramfs (scripts/vm-guest: apt-get download of linux-image-cloud-amd64)",
        built.is_ok(),
    );
    if let Err(e) = built {
        eprintln!("scripts/vm-guest: {e}");
    }
    let dir = built.as_ref().ok().filter(|_| ok)?;
    Some((dir.join("vmlinuz"), dir.join("initrd.img")))
}

/// The accelerator the tests use: `STRATA_VM_ACCEL` if set, else KVM if it boots the guest to its init
/// within 20 s (nested KVM may hang in the guest's early boot), else TCG.
pub fn accel() -> &'static str {
    static ACCEL: OnceLock<&'static str> = OnceLock::new();
    ACCEL.get_or_init(|| {
        if let Ok(a) = std::env::var("STRATA_VM_ACCEL") {
            return if a == "kvm" { "kvm" } else { "tcg" };
        }
        let Some((kernel, initrd)) = guest() else {
            return "tcg";
        };
        let usable = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        let boots = usable && {
            let mut c = Command::new("qemu-system-x86_64");
            c.args([
                "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256",
            ])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-serial", "stdio", "-no-reboot", "-kernel"])
            .arg(kernel)
            .arg("-initrd")
            .arg(initrd)
            .args(["-append", "console=ttyS0 reboot=t panic=-1 quiet"]);
            let run = Vm::spawn(c);
            run.wait_for("strata-vm: exit", Duration::from_secs(20))
                .is_some()
        };
        let a = if boots { "kvm" } else { "tcg" };
        eprintln!("microVM tests use {a} (set STRATA_VM_ACCEL to choose)");
        a
    })
}

/// A running VM: its console lines arrive on a channel; killed when dropped.
pub struct Vm {
    child: Mutex<Child>,
    lines: Mutex<mpsc::Receiver<String>>,
    /// Every line read so far.
    pub seen: Mutex<Vec<String>>,
}

impl Vm {
    /// Starts `c` with standard output (the console) read line by line.
    pub fn spawn(mut c: Command) -> Vm {
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = c.spawn().expect("start qemu");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Vm {
            child: Mutex::new(child),
            lines: Mutex::new(rx),
            seen: Mutex::new(Vec::new()),
        }
    }

    /// Runs `DIR/qemu.sh` (a `strata vm` launch description) with the tests' accelerator.
    pub fn start(dir: &Path) -> Vm {
        let mut c = Command::new(dir.join("qemu.sh"));
        c.env("STRATA_VM_ACCEL", accel());
        Vm::spawn(c)
    }

    /// Waits for a console line containing `text`; returns when it came (`None`: not within `within`,
    /// or the VM ended first).
    pub fn wait_for(&self, text: &str, within: Duration) -> Option<Instant> {
        let end = Instant::now() + within;
        let rx = self.lines.lock().expect("lines");
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(text);
                    self.seen.lock().expect("seen").push(line);
                    if hit {
                        return Some(Instant::now());
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Waits for the VM to end (its init's `strata-vm: exit N`, then the process) within `within`;
    /// returns N and the console.
    pub fn finish(&self, within: Duration) -> (i32, String) {
        let ended = self.wait_for("strata-vm: exit", within);
        let console = self.console();
        assert!(
            ended.is_some(),
            "the VM did not end within {within:?}:\n{console}"
        );
        let code = console
            .lines()
            .rev()
            .find_map(|l| l.split("strata-vm: exit ").nth(1))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(-1);
        let start = Instant::now();
        let mut child = self.child.lock().expect("child");
        while child.try_wait().ok().flatten().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "qemu did not exit after the guest rebooted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        (code, console)
    }

    /// The console so far.
    pub fn console(&self) -> String {
        self.seen.lock().expect("seen").join("\n")
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap_or_else(|p| p.into_inner());
        if child.try_wait().ok().flatten().is_none() {
            // qemu.sh execs qemu: the child is qemu itself.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
