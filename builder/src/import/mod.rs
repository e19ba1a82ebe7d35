//! Importing an OCI image: each OCI layer becomes a strata layer, bottom first.
//!
//! **One pass per layer, verified.** A layer blob is streamed through the tar source
//! (`source::tar`: gzip/zstd/plain detected, whiteouts `.wh.NAME` and `.wh..wh..opq` turned into overlay
//! whiteouts and opaque directories, hostile paths refused) into the builder. Two [`Hashing`] readers
//! check, in the same pass, the blob against its manifest digest and size and the uncompressed tar
//! against its diff ID from the config. The checks run inside the source callback, before the build
//! stores anything, so a mismatching layer stores no descriptor; a tar that fails to parse is still
//! reported as a digest mismatch when that is the cause.
//!
//! **Layers.** The bottom layer is built as a `base` layer without parents, which drops whiteouts and
//! opaque markers (there is nothing below to hide, and overlay would show them as stray entries). Every
//! other layer is built with `parents` = the layers below it, nearest first: its chunks are deduplicated
//! against them; its whiteouts stay where they hide something below (one that hides nothing is pruned:
//! overlay would list it as a broken entry).
//! Each layer carries the labels `org.opencontainers.image.diff_id` and `org.strata.oci.chain_id`.
//!
//! Directories a layer implies without describing them take their metadata from the layers below,
//! whiteouts follow the OCI rules against the layer's own entries ([`parents`]), and a hard link to a
//! file of the layers below becomes a copy that references its stored chunks ([`links`]): all as
//! extracting the layer over the layers below would leave them, as far as overlay can show it.
//!
//! **Reuse.** A strata layer depends on the layers below it, not only on its own tar: which whiteouts
//! are kept and what metadata implied directories get come from them. So reuse is keyed by the OCI
//! *chain ID* — `sha256(chain ID below + " " + diff ID)`, the diff ID itself for the bottom layer — which
//! names a layer together with everything below it. After a layer is stored, the import record
//! `oci/<chain-id hex>` (the text `blake3:<layer digest>`) is written. A later import of a layer with the
//! same chain ID (the same layer on the same lower layers: an image rebuilt, or another image on the same
//! base) reads the record, checks the layer descriptor (digest verified), its labels, and that its
//! metadata and blobs exist, and reuses it: nothing is built or stored. The source blob is still verified
//! (hashed, not built) — unless it is in a registry: then it is not downloaded at all. A record that names something missing or different is ignored and rewritten.
//! Records are hints written after what they name, so a crash leaves at worst an unused record.
//!
//! **Limits.** A layer to build must fit: its declared size (and a reserve) must be free in the store's
//! spool, else the import stops before reading it. A registry's blob is read to its declared size and no
//! further, within the registry's timeouts ([`crate::oci::distribution::client`]). Every import first
//! removes what killed writers left in a local store's spool, once older than [`SPOOL_GRACE`].

use std::sync::Arc;

use strata_registry::digest::Digest;
use strata_registry::model::{LayerDescriptor, LayerKind};
use strata_registry::store::{key, Store, StoreError, SPOOL_GRACE};

use crate::build::{build_with, BuildOptions};
use crate::error::{BuildError, TarError};
use crate::oci::verify::Hashing;
use crate::oci::{OciError, OciImage, OciLayer, Sha256Digest};
use crate::source::{tar, EntrySink};

mod links;
mod parents;
use crate::lower::LowerView;
use parents::FillParents;

/// The label naming the OCI diff ID a layer was imported from.
pub const DIFF_ID_LABEL: &str = "org.opencontainers.image.diff_id";
/// The label naming the OCI chain ID of the layer (it and the layers below it).
pub const CHAIN_ID_LABEL: &str = "org.strata.oci.chain_id";

/// One imported layer.
#[derive(Clone, Debug)]
pub struct ImportedLayer {
    /// 1-based position in the image, bottom first.
    pub number: usize,
    pub digest: Digest,
    pub descriptor: LayerDescriptor,
    pub diff_id: Sha256Digest,
    /// The chain ID: this layer and the layers below it.
    pub chain_id: Sha256Digest,
    /// True when an earlier import's layer was reused (nothing was stored).
    pub reused: bool,
}

impl ImportedLayer {
    /// Bytes this import added to the store for this layer.
    pub fn stored_bytes(&self) -> u64 {
        if self.reused {
            0
        } else {
            self.descriptor.stats.stored_bytes
        }
    }
}

/// Imports every layer of `image` into `store`, bottom first. `template` gives the build options (chunk
/// size, level, threads, progress); kind, parents and labels are set per layer. `on_layer` is called after
/// each layer (for progress displays).
pub fn import_layers(
    store: &Store,
    image: &OciImage,
    template: &BuildOptions,
    mut on_layer: impl FnMut(&ImportedLayer),
) -> Result<Vec<ImportedLayer>, BuildError> {
    let mut done: Vec<ImportedLayer> = Vec::new();
    // The metadata of the layers done so far, bottom first, for the layers above them.
    let mut images = Vec::new();
    let mut chain: Option<Sha256Digest> = None;
    // What killed imports left behind.
    store.clean_spool(SPOOL_GRACE, std::time::SystemTime::now(), false)?;
    for layer in &image.layers {
        let bottom = done.is_empty();
        let chain_id = chain_id(chain, layer.diff_id);
        chain = Some(chain_id);
        let record = key::oci_import(&chain_id.hex());
        let imported = match reusable(store, &record, layer, chain_id)? {
            Some((digest, descriptor)) => {
                // A registry's blob is not downloaded only to be hashed: the verified config names
                // its content (the diff ID in the chain ID), and the reused layer was verified when
                // it was built.
                if !layer.is_remote() {
                    verify_only(layer)?;
                }
                ImportedLayer {
                    number: layer.number,
                    digest,
                    descriptor,
                    diff_id: layer.diff_id,
                    chain_id,
                    reused: true,
                }
            }
            None => {
                check_space(store, layer)?;
                let mut opts = template.clone();
                opts.kind = LayerKind::Base;
                opts.parents = done.iter().rev().map(|l| l.digest).collect();
                // A layer's metadata shares little with the one below: a patch would not pay.
                opts.patch_meta = false;
                opts.labels
                    .insert(DIFF_ID_LABEL.to_string(), layer.diff_id.to_string());
                opts.labels
                    .insert(CHAIN_ID_LABEL.to_string(), chain_id.to_string());
                let lower = Arc::new(LowerView::new(images.iter().rev().cloned().collect()));
                if !bottom {
                    let l = lower.clone();
                    opts.keep_whiteout = Some(Arc::new(move |p: &[u8]| l.shows(p)));
                }
                let built = build_with(store, opts, |sink| {
                    read_layer(layer, &mut FillParents::new(sink, &lower, store))
                })?;
                store.put_index(&record, format!("{}\n", built.digest).into_bytes())?;
                ImportedLayer {
                    number: layer.number,
                    digest: built.digest,
                    descriptor: built.descriptor,
                    diff_id: layer.diff_id,
                    chain_id,
                    reused: false,
                }
            }
        };
        if layer.number < image.layers.len() {
            images.push(LowerView::load(store, &imported.digest)?);
        }
        on_layer(&imported);
        done.push(imported);
    }
    Ok(done)
}

/// Free space a layer leaves in the spool's filesystem besides its own blob.
const SPACE_RESERVE: u64 = 64 << 20;

/// Refuses a layer whose blob cannot fit in the spool (its compressed size as the source declares it: the
/// stored blob, zstd-compressed chunks, is about as large).
fn check_space(store: &Store, layer: &OciLayer) -> Result<(), BuildError> {
    let Some(size) = layer.size else {
        return Ok(());
    };
    let (dir, free) = store.spool_free()?;
    let need = size.saturating_add(SPACE_RESERVE);
    if free < need {
        return Err(BuildError::NoSpace {
            what: format!("{} ({})", layer.name(), layer.location()),
            dir,
            need,
            free,
        });
    }
    Ok(())
}

/// The OCI chain ID of a layer with diff ID `diff_id` above the layers whose chain ID is `below`.
pub fn chain_id(below: Option<Sha256Digest>, diff_id: Sha256Digest) -> Sha256Digest {
    match below {
        None => diff_id,
        Some(b) => Sha256Digest::of(format!("{b} {diff_id}").as_bytes()),
    }
}

/// The layer an earlier import made from `layer` on the same lower layers, if it is still whole.
fn reusable(
    store: &Store,
    record: &str,
    layer: &OciLayer,
    chain_id: Sha256Digest,
) -> Result<Option<(Digest, LayerDescriptor)>, BuildError> {
    let Some(text) = store.get_index(record)? else {
        return Ok(None);
    };
    let stale = |why: &str| {
        tracing::warn!(
            record,
            why,
            "ignoring an import record; building the layer again"
        );
        Ok(None)
    };
    let Some(digest) = std::str::from_utf8(&text)
        .ok()
        .and_then(|t| t.trim().parse::<Digest>().ok())
    else {
        return stale("not a layer digest");
    };
    let desc = match store.get_layer(&digest) {
        Ok(d) => d,
        Err(StoreError::NotFound(_)) => return stale("the layer is gone"),
        Err(StoreError::Corrupt { .. } | StoreError::Malformed { .. } | StoreError::Model(_)) => {
            return stale("the layer descriptor is corrupt")
        }
        Err(e) => return Err(e.into()),
    };
    if store.layer_unreusable(&digest, &desc)?.is_some() {
        return stale("garbage collection condemned the layer or one of its objects");
    }
    if desc.labels.get(DIFF_ID_LABEL) != Some(&layer.diff_id.to_string())
        || desc.labels.get(CHAIN_ID_LABEL) != Some(&chain_id.to_string())
    {
        return stale("the layer has another diff ID or chain ID");
    }
    if !store.exists(&key::meta(&desc.meta.digest))? {
        return stale("the layer's metadata is gone");
    }
    for b in &desc.blobs {
        if !store.exists(&key::blob(&b.digest))? {
            return stale("a blob of the layer is gone");
        }
    }
    Ok(Some((digest, desc)))
}

/// Checks the blob's digest and size (or, without a digest, its diff ID) against the source.
fn check_blob(layer: &OciLayer, actual: Sha256Digest, size: u64) -> Result<(), OciError> {
    if let Some(want) = layer.digest {
        if want != actual {
            return Err(OciError::DigestMismatch {
                what: format!("{} blob ({})", layer.name(), layer.location()),
                expected: want.to_string(),
                actual: actual.to_string(),
            });
        }
    }
    match layer.size {
        Some(want) if want != size => Err(OciError::SizeMismatch {
            what: format!("{} blob ({})", layer.name(), layer.location()),
            expected: want,
            actual: size,
        }),
        _ => Ok(()),
    }
}

fn check_diff_id(layer: &OciLayer, actual: Sha256Digest) -> Result<(), OciError> {
    if actual != layer.diff_id {
        return Err(OciError::DigestMismatch {
            what: format!(
                "{} diff ID (its uncompressed tar, {})",
                layer.name(),
                layer.location()
            ),
            expected: layer.diff_id.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

/// A failed read of a layer blob: a registry's limits ([`crate::oci::distribution::client::from_io`]) keep
/// their meaning.
fn read_error(layer: &OciLayer, e: std::io::Error) -> OciError {
    crate::oci::distribution::client::from_io(layer.location(), e)
}

/// Streams a layer blob into `sink`, verifying blob digest and diff ID on the way.
fn read_layer(layer: &OciLayer, sink: &mut dyn EntrySink) -> Result<(), BuildError> {
    let raw = Hashing::new(layer.open()?);
    let parsed = tar::open_stream(Box::new(raw.clone())).and_then(|stream| {
        let plain = Hashing::new(stream);
        tar::read_tar_verified(plain.clone(), sink)?;
        Ok(plain)
    });
    // The blob first: a corrupt blob is reported as such even when its tar failed to parse.
    let (digest, size) = raw.finish().map_err(|e| read_error(layer, e))?;
    check_blob(layer, digest, size)?;
    let plain = parsed?;
    let (diff_id, _) = plain.finish().map_err(|source| TarError::Layer {
        layer: layer.name(),
        source,
    })?;
    check_diff_id(layer, diff_id)?;
    Ok(())
}

/// Verifies a layer blob that is not built (its layer is reused): the blob digest when the source names
/// one, else the diff ID of its uncompressed content.
fn verify_only(layer: &OciLayer) -> Result<(), BuildError> {
    let raw = Hashing::new(layer.open()?);
    if layer.digest.is_some() {
        let (digest, size) = raw.finish().map_err(|e| read_error(layer, e))?;
        check_blob(layer, digest, size)?;
        return Ok(());
    }
    let whole = Hashing::new(tar::open_stream(Box::new(raw))?);
    let (diff_id, _) = whole.finish().map_err(|source| TarError::Layer {
        layer: layer.name(),
        source,
    })?;
    check_diff_id(layer, diff_id)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_image_spec() {
        let a: Sha256Digest =
            "sha256:a3ed95caeb02ffe68cdd9fd84406680ae93d633cb16422d00e8a7c22955b46d4"
                .parse()
                .unwrap();
        assert_eq!(chain_id(None, a), a);
        // ChainID(A|B) = Digest(ChainID(A) + " " + DiffID(B)), over the textual digests.
        let b = Sha256Digest::of(b"b");
        let want = Sha256Digest::of(format!("{a} {b}").as_bytes());
        assert_eq!(chain_id(Some(a), b), want);
        assert_ne!(chain_id(Some(b), a), want);
    }
}
