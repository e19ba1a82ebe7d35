//! MicroVM sandboxes: an image's layers as read-only drives, plus a writable scratch drive.
//!
//! A microVM cannot use the host's overlay: it needs block devices. Each layer already is what a guest
//! kernel mounts — an EROFS metadata image whose device table names blobs — so a VM sandbox mounts
//! nothing on the host. The daemon fetches each layer's metadata (verified) and serves it, and the
//! layer's blobs, as files of its FUSE mount (`<runtime>/fuse/meta/<layer>`, `<runtime>/fuse/blobs/<blob>`,
//! lazily, through the same chunk cache and fetcher as container sandboxes); the VMM opens them as
//! read-only virtio-blk drives and the guest mounts each layer with `device=` its blob drives. A sandbox's
//! changes go to a scratch drive: a sparse raw ext4 image (made with `mkfs.ext4`) holding the overlay's
//! `upper/` and `work/`, which `pack_diff --vm` packs once the VM has stopped.
//!
//! **Drives** are named by their virtio-blk serial: `m<i>` for layer i's metadata (bottom first), `b<j>`
//! for each distinct blob (a blob several layers name is one drive), `scratch`. They are listed in the
//! order a VMM is given them; [`VmDrives::layers`] says, per layer, which serials are its metadata and
//! its devices in device-table order (the guest's init maps serials to `/dev/vdX`). A VMM takes a bounded
//! number of drives — QEMU's `microvm` machine has [`MAX_DRIVES`] virtio-mmio transports — and an image
//! needing more is refused, naming the count ([`VmError::TooManyDrives`]): `strata vm` flattens such an
//! image first (one metadata drive for all its layers).
//!
//! **State.** A VM sandbox is a [`Sandbox`] with `vm` set: `upper` is its scratch image, `work` the
//! directory holding it (`<state>/vms/<id>/` unless the request names one). Whether a VMM runs is not
//! visible to the daemon: a VM sandbox is *running* from its creation until it is stopped (its drives
//! are served; the layers are referenced), and after a restart only if the daemon adopted the FUSE
//! connection its drives live on. A purge refuses while a process holds the scratch image open.
//!
//! **Access.** The drive files follow the daemon's rules: the blob and metadata files are root's (0400)
//! or readable by the configured group (0440); the scratch image and its directory are root's (0600,
//! 0700) or the group's too (0660, 0750).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;

use crate::control::daemon::{valid_id, Daemon, DaemonError, State};
use crate::control::sandboxes::{leftovers, Leftovers, Reuse};
use crate::control::state::{Sandbox, SandboxState};

/// Drives a VM sandbox may have: QEMU's `microvm` machine has 24 virtio-mmio transports (with its
/// second IO-APIC, the default), each one drive.
pub const MAX_DRIVES: usize = 24;

/// Size of a new scratch drive unless the request says otherwise (sparse: it costs what is written).
pub const DEFAULT_SCRATCH_BYTES: u64 = 4 << 30;

/// What a drive holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriveKind {
    /// A layer's EROFS metadata (read-only).
    Meta,
    /// A blob's uncompressed view (read-only).
    Blob,
    /// The writable ext4 image.
    Scratch,
}

/// One drive of a VM sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drive {
    /// The virtio-blk serial the guest finds it by.
    pub serial: String,
    pub kind: DriveKind,
    /// The file the VMM opens.
    pub path: PathBuf,
    pub read_only: bool,
    /// Its size as the VMM sees it.
    pub bytes: u64,
    /// The layer (metadata) or blob it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<Digest>,
}

/// A VM sandbox's drives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDrives {
    /// Every drive, in the order the VMM is given them (the scratch drive last).
    pub drives: Vec<Drive>,
    /// Per layer, bottom first: the serial of its metadata drive, then of its devices (device ids 1, 2,
    /// … of its device table).
    pub layers: Vec<Vec<String>>,
    /// The scratch image.
    pub scratch: PathBuf,
}

/// A layer served to microVMs (not mounted on the host).
pub(crate) struct VmLayer {
    pub(crate) refs: usize,
    pub(crate) blobs: Vec<Digest>,
    /// Stored bytes of the layer (metadata and blobs).
    pub(crate) bytes: u64,
}

/// Errors particular to VM sandboxes.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("image {image} needs {needed} drives ({layers} layer metadata, {blobs} blobs, 1 scratch); a microVM takes at most {max}: flatten it (`strata flatten`) or use fewer layers")]
    TooManyDrives {
        image: String,
        needed: usize,
        layers: usize,
        blobs: usize,
        max: usize,
    },
    #[error("making the scratch drive {path}: mkfs.ext4 failed ({status}): {stderr}")]
    Mkfs {
        path: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("making the scratch drive {path}: cannot run mkfs.ext4 (apt-get install e2fsprogs): {source}")]
    NoMkfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("scratch size {0} bytes: at least 64 MiB")]
    ScratchTooSmall(u64),
}

/// A request for a VM sandbox (`POST /v1/sandboxes` with `"kind": "vm"`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmRequest {
    pub image: String,
    pub id: String,
    /// `"vm"`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Directory for the scratch image (default `<state>/vms/<id>`).
    #[serde(default)]
    pub dir: Option<PathBuf>,
    #[serde(default)]
    pub reuse: Reuse,
    /// Size of a new scratch drive (bytes, or with a unit: `"8G"`).
    #[serde(default, deserialize_with = "crate::size::deserialize_opt")]
    pub scratch_size: Option<u64>,
}

fn io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The state a recorded VM sandbox is in after a (re)start: running only if it ran and this server
/// adopted the FUSE connection its drives are files of (a new connection means the VMM's drives died).
pub(crate) fn restored_state(adopted: bool, recorded: SandboxState) -> SandboxState {
    match (adopted, recorded) {
        (true, SandboxState::Running) => SandboxState::Running,
        _ => SandboxState::Stopped,
    }
}

impl Daemon {
    /// Creates a VM sandbox of `req.image`: its layers' metadata and blobs served as drive files, and a
    /// scratch drive (kept from a stopped sandbox with [`Reuse::Resume`]).
    pub fn create_vm(&self, req: &VmRequest) -> Result<Sandbox, DaemonError> {
        let id = req.id.as_str();
        if !valid_id(id) {
            return Err(DaemonError::Invalid(format!(
                "sandbox id {id:?}: use 1 to 128 of [A-Za-z0-9._-], not starting with '.'"
            )));
        }
        let scratch_bytes = req.scratch_size.unwrap_or(DEFAULT_SCRATCH_BYTES);
        if scratch_bytes < 64 << 20 {
            return Err(VmError::ScratchTooSmall(scratch_bytes).into());
        }
        let prior = self.lock().sandboxes.get(id).cloned();
        if prior
            .as_ref()
            .is_some_and(|p| p.state == SandboxState::Running)
        {
            return Err(DaemonError::SandboxExists(id.to_string()));
        }
        if prior.as_ref().is_some_and(|p| p.vm.is_none()) && req.reuse == Reuse::Resume {
            return Err(DaemonError::Invalid(format!(
                "sandbox {id} is a container: resume it with `strata mount --resume`"
            )));
        }
        let started = std::time::Instant::now();
        let (manifest, m) = self.resolve(&req.image)?;
        let dir = match (&req.dir, &prior) {
            (Some(d), _) => d.clone(),
            (None, Some(p)) if p.vm.is_some() && req.reuse == Reuse::Resume => p.work.clone(),
            (None, _) => self.config.state_dir.join("vms").join(id),
        };
        let scratch = dir.join("scratch.ext4");
        match leftovers(
            id,
            &req.image,
            &manifest,
            prior.as_ref(),
            scratch.exists(),
            req.reuse,
        )? {
            Leftovers::Discard => {
                if let Some(p) = &prior {
                    self.delete_sandbox_files(p)?;
                }
                remove_scratch(&scratch, &dir)?;
            }
            Leftovers::None | Leftovers::Resume => {}
        }
        self.warming.sandbox_requested(&manifest);
        let layers: Vec<Digest> = m.layers.iter().map(|l| l.digest).collect();
        let acquired = self.acquire_vm_layers(&layers)?;
        let made = self
            .vm_drives(&req.image, &layers, &scratch, scratch_bytes)
            .and_then(|(drives, image_bytes)| {
                self.make_scratch_dir(&dir)?;
                if !scratch.exists() {
                    make_scratch(&scratch, scratch_bytes, self.config.group)?;
                }
                Ok((drives, image_bytes))
            });
        let (drives, image_bytes) = match made {
            Ok(x) => x,
            Err(e) => {
                self.release_vm_layers(&acquired);
                return Err(e);
            }
        };
        let sb = Sandbox {
            id: id.to_string(),
            image: req.image.clone(),
            manifest,
            layers,
            rootfs: PathBuf::new(),
            upper: scratch,
            work: dir,
            created: crate::control::state::unix_now(),
            image_bytes,
            state: SandboxState::Running,
            config: m.config.clone(),
            vm: Some(drives),
            charged: Default::default(),
            root: None,
        };
        if let Err(e) = self.node.save_sandbox(&sb) {
            self.release_vm_layers(&acquired);
            return Err(e.into());
        }
        self.lock().sandboxes.insert(id.to_string(), sb.clone());
        tracing::info!(sandbox = id, image = %req.image,
            ms = started.elapsed().as_millis() as u64, "VM sandbox created");
        Ok(sb)
    }

    /// Serves each of `layers` to a VM (another reference to those served already); on a failure none
    /// stays acquired.
    fn acquire_vm_layers(&self, layers: &[Digest]) -> Result<Vec<Digest>, DaemonError> {
        let mut acquired = Vec::new();
        for l in layers {
            if let Err(e) = self.acquire_vm_layer(l) {
                self.release_vm_layers(&acquired);
                return Err(e);
            }
            acquired.push(*l);
        }
        Ok(acquired)
    }

    /// The drives of a VM of `layers` (served already), and the image's stored bytes.
    fn vm_drives(
        &self,
        image: &str,
        layers: &[Digest],
        scratch: &Path,
        scratch_bytes: u64,
    ) -> Result<(VmDrives, u64), DaemonError> {
        let st = self.lock();
        let mut drives = Vec::new();
        let mut per_layer = Vec::new();
        let mut blob_serial: HashMap<Digest, String> = HashMap::new();
        let mut image_bytes = 0;
        for (i, l) in layers.iter().enumerate() {
            let (Some(v), Some(meta)) = (st.vm_layers.get(l), self.table.metas.by_digest(l)) else {
                return Err(DaemonError::Metadata(format!("layer {l} is not served")));
            };
            image_bytes += v.bytes;
            let serial = format!("m{i}");
            drives.push(Drive {
                serial: serial.clone(),
                kind: DriveKind::Meta,
                path: self.config.runtime_dir.join("fuse/meta").join(l.hex()),
                read_only: true,
                bytes: meta.size(),
                digest: Some(*l),
            });
            let mut spec = vec![serial];
            for b in &v.blobs {
                if let Some(s) = blob_serial.get(b) {
                    spec.push(s.clone());
                    continue;
                }
                let Some(h) = self.table.handle(b) else {
                    return Err(DaemonError::Metadata(format!("blob {b} is not served")));
                };
                let s = format!("b{}", blob_serial.len());
                blob_serial.insert(*b, s.clone());
                drives.push(Drive {
                    serial: s.clone(),
                    kind: DriveKind::Blob,
                    path: self.blob_path(b),
                    read_only: true,
                    bytes: h.toc.view_size(),
                    digest: Some(*b),
                });
                spec.push(s);
            }
            per_layer.push(spec);
        }
        drives.push(Drive {
            serial: "scratch".into(),
            kind: DriveKind::Scratch,
            path: scratch.to_path_buf(),
            read_only: false,
            bytes: std::fs::metadata(scratch).map_or(scratch_bytes, |m| m.len()),
            digest: None,
        });
        if drives.len() > MAX_DRIVES {
            return Err(VmError::TooManyDrives {
                image: image.to_string(),
                needed: drives.len(),
                layers: layers.len(),
                blobs: blob_serial.len(),
                max: MAX_DRIVES,
            }
            .into());
        }
        let vm = VmDrives {
            drives,
            layers: per_layer,
            scratch: scratch.to_path_buf(),
        };
        Ok((vm, image_bytes))
    }

    /// Serves layer `d` to microVMs (metadata and blobs) and takes a reference.
    fn acquire_vm_layer(&self, d: &Digest) -> Result<(), DaemonError> {
        let take = |st: &mut State| st.vm_layers.get_mut(d).map(|l| l.refs += 1).is_some();
        if take(&mut self.lock()) {
            return Ok(());
        }
        let _flight = self.layer_flights.enter(d);
        if take(&mut self.lock()) {
            return Ok(());
        }
        let fetched = self.fetch_layer(d)?;
        let _g = self.layer_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (desc, meta) = self.serve_fetched(d, fetched)?;
        self.table.metas.add(d, &meta).map_err(|e| io(&meta, e))?;
        self.lock().vm_layers.insert(
            *d,
            VmLayer {
                refs: 1,
                blobs: desc.blobs.iter().map(|b| b.digest).collect(),
                bytes: desc.stored_bytes(),
            },
        );
        Ok(())
    }

    /// Drops a reference to each of `layers`; a layer no VM uses stops being served as metadata.
    pub(crate) fn release_vm_layers(&self, layers: &[Digest]) {
        let mut gone = Vec::new();
        {
            let mut st = self.lock();
            for d in layers {
                if let Some(l) = st.vm_layers.get_mut(d) {
                    l.refs -= 1;
                    if l.refs == 0 {
                        st.vm_layers.remove(d);
                        gone.push(*d);
                    }
                }
            }
        }
        for d in &gone {
            self.table.metas.remove(d);
        }
        if !gone.is_empty() {
            self.trim_metadata();
        }
    }

    /// Creates the directory of a scratch image with the daemon's modes (see the module documentation).
    fn make_scratch_dir(&self, dir: &Path) -> Result<(), DaemonError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        crate::control::perms::close_dir(
            dir,
            self.config.group.map_or(0o700, |_| 0o750),
            self.config.group,
        )
    }

    /// Stops a VM sandbox: its layers are released (the record and scratch image stay).
    pub(crate) fn stop_vm(&self, sb: &Sandbox) {
        self.release_vm_layers(&sb.layers);
    }

    /// Deletes a stopped VM sandbox's scratch image (and its directory, if left empty).
    pub(crate) fn delete_files(&self, sb: &Sandbox) -> Result<(), DaemonError> {
        remove_scratch(&sb.upper, &sb.work)
    }

    /// Serves the layers of the VM sandboxes found running at start (their layers by use count).
    pub(crate) fn restore_vm_layers(&self, st: &mut State, refs: BTreeMap<Digest, usize>) {
        for (d, n) in refs {
            let meta = self.meta_path(&d);
            let served = self.serve_layer(&d).and_then(|(blobs, bytes)| {
                self.table.metas.add(&d, &meta).map_err(|e| io(&meta, e))?;
                Ok((blobs, bytes))
            });
            match served {
                Ok((blobs, bytes)) => {
                    st.vm_layers.insert(
                        d,
                        VmLayer {
                            refs: n,
                            blobs,
                            bytes,
                        },
                    );
                }
                Err(e) => tracing::error!(layer = %d, error = %e,
                    "cannot serve a running VM's layer: its drives fail"),
            }
        }
    }
}

/// Deletes a scratch image and its directory if that is then empty.
fn remove_scratch(scratch: &Path, dir: &Path) -> Result<(), DaemonError> {
    match std::fs::remove_file(scratch) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(scratch, e)),
        _ => {}
    }
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

/// Makes a sparse ext4 image of `bytes` at `path` (root's, or readable and writable by `group`).
fn make_scratch(path: &Path, bytes: u64, group: Option<u32>) -> Result<(), DaemonError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension("ext4.tmp");
    let mode = group.map_or(0o600, |_| 0o660);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| io(&tmp, e))?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| io(&tmp, e))?;
    f.set_len(bytes).map_err(|e| io(&tmp, e))?;
    drop(f);
    if let Some(g) = group {
        std::os::unix::fs::chown(&tmp, Some(0), Some(g)).map_err(|e| io(&tmp, e))?;
    }
    // Inode tables and the journal are left for the guest to initialize lazily (`noinit_itable` there):
    // the image stays sparse.
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-L", "strata-scratch"])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(&tmp)
        .output()
        .map_err(|source| VmError::NoMkfs {
            path: path.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(VmError::Mkfs {
            path: path.to_path_buf(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
        .into());
    }
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Whether `pid` is a child of this process between its fork and its exec: it still runs this
/// program and holds copies of all this process's descriptors — for an instant, so it is no user.
fn forking_child(pid: i32, me: i32) -> bool {
    let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The command name (in parentheses) may hold spaces: the fields after it are plain.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(1)?.parse::<i32>().ok()
        });
    if parent != Some(me) {
        return false;
    }
    let exe = |p: &str| std::fs::read_link(format!("/proc/{p}/exe")).ok();
    exe(&pid.to_string()).is_some_and(|e| Some(e) == exe("self"))
}

/// The processes (other than this one) holding `file` open: a VMM using a scratch image. A child of
/// this process not yet past its exec (another sandbox's runtime being started) is not counted; one
/// that execs while we look is looked at again (its exec closes the copies).
pub fn holders(file: &Path) -> std::io::Result<Vec<i32>> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(file)?;
    let me = std::process::id() as i32;
    // A process may exit while we look: it holds nothing.
    let holds = |pid: i32| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                std::fs::metadata(fd.path()).is_ok_and(|f| (f.dev(), f.ino()) == (m.dev(), m.ino()))
            })
        })
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // Looked at again after the child check: a child that exec'd in between closed its copies.
        if pid != me && holds(pid) && !forking_child(pid, me) && holds(pid) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_runs_after_a_restart_only_on_the_connection_it_ran_on() {
        use SandboxState::*;
        assert_eq!(restored_state(true, Running), Running);
        assert_eq!(restored_state(false, Running), Stopped);
        assert_eq!(restored_state(true, Stopped), Stopped);
    }

    #[test]
    fn a_scratch_image_is_sparse_ext4_and_its_holders_are_found() {
        let t = tempfile::tempdir().expect("tempdir");
        let p = t.path().join("scratch.ext4");
        match make_scratch(&p, 256 << 20, None) {
            Err(DaemonError::Vm(VmError::NoMkfs { .. })) => return, // no e2fsprogs here
            r => r.expect("mkfs"),
        }
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::metadata(&p).expect("stat");
        assert_eq!(m.len(), 256 << 20);
        assert!(m.blocks() * 512 < 32 << 20, "sparse: {} blocks", m.blocks());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        let sb = std::fs::read(&p).expect("read");
        assert_eq!(&sb[1024 + 56..1024 + 58], &[0x53, 0xef], "ext4 magic");
        let f = std::fs::File::open(&p).expect("open");
        assert!(
            holders(&p).expect("scan").is_empty(),
            "this process is not counted"
        );
        // A child holding it counts once it runs another program; before its exec it does not.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open(&p).expect("open"))
            .spawn()
            .expect("sleep");
        let pid = child.id() as i32;
        let start = std::time::Instant::now();
        while forking_child(pid, std::process::id() as i32) {
            assert!(start.elapsed().as_secs() < 10, "the child never ran sleep");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let found = holders(&p).expect("scan");
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&pid), "{found:?} lacks the child {pid}");
        drop(f);
    }
}
