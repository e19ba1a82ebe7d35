//! Mount modes: how a layer's blob bytes reach the kernel, chosen for the kernel the node runs.
//!
//! | mode | needs | a layer is |
//! |---|---|---|
//! | `file` | file-backed EROFS (Linux 6.12+), FUSE | EROFS mounted on its metadata file, one `device=` per blob file on stratad's FUSE mount |
//! | `loop` | multi-device EROFS on block devices (5.16+), loop devices, FUSE | EROFS on a loop device of its metadata file, one `device=` loop device per blob file ([`crate::loops`]) |
//! | `fuse` | FUSE | stratad serves the layer's whole tree from its metadata (`crate::treefs`) |
//!
//! `auto` (the default) probes at start what this kernel can do and takes the first mode of that list
//! that works; the report says, for each better mode, why not (the missing kernel option or the
//! errno a call answered). The probe is real and takes milliseconds: it writes a one-block EROFS image
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
}

impl MountMode {
    /// Every mode, the fastest first: the order `auto` tries them in.
    pub const BEST_FIRST: [MountMode; 3] = [MountMode::File, MountMode::Loop, MountMode::Fuse];

    /// Whether this stratad can mount layers this way.
    pub fn built(self) -> bool {
        true
    }

    pub fn name(self) -> &'static str {
        match self {
            MountMode::File => "file",
            MountMode::Loop => "loop",
            MountMode::Fuse => "fuse",
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
}

impl ModeRequest {
    /// The mode forced, if any.
    pub fn forced(self) -> Option<MountMode> {
        match self {
            ModeRequest::Auto => None,
            ModeRequest::File => Some(MountMode::File),
            ModeRequest::Loop => Some(MountMode::Loop),
            ModeRequest::Fuse => Some(MountMode::Fuse),
        }
    }
}

/// A `mount_mode` value that is none of `auto`, `file`, `loop`, `fuse`.
#[derive(Debug, thiserror::Error)]
#[error("mount mode {0:?}: use auto, file, loop or fuse")]
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
        ];
        let requested = serde_json::to_value(self.requested).unwrap_or_default();
        let requested = requested.as_str().unwrap_or("?");
        out.push(match self.mode {
            Some(m) => format!("mount mode    {m} (requested {requested})"),
            None => format!("mount mode    none works (requested {requested})"),
        });
        for p in &self.passed_over {
            out.push(format!("  not {:<5} {}", p.mode.name(), p.reason));
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
        return caps;
    }
    let image = dir.join(format!(".mode-probe-{}.erofs", std::process::id()));
    if let Err(e) = std::fs::write(&image, probe_image()) {
        let lack = Some(format!(
            "cannot write the probe image {}: {e}",
            image.display()
        ));
        caps.file_backed = lack.clone();
        caps.loop_devices = lack;
        return caps;
    }
    caps.file_backed = probe_file_backed(&image);
    caps.loop_devices = probe_loop(&image);
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

/// EROFS's magic number.
const EROFS_MAGIC: u32 = 0xE0F5_E1E2;
/// The root directory's inode: at byte 1280 (metadata from block 0, 32-byte slots).
const PROBE_ROOT_NID: u16 = 40;

/// A one-block EROFS image: an empty root directory and a device table of one slot (one block), so
/// that mounting it needs exactly one `device=` — what `file` and `loop` modes do with every layer.
/// Layout facts: `../shared/EROFS-FORMAT.md`.
pub fn probe_image() -> Vec<u8> {
    let mut img = vec![0u8; 4096];
    let mut put = |at: usize, bytes: &[u8]| img[at..at + bytes.len()].copy_from_slice(bytes);
    let sb = 1024;
    put(sb, &EROFS_MAGIC.to_le_bytes());
    put(sb + 12, &[12]); // 4 KiB blocks
    put(sb + 14, &PROBE_ROOT_NID.to_le_bytes());
    put(sb + 16, &1u64.to_le_bytes()); // inodes
    put(sb + 36, &1u32.to_le_bytes()); // blocks
    put(sb + 80, &8u32.to_le_bytes()); // incompat: DEVICE_TABLE
    put(sb + 86, &1u16.to_le_bytes()); // extra devices
    put(sb + 88, &9u16.to_le_bytes()); // device table at 9 * 128 = 1152
    put(1152, b"strata-mode-probe");
    put(1152 + 64, &1u32.to_le_bytes()); // the device's blocks
                                         // The root: a compact inode, data inline (FLAT_INLINE = 2 << 1), "." and ".." only.
    let root = usize::from(PROBE_ROOT_NID) * 32;
    let names = b"...";
    let dirents = 2 * 12;
    put(root, &(2u16 << 1).to_le_bytes());
    put(root + 4, &0o040755u16.to_le_bytes());
    put(root + 6, &2u16.to_le_bytes()); // nlink
    put(root + 8, &((dirents + names.len()) as u32).to_le_bytes());
    put(root + 20, &1u32.to_le_bytes()); // ino
    let data = root + 32;
    for (i, nameoff) in [(0usize, dirents), (1, dirents + 1)] {
        let de = data + i * 12;
        put(de, &u64::from(PROBE_ROOT_NID).to_le_bytes());
        put(de + 8, &(nameoff as u16).to_le_bytes());
        put(de + 10, &[2]); // a directory
    }
    put(data + dirents, names);
    img
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
        }
    }

    fn modes(r: &ModeReport) -> Vec<MountMode> {
        r.passed_over.iter().map(|p| p.mode).collect()
    }

    #[test]
    fn auto_takes_the_fastest_mode_that_works_and_says_why_not_the_better_ones() {
        // 6.12+: file.
        let r = decide(&caps(true, true, true), ModeRequest::Auto);
        assert_eq!((r.mode, modes(&r)), (Some(MountMode::File), vec![]));
        // 6.1 (Debian 12, AL2023): loop, because file-backed mounts are missing.
        let r = decide(&caps(false, true, true), ModeRequest::Auto);
        assert_eq!(r.mode, Some(MountMode::Loop));
        assert_eq!(modes(&r), [MountMode::File]);
        assert!(r.passed_over[0].reason.contains("ENOTBLK"));
        // Neither (5.15, or no loop devices in a container): fuse, saying why not the others.
        let r = decide(&caps(false, false, true), ModeRequest::Auto);
        assert_eq!(r.mode, Some(MountMode::Fuse));
        assert_eq!(modes(&r), [MountMode::File, MountMode::Loop]);
        assert!(
            r.passed_over[1].reason.contains("no /dev/loop-control"),
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

    #[test]
    fn the_probe_image_is_one_block_with_one_device_slot() {
        let img = probe_image();
        assert_eq!(img.len(), 4096);
        assert_eq!(
            u32::from_le_bytes(img[1024..1028].try_into().unwrap()),
            EROFS_MAGIC
        );
        assert_eq!(u16::from_le_bytes(img[1110..1112].try_into().unwrap()), 1);
        assert_eq!(&img[1312 + 24..1312 + 27], b"...");
    }
}
