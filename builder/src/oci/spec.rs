//! The OCI (and Docker v2 schema 2) JSON documents an import reads, and their media types.
//!
//! Only the fields strata uses are modelled; unknown fields are ignored, as the image spec asks. Field
//! names follow the specs (`mediaType`, `rootfs.diff_ids`, the config's capitalized `Env`, `Cmd`, ...).
//! Docker's manifest list and manifest are read as OCI index and manifest: they are the same shapes under
//! other media types. A layer's media type says how its tar is compressed; [`LayerMedia::parse`] accepts
//! the OCI and Docker tar, tar+gzip and tar+zstd types (the "nondistributable"/"foreign" variants too) and
//! nothing else.

use std::collections::BTreeMap;

use serde::Deserialize;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// The annotation naming an image in an OCI layout's `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// True for an index (multi-platform) media type.
pub fn is_index(media_type: &str) -> bool {
    media_type == OCI_INDEX || media_type == DOCKER_LIST
}

/// True for an image manifest media type.
pub fn is_manifest(media_type: &str) -> bool {
    media_type == OCI_MANIFEST || media_type == DOCKER_MANIFEST
}

/// A content descriptor.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<PlatformSpec>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// A descriptor's platform.
#[derive(Clone, Debug, Deserialize)]
pub struct PlatformSpec {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// `index.json`, an image index or a Docker manifest list.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    #[serde(default)]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
}

/// An image manifest.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageManifest {
    #[serde(default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// An image configuration.
#[derive(Debug, Deserialize)]
pub struct ImageConfigFile {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
    #[serde(default)]
    pub config: Option<RunConfig>,
    pub rootfs: RootFs,
}

/// The runtime part of a config (`config` in the JSON).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
}

/// `rootfs`: the uncompressed digests of the layers, bottom first.
#[derive(Debug, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<String>,
}

/// An entry of a `docker save` archive's `manifest.json`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ArchiveEntry {
    pub config: String,
    #[serde(default)]
    pub repo_tags: Option<Vec<String>>,
    pub layers: Vec<String>,
}

/// How a layer blob is compressed, from its media type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerMedia {
    Tar,
    Gzip,
    Zstd,
}

impl LayerMedia {
    /// The compression of a layer media type, or `None` for a type strata does not import.
    pub fn parse(media_type: &str) -> Option<LayerMedia> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(LayerMedia::Tar),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(LayerMedia::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(LayerMedia::Zstd),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_types() {
        assert_eq!(
            LayerMedia::parse("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(LayerMedia::Gzip)
        );
        assert_eq!(
            LayerMedia::parse("application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"),
            Some(LayerMedia::Zstd)
        );
        assert_eq!(
            LayerMedia::parse("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(LayerMedia::Gzip)
        );
        assert_eq!(
            LayerMedia::parse("application/vnd.oci.image.layer.v1.tar+bzip2"),
            None
        );
        assert!(is_index(DOCKER_LIST) && is_manifest(OCI_MANIFEST) && !is_index(OCI_MANIFEST));
    }

    #[test]
    fn config_parses_with_missing_parts() {
        let c: ImageConfigFile = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1"],"Cmd":null},
                "rootfs":{"type":"layers","diff_ids":["sha256:00"]},"history":[]}"#,
        )
        .unwrap();
        let rc = c.config.unwrap();
        assert_eq!(rc.env.unwrap(), vec!["A=1".to_string()]);
        assert!(rc.cmd.is_none());
        assert_eq!(c.rootfs.diff_ids.len(), 1);
    }
}
