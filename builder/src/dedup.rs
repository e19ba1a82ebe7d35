//! Which chunks a build need not store: the parents' (`--parent`) and, with the store-wide index, any
//! blob's of the store, whoever built it.
//!
//! [`Known`] answers the chunk workers' question "is this chunk stored already?". Parent chunks always
//! are: the parents' blobs are devices of the new layer. A chunk found in the store-wide index
//! ([`strata_registry::index`]) lies in a *foreign* blob, which becomes a device of the new layer too.
//!
//! **The device rule.** Every device is a file the kernel keeps open for the mount, and a blob whose table
//! of contents a node fetches before reading it, so a layer references at most [`MAX_FOREIGN_BLOBS`]
//! foreign blobs (by default; `BuildOptions::max_foreign_blobs`). A chunk held by several blobs goes to
//! one the layer already references; else to a new foreign blob while the layer has fewer than the cap;
//! else it is stored again in the layer's own blob. Once every chunk has been looked up, a foreign blob
//! that gives the layer fewer than [`MIN_FOREIGN_BYTES`] (by default; `BuildOptions::min_foreign_bytes`)
//! is given up: its chunks are read back from it (verified) and stored in the new blob, so that a device
//! is spent only on a blob that saves real bytes. Blobs are taken in the order the build meets their
//! chunks (workers run in parallel, so which blobs make the cap can vary between two builds of the same
//! tree once more than the cap would be needed; below the cap the result is reproducible). A rebuild of a
//! tree the store holds meets one or a few blobs, and a new base sharing packages with an old one a few
//! more: the cap matters for trees assembled from many unrelated builds.
//!
//! **Against gc.** The index cache marks condemned and deleted blobs dead when it syncs, so they are never
//! chosen; before the layer is written, [`Known::recheck`] checks that each foreign blob the layer uses
//! still exists and is not condemned (see `strata_registry::index::condemn` for why that suffices).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use strata_registry::digest::Digest;
use strata_registry::index::cache::{IndexCache, SyncReport};
use strata_registry::model::BlobRef;
use strata_registry::store::Store;

use crate::error::BuildError;

/// Default cap on the foreign blobs one layer references.
pub const MAX_FOREIGN_BLOBS: usize = 32;
/// Default least bytes a foreign blob must give a layer to be referenced (else its chunks are copied).
pub const MIN_FOREIGN_BYTES: u64 = 256 << 10;

/// What store-wide dedup did in a build.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DedupReport {
    /// The index cache's sync before the build.
    pub sync: SyncReport,
    /// Chunks found in the store-wide index (not stored again).
    pub index_chunks: u64,
    pub index_bytes: u64,
    /// Foreign blobs the layer references.
    pub foreign_blobs: u64,
    /// Chunks found in the index but stored again because of the cap on foreign blobs.
    pub capped_chunks: u64,
    /// Foreign blobs that gave fewer bytes than the threshold, and the bytes of theirs stored again.
    pub pruned_blobs: u64,
    pub pruned_bytes: u64,
}

#[derive(Default)]
struct Selection {
    /// Foreign blobs chosen, in the order chosen, and the bytes each gives.
    blobs: Vec<BlobRef>,
    bytes: Vec<u64>,
    by_digest: HashMap<Digest, usize>,
    /// Chunk → (index into `blobs`, block).
    chunks: HashMap<Digest, (usize, u32)>,
    report: DedupReport,
}

struct StoreWide {
    cache: IndexCache,
    cap: usize,
    sel: Mutex<Selection>,
    /// A lookup failed: the cache is marked damaged (rebuilt by the next build) and not asked again.
    damaged: std::sync::atomic::AtomicBool,
}

/// Chunks stored before this build (see the module documentation).
pub struct Known {
    /// The parents' blobs (devices after the new blob, in the parents' order).
    pub parent_blobs: Vec<BlobRef>,
    /// Chunk → (index into `parent_blobs`, block).
    pub parent_chunks: HashMap<Digest, (usize, u32)>,
    index: Option<StoreWide>,
}

impl Known {
    /// The parents' chunks (the layers' blobs' tables of contents), and, when `index` names a cache
    /// directory, the store-wide index after syncing it.
    pub fn load(
        store: &Store,
        parents: &[Digest],
        index: Option<&Path>,
        cap: usize,
    ) -> Result<Known, BuildError> {
        let mut known = Known {
            parent_blobs: Vec::new(),
            parent_chunks: HashMap::new(),
            index: None,
        };
        let mut seen = HashMap::new();
        for p in parents {
            let layer = store.get_layer(p)?;
            if let Some(k) = store.layer_unreusable(p, &layer)? {
                return Err(BuildError::Layer {
                    layer: p.to_string(),
                    why: format!(
                        "{k} is missing or condemned by garbage collection (no tag reaches it); tag an \
                         image that uses the layer again, or build without it as a parent"
                    ),
                });
            }
            for b in &layer.blobs {
                if seen.contains_key(&b.digest) {
                    continue;
                }
                let toc = store.get_toc(b)?;
                let i = known.parent_blobs.len();
                seen.insert(b.digest, i);
                known.parent_blobs.push(b.clone());
                for c in &toc.chunks {
                    known.parent_chunks.entry(c.digest).or_insert((i, c.block));
                }
            }
        }
        if let Some(dir) = index {
            // A cache that cannot be opened or synced costs dedup, never the build.
            let (cache, sync) = match IndexCache::sync_and_open(store, dir) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "store-wide index unavailable: deduplicating against the parents only");
                    return Ok(known);
                }
            };
            known.index = Some(StoreWide {
                cache,
                cap,
                sel: Mutex::new(Selection {
                    report: DedupReport {
                        sync,
                        ..DedupReport::default()
                    },
                    ..Selection::default()
                }),
                damaged: Default::default(),
            });
        }
        Ok(known)
    }

    /// True if chunk `d` (of `len` bytes) is stored already and the layer may reference it (workers ask
    /// this before compressing a chunk). A failing index lookup is logged and answered "no": the chunk is
    /// then stored again, never lost.
    pub fn known(&self, d: &Digest, len: u64) -> bool {
        if self.parent_chunks.contains_key(d) {
            return true;
        }
        let Some(sw) = &self.index else {
            return false;
        };
        if let Ok(sel) = sw.sel.lock() {
            if sel.chunks.contains_key(d) {
                return true;
            }
        }
        use std::sync::atomic::Ordering;
        if sw.damaged.load(Ordering::Relaxed) {
            return false;
        }
        let hits = match sw.cache.lookup(d) {
            Ok(h) => h,
            Err(e) => {
                if !sw.damaged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "index lookup failed: this build stores its remaining chunks, the next one rebuilds the index cache");
                    sw.cache.mark_damaged(&e.to_string());
                }
                return false;
            }
        };
        if hits.is_empty() {
            return false;
        }
        let Ok(mut sel) = sw.sel.lock() else {
            return false;
        };
        if sel.chunks.contains_key(d) {
            return true;
        }
        let chosen = hits
            .iter()
            .find_map(|h| sel.by_digest.get(&h.blob).map(|i| (*i, h.block)));
        let chosen = match chosen {
            Some(c) => Some(c),
            None if sel.blobs.len() < sw.cap => hits.iter().find_map(|h| {
                let blob = sw.cache.blob(&h.blob).ok().flatten()?;
                let i = sel.blobs.len();
                sel.by_digest.insert(blob.digest, i);
                sel.blobs.push(blob);
                sel.bytes.push(0);
                Some((i, h.block))
            }),
            None => None,
        };
        match chosen {
            Some(c) => {
                sel.chunks.insert(*d, c);
                sel.bytes[c.0] += len;
                sel.report.index_chunks += 1;
                sel.report.index_bytes += len;
                true
            }
            None => {
                sel.report.capped_chunks += 1;
                false
            }
        }
    }

    /// Gives up the foreign blobs that give the layer fewer than `min_bytes` bytes (once every chunk has
    /// been looked up): returns each with the view blocks of its chunks, which the caller stores again.
    pub fn prune(&self, min_bytes: u64) -> Vec<(BlobRef, HashSet<u32>)> {
        let Some(Ok(mut sel)) = self.index.as_ref().map(|sw| sw.sel.lock()) else {
            return Vec::new();
        };
        let small: HashSet<usize> = (0..sel.blobs.len())
            .filter(|i| sel.bytes[*i] < min_bytes)
            .collect();
        if small.is_empty() {
            return Vec::new();
        }
        let mut out: HashMap<usize, HashSet<u32>> = HashMap::new();
        sel.chunks.retain(|_, (i, block)| {
            if !small.contains(i) {
                return true;
            }
            out.entry(*i).or_default().insert(*block);
            false
        });
        let mut pruned = Vec::new();
        for (i, blocks) in out {
            sel.report.pruned_blobs += 1;
            sel.report.pruned_bytes += sel.bytes[i];
            sel.report.index_chunks -= blocks.len() as u64;
            sel.report.index_bytes -= sel.bytes[i];
            sel.bytes[i] = 0;
            pruned.push((sel.blobs[i].clone(), blocks));
        }
        pruned
    }

    /// The foreign blobs chosen and where each chosen chunk lies in them.
    pub fn foreign(&self) -> (Vec<BlobRef>, HashMap<Digest, (usize, u32)>, DedupReport) {
        match self.index.as_ref().map(|sw| sw.sel.lock()) {
            Some(Ok(sel)) => (sel.blobs.clone(), sel.chunks.clone(), sel.report.clone()),
            _ => Default::default(),
        }
    }

    /// Checks, just before the layer is written, that each foreign blob it uses still exists and is not
    /// condemned by gc. A blob that is not is marked dead in the cache so that the next build avoids it.
    pub fn recheck(&self, store: &Store, used: &[BlobRef]) -> Result<(), BuildError> {
        for b in used {
            if !store.blob_usable(&b.digest)? {
                if let Some(sw) = &self.index {
                    forget(sw.cache.path(), &b.digest);
                }
                return Err(BuildError::BlobGone { blob: b.digest });
            }
        }
        Ok(())
    }
}

/// Marks a blob dead in the cache at `path` (best effort: the next sync does it for a condemned blob).
fn forget(path: &Path, d: &Digest) {
    use strata_registry::index::cache::LOCK_WAIT;
    match IndexCache::open_rw(path, LOCK_WAIT) {
        Ok(Some(mut c)) => {
            if let Err(e) = c.mark_dead(d) {
                tracing::warn!(error = %e, "could not mark a gone blob in the index cache");
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "could not open the index cache"),
    }
}
