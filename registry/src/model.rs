//! Layer descriptors, image manifests, tags and references: the JSON objects of a store.
//!
//! Both are canonical JSON (serde field order, no extra whitespace) named by the BLAKE3 digest of their
//! bytes, so the same content always has the same digest. `schema` is 1; readers refuse other versions.
//! `docs/FORMAT.md` documents every field.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use strata_api::ErrorKind;

pub use crate::config::{ImageConfig, LayerConfig};
use crate::digest::Digest;

/// The schema version this code writes and reads.
pub const SCHEMA: u32 = 1;

/// What a layer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    Base,
    Workspace,
    Toolkit,
    Diff,
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayerKind::Base => "base",
            LayerKind::Workspace => "workspace",
            LayerKind::Toolkit => "toolkit",
            LayerKind::Diff => "diff",
        })
    }
}

impl FromStr for LayerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "base" => Ok(LayerKind::Base),
            "workspace" => Ok(LayerKind::Workspace),
            "toolkit" => Ok(LayerKind::Toolkit),
            "diff" => Ok(LayerKind::Diff),
            _ => Err(format!(
                "unknown layer kind {s:?} (base, workspace, toolkit or diff)"
            )),
        }
    }
}

/// A stored object named by digest, with its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    pub digest: Digest,
    pub size: u64,
}

/// A blob a layer's metadata refers to (an EROFS device).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    /// Digest and size of the blob object.
    pub digest: Digest,
    pub size: u64,
    /// Size of the uncompressed view (a multiple of 4 KiB): the device's size.
    pub view_size: u64,
    /// Where the table of contents lies in the blob object, and its digest.
    pub toc_offset: u64,
    pub toc_len: u64,
    pub toc_digest: Digest,
    /// Number of chunks in the blob.
    pub chunks: u64,
}

/// Figures about a layer's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Directory entries (hard links counted each time), the root included.
    pub entries: u64,
    /// Regular files (inodes).
    pub files: u64,
    /// Logical bytes of regular files.
    pub file_bytes: u64,
    /// Chunks referenced by the layer's files (holes and inline files excluded).
    pub chunks: u64,
    /// Chunks this layer stored in its own new blob (the rest were deduplicated).
    pub new_chunks: u64,
    /// Uncompressed bytes of the new chunks.
    pub new_bytes: u64,
    /// Overlay whiteouts in the layer.
    pub whiteouts: u64,
    /// Bytes this layer added to the store: its new blob and its compressed metadata.
    pub stored_bytes: u64,
}

/// A layer: its EROFS metadata and the blobs its device table names, in device order.
///
/// A descriptor has two parts. Its **identity** — kind, `content` (the digest of the layer's tree with its
/// chunks named by digest, see [`LayerDescriptor::digest`]), chunk size, labels, declared config,
/// `built_on` — is what the layer *is*, and names it. Its **placement** — `meta` (whose device table and
/// chunk indexes say which blob holds each chunk, and where), `blobs`, `parent` and `stats` — is where the
/// store keeps the layer's chunks: deduplication against what a store already holds changes it, never
/// the identity, and a store may rewrite it under the same name. A descriptor written before `content`
/// existed has no such split: its name is the digest of its bytes, placement included.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerDescriptor {
    pub schema: u32,
    pub kind: LayerKind,
    /// Digest of the layer's canonical metadata image ([`LayerDescriptor::digest`]); `None` in layers
    /// written before reproducible layers, named by the digest of their bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Digest>,
    /// The EROFS metadata image (stored zstd-compressed; digest and size are of the image itself).
    pub meta: ObjectRef,
    /// Device `i + 1` of the metadata is `blobs[i]`.
    pub blobs: Vec<BlobRef>,
    /// Chunk size in bytes (a power of two, 4 KiB..=16 MiB).
    pub chunk_size: u64,
    pub stats: LayerStats,
    /// The layer whose chunks this one was deduplicated against, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Digest>,
    /// strata's own labels (`strata.pack_diff.image`, the OCI diff and chain IDs of an import, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The config this layer declares (`build --env …`): merged onto what it is put on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Box<LayerConfig>>,
    /// What this layer was built on: compose refuses to put it on anything else (unless `--rebase`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built_on: Option<BuiltOn>,
}

impl LayerDescriptor {
    /// Bytes the store keeps for the layer: its metadata object and its blobs.
    pub fn stored_bytes(&self) -> u64 {
        self.meta.size + self.blobs.iter().map(|b| b.size).sum::<u64>()
    }

    /// The config the layer declares (empty if none).
    pub fn declared(&self) -> LayerConfig {
        self.config.as_deref().cloned().unwrap_or_default()
    }

    /// The layer's name. With `content`: the BLAKE3 of its identity record, the canonical JSON
    /// `{"schema","kind","content","chunk_size","labels","config","built_on"}` (the last three omitted
    /// when empty), so that the same tree built with the same options has the same name whatever the
    /// store held and wherever its chunks went. Without (an older layer): the BLAKE3 of its bytes.
    pub fn digest(&self) -> Digest {
        match &self.content {
            Some(content) => Digest::of(&self.identity_bytes(content)),
            None => Digest::of(&self.to_bytes()),
        }
    }

    fn identity_bytes(&self, content: &Digest) -> Vec<u8> {
        let id = LayerIdentity {
            schema: self.schema,
            kind: self.kind,
            content,
            chunk_size: self.chunk_size,
            labels: &self.labels,
            config: self.config.as_deref(),
            built_on: self.built_on.as_ref(),
        };
        // Serializing this plain struct to a Vec cannot fail.
        serde_json::to_vec(&id).unwrap_or_default()
    }
}

/// The part of a descriptor that names a reproducible layer (see [`LayerDescriptor::digest`]).
#[derive(Serialize)]
struct LayerIdentity<'a> {
    schema: u32,
    kind: LayerKind,
    content: &'a Digest,
    chunk_size: u64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    labels: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    config: Option<&'a LayerConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    built_on: Option<&'a BuiltOn>,
}

/// The layers a layer was built on (a toolkit's or workspace's base, the image a diff was made on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuiltOn {
    /// The image's manifest, when it was given as an image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<Digest>,
    /// Its layers, bottom first: an image this layer is put in must have exactly these at its bottom.
    pub layers: Vec<Digest>,
}

/// One layer of an image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestLayer {
    pub digest: Digest,
    pub kind: LayerKind,
}

/// An image: layers bottom first, and its config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema: u32,
    pub layers: Vec<ManifestLayer>,
    #[serde(default)]
    pub config: ImageConfig,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Why a JSON object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("malformed {what}: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what} has schema {found}; this strata reads schema {SCHEMA}")]
    Schema { what: &'static str, found: u32 },
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
    /// A tag or reference as a user wrote it that does not parse (input, not stored data).
    #[error("invalid {what}: {why}")]
    Reference { what: &'static str, why: String },
}

impl ModelError {
    /// What kind of failure this is: a reference that does not parse is bad input; a stored
    /// object that does not parse or breaks its invariants is corrupt data.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ModelError::Reference { .. } => ErrorKind::Invalid,
            ModelError::Json { .. } | ModelError::Schema { .. } | ModelError::Invalid { .. } => {
                ErrorKind::Corrupt
            }
        }
    }
}

/// Serialization shared by the JSON objects.
pub trait JsonObject: Serialize + for<'de> Deserialize<'de> {
    /// A name for error messages.
    const WHAT: &'static str;
    /// The schema field.
    fn schema(&self) -> u32;
    /// Checks invariants after decoding.
    fn check(&self) -> Result<(), ModelError> {
        Ok(())
    }
    /// Canonical bytes.
    fn to_bytes(&self) -> Vec<u8> {
        // Serializing these plain structs to a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
    /// Parses and checks bytes.
    fn from_bytes(b: &[u8]) -> Result<Self, ModelError> {
        let v: Self = serde_json::from_slice(b).map_err(|source| ModelError::Json {
            what: Self::WHAT,
            source,
        })?;
        if v.schema() != SCHEMA {
            return Err(ModelError::Schema {
                what: Self::WHAT,
                found: v.schema(),
            });
        }
        v.check()?;
        Ok(v)
    }
}

impl JsonObject for LayerDescriptor {
    const WHAT: &'static str = "layer descriptor";
    fn schema(&self) -> u32 {
        self.schema
    }
    fn check(&self) -> Result<(), ModelError> {
        let cs = self.chunk_size;
        if !cs.is_power_of_two() || !(4096..=16 << 20).contains(&cs) {
            return Err(ModelError::Invalid {
                what: Self::WHAT,
                why: format!("chunk size {cs} is not a power of two from 4 KiB to 16 MiB"),
            });
        }
        if self.blobs.len() > u16::MAX as usize - 1 {
            return Err(ModelError::Invalid {
                what: Self::WHAT,
                why: "too many blobs".into(),
            });
        }
        Ok(())
    }
}

impl JsonObject for Manifest {
    const WHAT: &'static str = "image manifest";
    fn schema(&self) -> u32 {
        self.schema
    }
    fn check(&self) -> Result<(), ModelError> {
        if self.layers.is_empty() {
            return Err(ModelError::Invalid {
                what: Self::WHAT,
                why: "no layers".into(),
            });
        }
        Ok(())
    }
}

/// A tag: `name:tag`. Names are lowercase `[a-z0-9]` runs joined by `.`, `_`, `-` or `/` (as in OCI);
/// tags are `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TagName {
    pub name: String,
    pub tag: String,
}

impl TagName {
    /// Parses `name:tag` (`name` alone means `name:latest`).
    pub fn parse(s: &str) -> Result<TagName, ModelError> {
        let bad = |why: &str| ModelError::Reference {
            what: "tag",
            why: format!("{s:?}: {why}"),
        };
        let (name, tag) = match s.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n, t),
            _ => (s, "latest"),
        };
        if name.is_empty() || name.len() > 255 {
            return Err(bad("name must be 1 to 255 characters"));
        }
        let name_ok = name.split('/').all(|part| {
            !part.is_empty()
                && part.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
                })
                && part.as_bytes()[0].is_ascii_alphanumeric()
                && part != "."
                && part != ".."
        });
        if !name_ok {
            return Err(bad(
                "name parts must be lowercase letters, digits, '.', '_' or '-', starting alphanumeric",
            ));
        }
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && !tag.starts_with(['.', '-']);
        if !tag_ok {
            return Err(bad(
                "tag must be 1 to 128 of [A-Za-z0-9._-], not starting with '.' or '-'",
            ));
        }
        Ok(TagName {
            name: name.to_string(),
            tag: tag.to_string(),
        })
    }
}

impl fmt::Display for TagName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

/// A reference to an image or layer: a digest, or a tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    Digest(Digest),
    Tag(TagName),
}

impl Reference {
    /// Parses `blake3:<hex>` as a digest, anything else as a tag.
    pub fn parse(s: &str) -> Result<Reference, ModelError> {
        if s.starts_with("blake3:") {
            return s
                .parse()
                .map(Reference::Digest)
                .map_err(|e| ModelError::Reference {
                    what: "reference",
                    why: e.to_string(),
                });
        }
        TagName::parse(s).map(Reference::Tag)
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Digest(d) => write!(f, "{d}"),
            Reference::Tag(t) => write!(f, "{t}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_parse() {
        let t = TagName::parse("agents/py-base:v1.2").unwrap();
        assert_eq!(
            (t.name.as_str(), t.tag.as_str()),
            ("agents/py-base", "v1.2")
        );
        assert_eq!(TagName::parse("x").unwrap().tag, "latest");
        for bad in ["", "Up:x", "a//b:x", "a:-x", "../a:x", "a:b c"] {
            assert!(TagName::parse(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            Reference::parse(&Digest::of(b"x").to_string()),
            Ok(Reference::Digest(_))
        ));
        assert!(Reference::parse("blake3:12").is_err());
    }

    #[test]
    fn descriptors_without_config_or_base_still_parse() {
        let old = br#"{"schema":1,"kind":"toolkit","meta":{"digest":"blake3:0000000000000000000000000000000000000000000000000000000000000000","size":4096},"blobs":[],"chunk_size":1048576,"stats":{"entries":1,"files":0,"file_bytes":0,"chunks":0,"new_chunks":0,"new_bytes":0,"whiteouts":0,"stored_bytes":10}}"#;
        let d = LayerDescriptor::from_bytes(old).unwrap();
        assert_eq!((d.config.clone(), d.built_on.clone()), (None, None));
        assert_eq!(
            d.to_bytes(),
            old.to_vec(),
            "an old descriptor keeps its digest"
        );
        let mut d2 = d.clone();
        d2.config = Some(Box::new(LayerConfig {
            env: vec!["PATH=/opt/bin:$PATH".into()],
            ..Default::default()
        }));
        d2.built_on = Some(BuiltOn {
            image: None,
            layers: vec![Digest::of(b"base")],
        });
        assert_eq!(LayerDescriptor::from_bytes(&d2.to_bytes()).unwrap(), d2);
        assert_eq!(
            d.digest(),
            Digest::of(old),
            "an old layer is named by its bytes"
        );
    }

    #[test]
    fn a_reproducible_layer_is_named_by_its_identity_not_its_placement() {
        let old = br#"{"schema":1,"kind":"toolkit","meta":{"digest":"blake3:0000000000000000000000000000000000000000000000000000000000000000","size":4096},"blobs":[],"chunk_size":1048576,"stats":{"entries":1,"files":0,"file_bytes":0,"chunks":0,"new_chunks":0,"new_bytes":0,"whiteouts":0,"stored_bytes":10}}"#;
        let mut d = LayerDescriptor::from_bytes(old).unwrap();
        d.content = Some(Digest::of(b"tree"));
        let name = d.digest();
        let mut moved = d.clone();
        moved.meta.digest = Digest::of(b"other placement");
        moved.parent = Some(Digest::of(b"parent"));
        moved.stats.new_chunks = 7;
        moved.stats.stored_bytes = 0;
        assert_eq!(moved.digest(), name, "placement is not identity");
        assert_eq!(
            LayerDescriptor::from_bytes(&moved.to_bytes()).unwrap(),
            moved
        );
        for change in [
            |l: &mut LayerDescriptor| l.content = Some(Digest::of(b"another tree")),
            |l: &mut LayerDescriptor| l.kind = LayerKind::Base,
            |l: &mut LayerDescriptor| l.chunk_size = 4096,
            |l: &mut LayerDescriptor| {
                l.labels.insert("k".into(), "v".into());
            },
        ] {
            let mut other = d.clone();
            change(&mut other);
            assert_ne!(other.digest(), name);
        }
    }

    #[test]
    fn manifest_round_trip_and_schema() {
        let m = Manifest {
            schema: SCHEMA,
            layers: vec![ManifestLayer {
                digest: Digest::of(b"l"),
                kind: LayerKind::Base,
            }],
            config: ImageConfig::default(),
            annotations: BTreeMap::new(),
        };
        let b = m.to_bytes();
        assert_eq!(Manifest::from_bytes(&b).unwrap(), m);
        let mut m2 = m.clone();
        m2.schema = 9;
        assert!(matches!(
            Manifest::from_bytes(&m2.to_bytes()),
            Err(ModelError::Schema { .. })
        ));
        assert!(Manifest::from_bytes(b"{").is_err());
    }
}
