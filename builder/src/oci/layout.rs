//! An OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/<hex>`), as skopeo, umoci
//! and buildah write it.
//!
//! `index.json` is the one file not named by a digest. From it, the entry named by `REF` (or the only
//! entry) is followed through nested indexes, choosing by platform, to an image manifest; then the config.
//! Every blob on the way is verified against the descriptor that named it ([`BlobLoc::read_json`]).

use std::path::Path;

use super::spec::{self, Descriptor, ImageManifest, Index};
use super::{
    image_of, manifest_media_type, not_found, parse_digest, parse_json, BlobLoc, OciError,
    OciImage, Platform, Sha256Digest,
};

/// Nested indexes followed at most.
const MAX_DEPTH: usize = 8;

fn blob(dir: &Path, d: &Sha256Digest) -> BlobLoc {
    BlobLoc::File(dir.join("blobs").join("sha256").join(d.hex()))
}

/// Opens the image `reference` (or the only one) of the layout at `dir`.
pub(super) fn open(
    dir: &Path,
    reference: Option<&str>,
    platform: &Platform,
) -> Result<OciImage, OciError> {
    if !dir.is_dir() {
        return Err(not_found("OCI layout directory", dir));
    }
    let index_path = dir.join("index.json");
    if !index_path.exists() {
        return Err(OciError::Malformed(format!(
            "{} is not an OCI image layout: it has no index.json",
            dir.display()
        )));
    }
    let index_bytes = BlobLoc::File(index_path).read_json("index.json", None, None)?;
    let index: Index = parse_json("index.json", &index_bytes)?;
    let candidates: Vec<&Descriptor> = match reference {
        Some(r) => index
            .manifests
            .iter()
            .filter(|d| d.annotations.get(spec::REF_NAME).map(String::as_str) == Some(r))
            .collect(),
        None => index.manifests.iter().collect(),
    };
    let refs = || {
        let names: Vec<&str> = index
            .manifests
            .iter()
            .filter_map(|d| d.annotations.get(spec::REF_NAME).map(String::as_str))
            .collect();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    };
    let chosen = match candidates.as_slice() {
        [] => {
            return Err(OciError::NotFound(format!(
                "{}: no image named {:?} in index.json (names: {})",
                dir.display(),
                reference.unwrap_or(""),
                refs()
            )))
        }
        [one] => (*one).clone(),
        many if many.iter().all(|d| d.platform.is_some()) => {
            pick_platform(many, platform, "index.json")?.clone()
        }
        many => {
            return Err(OciError::Usage(format!(
                "{} holds {} images; name one as oci:DIR:REF (names: {})",
                dir.display(),
                many.len(),
                refs()
            )))
        }
    };
    let (manifest_digest, manifest) = resolve(dir, chosen, platform, 0)?;
    let config_digest = parse_digest("config", &manifest.config.digest)?;
    let cmt = manifest.config.media_type.as_str();
    if !cmt.is_empty() && cmt != spec::OCI_CONFIG && cmt != spec::DOCKER_CONFIG {
        return Err(OciError::Unsupported(format!(
            "config {config_digest}: unsupported media type {cmt:?} (not a container image)"
        )));
    }
    let config_bytes = blob(dir, &config_digest).read_json(
        "config",
        Some(&config_digest),
        Some(manifest.config.size),
    )?;
    image_of(
        manifest_digest,
        &manifest,
        config_digest,
        &config_bytes,
        |what, d, l| {
            // Every blob is there with its size before anything is built: a missing one fails the
            // import before the layers below it are stored.
            let loc = blob(dir, d);
            drop(loc.open(what, &l.digest, Some(l.size))?);
            Ok(loc)
        },
    )
}

/// The descriptor for `platform` among `many`.
pub(super) fn pick_platform<'a>(
    many: &[&'a Descriptor],
    platform: &Platform,
    what: &str,
) -> Result<&'a Descriptor, OciError> {
    let found = many.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| platform.matches_spec(p))
    });
    found.copied().ok_or_else(|| {
        let have: Vec<String> = many
            .iter()
            .filter_map(|d| d.platform.as_ref())
            .map(|p| match &p.variant {
                Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                None => format!("{}/{}", p.os, p.architecture),
            })
            .collect();
        OciError::NotFound(format!(
            "{what}: no image for platform {platform} (available: {}); choose one with --platform",
            have.join(", ")
        ))
    })
}

/// Follows `desc` through nested indexes to an image manifest.
fn resolve(
    dir: &Path,
    desc: Descriptor,
    platform: &Platform,
    depth: usize,
) -> Result<(Sha256Digest, ImageManifest), OciError> {
    let what = if depth == 0 {
        "manifest".to_string()
    } else {
        format!("manifest (nested index level {depth})")
    };
    let d = parse_digest(&what, &desc.digest)?;
    let bytes = blob(dir, &d).read_json(&what, Some(&d), Some(desc.size))?;
    // The descriptor's media type decides; a blob's own `mediaType` is the fallback (older writers
    // leave the descriptor's empty).
    let media_type = manifest_media_type(&what, &bytes, Some(&desc.media_type))?;
    if spec::is_index(&media_type) {
        if depth >= MAX_DEPTH {
            return Err(OciError::Malformed(format!(
                "indexes nested deeper than {MAX_DEPTH}"
            )));
        }
        let index: Index = parse_json(&what, &bytes)?;
        let all: Vec<&Descriptor> = index.manifests.iter().collect();
        let next = match all.as_slice() {
            [one] if one.platform.is_none() => (*one).clone(),
            many => pick_platform(many, platform, &format!("index {d}"))?.clone(),
        };
        return resolve(dir, next, platform, depth + 1);
    }
    if !spec::is_manifest(&media_type) {
        return Err(OciError::Unsupported(format!(
            "{what} {d}: unsupported media type {media_type:?}"
        )));
    }
    let m: ImageManifest = parse_json(&what, &bytes)?;
    if let Some(mt) = &m.media_type {
        if !spec::is_manifest(mt) {
            return Err(OciError::Malformed(format!(
                "{what} {d}: the descriptor says {media_type:?}, the manifest says {mt:?}"
            )));
        }
    }
    Ok((d, m))
}
