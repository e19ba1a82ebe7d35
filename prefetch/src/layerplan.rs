//! Plans by layer: what starts read from each layer, kept with the layer, inherited by every image that
//! contains it, and refined run after run.
//!
//! Most images a node sees are new (a fresh workspace or toolkit on a known base), so an image's own plan
//! ([`crate::Plan`]) helps only its second sandbox. A *layer* plan is kept per layer instead:
//! `plans/by-layer/<layer>` names a content-addressed [`LayerPlan`], the chunks of that layer's blobs that
//! runs read, each with the number of runs that read it. A sandbox of an image without a plan of its own
//! warms the plans of all its layers, so a new workspace on a traced base starts with the base warm.
//!
//! **Which layer a chunk belongs to.** A layer's device table names its own blob and, after
//! deduplication, blobs of the layers below it. A recorded chunk is credited to the *lowest* layer of the
//! image whose device table names its blob: that is where the chunk's data lives, and the layer every
//! image sharing it inherits from.
//!
//! **Refinement** ([`LayerPlan::refine`]) is a union: a chunk already planned gains a read, a new chunk
//! is added. Entries are ordered by reads (most-read first: what every start needs comes before what one
//! run happened to touch), then by first appearance (the earlier plan's order, then the new run's order),
//! and the plan is cut at [`MAX_ENTRIES`]. The result depends only on the previous plan and the run, so
//! the same runs give the same plan. Two nodes refining the same layer at once may lose one run's
//! contribution (the pointer is last-writer-wins); plans are hints and the next run adds it again.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;
use strata_registry::model::LayerDescriptor;
use strata_registry::store::{key, Store};

use crate::plan::{get_plan, get_pointed, pointed, put_pointed, PlanEntry, PlanError, PLAN_SCHEMA};

/// Most chunks a layer plan keeps (256 MiB of 4 KiB chunks, 64 GiB of 1 MiB ones).
pub const MAX_ENTRIES: usize = 65_536;

/// A planned chunk of a layer and how many recorded runs read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlanEntry {
    pub blob: Digest,
    pub chunk: u32,
    pub reads: u32,
}

/// The chunks of one layer's blobs that recorded runs read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub schema: u32,
    pub layer: Digest,
    /// Runs merged into this plan.
    pub runs: u32,
    pub entries: Vec<LayerPlanEntry>,
}

impl LayerPlan {
    /// `prev` (or nothing) with one more run's reads of this layer merged in (see the module
    /// documentation), at most `max` entries.
    pub fn refine(
        prev: Option<&LayerPlan>,
        layer: Digest,
        run: &[PlanEntry],
        max: usize,
    ) -> LayerPlan {
        // (reads, first appearance) by chunk.
        let mut seen: HashMap<(Digest, u32), (u32, usize)> = HashMap::new();
        let mut order = 0usize;
        for e in prev.map(|p| p.entries.as_slice()).unwrap_or_default() {
            seen.entry((e.blob, e.chunk)).or_insert_with(|| {
                order += 1;
                (e.reads, order)
            });
        }
        let mut this_run = HashSet::new();
        for e in run {
            if !this_run.insert((e.blob, e.chunk)) {
                continue;
            }
            let v = seen.entry((e.blob, e.chunk)).or_insert_with(|| {
                order += 1;
                (0, order)
            });
            v.0 = v.0.saturating_add(1);
        }
        let mut entries: Vec<_> = seen.into_iter().collect();
        entries.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.1 .1.cmp(&b.1 .1)));
        entries.truncate(max);
        LayerPlan {
            schema: PLAN_SCHEMA,
            layer,
            runs: prev.map_or(0, |p| p.runs).saturating_add(1),
            entries: entries
                .into_iter()
                .map(|((blob, chunk), (reads, _))| LayerPlanEntry { blob, chunk, reads })
                .collect(),
        }
    }

    /// The plan's chunks, in order.
    pub fn chunks(&self) -> impl Iterator<Item = PlanEntry> + '_ {
        self.entries.iter().map(|e| PlanEntry {
            blob: e.blob,
            chunk: e.chunk,
        })
    }

    /// Stores the plan and points its layer at it; returns the plan's digest.
    pub fn put(&self, store: &Store) -> Result<Digest, PlanError> {
        put_pointed(store, &key::plan_of_layer(&self.layer), self)
    }

    /// The plan of layer `layer`, if it has one (verified against its digest).
    pub fn get(store: &Store, layer: &Digest) -> Result<Option<LayerPlan>, PlanError> {
        let pointer = key::plan_of_layer(layer);
        let Some(plan) = get_pointed::<LayerPlan>(store, &pointer)? else {
            return Ok(None);
        };
        if plan.schema != PLAN_SCHEMA || plan.layer != *layer {
            return Err(PlanError::Malformed {
                key: pointer,
                why: format!(
                    "schema {} for layer {}, expected schema {PLAN_SCHEMA} for {layer}",
                    plan.schema, plan.layer
                ),
            });
        }
        Ok(Some(plan))
    }
}

/// Splits a run's entries by layer: each goes to the lowest of `layers` (bottom first) whose device
/// table names its blob; entries of blobs no layer names are dropped. Layers nothing was read from are
/// left out; the order of each layer's entries is the run's.
pub fn split_by_layer(
    layers: &[(Digest, LayerDescriptor)],
    run: &[PlanEntry],
) -> Vec<(Digest, Vec<PlanEntry>)> {
    let mut owner: HashMap<Digest, usize> = HashMap::new();
    for (i, (_, l)) in layers.iter().enumerate() {
        for b in &l.blobs {
            owner.entry(b.digest).or_insert(i);
        }
    }
    let mut out: Vec<Vec<PlanEntry>> = vec![Vec::new(); layers.len()];
    for e in run {
        if let Some(&i) = owner.get(&e.blob) {
            out[i].push(*e);
        }
    }
    layers
        .iter()
        .zip(out)
        .filter(|(_, v)| !v.is_empty())
        .map(|((d, _), v)| (*d, v))
        .collect()
}

/// Merges a recorded run into the plans of the layers it read from, and points each blob the run
/// read at the plan that now credits it; returns how many layer plans were written.
pub fn record_run(
    store: &Store,
    layers: &[(Digest, LayerDescriptor)],
    run: &[PlanEntry],
) -> Result<usize, PlanError> {
    let parts = split_by_layer(layers, run);
    for (layer, entries) in &parts {
        // A damaged plan is started again; a failing store stops the recording.
        let prev = hint(LayerPlan::get(store, layer))?;
        let plan = LayerPlan::refine(prev.as_ref(), *layer, entries, MAX_ENTRIES);
        let d = plan.put(store)?;
        let blobs: HashSet<Digest> = entries.iter().map(|e| e.blob).collect();
        for b in blobs {
            store.put_index(&key::plan_of_blob(&b), d.to_string().into_bytes())?;
        }
    }
    Ok(parts.len())
}

/// The chunks the plans of `layers` (bottom first) name, bottom layer first, each chunk once, and the
/// layers that had a plan.
///
/// **By content.** A layer without a plan of its own — a rebuilt base: a new layer digest whose
/// unchanged chunks the build found in the old base's blob (store-wide dedup) and names there — takes
/// from the plans its blobs point to (`plans/by-blob/`) the entries of those blobs. The chunks are the
/// same bytes at the same places (blobs are content addressed), so the predecessor's plan holds for
/// them; what the rebuild changed is in new blobs that no plan names yet. `blobs_of` gives a layer's
/// blobs (asked only for layers without a plan). A by-blob pointer that is damaged is skipped: plans
/// are hints.
pub fn inherited(
    store: &Store,
    layers: &[Digest],
    blobs_of: impl Fn(&Digest) -> Result<Vec<Digest>, PlanError>,
) -> Result<(Vec<PlanEntry>, Vec<Digest>), PlanError> {
    let mut seen = HashSet::new();
    let mut entries = Vec::new();
    let mut planned = Vec::new();
    for l in layers {
        let found: Vec<PlanEntry> = match LayerPlan::get(store, l)? {
            Some(p) => p.chunks().collect(),
            None => match by_blob(store, &blobs_of(l)?)? {
                f if f.is_empty() => continue,
                f => f,
            },
        };
        planned.push(*l);
        entries.extend(found.into_iter().filter(|e| seen.insert((e.blob, e.chunk))));
    }
    Ok((entries, planned))
}

/// A plan read as the hint it is: missing or damaged is `None`; a failing store stays an error.
fn hint<T>(r: Result<Option<T>, PlanError>) -> Result<Option<T>, PlanError> {
    match r {
        Err(PlanError::Malformed { .. }) => Ok(None),
        Err(PlanError::Store(e)) if e.is_damaged() => Ok(None),
        r => r,
    }
}

/// The entries of `blobs` in the plans their by-blob pointers name.
fn by_blob(store: &Store, blobs: &[Digest]) -> Result<Vec<PlanEntry>, PlanError> {
    let mine: HashSet<Digest> = blobs.iter().copied().collect();
    let mut read = HashSet::new();
    let mut out = Vec::new();
    for b in blobs {
        // A layer's blobs mostly name one plan: each plan is read once.
        let pointer = key::plan_of_blob(b);
        let Some(d) = hint(pointed(store, &pointer))? else {
            continue;
        };
        if !read.insert(d) {
            continue;
        }
        let Some(plan) = hint(get_plan::<LayerPlan>(store, &pointer, &d).map(Some))? else {
            continue;
        };
        out.extend(plan.chunks().filter(|e| mine.contains(&e.blob)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> Digest {
        Digest([n; 32])
    }

    fn e(blob: u8, chunk: u32) -> PlanEntry {
        PlanEntry {
            blob: d(blob),
            chunk,
        }
    }

    fn order(p: &LayerPlan) -> Vec<(u8, u32, u32)> {
        p.entries
            .iter()
            .map(|x| (x.blob.0[0], x.chunk, x.reads))
            .collect()
    }

    #[test]
    fn refinement_is_a_union_most_read_first_bounded_and_deterministic() {
        let first = LayerPlan::refine(None, d(9), &[e(1, 5), e(1, 2), e(1, 5), e(1, 7)], 10);
        assert_eq!(order(&first), [(1, 5, 1), (1, 2, 1), (1, 7, 1)]);
        let second = LayerPlan::refine(Some(&first), d(9), &[e(1, 7), e(1, 9), e(1, 2)], 10);
        // 7 and 2 were read twice (2 first in the earlier order), then 5, then the new 9.
        assert_eq!(order(&second), [(1, 2, 2), (1, 7, 2), (1, 5, 1), (1, 9, 1)]);
        assert_eq!(second.runs, 2);
        // Bounded: the least-read, latest entries go.
        let cut = LayerPlan::refine(Some(&first), d(9), &[e(1, 7), e(1, 9), e(1, 2)], 3);
        assert_eq!(order(&cut), [(1, 2, 2), (1, 7, 2), (1, 5, 1)]);
        // Deterministic: the same runs give the same bytes.
        let again = LayerPlan::refine(
            Some(&LayerPlan::refine(
                None,
                d(9),
                &[e(1, 5), e(1, 2), e(1, 5), e(1, 7)],
                10,
            )),
            d(9),
            &[e(1, 7), e(1, 9), e(1, 2)],
            10,
        );
        assert_eq!(
            serde_json::to_vec(&again).expect("json"),
            serde_json::to_vec(&second).expect("json")
        );
        // Many runs never grow a plan past its bound.
        let mut p = None;
        for r in 0..50u32 {
            let run: Vec<_> = (0..100).map(|c| e(1, r * 37 + c)).collect();
            p = Some(LayerPlan::refine(p.as_ref(), d(9), &run, 500));
        }
        assert_eq!(p.expect("plan").entries.len(), 500);
    }

    fn layer(blobs: &[u8]) -> LayerDescriptor {
        use strata_registry::model::{BlobRef, LayerKind, LayerStats, ObjectRef, SCHEMA};
        LayerDescriptor {
            schema: SCHEMA,
            kind: LayerKind::Base,
            content: None,
            meta: ObjectRef {
                digest: d(0),
                size: 0,
            },
            blobs: blobs
                .iter()
                .map(|&b| BlobRef {
                    digest: d(b),
                    size: 0,
                    view_size: 0,
                    toc_offset: 0,
                    toc_len: 0,
                    toc_digest: d(0),
                    chunks: 0,
                })
                .collect(),
            chunk_size: 4096,
            stats: LayerStats::default(),
            parent: None,
            labels: Default::default(),
            config: Default::default(),
            built_on: None,
        }
    }

    #[test]
    fn chunks_go_to_the_lowest_layer_naming_their_blob() {
        // The workspace (20) deduplicated against the base's blob 1 and has its own blob 2.
        let layers = vec![(d(10), layer(&[1])), (d(20), layer(&[2, 1]))];
        let parts = split_by_layer(&layers, &[e(2, 0), e(1, 3), e(3, 1), e(2, 4)]);
        assert_eq!(
            parts,
            vec![(d(10), vec![e(1, 3)]), (d(20), vec![e(2, 0), e(2, 4)])]
        );
    }

    #[test]
    fn a_layer_without_a_plan_inherits_what_plans_know_of_its_blobs() {
        let store = Store::with_backend(std::sync::Arc::new(
            strata_registry::store::MemoryStore::new(),
        ));
        let base = [(d(10), layer(&[1]))];
        assert_eq!(
            record_run(&store, &base, &[e(1, 3), e(1, 5)]).expect("record"),
            1
        );
        let no_blobs = |_: &Digest| -> Result<Vec<Digest>, PlanError> { panic!("own plan first") };
        assert_eq!(
            inherited(&store, &[d(10)], no_blobs).expect("own plan"),
            (vec![e(1, 3), e(1, 5)], vec![d(10)])
        );
        // A rebuild (30) names blob 1 (deduplicated) and its own new blob 3: it inherits blob 1's
        // entries; a layer naming no planned blob inherits nothing.
        let blobs = |l: &Digest| {
            Ok(if *l == d(30) {
                vec![d(3), d(1)]
            } else {
                vec![d(4)]
            })
        };
        assert_eq!(
            inherited(&store, &[d(40), d(30)], blobs).expect("by blob"),
            (vec![e(1, 3), e(1, 5)], vec![d(30)])
        );
        // Another layer's plan crediting blob 1 and blob 2 moves the pointer; only blob 1's entries
        // are taken.
        let other = [(d(50), layer(&[2, 1]))];
        record_run(&store, &other, &[e(2, 0), e(1, 9)]).expect("record");
        assert_eq!(
            inherited(&store, &[d(30)], blobs).expect("by blob").0,
            vec![e(1, 9)]
        );
    }
}
