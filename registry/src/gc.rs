//! Garbage collection of a store: mark from the tags, sweep what nothing live references.
//!
//! Objects are content addressed and written before anything refers to them (blob → metadata → layer →
//! manifest → tag), so a failed or abandoned build, an overwritten tag or a superseded snapshot leaves
//! objects that nothing names. [`collect`] marks everything reachable from every tag — manifests, their
//! layers, each layer's metadata (and the metadata a patch is based on) and blobs, the image's prefetch
//! plan — and deletes the unmarked objects under `meta/`, `layers/`, `manifests/`, `plans/` and `oci/`
//! that are older than `grace`. Unmarked blobs go in two steps, condemned first and deleted a grace period
//! later, because builders deduplicate against any blob of the store ([`crate::index::condemn`]); index
//! segments follow their blobs. Other prefixes (`tags/`, a local store's `tmp/`) are never touched.
//!
//! **The grace period** protects work in flight: a build's objects are unreferenced until its tag is
//! written, so anything younger than `grace` is kept. It must exceed the longest build or `pack_diff`.
//! **Images in use must stay tagged**: a node running sandboxes of an image that no tag names any more
//! reads its uncached chunks from the store, and they are gone after a collection.
//! A dry run reports what would be deleted.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::digest::Digest;
use crate::index::condemn::sweep_blobs;
use crate::store::{key, Store, StoreError};

/// What a collection found and did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct GcReport {
    pub tags: u64,
    /// Live objects (marked).
    pub live: u64,
    /// Unreferenced objects deleted (or, in a dry run, that would be).
    pub deleted: u64,
    pub deleted_bytes: u64,
    /// Unreferenced objects kept because they are younger than the grace period.
    pub young: u64,
    /// Unreferenced blobs condemned but not deleted yet (see [`crate::index::condemn`]).
    pub condemned: u64,
    pub dry_run: bool,
    /// Keys deleted (at most the first 1000).
    pub keys: Vec<String>,
}

/// Swept here; `blobs/` (with `index/` and `condemned/`) is swept by [`sweep_blobs`], in two steps.
const SWEPT: [&str; 5] = ["meta", "layers", "manifests", "plans", "oci"];

fn mark_image(store: &Store, m: &Digest, live: &mut HashSet<String>) -> Result<(), StoreError> {
    if !live.insert(key::manifest(m)) {
        return Ok(());
    }
    let manifest = store.get_manifest(m)?;
    for l in &manifest.layers {
        if !live.insert(key::layer(&l.digest)) {
            continue;
        }
        let desc = store.get_layer(&l.digest)?;
        live.insert(key::meta(&desc.meta.digest));
        if let Some(base) = store.meta_base(&desc.meta.digest)? {
            live.insert(key::meta(&base));
        }
        for b in &desc.blobs {
            live.insert(key::blob(&b.digest));
        }
    }
    let pointer = key::plan_of(m);
    if let Some(p) = store.get_index(&pointer)? {
        live.insert(pointer);
        if let Some(d) = std::str::from_utf8(&p)
            .ok()
            .and_then(|s| s.trim().parse::<Digest>().ok())
        {
            live.insert(key::plan(&d));
        }
    }
    Ok(())
}

/// An `oci/<chain id>` import record stays while the layer it names is live.
fn oci_record_live(store: &Store, key_: &str, live: &HashSet<String>) -> bool {
    let Ok(Some(b)) = store.get_index(key_) else {
        return false;
    };
    let text = String::from_utf8_lossy(&b);
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == ':'))
        .filter_map(|w| w.parse::<Digest>().ok())
        .any(|d| live.contains(&key::layer(&d)))
}

/// Collects garbage (see the module documentation). `now` is the reference time for `grace`.
pub fn collect(
    store: &Store,
    grace: Duration,
    dry_run: bool,
    now: SystemTime,
) -> Result<GcReport, StoreError> {
    let mut report = GcReport {
        dry_run,
        ..GcReport::default()
    };
    let mut live = HashSet::new();
    for (_, m) in store.tags()? {
        report.tags += 1;
        mark_image(store, &m, &mut live)?;
    }
    let cutoff = now
        .checked_sub(grace)
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(i64::MIN, |d| d.as_secs() as i64);
    let blobs = sweep_blobs(store, &live, cutoff, grace.is_zero(), dry_run)?;
    report.live += blobs.live;
    report.young += blobs.young;
    report.condemned = blobs.condemned;
    for (k, size) in blobs.deleted {
        report.deleted += 1;
        report.deleted_bytes += size;
        if report.keys.len() < 1000 {
            report.keys.push(k);
        }
    }
    for prefix in SWEPT {
        for (k, size, modified) in store.list_info(prefix)? {
            let keep = live.contains(&k) || (prefix == "oci" && oci_record_live(store, &k, &live));
            if keep {
                report.live += 1;
                continue;
            }
            if modified > cutoff {
                report.young += 1;
                continue;
            }
            if !dry_run {
                store.delete(&k)?;
            }
            report.deleted += 1;
            report.deleted_bytes += size;
            if report.keys.len() < 1000 {
                report.keys.push(k);
            }
        }
    }
    Ok(report)
}
