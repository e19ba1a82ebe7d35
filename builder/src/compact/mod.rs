//! Compaction: rewriting blobs that hold mostly dead chunks (`strata gc --compact`).
//!
//! A rebuild with `--parent` references its parent's blobs for the chunks it keeps and stores the rest in
//! a new blob; once the older images are untagged, a blob may be referenced by live layers for only a
//! fraction of its chunks (the data of files later versions deleted or changed is dead but stays). gc
//! cannot delete such a blob. [`compact`]:
//!
//! 1. **Measures** every blob live layers reference: its *live fraction* is the bytes of the chunks that
//!    some live layer's chunk indexes name, over the bytes of all its chunks (metadata of every live layer
//!    is read once).
//! 2. **Rewrites** each blob whose live fraction is below `min_live` (and above zero) into a new blob of
//!    its live chunks only, verified as they are copied ([`blob::rewrite`]), stored with its index segment.
//! 3. **Re-points** every live layer that uses a rewritten blob: new metadata, identical except for the
//!    device slots and chunk indexes of the rewritten blobs ([`crate::erofs::repoint`]) — stored as a patch
//!    against the old metadata — and a new layer descriptor (label `strata.compacted.from` = the old layer).
//! 4. Writes new **manifests** (the same but for the re-pointed layers) and moves each **tag** from the old
//!    manifest to the new one by compare-and-swap; a tag someone moved meanwhile is left alone (reported).
//!
//! Objects are written in the store's order (blob → segment → metadata → layer → manifest → tag), so an
//! interrupted compaction leaves only unreferenced objects. Nothing is deleted: the old layers and blobs
//! stay readable, so nodes that hold the old layers mounted keep working, and go only through gc once
//! nothing reaches them (condemned, then deleted a grace period later). Nothing readable changes: every
//! path of every image reads the same bytes (the re-pointed chunks are the same chunks, verified).

pub mod blob;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use serde::Serialize;
use strata_registry::digest::Digest;
use strata_registry::model::{BlobRef, LayerDescriptor, Manifest, TagName};
use strata_registry::store::{Store, StoreError};

use crate::erofs::repoint::{chunk_tables, repoint, Replacement};
use crate::erofs::{BlobSlot, DeviceSlot, ErofsImage};
use crate::error::BuildError;

/// Label of a re-pointed layer: the layer it replaces.
pub const COMPACTED_FROM: &str = "strata.compacted.from";

/// What a compaction found and did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CompactReport {
    /// Blobs live layers reference.
    pub blobs: u64,
    /// Blobs rewritten, their bytes before and the new blobs' bytes.
    pub compacted: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Live layers re-pointed, manifests written, tags moved.
    pub layers: u64,
    pub manifests: u64,
    pub tags_moved: u64,
    /// Tags someone else moved during the compaction (left as they were).
    pub tags_skipped: Vec<String>,
    pub seconds: f64,
}

/// Per blob: its reference, and the view blocks live layers name in it.
type LiveBlocks = HashMap<Digest, (BlobRef, HashSet<u32>)>;

/// The view blocks of each blob that `layer`'s chunk indexes name.
fn mark_layer(
    store: &Store,
    layer: &LayerDescriptor,
    live: &mut LiveBlocks,
) -> Result<(), BuildError> {
    let image = ErofsImage::parse(store.get_meta(&layer.meta.digest)?)?;
    let bytes = image.bytes();
    for (offset, count) in chunk_tables(&image)? {
        for k in 0..count {
            let at = (offset + k * 8) as usize;
            let Some(ci) = crate::erofs::format::ChunkIndex::read(bytes, at) else {
                continue;
            };
            if ci.startblk_lo == crate::erofs::format::NULL_ADDR {
                continue;
            }
            let Some(b) = usize::from(ci.device_id)
                .checked_sub(1)
                .and_then(|i| layer.blobs.get(i))
            else {
                continue;
            };
            live.entry(b.digest)
                .or_insert_with(|| (b.clone(), HashSet::new()))
                .1
                .insert(ci.startblk_lo);
        }
    }
    for b in &layer.blobs {
        live.entry(b.digest)
            .or_insert_with(|| (b.clone(), HashSet::new()));
    }
    Ok(())
}

/// Compacts the blobs of `store` whose live fraction is below `min_live` (see the module documentation).
pub fn compact(store: &Store, min_live: f64, level: i32) -> Result<CompactReport, BuildError> {
    let start = Instant::now();
    let mut report = CompactReport::default();
    // Live images and layers, from the tags as they are now.
    let list = store.tags()?;
    // A tag that cannot be read hides what it reaches: live fractions would be wrong.
    if let Some(b) = list.broken.first() {
        return Err(StoreError::Malformed {
            key: b.key.clone(),
            why: format!(
                "{}; compaction needs every tag readable (strata images names them)",
                b.why
            ),
        }
        .into());
    }
    let tags = list.good;
    let mut manifests: BTreeMap<Digest, Manifest> = BTreeMap::new();
    let mut layers: BTreeMap<Digest, LayerDescriptor> = BTreeMap::new();
    let mut live = LiveBlocks::new();
    for (_, m) in &tags {
        if manifests.contains_key(m) {
            continue;
        }
        let manifest = store.get_manifest(m)?;
        for l in &manifest.layers {
            if let std::collections::btree_map::Entry::Vacant(v) = layers.entry(l.digest) {
                let desc = store.get_layer(&l.digest)?;
                mark_layer(store, &desc, &mut live)?;
                v.insert(desc);
            }
        }
        manifests.insert(*m, manifest);
    }
    report.blobs = live.len() as u64;
    // Rewrite the sparse blobs.
    let spool = store.spool_dir()?;
    let mut rewritten: HashMap<Digest, blob::Rewritten> = HashMap::new();
    for (d, (b, blocks)) in &live {
        if blocks.is_empty() {
            continue;
        }
        let toc = store.get_toc(b)?;
        let total: u64 = toc.chunks.iter().map(|c| c.len as u64).sum();
        let used: u64 = toc
            .chunks
            .iter()
            .filter(|c| blocks.contains(&c.block))
            .map(|c| c.len as u64)
            .sum();
        if total == 0 || used as f64 >= min_live * total as f64 {
            continue;
        }
        let new = blob::rewrite(store, b, blocks, level, &spool)?;
        report.compacted += 1;
        report.bytes_before += b.size;
        report.bytes_after += new.blob.size;
        rewritten.insert(*d, new);
    }
    // Re-point the layers, then the manifests, then move the tags.
    let mut new_layers: HashMap<Digest, Digest> = HashMap::new();
    for (d, desc) in &layers {
        if desc.blobs.iter().any(|b| rewritten.contains_key(&b.digest)) {
            new_layers.insert(*d, repoint_layer(store, d, desc, &rewritten)?);
            report.layers += 1;
        }
    }
    let mut new_manifests: HashMap<Digest, Digest> = HashMap::new();
    for (d, m) in &manifests {
        if m.layers.iter().any(|l| new_layers.contains_key(&l.digest)) {
            let mut m = m.clone();
            for l in &mut m.layers {
                if let Some(n) = new_layers.get(&l.digest) {
                    l.digest = *n;
                }
            }
            new_manifests.insert(*d, store.put_manifest(&m)?);
            report.manifests += 1;
        }
    }
    for (t, m) in &tags {
        if let Some(n) = new_manifests.get(m) {
            move_tag(store, t, m, n, &mut report)?;
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

/// True if image `tagged` is image `built` after compaction: the same config and annotations, and each
/// layer the same or a compacted form of it (a reproducible layer whose identity without the
/// [`COMPACTED_FROM`] label is the built layer's). A rebuild of a compacted image's tree names the image
/// its tag holds already, in another placement.
pub fn is_compacted_form(
    store: &Store,
    tagged: &Digest,
    built: &Digest,
) -> Result<bool, StoreError> {
    let (t, b) = (store.get_manifest(tagged)?, store.get_manifest(built)?);
    if t.layers.len() != b.layers.len() || t.config != b.config || t.annotations != b.annotations {
        return Ok(false);
    }
    for (tl, bl) in t.layers.iter().zip(&b.layers) {
        if tl.digest == bl.digest {
            continue;
        }
        let mut d = store.get_layer(&tl.digest)?;
        if d.content.is_none()
            || d.labels.remove(COMPACTED_FROM).is_none()
            || d.digest() != bl.digest
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Moves tag `t` from `old` to `new` by compare-and-swap; a tag changed meanwhile is reported, not moved.
fn move_tag(
    store: &Store,
    t: &TagName,
    old: &Digest,
    new: &Digest,
    report: &mut CompactReport,
) -> Result<(), BuildError> {
    let state = store.tag_get(t)?;
    match state {
        Some(s) if s.digest == *old => match store.tag_set(t, Some(&s), new) {
            Ok(()) => report.tags_moved += 1,
            Err(StoreError::TagConflict { .. }) => report.tags_skipped.push(t.to_string()),
            Err(e) => return Err(e.into()),
        },
        _ => report.tags_skipped.push(t.to_string()),
    }
    Ok(())
}

/// Writes the re-pointed metadata and descriptor of layer `d`; returns the new layer's digest.
fn repoint_layer(
    store: &Store,
    d: &Digest,
    desc: &LayerDescriptor,
    rewritten: &HashMap<Digest, blob::Rewritten>,
) -> Result<Digest, BuildError> {
    let old = store.get_meta(&desc.meta.digest)?;
    let image = ErofsImage::parse(old.clone())?;
    let mut replace = HashMap::new();
    let mut blobs = desc.blobs.clone();
    for (i, b) in blobs.iter_mut().enumerate() {
        let Some(r) = rewritten.get(&b.digest) else {
            continue;
        };
        let device = u16::try_from(i + 1)
            .map_err(|_| BuildError::Option("more than 65535 devices".into()))?;
        replace.insert(
            device,
            Replacement {
                slot: DeviceSlot::for_blob(&r.blob.digest, (r.blob.view_size / 4096) as u32),
                blocks: &r.blocks,
            },
        );
        *b = r.blob.clone();
    }
    let new = repoint(&image, &replace)?;
    let (meta, _) = store.put_meta(&new, Some((&desc.meta.digest, &old)))?;
    let mut labels = desc.labels.clone();
    labels.insert(COMPACTED_FROM.into(), d.to_string());
    let layer = LayerDescriptor {
        meta: strata_registry::model::ObjectRef {
            digest: meta,
            size: new.len() as u64,
        },
        blobs,
        labels,
        ..desc.clone()
    };
    Ok(store.put_layer(&layer)?)
}
