//! `strata vm`: a microVM sandbox through stratad, and its launch description.
//!
//! stratad serves the image's layers as drive files (metadata and blobs, lazily) and makes the scratch
//! drive ([`strata_fs::vm`]); this command asks for that and writes into DIR what a launcher needs:
//!
//! ```text
//! DIR/vm.json               everything: drives in order (serial, path, read-only, size), the kernel
//!                           command line, kernel and initramfs, the QEMU argv
//! DIR/cmdline               the kernel command line
//! DIR/qemu.sh               a ready `qemu-system-x86_64 -M microvm …` (KVM if a paused KVM guest starts, else TCG;
//!                           STRATA_VM_ACCEL=kvm|tcg overrides); extra arguments are passed on
//! DIR/firecracker.json      a Firecracker --config-file (untested here)
//! DIR/cloud-hypervisor.json a Cloud Hypervisor vm.create body (untested here)
//! ```
//!
//! The kernel command line tells strata's guest init (dist/vm/init, built by scripts/vm-guest) which
//! drive serial is which layer's metadata and devices, which is the scratch drive, and what to run: the
//! image's config (entrypoint and cmd, env, working directory) or the command given after `--`, as a
//! script for the image's `/bin/sh`, base64-encoded. An image needing more drives than a microVM takes
//! ([`MAX_DRIVES`]) is flattened first (metadata only: one drive for all its layers' metadata).
//!
//! `pack_diff --vm ID` ([`ScratchUpper`]) mounts a stopped VM's scratch image read-only on a private
//! directory and packs its `upper/` exactly as a container sandbox's.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde_json::{json, Value};
use strata_api::Client;
use strata_builder::build::BuildOptions;
use strata_fs::vm::MAX_DRIVES;
use strata_registry::digest::Digest;
use strata_registry::model::{ImageConfig, LayerKind, Manifest, ManifestLayer, SCHEMA};
use strata_registry::store::Store;

use crate::exit::{NotFound, Usage};
use crate::images::resolve_image;

/// The kernel command line x86 Linux keeps (`COMMAND_LINE_SIZE`).
const CMDLINE_MAX: usize = 2048;

/// Arguments of `strata vm`.
#[derive(clap::Args)]
pub struct VmArgs {
    /// Image (tag or manifest digest).
    pub image: String,
    /// The sandbox's id.
    #[arg(long)]
    pub sandbox: String,
    /// Directory for the launch description.
    pub dir: PathBuf,
    /// Guest kernel (scripts/vm-guest writes one).
    #[arg(long, default_value = "/var/lib/strata/vm/vmlinuz")]
    pub kernel: PathBuf,
    /// Guest initramfs holding strata's init (scripts/vm-guest).
    #[arg(long, default_value = "/var/lib/strata/vm/initrd.img")]
    pub initrd: PathBuf,
    /// Size of a new scratch drive (sparse), e.g. 4G.
    #[arg(long)]
    pub scratch_size: Option<String>,
    /// Directory for the scratch image (default: in stratad's state).
    #[arg(long)]
    pub scratch_dir: Option<PathBuf>,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    pub memory: u32,
    /// Guest CPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// The id has a stopped VM of the same image: continue with its scratch drive.
    #[arg(long, conflicts_with = "fresh")]
    pub resume: bool,
    /// The id has a stopped sandbox: discard what it left and start empty.
    #[arg(long)]
    pub fresh: bool,
    /// Print the launch description (vm.json) instead of DIR.
    #[arg(long)]
    pub json: bool,
    /// Command to run instead of the image's entrypoint and cmd.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// `strata vm`.
pub fn vm(store: &Store, socket: &Path, a: VmArgs) -> Result<()> {
    for (what, p) in [("--kernel", &a.kernel), ("--initrd", &a.initrd)] {
        if !p.is_file() {
            bail!(NotFound(format!(
                "{what} {}: no such file (scripts/vm-guest writes the guest kernel and initramfs)",
                p.display()
            )));
        }
    }
    let (_, manifest) = resolve_image(store, &a.image)?;
    let image_ref = fitting_image(store, &a.image, &manifest)?;
    let mut body = json!({
        "kind": "vm",
        "image": image_ref,
        "id": a.sandbox,
        "reuse": strata_cli::node::reuse(a.resume, a.fresh),
    });
    if let Some(s) = &a.scratch_size {
        body["scratch_size"] = json!(s);
    }
    if let Some(d) = &a.scratch_dir {
        body["dir"] = json!(std::path::absolute(d)?);
    }
    let sb = Client {
        socket: socket.to_path_buf(),
    }
    .call("POST", "/v1/sandboxes", Some(&body))?;
    let run = run_script(&manifest.config, &a.command);
    let cmdline = kernel_cmdline(&sb, &run)?;
    let desc = describe(&a, &sb, &cmdline)?;
    write_dir(&a.dir, &desc)?;
    match a.json {
        true => println!("{desc}"),
        false => println!("{}", a.dir.display()),
    }
    Ok(())
}

/// The image to ask stratad for: `image` itself, or, when its layers need more drives than a microVM
/// takes, a flattened copy (stored untagged; no file data is copied).
fn fitting_image(store: &Store, image: &str, m: &Manifest) -> Result<String> {
    let mut blobs = Vec::new();
    for l in &m.layers {
        let desc = store.get_layer(&l.digest)?;
        blobs.extend(desc.blobs.iter().map(|b| b.digest));
    }
    blobs.sort();
    blobs.dedup();
    let needed = m.layers.len() + blobs.len() + 1;
    if needed <= MAX_DRIVES || m.layers.len() == 1 {
        return Ok(image.to_string());
    }
    let layers: Vec<Digest> = m.layers.iter().map(|l| l.digest).collect();
    let mut opts = BuildOptions::new(LayerKind::Base);
    opts.labels
        .insert("strata.flatten.layers".into(), layers.len().to_string());
    let built = strata_builder::flatten::flatten(store, &[], &layers, opts)
        .with_context(|| format!("flattening {image} to fit a microVM's {MAX_DRIVES} drives"))?;
    let flat = Manifest {
        schema: SCHEMA,
        layers: vec![ManifestLayer {
            digest: built.digest,
            kind: LayerKind::Base,
        }],
        config: m.config.clone(),
        annotations: m.annotations.clone(),
    };
    let d = store.put_manifest(&flat)?;
    eprintln!(
        "strata: {image} needs {needed} drives, a microVM takes {MAX_DRIVES}: running it flattened ({d})"
    );
    Ok(d.to_string())
}

/// `s` quoted for a POSIX shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script the guest's init has the image's `/bin/sh` run: env, working directory, command.
pub fn run_script(cfg: &ImageConfig, command: &[String]) -> String {
    let mut args: Vec<String> = match command.is_empty() {
        true => cfg
            .entrypoint
            .iter()
            .chain(cfg.cmd.iter())
            .cloned()
            .collect(),
        false => command.to_vec(),
    };
    if args.is_empty() {
        args = vec!["/bin/sh".into()];
    }
    let mut env = cfg.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    let mut s = String::new();
    for e in &env {
        s.push_str(&format!("export {}\n", quote(e)));
    }
    let cwd = cfg
        .working_dir
        .as_deref()
        .filter(|w| !w.is_empty())
        .unwrap_or("/");
    s.push_str(&format!("cd {} || exit 1\n", quote(cwd)));
    let argv: Vec<String> = args.iter().map(|a| quote(a)).collect();
    s.push_str(&format!("exec {}\n", argv.join(" ")));
    s
}

/// The kernel command line for sandbox `sb` (the daemon's answer) running `run`.
pub fn kernel_cmdline(sb: &Value, run: &str) -> Result<String> {
    let layers = sb["vm"]["layers"]
        .as_array()
        .with_context(|| format!("stratad's answer has no VM layers: {sb}"))?;
    let mut parts = vec![
        "console=ttyS0".to_string(),
        "reboot=t".into(),
        "panic=-1".into(),
        "quiet".into(),
        format!("strata.layers={}", layers.len()),
    ];
    for (i, l) in layers.iter().enumerate() {
        let serials: Vec<&str> = l
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        parts.push(format!("strata.l{i}={}", serials.join(",")));
    }
    parts.push("strata.scratch=scratch".into());
    let b64 = base64::engine::general_purpose::STANDARD.encode(run);
    parts.push(format!("strata.run={b64}"));
    let line = parts.join(" ");
    // Room for what the launcher adds (qemu.sh: tsc_early_khz under TCG).
    if line.len() > CMDLINE_MAX - 64 {
        bail!(Usage(format!(
            "the kernel command line would be {} bytes (the image's env and command take {} as base64); \
             Linux keeps {}: give a shorter command or env",
            line.len(),
            b64.len(),
            CMDLINE_MAX - 64
        )));
    }
    Ok(line)
}

/// The launch description (vm.json).
fn describe(a: &VmArgs, sb: &Value, cmdline: &str) -> Result<Value> {
    let kernel = std::path::absolute(&a.kernel)?;
    let initrd = std::path::absolute(&a.initrd)?;
    let drives = sb["vm"]["drives"].clone();
    let qemu = qemu_argv(&kernel, &initrd, cmdline, &drives, a.memory, a.cpus);
    Ok(json!({
        "id": sb["id"],
        "image": a.image,
        "manifest": sb["manifest"],
        "kernel": kernel,
        "initrd": initrd,
        "cmdline": cmdline,
        "memory_mib": a.memory,
        "cpus": a.cpus,
        "drives": drives,
        "layers": sb["vm"]["layers"],
        "scratch": sb["vm"]["scratch"],
        "qemu": qemu,
    }))
}

/// QEMU's argv (without the accelerator, which qemu.sh picks at run time).
fn qemu_argv(
    kernel: &Path,
    initrd: &Path,
    cmdline: &str,
    drives: &Value,
    memory: u32,
    cpus: u32,
) -> Vec<String> {
    let mut v: Vec<String> = [
        "qemu-system-x86_64",
        "-M",
        "microvm,x-option-roms=off,isa-serial=on,rtc=on",
        "-m",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(memory.to_string());
    v.extend(["-smp".into(), cpus.to_string()]);
    v.extend(
        [
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    v.extend(["-kernel".into(), kernel.display().to_string()]);
    v.extend(["-initrd".into(), initrd.display().to_string()]);
    v.extend(["-append".into(), cmdline.to_string()]);
    for d in drives.as_array().into_iter().flatten() {
        let serial = d["serial"].as_str().unwrap_or_default();
        let path = d["path"].as_str().unwrap_or_default();
        // QEMU splits -drive options at commas: a comma in a path is doubled.
        let ro = match d["read_only"].as_bool() {
            Some(true) => ",readonly=on",
            _ => "",
        };
        v.push("-drive".into());
        v.push(format!(
            "id={serial},file={},format=raw,if=none,cache=writeback,aio=threads{ro}",
            path.replace(',', ",,")
        ));
        v.push("-device".into());
        v.push(format!("virtio-blk-device,drive={serial},serial={serial}"));
    }
    v
}

/// qemu.sh: the argv, with the accelerator chosen when it runs.
fn qemu_script(desc: &Value) -> String {
    let argv: Vec<String> = desc["qemu"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(quote)
        .collect();
    let cmdline = desc["cmdline"].as_str().unwrap_or_default();
    let mut argv_lines = argv.join(" \\\n  ");
    // The command line is given again at the end with the accelerator's additions.
    argv_lines = argv_lines.replace(&quote(cmdline), "\"$cmdline\"");
    format!(
        r#"#!/bin/sh
# Starts microVM sandbox {id} of {image} (written by `strata vm`; see docs/VM.md). The console is
# standard output; the VM ends when the command does (`strata-vm: exit N` is its last line).
# STRATA_VM_ACCEL=kvm|tcg picks the accelerator. Default: kvm if /dev/kvm opens *and* a paused KVM guest
# starts (some hosts open /dev/kvm but abort every guest, e.g. on an MSR QEMU cannot set), else tcg.
cmdline={cmdline}
accel=${{STRATA_VM_ACCEL:-}}
if [ -z "$accel" ]; then
  accel=tcg
  if [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
    timeout 1 qemu-system-x86_64 -accel kvm -cpu host -M microvm -nodefaults -no-user-config \
      -display none -serial none -monitor none -S >/dev/null 2>&1
    # Still running when the timeout ended it (124): KVM boots guests here.
    [ $? = 124 ] && accel=kvm
  fi
fi
echo "qemu.sh: accelerator $accel${{STRATA_VM_ACCEL:+ (STRATA_VM_ACCEL)}}" >&2
case "$accel" in
  kvm) set -- -accel kvm -cpu host "$@" ;;
  # Without KVM the guest has no clock to calibrate its TSC against (microvm has no HPET): give it.
  tcg) set -- -accel tcg -cpu max "$@"
       khz=$(awk '/^cpu MHz/ {{ printf "%d", $4 * 1000; exit }}' /proc/cpuinfo)
       [ -n "$khz" ] && cmdline="$cmdline tsc_early_khz=$khz" ;;
  *) echo "qemu.sh: STRATA_VM_ACCEL must be kvm or tcg" >&2; exit 2 ;;
esac
exec {argv_lines} \
  "$@"
"#,
        id = desc["id"].as_str().unwrap_or_default(),
        image = desc["image"].as_str().unwrap_or_default(),
        cmdline = quote(cmdline),
    )
}

/// firecracker.json: a `firecracker --config-file` (untested here). Firecracker exposes a drive's
/// `drive_id` as its virtio-blk serial.
fn firecracker(desc: &Value) -> Value {
    let drives: Vec<Value> = desc["drives"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            json!({"drive_id": d["serial"], "path_on_host": d["path"], "is_root_device": false,
                   "is_read_only": d["read_only"]})
        })
        .collect();
    json!({
        "boot-source": {"kernel_image_path": desc["kernel"], "initrd_path": desc["initrd"],
                        "boot_args": desc["cmdline"]},
        "drives": drives,
        "machine-config": {"vcpu_count": desc["cpus"], "mem_size_mib": desc["memory_mib"]},
    })
}

/// cloud-hypervisor.json: a `PUT /api/v1/vm.create` body (untested here).
fn cloud_hypervisor(desc: &Value) -> Value {
    let disks: Vec<Value> = desc["drives"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| json!({"path": d["path"], "readonly": d["read_only"], "serial": d["serial"]}))
        .collect();
    json!({
        "payload": {"kernel": desc["kernel"], "initramfs": desc["initrd"], "cmdline": desc["cmdline"]},
        "cpus": {"boot_vcpus": desc["cpus"], "max_vcpus": desc["cpus"]},
        "memory": {"size": desc["memory_mib"].as_u64().unwrap_or(512) << 20},
        "disks": disks,
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
    })
}

fn write_dir(dir: &Path, desc: &Value) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, bytes: &[u8]| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))
    };
    write("vm.json", &serde_json::to_vec_pretty(desc)?)?;
    write(
        "cmdline",
        format!("{}\n", desc["cmdline"].as_str().unwrap_or_default()).as_bytes(),
    )?;
    write("qemu.sh", qemu_script(desc).as_bytes())?;
    let p = dir.join("qemu.sh");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", p.display()))?;
    write(
        "firecracker.json",
        &serde_json::to_vec_pretty(&firecracker(desc))?,
    )?;
    write(
        "cloud-hypervisor.json",
        &serde_json::to_vec_pretty(&cloud_hypervisor(desc))?,
    )?;
    Ok(())
}

/// A stopped VM's scratch image mounted read-only on a private directory, for `pack_diff --vm`;
/// unmounted (and its loop device released) when dropped.
pub struct ScratchUpper {
    mnt: tempfile::TempDir,
}

impl ScratchUpper {
    /// Mounts `scratch` (refused while a process, a VMM, holds it open: its writes would be half seen).
    pub fn mount(id: &str, scratch: &Path) -> Result<ScratchUpper> {
        let holders = strata_fs::vm::holders(scratch)
            .with_context(|| format!("scratch image {}", scratch.display()))?;
        if !holders.is_empty() {
            bail!(crate::exit::SandboxState(format!(
                "VM {id} is still running (processes {holders:?} hold its scratch image {}): stop the VM first",
                scratch.display()
            )));
        }
        let mnt = tempfile::Builder::new()
            .prefix("strata-vm-scratch-")
            .tempdir()
            .context("a mount point for the scratch image")?;
        // util-linux sets the loop device up and releases it at umount (autoclear). `ro` without
        // `noload`: a journal the guest left is replayed (on the loop device, writable), as a mount in
        // the guest would.
        let out = std::process::Command::new("mount")
            .args(["-t", "ext4", "-o", "ro,loop,nodev,nosuid,noexec"])
            .arg(scratch)
            .arg(mnt.path())
            .output()
            .context("running mount (util-linux)")?;
        if !out.status.success() {
            bail!(
                "mounting VM {id}'s scratch image {}: {}",
                scratch.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(ScratchUpper { mnt })
    }

    /// The overlay's upper directory on it.
    pub fn upper(&self) -> PathBuf {
        self.mnt.path().join("upper")
    }
}

impl Drop for ScratchUpper {
    fn drop(&mut self) {
        if let Err(e) = strata_fs::mount::unmount(self.mnt.path(), false) {
            tracing::warn!(error = %e, "unmounting a VM's scratch image");
            let _ = strata_fs::mount::unmount(self.mnt.path(), true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_script_quotes_everything() {
        let cfg = ImageConfig {
            env: vec!["A=it's".into()],
            cmd: vec!["echo".into(), "a b".into()],
            working_dir: Some("/w d".into()),
            ..ImageConfig::default()
        };
        let s = run_script(&cfg, &[]);
        assert!(s.contains("export 'A=it'\\''s'\n"), "{s}");
        assert!(s.contains("export 'PATH="), "{s}");
        assert!(s.contains("cd '/w d' || exit 1\n"), "{s}");
        assert!(s.ends_with("exec 'echo' 'a b'\n"), "{s}");
        let s = run_script(&cfg, &["id".into()]);
        assert!(s.ends_with("exec 'id'\n"), "{s}");
        let out = std::process::Command::new("sh")
            .args([
                "-c",
                &run_script(&cfg, &["sh".into(), "-c".into(), "echo \"$A\"".into()])
                    .replace("cd '/w d' || exit 1\n", ""),
            ])
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's\n");
    }

    #[test]
    fn the_command_line_names_each_layer_and_is_bounded() {
        let sb = json!({"vm": {"layers": [["m0", "b0"], ["m1", "b0", "b1"]]}});
        let line = kernel_cmdline(&sb, "exec 'true'\n").expect("fits");
        assert!(line.contains(" strata.layers=2 strata.l0=m0,b0 strata.l1=m1,b0,b1 strata.scratch=scratch strata.run="), "{line}");
        let long = "x".repeat(3000);
        assert!(kernel_cmdline(&sb, &long).is_err());
    }
}
