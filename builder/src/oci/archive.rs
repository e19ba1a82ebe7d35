//! A `docker save` archive: a tar holding `manifest.json` (`[{Config, RepoTags, Layers}]`), the config
//! JSON and one tar per layer (`<id>/layer.tar` in the classic format, `blobs/sha256/<hex>` since
//! Docker 25, which also writes an OCI layout beside it).
//!
//! The archive is scanned once for its members' names, offsets and sizes; members are then read in place
//! (seek and take), never extracted. Names from `manifest.json` are only looked up in that table. Docker
//! names the config by its digest (`<hex>.json` or `blobs/sha256/<hex>`): when it does, the config is
//! verified; a layer stored as `blobs/sha256/<hex>` is verified as a blob too. Every layer is verified
//! against its diff ID from the config while it is imported, so the archive's content is always checked.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use super::spec::ArchiveEntry;
use super::{
    assemble, config_platform, not_found, parse_json, strata_config, BlobLoc, OciError, OciImage,
    Sha256Digest,
};

/// Name → (offset, size) of every regular member.
fn scan(file: &Path) -> Result<HashMap<String, (u64, u64)>, OciError> {
    let f = File::open(file).map_err(|e| OciError::io(file.display(), e))?;
    let mut ar = tar::Archive::new(f);
    let bad = |e: std::io::Error| {
        OciError::Malformed(format!(
            "{}: not a readable tar archive: {e}",
            file.display()
        ))
    };
    let mut out = HashMap::new();
    for entry in ar.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let name = name.trim_start_matches("./").to_string();
        out.insert(name, (entry.raw_file_position(), entry.size()));
    }
    Ok(out)
}

/// The digest a member name carries (`<hex>.json`, `blobs/sha256/<hex>`), if any.
fn digest_in_name(name: &str) -> Option<Sha256Digest> {
    let hex = name
        .strip_prefix("blobs/sha256/")
        .or_else(|| name.strip_suffix(".json"))?;
    format!("sha256:{hex}").parse().ok()
}

/// Opens the image `reference` (a repo tag; or the only one) of the archive `file`.
pub(super) fn open(file: &Path, reference: Option<&str>) -> Result<OciImage, OciError> {
    if !file.is_file() {
        return Err(not_found("docker archive", file));
    }
    let members = scan(file)?;
    let member = |name: &str, what: &str| -> Result<BlobLoc, OciError> {
        let (offset, size) = members
            .get(name)
            .copied()
            .ok_or_else(|| OciError::MissingBlob {
                what: what.to_string(),
                digest: String::new(),
                path: format!("{}:{name}", file.display()),
            })?;
        Ok(BlobLoc::Member {
            archive: file.to_path_buf(),
            name: name.to_string(),
            offset,
            size,
        })
    };
    let manifest =
        member("manifest.json", "manifest.json")?.read_json("manifest.json", None, None)?;
    let entries: Vec<ArchiveEntry> = parse_json("manifest.json", &manifest)?;
    let tags = |e: &ArchiveEntry| e.repo_tags.clone().unwrap_or_default();
    let chosen: Vec<&ArchiveEntry> = match reference {
        Some(r) => entries
            .iter()
            .filter(|e| tags(e).iter().any(|t| t == r))
            .collect(),
        None => entries.iter().collect(),
    };
    let entry = match chosen.as_slice() {
        [one] => *one,
        found => {
            let all: Vec<String> = entries.iter().flat_map(tags).collect();
            let why = if found.is_empty() {
                format!("no image tagged {:?}", reference.unwrap_or(""))
            } else {
                format!(
                    "{} images; name one as docker-archive:FILE:REPO:TAG",
                    found.len()
                )
            };
            let e = format!("{}: {why} (tags: {})", file.display(), all.join(", "));
            return Err(if found.is_empty() {
                OciError::NotFound(e)
            } else {
                OciError::Usage(e)
            });
        }
    };
    let config_digest_named = digest_in_name(&entry.config);
    let config_loc = member(&entry.config, "config")?;
    let config_bytes = config_loc.read_json("config", config_digest_named.as_ref(), None)?;
    let mut blob_bytes = config_bytes.len() as u64;
    let mut layers = Vec::new();
    for (i, name) in entry.layers.iter().enumerate() {
        let loc = member(name, &format!("layer {}", i + 1))?;
        if let BlobLoc::Member { size, .. } = &loc {
            blob_bytes += size;
        }
        layers.push((None, digest_in_name(name), None, loc));
    }
    let (cfg, layers) = assemble(&config_bytes, layers)?;
    Ok(OciImage {
        manifest_digest: None,
        config_digest: Sha256Digest::of(&config_bytes),
        platform: config_platform(&cfg),
        config: strata_config(&cfg),
        layers,
        blob_bytes,
    })
}
