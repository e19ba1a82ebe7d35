//! Reading OCI images from disk: an OCI image layout directory or a `docker save` archive.
//!
//! [`open`] turns a source (`oci:DIR[:REF]` or `docker-archive:FILE[:REF]`) into an [`OciImage`]: the
//! chosen manifest's layers, bottom first, each with its diff ID and where its blob lies, and the image
//! configuration converted to strata's [`ImageConfig`]. Nothing is stored and no layer is read yet; the
//! importer (`crate::import`) streams each layer blob through the tar source.
//!
//! **Trust.** The source is untrusted input. Every JSON blob (nested indexes, the manifest, the config)
//! is read with a size limit and checked against the digest and size of the descriptor that named it
//! before it is parsed; layer blobs are checked while they are read ([`verify`]). Digests must be
//! `sha256:<64 lowercase hex>`, which also makes them safe file names under `blobs/sha256/`. In a Docker
//! archive, member names come from `manifest.json` and are only looked up in the archive's own table,
//! never joined to a filesystem path.
//!
//! **Choosing the image.** In a layout, `REF` selects the `index.json` entry annotated
//! `org.opencontainers.image.ref.name=REF`; without `REF` the layout must hold one entry (or only
//! entries of one multi-platform image). An index (OCI image index or Docker manifest list, nested to any
//! depth up to 8) is resolved by [`Platform`]: `os/arch[/variant]`, by default `linux/<host arch>`.
//! In an archive, `REF` matches one of an entry's `RepoTags`.
//!
//! The other ways: [`distribution`] pulls an image from a registry; [`export`] writes a strata image as
//! an OCI layout.

mod archive;
pub mod distribution;
pub mod export;
mod layout;
pub mod spec;
pub mod verify;

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use strata_registry::model::ImageConfig;

use spec::{ImageConfigFile, PlatformSpec};
pub use verify::Sha256Digest;

/// Largest JSON document (index, manifest, config, `manifest.json`) read from a source.
const JSON_LIMIT: u64 = 16 << 20;

/// Why an OCI source could not be read. Each names the source part and what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// A malformed source string or platform.
    #[error("{0}")]
    Usage(String),
    /// The source, or the image asked for, is not there.
    #[error("{0}")]
    NotFound(String),
    #[error("{what} {digest} is missing from the source ({path} does not exist)")]
    MissingBlob {
        what: String,
        digest: String,
        path: String,
    },
    #[error("{what}: digest mismatch: expected {expected}, the source has {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error(
        "{what}: size mismatch: the descriptor says {expected} bytes, the source has {actual}"
    )]
    SizeMismatch {
        what: String,
        expected: u64,
        actual: u64,
    },
    /// Malformed JSON or an inconsistent image.
    #[error("{0}")]
    Malformed(String),
    /// Well-formed, but not something strata imports (a media type, a digest algorithm).
    #[error("{0}")]
    Unsupported(String),
    /// A registry answered a request with an HTTP error status.
    #[error("registry {registry}: {what}: HTTP {status}{detail}")]
    Http {
        registry: String,
        what: String,
        status: u16,
        /// The registry's own error codes and messages, or how to fix it.
        detail: String,
    },
    /// A registry refused the credentials, wants some and none were found, or where they are kept
    /// cannot give them (a credential helper).
    #[error("registry {registry}: {why}")]
    Auth { registry: String, why: String },
    /// A registry request did not complete in time: no bytes for the stall timeout, or not all of
    /// them within the request's deadline.
    #[error(
        "registry {registry}: {what}: {why} (see --registry-timeout, --registry-stall-timeout)"
    )]
    Timeout {
        registry: String,
        what: String,
        why: String,
    },
    /// A registry could not be reached, or a transfer broke off.
    #[error("registry {registry}: {what}: {source}")]
    Transport {
        registry: String,
        what: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

impl OciError {
    pub(crate) fn io(path: impl fmt::Display, source: io::Error) -> OciError {
        OciError::Io {
            path: path.to_string(),
            source,
        }
    }
}

/// Where an image comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// An OCI image layout directory, and optionally the `ref.name` of one of its images.
    Layout {
        dir: PathBuf,
        reference: Option<String>,
    },
    /// A `docker save` archive, and optionally one of its repo tags.
    DockerArchive {
        file: PathBuf,
        reference: Option<String>,
    },
    /// An image in a registry (`docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`).
    Registry(distribution::RegistryRef),
}

impl Source {
    /// Parses `oci:DIR[:REF]` or `docker-archive:FILE[:REF]`. As in skopeo, the path ends at its first
    /// `:` (so it cannot hold one) and the rest is the reference: `docker-archive:img.tar:repo:tag`.
    pub fn parse(s: &str) -> Result<Source, OciError> {
        if let Some(r) = s.strip_prefix("docker://") {
            return Ok(Source::Registry(distribution::RegistryRef::parse(r)?));
        }
        let (transport, rest) = s.split_once(':').ok_or_else(|| {
            OciError::Usage(format!(
                "source {s:?}: expected oci:DIR[:REF], docker-archive:FILE[:REF] or docker://HOST/REPO[:TAG]"
            ))
        })?;
        let (path, reference) = match rest.split_once(':') {
            Some((p, r)) => (p, Some(r)),
            None => (rest, None),
        };
        if path.is_empty() || reference == Some("") {
            return Err(OciError::Usage(format!(
                "source {s:?}: empty path or reference"
            )));
        }
        let (path, reference) = (PathBuf::from(path), reference.map(str::to_string));
        match transport {
            "oci" => Ok(Source::Layout {
                dir: path,
                reference,
            }),
            "docker-archive" => Ok(Source::DockerArchive {
                file: path,
                reference,
            }),
            other => Err(OciError::Usage(format!(
                "source {s:?}: unknown transport {other:?} (oci or docker-archive)"
            ))),
        }
    }
}

/// An OCI platform: `os/architecture[/variant]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Platform {
    /// `linux/<this machine's architecture>` in OCI (Go) names.
    pub fn host() -> Platform {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "x86" => "386",
            "powerpc64" => "ppc64le",
            "loongarch64" => "loong64",
            other => other,
        };
        Platform {
            os: "linux".into(),
            architecture: arch.into(),
            variant: None,
        }
    }

    /// Parses `os/arch` or `os/arch/variant`.
    pub fn parse(s: &str) -> Result<Platform, OciError> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            [os, arch] | [os, arch, _] if !os.is_empty() && !arch.is_empty() => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: parts.get(2).map(|v| v.to_string()),
            }),
            _ => Err(OciError::Usage(format!(
                "platform {s:?}: expected os/arch[/variant], e.g. linux/amd64"
            ))),
        }
    }

    /// True if an image for `p` runs here as asked (an unasked variant matches any).
    pub fn matches(&self, os: &str, architecture: &str, variant: Option<&str>) -> bool {
        let norm = |v: Option<&str>| match (architecture, v) {
            ("arm64", None) => Some("v8".to_string()),
            (_, v) => v.map(str::to_string),
        };
        self.os == os
            && self.architecture == architecture
            && (self.variant.is_none() || norm(self.variant.as_deref()) == norm(variant))
    }

    fn matches_spec(&self, p: &PlatformSpec) -> bool {
        self.matches(&p.os, &p.architecture, p.variant.as_deref())
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// Where a blob's bytes are.
#[derive(Clone, Debug)]
enum BlobLoc {
    /// A whole file (`blobs/sha256/<hex>` of a layout).
    File(PathBuf),
    /// A member of a tar archive: `size` bytes at `offset`.
    Member {
        archive: PathBuf,
        name: String,
        offset: u64,
        size: u64,
    },
    /// A blob in a registry, downloaded as it is read.
    Remote(distribution::RemoteBlob),
}

impl BlobLoc {
    fn shown(&self) -> String {
        match self {
            BlobLoc::File(p) => p.display().to_string(),
            BlobLoc::Member { archive, name, .. } => format!("{}:{name}", archive.display()),
            BlobLoc::Remote(r) => r.shown(),
        }
    }

    /// Opens the blob, checking its size against `expected` first when given.
    fn open(
        &self,
        what: &str,
        digest: &str,
        expected: Option<u64>,
    ) -> Result<Box<dyn Read + Send>, OciError> {
        let (file, size): (Box<dyn Read + Send>, u64) = match self {
            BlobLoc::File(p) => {
                let f = File::open(p).map_err(|e| {
                    if e.kind() == io::ErrorKind::NotFound {
                        OciError::MissingBlob {
                            what: what.to_string(),
                            digest: digest.to_string(),
                            path: p.display().to_string(),
                        }
                    } else {
                        OciError::io(p.display(), e)
                    }
                })?;
                let len = f
                    .metadata()
                    .map_err(|e| OciError::io(p.display(), e))?
                    .len();
                (Box::new(f), len)
            }
            BlobLoc::Member {
                archive,
                offset,
                size,
                ..
            } => {
                let mut f = File::open(archive).map_err(|e| OciError::io(archive.display(), e))?;
                f.seek(SeekFrom::Start(*offset))
                    .map_err(|e| OciError::io(archive.display(), e))?;
                (Box::new(f.take(*size)), *size)
            }
            BlobLoc::Remote(r) => return r.open(what, expected),
        };
        match expected {
            Some(n) if n != size => Err(OciError::SizeMismatch {
                what: format!("{what} {digest} ({})", self.shown()),
                expected: n,
                actual: size,
            }),
            _ => Ok(file),
        }
    }

    /// Reads a whole JSON blob, checking size and (when given) digest before returning it.
    fn read_json(
        &self,
        what: &str,
        digest: Option<&Sha256Digest>,
        size: Option<u64>,
    ) -> Result<Vec<u8>, OciError> {
        let shown = digest.map_or_else(|| self.shown(), |d| d.to_string());
        let r = self.open(what, &shown, size)?;
        let mut bytes = Vec::new();
        r.take(JSON_LIMIT + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| OciError::io(self.shown(), e))?;
        if bytes.len() as u64 > JSON_LIMIT {
            return Err(OciError::Malformed(format!(
                "{what} {shown} is over {JSON_LIMIT} bytes"
            )));
        }
        if let Some(d) = digest {
            let actual = Sha256Digest::of(&bytes);
            if actual != *d {
                return Err(OciError::DigestMismatch {
                    what: format!("{what} ({})", self.shown()),
                    expected: d.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        Ok(bytes)
    }
}

/// Parses a descriptor's digest for `what`.
fn parse_digest(what: &str, text: &str) -> Result<Sha256Digest, OciError> {
    text.parse().map_err(|e| match e {
        verify::DigestTextError::Algorithm(a) => OciError::Unsupported(format!(
            "{what}: digest algorithm {a:?} is not supported (sha256 only)"
        )),
        verify::DigestTextError::Malformed => {
            OciError::Malformed(format!("{what}: malformed digest {text:?}"))
        }
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, OciError> {
    serde_json::from_slice(bytes).map_err(|e| OciError::Malformed(format!("{what}: {e}")))
}

/// One layer of an image, bottom first.
#[derive(Clone, Debug)]
pub struct OciLayer {
    /// 1-based position, for messages ("layer 2").
    pub number: usize,
    /// The manifest's media type (a Docker archive has none).
    pub media_type: Option<String>,
    /// The blob's digest and size, when the source names them (a layout always does).
    pub digest: Option<Sha256Digest>,
    pub size: Option<u64>,
    /// The digest of the uncompressed tar, from the config's `rootfs.diff_ids`.
    pub diff_id: Sha256Digest,
    loc: BlobLoc,
}

impl OciLayer {
    /// What this layer is called in messages.
    pub fn name(&self) -> String {
        format!("layer {}", self.number)
    }

    /// Opens the layer blob as it is stored (possibly compressed); its size is checked first.
    pub fn open(&self) -> Result<Box<dyn Read + Send>, OciError> {
        let digest = self.digest.map_or_else(String::new, |d| d.to_string());
        self.loc.open(&self.name(), &digest, self.size)
    }

    /// Where the blob is, for messages.
    pub fn location(&self) -> String {
        self.loc.shown()
    }

    /// True for a blob in a registry (reading it downloads it).
    pub fn is_remote(&self) -> bool {
        matches!(self.loc, BlobLoc::Remote(_))
    }
}

/// An image found in a source: its layers and configuration.
#[derive(Clone, Debug)]
pub struct OciImage {
    /// The manifest's digest (a Docker archive has no manifest blob).
    pub manifest_digest: Option<Sha256Digest>,
    pub config_digest: Sha256Digest,
    /// `os/arch[/variant]` from the config.
    pub platform: String,
    pub config: ImageConfig,
    pub layers: Vec<OciLayer>,
    /// Total bytes of the manifest, config and layer blobs (as stored in the source).
    pub blob_bytes: u64,
}

/// Opens the image `source` names, for `platform` (a registry with default [`distribution::PullOptions`];
/// [`distribution::open`] takes others).
pub fn open(source: &Source, platform: &Platform) -> Result<OciImage, OciError> {
    match source {
        Source::Layout { dir, reference } => layout::open(dir, reference.as_deref(), platform),
        Source::DockerArchive { file, reference } => archive::open(file, reference.as_deref()),
        Source::Registry(r) => distribution::open(r, platform, &Default::default()),
    }
}

/// A layer blob as a manifest describes it: media type, digest, size (each when known), location.
type LayerBlob = (Option<String>, Option<Sha256Digest>, Option<u64>, BlobLoc);

/// Builds the layer list and strata config from a parsed config and the layer blobs' descriptions.
fn assemble(
    config_bytes: &[u8],
    layers: Vec<LayerBlob>,
) -> Result<(ImageConfigFile, Vec<OciLayer>), OciError> {
    let cfg: ImageConfigFile = parse_json("image config", config_bytes)?;
    if cfg.rootfs.kind != "layers" {
        return Err(OciError::Malformed(format!(
            "image config: rootfs type {:?}, expected \"layers\"",
            cfg.rootfs.kind
        )));
    }
    if cfg.rootfs.diff_ids.len() != layers.len() {
        return Err(OciError::Malformed(format!(
            "image config names {} diff IDs for {} layers",
            cfg.rootfs.diff_ids.len(),
            layers.len()
        )));
    }
    if layers.is_empty() {
        return Err(OciError::Malformed("the image has no layers".into()));
    }
    let mut out = Vec::new();
    for (i, ((media_type, digest, size, loc), diff)) in
        layers.into_iter().zip(&cfg.rootfs.diff_ids).enumerate()
    {
        let number = i + 1;
        if let Some(mt) = &media_type {
            if spec::LayerMedia::parse(mt).is_none() {
                return Err(OciError::Unsupported(format!(
                    "unsupported media type {mt:?} in layer {number}"
                )));
            }
        }
        out.push(OciLayer {
            number,
            media_type,
            digest,
            size,
            diff_id: parse_digest(&format!("layer {number} diff ID"), diff)?,
            loc,
        });
    }
    Ok((cfg, out))
}

/// The image a manifest and its verified config describe; `loc` says where each layer blob is (and may
/// check it is there), given the layer's name for messages, its digest and its descriptor.
fn image_of(
    manifest_digest: Sha256Digest,
    manifest: &spec::ImageManifest,
    config_digest: Sha256Digest,
    config_bytes: &[u8],
    mut loc: impl FnMut(&str, &Sha256Digest, &spec::Descriptor) -> Result<BlobLoc, OciError>,
) -> Result<OciImage, OciError> {
    let mut blob_bytes = manifest.config.size;
    let mut layers = Vec::new();
    for (i, l) in manifest.layers.iter().enumerate() {
        let what = format!("layer {}", i + 1);
        let d = parse_digest(&what, &l.digest)?;
        blob_bytes += l.size;
        let at = loc(&what, &d, l)?;
        layers.push((Some(l.media_type.clone()), Some(d), Some(l.size), at));
    }
    let (cfg, layers) = assemble(config_bytes, layers)?;
    Ok(OciImage {
        manifest_digest: Some(manifest_digest),
        config_digest,
        platform: config_platform(&cfg),
        config: strata_config(&cfg),
        layers,
        blob_bytes,
    })
}

/// A manifest's media type: `declared` (the descriptor's, or the registry's `Content-Type`) when
/// given, else the document's own `mediaType`, else an index if it lists `manifests`, else an image
/// manifest (older writers leave both out).
fn manifest_media_type(
    what: &str,
    bytes: &[u8],
    declared: Option<&str>,
) -> Result<String, OciError> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        #[serde(default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
    }
    let probe: Probe = parse_json(what, bytes)?;
    if let Some(d) = declared.filter(|d| !d.is_empty()) {
        return Ok(d.to_string());
    }
    Ok(probe
        .media_type
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| {
            if probe.manifests.is_some() {
                spec::OCI_INDEX.to_string()
            } else {
                spec::OCI_MANIFEST.to_string()
            }
        }))
}

/// strata's image config from an OCI config.
pub fn strata_config(cfg: &ImageConfigFile) -> ImageConfig {
    let rc = cfg.config.as_ref();
    let get = |f: fn(&spec::RunConfig) -> Option<Vec<String>>| rc.and_then(f).unwrap_or_default();
    ImageConfig {
        env: get(|c| c.env.clone()),
        entrypoint: get(|c| c.entrypoint.clone()),
        cmd: get(|c| c.cmd.clone()),
        working_dir: rc
            .and_then(|c| c.working_dir.clone())
            .filter(|w| !w.is_empty()),
        user: rc.and_then(|c| c.user.clone()).filter(|u| !u.is_empty()),
        labels: rc.and_then(|c| c.labels.clone()).unwrap_or_default(),
    }
}

/// `os/arch[/variant]` of a config.
fn config_platform(cfg: &ImageConfigFile) -> String {
    let mut p = format!("{}/{}", cfg.os, cfg.architecture);
    if let Some(v) = cfg.variant.as_deref().filter(|v| !v.is_empty()) {
        p = format!("{p}/{v}");
    }
    p
}

/// Annotations a strata manifest gets from an imported image.
pub fn annotations(img: &OciImage) -> BTreeMap<String, String> {
    let mut a = BTreeMap::new();
    if let Some(d) = img.manifest_digest {
        a.insert("org.strata.oci.manifest".into(), d.to_string());
    }
    a.insert(
        "org.strata.oci.config".into(),
        img.config_digest.to_string(),
    );
    a.insert("org.strata.oci.platform".into(), img.platform.clone());
    a
}

fn not_found(what: &str, path: &Path) -> OciError {
    OciError::NotFound(format!("{what} {} does not exist", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(
            Source::parse("oci:/a/b:v1").unwrap(),
            Source::Layout {
                dir: "/a/b".into(),
                reference: Some("v1".into())
            }
        );
        assert_eq!(
            Source::parse("oci:rel/dir").unwrap(),
            Source::Layout {
                dir: "rel/dir".into(),
                reference: None
            }
        );
        assert_eq!(
            Source::parse("docker-archive:/x/img.tar:repo:tag").unwrap(),
            Source::DockerArchive {
                file: "/x/img.tar".into(),
                reference: Some("repo:tag".into())
            }
        );
        for bad in [
            "/a/b",
            "oci:",
            "oci::x",
            "docker:/x",
            "oci:/a:",
            "docker://x",
        ] {
            assert!(Source::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn platforms_match() {
        let p = Platform::parse("linux/arm64").unwrap();
        assert!(p.matches("linux", "arm64", Some("v8")));
        assert!(!p.matches("linux", "amd64", None));
        let v = Platform::parse("linux/arm64/v8").unwrap();
        assert!(v.matches("linux", "arm64", None));
        assert!(!Platform::parse("linux/arm/v7")
            .unwrap()
            .matches("linux", "arm", Some("v6")));
        assert!(Platform::parse("linux").is_err());
        assert_eq!(Platform::host().os, "linux");
    }
}
