//! Mount modes: how a layer's blob bytes reach the kernel, chosen for the kernel the node runs.
//!
//! | mode | needs | a layer is |
//! |---|---|---|
//! | `file` | file-backed EROFS (Linux 6.12+), FUSE | EROFS mounted on its metadata file, one `device=` per blob file on stratad's FUSE mount |
//! | `loop` | multi-device EROFS on block devices (5.16+), loop devices, FUSE | EROFS on a loop device of its metadata file, one `device=` loop device per blob file ([`crate::control::loops`]) |
//! | `fuse` | FUSE | stratad serves the layer's whole tree from its metadata (`crate::treefs`) |
//! | `fanotify` | file-backed EROFS, fanotify pre-content events (6.14+) | EROFS mounted on its metadata file, one `device=` per blob's local view file, filled on the kernel's pre-content events ([`crate::fanotify`]) |
//!
//! `auto` (the default) probes at start what this kernel can do and takes the first of `fanotify`,
//! `file`, `loop`, `fuse` that works (`fanotify` first: one copy of each byte in memory, cached reads
//! at the kernel's speed, never-seen images as fast as `file` — BENCHMARKS.md, twentieth session); the
//! report says, for each better mode, why not (the missing kernel option or the errno a call
//! answered). The probe is real and takes milliseconds: it writes a one-block EROFS image
//! with one device slot ([`probe_image`]) to the state directory, mounts it file-backed with itself as
//! its device, then on two loop devices of itself as source and device — each mount made and dropped
//! without being attached anywhere — and checks `/dev/fuse`, `/proc/filesystems` and
//! `/dev/loop-control`. [`decide`] is the pure half: capabilities and a request in, a mode and reasons
//! out.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::{loopdev, mount};

/// A way of mounting layers, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountMode {
    File,
    Loop,
    Fuse,
    Fanotify,
}

impl MountMode {
    /// The modes `auto` tries, the best first.
    pub const BEST_FIRST: [MountMode; 4] = [
        MountMode::Fanotify,
        MountMode::File,
        MountMode::Loop,
        MountMode::Fuse,
    ];

    /// Whether this stratad can mount layers this way.
    pub fn built(self) -> bool {
        true
    }

    pub fn name(self) -> &'static str {
        match self {
            MountMode::File => "file",
            MountMode::Loop => "loop",
            MountMode::Fuse => "fuse",
            MountMode::Fanotify => "fanotify",
        }
    }
}

impl std::fmt::Display for MountMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The configured `mount_mode`: `auto`, or one mode forced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeRequest {
    #[default]
    Auto,
    File,
    Loop,
    Fuse,
    Fanotify,
}

impl ModeRequest {
    /// The mode forced, if any.
    pub fn forced(self) -> Option<MountMode> {
        match self {
            ModeRequest::Auto => None,
            ModeRequest::File => Some(MountMode::File),
            ModeRequest::Loop => Some(MountMode::Loop),
            ModeRequest::Fuse => Some(MountMode::Fuse),
            ModeRequest::Fanotify => Some(MountMode::Fanotify),
        }
    }
}

/// A `mount_mode` value that is none of `auto`, `file`, `loop`, `fuse`, `fanotify`.
#[derive(Debug, thiserror::Error)]
#[error("mount mode {0:?}: use auto, file, loop, fuse or fanotify")]
pub struct BadMode(pub String);

impl std::str::FromStr for ModeRequest {
    type Err = BadMode;
    fn from_str(s: &str) -> Result<ModeRequest, BadMode> {
        serde_json::from_value(serde_json::Value::String(s.to_string()))
            .map_err(|_| BadMode(s.to_string()))
    }
}

/// One probed capability: `None` if present, else why not.
pub type Lack = Option<String>;

/// What the kernel can do, as probed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// `uname -r`.
    pub kernel: String,
    /// `/dev/fuse` opens and `fuse` is in `/proc/filesystems`.
    pub fuse: Lack,
    /// `fsopen("erofs")` works (the module loads).
    pub erofs: Lack,
    /// A multi-device EROFS image mounts file-backed, with a regular file as its device.
    pub file_backed: Lack,
    /// A multi-device EROFS image mounts on a loop device, with a loop device as its device.
    pub loop_devices: Lack,
    /// A fanotify group takes pre-content (`FAN_PRE_ACCESS`) marks.
    #[serde(default)]
    pub pre_content: Lack,
}

/// Which mode a node runs in and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModeReport {
    pub requested: ModeRequest,
    /// The mode chosen; `None`: nothing works (or the forced mode does not).
    pub mode: Option<MountMode>,
    /// Each better mode than the one chosen (every mode if none), and why it was not.
    pub passed_over: Vec<PassedOver>,
    pub capabilities: Capabilities,
    /// How long the probe took.
    pub probe_ms: f64,
}

/// A mode not chosen and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassedOver {
    pub mode: MountMode,
    pub reason: String,
}

/// No mode to run in.
#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("mount mode {mode} cannot run here (kernel {kernel}): {reason}")]
    Forced {
        mode: MountMode,
        kernel: String,
        reason: String,
    },
    #[error("no mount mode works on this kernel ({kernel}): {}", list(.passed_over))]
    None {
        kernel: String,
        passed_over: Vec<PassedOver>,
    },
}

fn list(p: &[PassedOver]) -> String {
    p.iter()
        .map(|p| format!("{}: {}", p.mode, p.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why `mode` cannot run with `caps` (`None`: it can).
pub fn why_not(caps: &Capabilities, mode: MountMode) -> Lack {
    if let Some(f) = &caps.fuse {
        return Some(format!("needs FUSE: {f}"));
    }
    let kernel = match mode {
        MountMode::File => caps.erofs.as_ref().or(caps.file_backed.as_ref()),
        MountMode::Loop => caps.erofs.as_ref().or(caps.loop_devices.as_ref()),
        MountMode::Fuse => None,
        MountMode::Fanotify => caps
            .erofs
            .as_ref()
            .or(caps.file_backed.as_ref())
            .or(caps.pre_content.as_ref()),
    };
    match kernel {
        Some(k) => Some(k.clone()),
        None if !mode.built() => Some(format!(
            "not built yet in this stratad (the {mode} mode's tree server is coming)"
        )),
        None => None,
    }
}

/// The mode for `requested` given `caps`: `auto` takes the first of [`MountMode::BEST_FIRST`] that
/// works; a forced mode is taken if it works. Either way the better modes are listed with why not.
pub fn decide(caps: &Capabilities, requested: ModeRequest) -> ModeReport {
    let mut passed_over = Vec::new();
    let mut mode = None;
    for m in MountMode::BEST_FIRST {
        let reason = match (requested.forced(), why_not(caps, m)) {
            (Some(f), None) if f != m => Some(format!("mount_mode is {f}")),
            (_, r) => r,
        };
        match reason {
            None => {
                mode = Some(m);
                break;
            }
            Some(reason) => {
                let forced_here = requested.forced() == Some(m);
                passed_over.push(PassedOver { mode: m, reason });
                if forced_here {
                    break;
                }
            }
        }
    }
    ModeReport {
        requested,
        mode,
        passed_over,
        capabilities: caps.clone(),
        probe_ms: 0.0,
    }
}

impl ModeReport {
    /// The mode to run in, or why there is none.
    pub fn usable(&self) -> Result<MountMode, ModeError> {
        let kernel = self.capabilities.kernel.clone();
        match (self.mode, self.requested.forced()) {
            (Some(m), _) => Ok(m),
            (None, Some(mode)) => Err(ModeError::Forced {
                mode,
                kernel,
                reason: self
                    .passed_over
                    .iter()
                    .find(|p| p.mode == mode)
                    .map_or_else(String::new, |p| p.reason.clone()),
            }),
            (None, None) => Err(ModeError::None {
                kernel,
                passed_over: self.passed_over.clone(),
            }),
        }
    }

    /// The report for people, one line each.
    pub fn lines(&self) -> Vec<String> {
        let c = &self.capabilities;
        let show = |l: &Lack| {
            l.as_deref()
                .map_or("ok".to_string(), |r| format!("no: {r}"))
        };
        let mut out = vec![
            format!("kernel        {}", c.kernel),
            format!("fuse          {}", show(&c.fuse)),
            format!("erofs         {}", show(&c.erofs)),
            format!("file-backed   {}", show(&c.file_backed)),
            format!("loop devices  {}", show(&c.loop_devices)),
            format!("pre-content   {}", show(&c.pre_content)),
        ];
        let requested = serde_json::to_value(self.requested).unwrap_or_default();
        let requested = requested.as_str().unwrap_or("?");
        out.push(match self.mode {
            Some(m) => format!("mount mode    {m} (requested {requested})"),
            None => format!("mount mode    none works (requested {requested})"),
        });
        for p in &self.passed_over {
            out.push(format!("  not {:<8} {}", p.mode.name(), p.reason));
        }
        out
    }
}

/// Probes this kernel (writing the probe image into `dir`, which must be on the disk filesystem the
/// layers' metadata will live on) and decides for `requested`.
pub fn probe_and_decide(dir: &Path, requested: ModeRequest) -> ModeReport {
    let t = Instant::now();
    let caps = probe(dir);
    let mut report = decide(&caps, requested);
    report.probe_ms = t.elapsed().as_secs_f64() * 1e3;
    report
}

/// Probes what this kernel can do (see the module documentation).
pub fn probe(dir: &Path) -> Capabilities {
    let mut caps = Capabilities {
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        fuse: probe_fuse(),
        ..Capabilities::default()
    };
    if let Err(e) = rustix::mount::fsopen("erofs", rustix::mount::FsOpenFlags::FSOPEN_CLOEXEC) {
        caps.erofs = Some(match e {
            rustix::io::Errno::NODEV => "no EROFS in this kernel (CONFIG_EROFS_FS)".into(),
            rustix::io::Errno::NOSYS => "no fsopen(2) (Linux < 5.2)".into(),
            e => format!("fsopen(\"erofs\"): {}", std::io::Error::from(e)),
        });
        caps.file_backed = caps.erofs.clone();
        caps.loop_devices = caps.erofs.clone();
        caps.pre_content = caps.erofs.clone();
        return caps;
    }
    let image = dir.join(format!(".mode-probe-{}.erofs", std::process::id()));
    if let Err(e) = std::fs::write(&image, probe_image()) {
        let lack = Some(format!(
            "cannot write the probe image {}: {e}",
            image.display()
        ));
        caps.file_backed = lack.clone();
        caps.loop_devices = lack.clone();
        caps.pre_content = lack;
        return caps;
    }
    caps.file_backed = probe_file_backed(&image);
    caps.loop_devices = probe_loop(&image);
    caps.pre_content = crate::fanotify::sys::probe(&image);
    let _ = std::fs::remove_file(&image);
    caps
}

fn probe_fuse() -> Lack {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Some(format!("/dev/fuse: {e}"));
    }
    let listed = std::fs::read_to_string("/proc/filesystems").is_ok_and(|t| {
        t.lines()
            .any(|l| l.split_whitespace().last() == Some("fuse"))
    });
    (!listed).then(|| "fuse is not in /proc/filesystems (CONFIG_FUSE_FS)".to_string())
}

fn probe_file_backed(image: &Path) -> Lack {
    let e = mount::try_erofs(image, &[image.to_path_buf()]).err()?;
    Some(match e.errno() {
        Some(libc::ENOTBLK) => {
            "EROFS mounts block devices only: file-backed mounts need Linux 6.12+ with CONFIG_EROFS_FS_BACKED_BY_FILE (ENOTBLK)".into()
        }
        _ => multi_device_lack(&e),
    })
}

fn probe_loop(image: &Path) -> Lack {
    if let Err(e) = loopdev::available() {
        return Some(format!(
            "/dev/loop-control: {e} (CONFIG_BLK_DEV_LOOP; `modprobe loop`)"
        ));
    }
    // Two devices of the one image: source and device. One for both is refused (EBUSY): the
    // superblock holds its block devices exclusively.
    let mut devs = Vec::new();
    for _ in 0..2 {
        match loopdev::attach(image, false) {
            Ok(d) => devs.push(d),
            Err(e) => return Some(format!("LOOP_CONFIGURE: {e} (needs Linux 5.8+)")),
        }
    }
    // The devices go when `devs` is dropped (autoclear): the mount is never attached.
    let e = mount::try_erofs(&devs[0].path(), &[devs[1].path()]).err()?;
    Some(multi_device_lack(&e))
}

/// Why a probe mount failed: a kernel that does not know the device table (before 5.16) refuses it as
/// an unknown incompatible feature.
fn multi_device_lack(e: &mount::MountError) -> String {
    match e.log.iter().any(|l| l.contains("incompatible feature")) {
        true => format!("EROFS without multi-device images (Linux < 5.16): {e}"),
        false => e.to_string(),
    }
}

/// The probe image's root directory inode: right after the superblock's block-0 neighbours (metadata
/// from block 0, 32-byte slots: byte 1280).
const PROBE_ROOT_NID: u16 = 40;

/// A one-block EROFS image: an empty root directory and a device table of one slot (one block), so
/// that mounting it needs exactly one `device=` — what `file` and `loop` modes do with every layer.
/// Written with the format's own structures (`strata_erofs::format`); layout facts:
/// `docs/FORMAT.md`.
pub fn probe_image() -> Vec<u8> {
    use strata_erofs::format::{
        Dirent, InodeCompact, RawDeviceSlot, SuperBlock, BLKSZ, BLKSZ_BITS, DEVT_SLOT_SIZE,
        EROFS_MAGIC, FEATURE_INCOMPAT_DEVICE_TABLE, FT_DIR, I_DATALAYOUT_BIT, LAYOUT_FLAT_INLINE,
        SUPER_OFFSET,
    };
    let mut img = vec![0u8; BLKSZ];
    let slot_at = 9 * DEVT_SLOT_SIZE; // 1152: the 128-byte slot after the superblock
    let sb = SuperBlock {
        magic: EROFS_MAGIC,
        blkszbits: BLKSZ_BITS,
        root_nid: PROBE_ROOT_NID,
        inos: 1,
        blocks: 1,
        feature_incompat: FEATURE_INCOMPAT_DEVICE_TABLE,
        extra_devices: 1,
        devt_slotoff: (slot_at / DEVT_SLOT_SIZE) as u16,
        ..SuperBlock::zeroed()
    };
    sb.write_to(&mut img, SUPER_OFFSET);
    let mut tag = [0u8; 64];
    tag[..17].copy_from_slice(b"strata-mode-probe");
    RawDeviceSlot {
        tag,
        blocks_lo: 1,
        ..RawDeviceSlot::zeroed()
    }
    .write_to(&mut img, slot_at);
    // The root: a compact inode with its entries inline, "." and ".." only.
    let names = b"...";
    let dirents = 2 * Dirent::SIZE;
    let root = usize::from(PROBE_ROOT_NID) * 32;
    InodeCompact {
        i_format: LAYOUT_FLAT_INLINE << I_DATALAYOUT_BIT,
        i_mode: 0o040755,
        i_nb: 2,
        i_size: (dirents + names.len()) as u32,
        i_ino: 1,
        ..InodeCompact::zeroed()
    }
    .write_to(&mut img, root);
    let data = root + InodeCompact::SIZE;
    for (i, nameoff) in [(0, dirents), (1, dirents + 1)] {
        Dirent {
            nid: u64::from(PROBE_ROOT_NID),
            nameoff: nameoff as u16,
            file_type: FT_DIR,
            reserved: 0,
        }
        .write_to(&mut img, data + i * Dirent::SIZE);
    }
    img[data + dirents..data + dirents + names.len()].copy_from_slice(names);
    img
}

/// Where the node's first server keeps the report it decided on.
const RECORD: &str = "node/mount_mode.json";

/// The mode report for a server starting on `state_dir`. A server that adopts a node (`adopted`) mounts
/// as the node's first server decided — its layers are mounted that way already — and so takes that
/// server's recorded report instead of probing again (no loop devices bound, nothing mounted before it
/// serves). A first server probes and records its decision; so does a successor whose configuration
/// asks for another mode, or that finds no record (an older predecessor).
pub fn for_server(state_dir: &Path, requested: ModeRequest, adopted: bool) -> ModeReport {
    let path = state_dir.join(RECORD);
    if adopted {
        let recorded = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<ModeReport>(&b).ok())
            .filter(|r| r.requested == requested && r.mode.is_some());
        if let Some(r) = recorded {
            return r;
        }
    }
    let report = probe_and_decide(state_dir, requested);
    if report.mode.is_some() {
        let saved = std::fs::create_dir_all(state_dir.join("node"))
            .map_err(|e| e.to_string())
            .and_then(|_| serde_json::to_vec(&report).map_err(|e| e.to_string()))
            .and_then(|b| {
                crate::control::state::write_atomic(&path, &b).map_err(|e| e.to_string())
            });
        if let Err(e) = saved {
            tracing::warn!(error = %e, "recording the mount mode: a successor will probe again");
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(file: bool, looped: bool, fuse: bool) -> Capabilities {
        let lack = |ok: bool, why: &str| (!ok).then(|| why.to_string());
        Capabilities {
            kernel: "6.x".into(),
            fuse: lack(fuse, "/dev/fuse: No such file or directory"),
            erofs: None,
            file_backed: lack(file, "ENOTBLK"),
            loop_devices: lack(looped, "no /dev/loop-control"),
            pre_content: lack(file, "no pre-content events"),
        }
    }

    #[test]
    fn the_probe_image_is_the_one_device_erofs_image_it_claims_to_be() {
        let img = strata_erofs::reader::ErofsImage::parse(probe_image()).expect("parses");
        assert_eq!(img.root_nid(), u64::from(PROBE_ROOT_NID));
        assert_eq!(img.devices().len(), 1);
        assert_eq!(img.inode_count(), 1);
        let root = img.lookup(b"/").expect("lookup").expect("a root");
        assert!(root.is_dir(), "{root:?}");
    }

    #[test]
    fn a_successor_takes_the_recorded_mode_without_probing() {
        let t = tempfile::tempdir().unwrap();
        // What the node's first server decided (a capability no probe here would report).
        let first = decide(&caps(false, true, true), ModeRequest::Auto);
        std::fs::create_dir_all(t.path().join("node")).unwrap();
        std::fs::write(t.path().join(RECORD), serde_json::to_vec(&first).unwrap()).unwrap();
        assert_eq!(for_server(t.path(), ModeRequest::Auto, true), first);
        // A damaged record is not trusted: the server probes (and records) instead.
        std::fs::write(t.path().join(RECORD), b"{").unwrap();
        let r = for_server(t.path(), ModeRequest::Auto, true);
        assert_ne!(r.capabilities.kernel, "6.x");
    }

    fn modes(r: &ModeReport) -> Vec<MountMode> {
        r.passed_over.iter().map(|p| p.mode).collect()
    }

    #[test]
    fn auto_takes_the_fastest_mode_that_works_and_says_why_not_the_better_ones() {
        // 6.14+: fanotify.
        let r = decide(&caps(true, true, true), ModeRequest::Auto);
        assert_eq!((r.mode, modes(&r)), (Some(MountMode::Fanotify), vec![]));
        // 6.12 and 6.13, or a state directory on tmpfs: file.
        let c = Capabilities {
            pre_content: Some("no pre-content events".into()),
            ..caps(true, true, true)
        };
        let r = decide(&c, ModeRequest::Auto);
        assert_eq!(r.mode, Some(MountMode::File));
        assert_eq!(modes(&r), [MountMode::Fanotify]);
        assert_eq!(r.passed_over[0].reason, "no pre-content events");
        // 6.1 (Debian 12, AL2023): loop, because file-backed mounts are missing.
        let r = decide(&caps(false, true, true), ModeRequest::Auto);
        assert_eq!(r.mode, Some(MountMode::Loop));
        assert_eq!(modes(&r), [MountMode::Fanotify, MountMode::File]);
        assert!(r.passed_over[1].reason.contains("ENOTBLK"));
        // Neither (5.15, or no loop devices in a container): fuse, saying why not the others.
        let r = decide(&caps(false, false, true), ModeRequest::Auto);
        assert_eq!(r.mode, Some(MountMode::Fuse));
        assert_eq!(
            modes(&r),
            [MountMode::Fanotify, MountMode::File, MountMode::Loop]
        );
        assert!(
            r.passed_over[2].reason.contains("no /dev/loop-control"),
            "{r:?}"
        );
        // No FUSE: nothing at all works, and every mode says so.
        let r = decide(&caps(true, true, false), ModeRequest::Auto);
        assert_eq!(r.mode, None);
        assert!(r
            .passed_over
            .iter()
            .all(|p| p.reason.contains("needs FUSE")));
    }

    #[test]
    fn a_forced_mode_is_taken_if_it_works_and_refused_naming_why_if_not() {
        let r = decide(&caps(true, true, true), ModeRequest::Loop);
        assert_eq!(r.mode, Some(MountMode::Loop));
        assert_eq!(modes(&r), [MountMode::Fanotify, MountMode::File]);
        assert_eq!(r.passed_over[0].reason, "mount_mode is loop");
        let r = decide(&caps(false, true, true), ModeRequest::File);
        assert_eq!(r.mode, None);
        let e = r.usable().unwrap_err().to_string();
        assert!(
            e.starts_with("mount mode file cannot run here") && e.contains("ENOTBLK"),
            "{e}"
        );
        // Fuse forced: taken wherever FUSE is, the kernel modes passed over as forced.
        let r = decide(&caps(true, true, true), ModeRequest::Fuse);
        assert_eq!(r.mode, Some(MountMode::Fuse));
        // Fanotify forced: only where pre-content events are.
        let r = decide(&caps(true, true, true), ModeRequest::Fanotify);
        assert_eq!((r.mode, modes(&r)), (Some(MountMode::Fanotify), vec![]));
        let r = decide(&caps(false, true, true), ModeRequest::Fanotify);
        assert_eq!(r.mode, None);
        assert!(r.usable().unwrap_err().to_string().contains("ENOTBLK"));
    }

    #[test]
    fn requests_parse_from_their_names() {
        assert_eq!("auto".parse::<ModeRequest>().unwrap(), ModeRequest::Auto);
        assert_eq!("loop".parse::<ModeRequest>().unwrap(), ModeRequest::Loop);
        assert!("block"
            .parse::<ModeRequest>()
            .unwrap_err()
            .to_string()
            .contains("block"));
    }
}
