//! Refusing a layer the running kernel cannot mount, before the kernel does.
//!
//! A kernel that meets an EROFS feature it lacks refuses the mount with a bare `EINVAL` and a line in its
//! log. strata writes only what Linux 5.16 reads (`strata_erofs::features`), but a store may hold layers
//! other tools made or a later strata will write, and a node may run an older kernel than the daemon
//! expects. [`check_layer`] reads the metadata file's superblock and compares the oldest kernel it needs
//! with the running one (`/proc/sys/kernel/osrelease`, what `uname -r` prints), so the user sees which
//! feature needs which kernel.

use std::io::Read;
use std::path::{Path, PathBuf};

use strata_erofs::format::{SuperBlock, SUPER_OFFSET};
use strata_erofs::{check_kernel, FeatureError, KernelVersion};

/// Why a layer was refused.
#[derive(Debug, thiserror::Error)]
pub enum KernelCheckError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: too short to hold an EROFS superblock")]
    NoSuperblock { path: PathBuf },
    #[error("cannot tell the running kernel's version from {release:?}")]
    Release { release: String },
    #[error("layer metadata {path} cannot be mounted here: {source}")]
    Feature {
        path: PathBuf,
        #[source]
        source: FeatureError,
    },
}

const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// The running kernel's version.
pub fn running_kernel() -> Result<KernelVersion, KernelCheckError> {
    let release = std::fs::read_to_string(OSRELEASE).map_err(|source| KernelCheckError::Io {
        path: OSRELEASE.into(),
        source,
    })?;
    KernelVersion::parse_release(release.trim()).ok_or(KernelCheckError::Release { release })
}

/// Checks that the running kernel mounts the EROFS image in `meta`.
pub fn check_layer(meta: &Path) -> Result<(), KernelCheckError> {
    check_layer_on(meta, running_kernel()?)
}

/// Checks that a kernel of version `running` mounts the EROFS image in `meta`.
pub fn check_layer_on(meta: &Path, running: KernelVersion) -> Result<(), KernelCheckError> {
    let io = |source| KernelCheckError::Io {
        path: meta.to_path_buf(),
        source,
    };
    let mut head = vec![0u8; SUPER_OFFSET + SuperBlock::SIZE];
    let mut f = std::fs::File::open(meta).map_err(io)?;
    let mut got = 0;
    while got < head.len() {
        match f.read(&mut head[got..]).map_err(io)? {
            0 => break,
            n => got += n,
        }
    }
    let sb = SuperBlock::read(&head[..got], SUPER_OFFSET).ok_or_else(|| {
        KernelCheckError::NoSuperblock {
            path: meta.to_path_buf(),
        }
    })?;
    check_kernel(&sb, running).map_err(|source| KernelCheckError::Feature {
        path: meta.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_erofs::format::*;

    #[test]
    fn refuses_what_the_kernel_lacks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("meta.erofs");
        let mut img = vec![0u8; 4096];
        let mut sb = SuperBlock::zeroed();
        sb.magic = EROFS_MAGIC;
        sb.blkszbits = BLKSZ_BITS;
        sb.feature_incompat = FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE;
        sb.write_to(&mut img, SUPER_OFFSET);
        std::fs::write(&path, &img).expect("write");
        assert!(check_layer_on(&path, KernelVersion::new(6, 1)).is_ok());
        let err = check_layer_on(&path, KernelVersion::new(5, 15)).expect_err("5.15");
        assert!(err.to_string().contains("device_table"), "{err}");
        assert!(running_kernel().is_ok());
        std::fs::write(&path, &img[..1100]).expect("write");
        assert!(matches!(
            check_layer_on(&path, KernelVersion::new(6, 1)),
            Err(KernelCheckError::NoSuperblock { .. })
        ));
    }
}
