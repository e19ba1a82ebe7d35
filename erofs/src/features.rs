//! Which Linux kernel an image needs, and refusing a layer the running kernel cannot mount.
//!
//! An EROFS superblock's `feature_incompat` bits name everything a reader must understand; a kernel that
//! meets an unknown bit refuses the mount (with a terse `EINVAL` and a line in the kernel log). strata
//! pins what it writes to what Linux 5.16 reads — `CHUNKED_FILE` (5.15) and, when the layer has blobs,
//! `DEVICE_TABLE` (5.16, multi-device) — plus the compatible `SB_CHKSUM` bit, which older kernels
//! ignore. 4 KiB blocks need nothing newer (smaller blocks need 6.4). [`required_kernel`] turns a
//! superblock into the oldest kernel that mounts it, and [`check_kernel`] compares that with the running
//! kernel so the daemon can refuse with a clear error before the kernel refuses obscurely.
//!
//! The versions are those of the mainline release that first mounted images with the feature (the
//! kernel's `fs/erofs/erofs_fs.h` history); distribution kernels may backport, never the reverse.

use std::fmt;

use crate::format::*;

/// A kernel release, `major.minor` (the patch level never adds an EROFS feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
}

impl KernelVersion {
    pub const fn new(major: u32, minor: u32) -> KernelVersion {
        KernelVersion { major, minor }
    }

    /// Parses the start of a `uname -r` release such as `6.1.0-18-cloud-amd64` or `5.16.20`.
    pub fn parse_release(release: &str) -> Option<KernelVersion> {
        let mut parts = release.split(|c: char| !c.is_ascii_digit());
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        Some(KernelVersion { major, minor })
    }
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The first mainline kernel that mounts an image at all (EROFS left staging in 5.4).
pub const BASE_KERNEL: KernelVersion = KernelVersion::new(5, 4);

/// Every `feature_incompat` bit: its name and the first kernel that reads it.
pub const INCOMPAT_FEATURES: &[(u32, &str, KernelVersion)] = &[
    (
        FEATURE_INCOMPAT_ZERO_PADDING,
        "zero_padding",
        KernelVersion::new(5, 4),
    ),
    (
        FEATURE_INCOMPAT_COMPR_CFGS,
        "compr_cfgs/big_pcluster",
        KernelVersion::new(5, 13),
    ),
    (
        FEATURE_INCOMPAT_CHUNKED_FILE,
        "chunked_file",
        KernelVersion::new(5, 15),
    ),
    (
        FEATURE_INCOMPAT_DEVICE_TABLE,
        "device_table",
        KernelVersion::new(5, 16),
    ),
    (
        FEATURE_INCOMPAT_ZTAILPACKING,
        "ztailpacking",
        KernelVersion::new(5, 17),
    ),
    (
        FEATURE_INCOMPAT_FRAGMENTS,
        "fragments/dedupe",
        KernelVersion::new(6, 1),
    ),
    (
        FEATURE_INCOMPAT_XATTR_PREFIXES,
        "xattr_prefixes",
        KernelVersion::new(6, 4),
    ),
    (FEATURE_INCOMPAT_48BIT, "48bit", KernelVersion::new(6, 15)),
    (
        FEATURE_INCOMPAT_METABOX,
        "metabox",
        KernelVersion::new(6, 17),
    ),
];

/// The features strata's writer may set: an image it wrote never needs more than [`WRITER_KERNEL`].
pub const WRITER_INCOMPAT: u32 = FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE;

/// The oldest kernel that mounts every image strata writes.
pub const WRITER_KERNEL: KernelVersion = KernelVersion::new(5, 16);

/// Why a kernel cannot mount an image.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeatureError {
    #[error("the image uses incompatible EROFS features {bits:#x} that no known kernel reads")]
    Unknown { bits: u32 },
    #[error(
        "the image needs Linux {needs} or newer for EROFS feature(s) {}, this kernel is {running}",
        features.join(", ")
    )]
    KernelTooOld {
        needs: KernelVersion,
        running: KernelVersion,
        features: Vec<&'static str>,
    },
    #[error(
        "the image has {bits}-bit blocks, which need Linux 6.4 or newer; this kernel is {running}"
    )]
    BlockSize { bits: u8, running: KernelVersion },
}

/// The oldest kernel that mounts an image with this superblock.
pub fn required_kernel(sb: &SuperBlock) -> Result<KernelVersion, FeatureError> {
    let unknown = sb.feature_incompat & !FEATURE_INCOMPAT_ALL;
    if unknown != 0 {
        return Err(FeatureError::Unknown { bits: unknown });
    }
    let mut needs = BASE_KERNEL;
    for &(bit, _, version) in INCOMPAT_FEATURES {
        if sb.feature_incompat & bit != 0 {
            needs = needs.max(version);
        }
    }
    if sb.blkszbits != BLKSZ_BITS {
        needs = needs.max(KernelVersion::new(6, 4));
    }
    Ok(needs)
}

/// Whether a kernel of version `running` mounts an image with this superblock; the error names the
/// features it lacks.
pub fn check_kernel(sb: &SuperBlock, running: KernelVersion) -> Result<(), FeatureError> {
    let needs = required_kernel(sb)?;
    if needs <= running {
        return Ok(());
    }
    let features: Vec<&'static str> = INCOMPAT_FEATURES
        .iter()
        .filter(|&&(bit, _, v)| sb.feature_incompat & bit != 0 && v > running)
        .map(|&(_, name, _)| name)
        .collect();
    if features.is_empty() {
        return Err(FeatureError::BlockSize {
            bits: sb.blkszbits,
            running,
        });
    }
    Err(FeatureError::KernelTooOld {
        needs,
        running,
        features,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(incompat: u32) -> SuperBlock {
        let mut sb = SuperBlock::zeroed();
        sb.blkszbits = BLKSZ_BITS;
        sb.feature_incompat = incompat;
        sb
    }

    #[test]
    fn what_strata_writes_mounts_on_5_16_and_6_1() {
        assert_eq!(required_kernel(&sb(WRITER_INCOMPAT)), Ok(WRITER_KERNEL));
        assert_eq!(
            required_kernel(&sb(FEATURE_INCOMPAT_CHUNKED_FILE)),
            Ok(KernelVersion::new(5, 15))
        );
        for running in ["5.16.0", "6.1.0-18-cloud-amd64", "6.18.1"] {
            let running = KernelVersion::parse_release(running).expect("release");
            assert_eq!(check_kernel(&sb(WRITER_INCOMPAT), running), Ok(()));
        }
        // Ubuntu 22.04's 5.15 lacks multi-device EROFS.
        let old = KernelVersion::parse_release("5.15.0-91-generic").expect("release");
        let err = check_kernel(&sb(WRITER_INCOMPAT), old).expect_err("too old");
        assert_eq!(
            err,
            FeatureError::KernelTooOld {
                needs: KernelVersion::new(5, 16),
                running: old,
                features: vec!["device_table"],
            }
        );
        assert!(err.to_string().contains("Linux 5.16"), "{err}");
    }

    #[test]
    fn newer_features_and_unknown_bits() {
        let six_one = KernelVersion::new(6, 1);
        let sb48 = sb(WRITER_INCOMPAT | FEATURE_INCOMPAT_48BIT);
        assert_eq!(required_kernel(&sb48), Ok(KernelVersion::new(6, 15)));
        assert!(matches!(
            check_kernel(&sb48, six_one),
            Err(FeatureError::KernelTooOld { ref features, .. }) if features == &["48bit"]
        ));
        assert_eq!(
            required_kernel(&sb(1 << 20)),
            Err(FeatureError::Unknown { bits: 1 << 20 })
        );
        let mut small = sb(WRITER_INCOMPAT);
        small.blkszbits = 9;
        assert!(matches!(
            check_kernel(&small, six_one),
            Err(FeatureError::BlockSize { bits: 9, .. })
        ));
        assert_eq!(KernelVersion::parse_release("6"), None);
        assert_eq!(KernelVersion::parse_release("x.y"), None);
        // Every incompatible bit the reader knows has a version.
        let all = INCOMPAT_FEATURES.iter().fold(0, |a, f| a | f.0);
        assert_eq!(all, FEATURE_INCOMPAT_ALL);
    }
}
