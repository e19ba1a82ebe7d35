//! Garbage collection of a store: mark from the tags, sweep what nothing live references.
//!
//! Objects are content addressed and written before anything refers to them (blob → metadata → layer →
//! manifest → tag), so a failed or abandoned build, an overwritten tag or a superseded snapshot leaves
//! objects that nothing names. [`collect`] marks everything reachable from every tag — manifests, their
//! layers, each layer's metadata (and the metadata a patch is based on) and blobs, the image's and each
//! layer's prefetch plan and the plan each live blob's `plans/by-blob/` pointer names — and deletes the
//! unmarked objects under `blobs/`, `meta/`, `layers/`, `manifests/`, `plans/` and `oci/` that have been
//! unreferenced for longer than `grace`. Other prefixes (`tags/`) are never touched, except a local
//! store's spool `tmp/`: the files writers that died left there are removed once older than `grace`
//! ([`Store::clean_spool`]; a live writer's file is kept however old).
//!
//! **The grace period** protects work in flight: a build's objects are unreferenced until its tag is
//! written, so anything younger than `grace` is kept. It must exceed the longest build or `pack_diff`.
//!
//! **Two phases.** A build may also *reuse* an object that already exists — content addressing makes the
//! write a no-op, and deduplication refers to existing blobs — and such an object can be old and, at that
//! moment, unreferenced (its image was untagged). Deleting every old unreferenced object at once could
//! delete it under the build. So an unreferenced object older than `grace` is first *condemned*: a mark
//! `gc/condemned/<key>` is written, and a later run deletes the object only if the mark is at least
//! `grace` old, the object was not written since, and it is still unreferenced. Writers treat a
//! condemned object as absent ([`Store::reusable`]) and write it again, which makes it young. A build
//! that reused an object before it was condemned tags its image, and every tag write first checks, as
//! late as the write allows, that nothing the image reaches is gone, pardoning (unmarking) what is
//! condemned ([`Store::revive_image`]): a tag written before the deleting run lists the tags keeps the
//! object, and a writer slower than `grace` — the soak on MooseFS saw a build take 10 s against a 5 s
//! grace — finds the object gone and is refused instead of naming deleted objects. With a zero grace
//! there is no second phase: the objects are deleted at once, which is safe only when nothing builds
//! meanwhile. The one window left: a writer that finds a condemnation mark and rewrites the object (or
//! tags it) while the deleting run is under way, between its listing and its delete (S3 has no
//! conditional delete).
//! **Images in use must stay tagged**: a node running sandboxes of an image that no tag names any more
//! reads its uncached chunks from the store, and they are gone after a collection.
//! A dry run reports what would be deleted.
//!
//! **Nothing reachable is ever deleted.** Marking reads every tag, manifest and layer descriptor; if any
//! of them cannot be read or parsed (a tag emptied or overwritten with garbage, a tag naming a manifest
//! that is gone, a descriptor that fails to parse), marking cannot see what that object reaches, so the
//! collection stops with [`GcError::Broken`] naming it before anything is deleted. With `skip_broken` it
//! goes on instead: what the broken images still let it read stays marked, the rest is collected as if
//! the broken tags did not exist, and the report lists each one. A store that fails or does not answer
//! (as opposed to an object that is broken) always stops the collection.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::digest::Digest;
use crate::store::{key, SpoolReport, Store, StoreError};

/// How to collect.
#[derive(Clone, Debug)]
pub struct GcOptions {
    /// Keep unreferenced objects younger than this.
    pub grace: Duration,
    /// Report; delete nothing.
    pub dry_run: bool,
    /// Collect even when tags, manifests or descriptors are broken (see the module documentation).
    pub skip_broken: bool,
    /// The reference time for `grace`.
    pub now: SystemTime,
}

impl GcOptions {
    pub fn new(grace: Duration) -> GcOptions {
        GcOptions {
            grace,
            dry_run: false,
            skip_broken: false,
            now: SystemTime::now(),
        }
    }
}

/// A tag whose image could not be followed.
#[derive(Debug, Clone, Serialize)]
pub struct BrokenRef {
    /// The tag (`NAME:TAG`, or its store key when the key is not a tag name).
    pub tag: String,
    /// What could not be read, and why.
    pub error: String,
}

/// Why a collection stopped.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error(
        "tag {tag} cannot be followed: {source}. Nothing was deleted: fix the object, delete the tag \
         (strata rmi), or collect with --skip-broken (everything only this tag reaches is then deleted)"
    )]
    Broken {
        tag: String,
        #[source]
        source: StoreError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

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
    /// Unreferenced objects condemned by this run: a run at least `grace` later deletes them if they are
    /// still unreferenced and nothing wrote them again.
    pub condemned: u64,
    pub condemned_bytes: u64,
    /// Objects condemned by an earlier run less than `grace` ago.
    pub pending: u64,
    pub dry_run: bool,
    /// Tags that could not be followed (only with `skip_broken`; otherwise the collection stops).
    pub broken: Vec<BrokenRef>,
    /// Keys deleted (at most the first 1000).
    pub keys: Vec<String>,
    /// Leftover spool files (a local store's `tmp/`) removed, or that would be.
    pub spool: SpoolReport,
}

/// Swept (a blob's `index/` segment goes with it).
const SWEPT: [&str; 6] = ["blobs", "meta", "layers", "manifests", "plans", "oci"];

/// Where condemnation marks live ([`key::condemned`]).
const MARKS: &str = "gc/condemned";

/// Marks what tag `tag` (naming manifest `m`) reaches. Broken objects are passed to `broken` and marking
/// goes on with the rest; a failing store stops it.
fn mark_image(
    store: &Store,
    m: &Digest,
    live: &mut HashSet<String>,
    broken: &mut dyn FnMut(StoreError) -> Result<(), GcError>,
) -> Result<(), GcError> {
    let mut check = |r: Result<(), StoreError>| match r {
        Err(e) if e.is_damaged() => broken(e),
        Err(e) => Err(GcError::Store(e)),
        Ok(()) => Ok(()),
    };
    if !live.insert(key::manifest(m)) {
        return Ok(());
    }
    let manifest = match store.get_manifest(m) {
        Ok(x) => x,
        Err(e) => return check(Err(e)),
    };
    for l in &manifest.layers {
        if !live.insert(key::layer(&l.digest)) {
            continue;
        }
        check(mark_layer(store, &l.digest, live))?;
    }
    mark_plan(store, key::plan_of(m), live)?;
    Ok(())
}

/// Marks a plan pointer (an image's or a layer's) and the plan it names.
fn mark_plan(store: &Store, pointer: String, live: &mut HashSet<String>) -> Result<(), StoreError> {
    if let Some(p) = store.get_index(&pointer)? {
        if let Some(d) = std::str::from_utf8(&p)
            .ok()
            .and_then(|s| s.trim().parse::<Digest>().ok())
        {
            live.insert(key::plan(&d));
        }
        live.insert(pointer);
    }
    Ok(())
}

fn mark_layer(store: &Store, d: &Digest, live: &mut HashSet<String>) -> Result<(), StoreError> {
    let desc = store.get_layer(d)?;
    mark_plan(store, key::plan_of_layer(d), live)?;
    live.insert(key::meta(&desc.meta.digest));
    if let Some(base) = store.meta_base(&desc.meta.digest)? {
        live.insert(key::meta(&base));
    }
    for b in &desc.blobs {
        // A blob shared by many layers is looked at once.
        if live.insert(key::blob(&b.digest)) {
            mark_plan(store, key::plan_of_blob(&b.digest), live)?;
        }
    }
    Ok(())
}

/// An `oci/<chain id>` import record stays while the layer it names is live.
fn oci_record_live(store: &Store, key_: &str, live: &HashSet<String>) -> Result<bool, StoreError> {
    let Some(b) = store.get_index(key_)? else {
        return Ok(false);
    };
    let text = String::from_utf8_lossy(&b);
    Ok(text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == ':'))
        .filter_map(|w| w.parse::<Digest>().ok())
        .any(|d| live.contains(&key::layer(&d))))
}

/// Marks everything the store's tags reach.
fn mark(store: &Store, o: &GcOptions, report: &mut GcReport) -> Result<HashSet<String>, GcError> {
    let tags = store.tags()?;
    let mut broken: Vec<BrokenRef> = Vec::new();
    for b in tags.broken {
        let tag = b.tag.clone().unwrap_or_else(|| b.key.clone());
        let source = StoreError::Malformed {
            key: b.key,
            why: b.why,
        };
        if !o.skip_broken {
            return Err(GcError::Broken { tag, source });
        }
        broken.push(BrokenRef {
            tag,
            error: source.to_string(),
        });
    }
    let mut live = HashSet::new();
    for (t, m) in tags.good {
        report.tags += 1;
        let mut on_broken = |source: StoreError| {
            if !o.skip_broken {
                return Err(GcError::Broken {
                    tag: t.to_string(),
                    source,
                });
            }
            broken.push(BrokenRef {
                tag: t.to_string(),
                error: source.to_string(),
            });
            Ok(())
        };
        mark_image(store, &m, &mut live, &mut on_broken)?;
    }
    report.broken = broken;
    Ok(live)
}

/// Collects garbage (see the module documentation).
pub fn collect(store: &Store, o: &GcOptions) -> Result<GcReport, GcError> {
    let mut report = GcReport {
        dry_run: o.dry_run,
        ..GcReport::default()
    };
    let live = mark(store, o, &mut report)?;
    // Stores give times in whole seconds: a time `t` stands for [t, t + 1). Something is known to be
    // older than `grace` only when `t + 1 <= now - grace`, that is `t < cutoff` (with `<=`, an object or
    // mark could go up to a second early: on MooseFS, whose times are seconds, a 5 s grace was 4 s).
    let cutoff = o
        .now
        .checked_sub(o.grace)
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(i64::MIN, |d| d.as_secs() as i64);
    let mut marks: HashMap<String, i64> = store
        .list_info(MARKS)?
        .into_iter()
        .filter_map(|(k, _, t)| Some((k.strip_prefix(MARKS)?.strip_prefix('/')?.to_string(), t)))
        .collect();
    // A blob's index segment (`index/<hex>`) lives and dies with the blob.
    let mut segments: HashMap<String, (u64, i64)> = store
        .list_info("index")?
        .into_iter()
        .filter_map(|(k, size, t)| Some((k.strip_prefix("index/")?.to_string(), (size, t))))
        .collect();
    let mut kept_blobs = HashSet::new();
    for prefix in SWEPT {
        for (k, size, modified) in store.list_info(prefix)? {
            let mark = marks.remove(&k);
            let keep = live.contains(&k) || (prefix == "oci" && oci_record_live(store, &k, &live)?);
            let verdict = if keep {
                report.live += 1;
                Verdict::Keep
            } else if modified >= cutoff && !o.grace.is_zero() {
                report.young += 1;
                Verdict::Keep
            } else if o.grace.is_zero() {
                Verdict::Delete
            } else {
                match mark {
                    // Condemned at least `grace` ago and not written since: nothing took it up.
                    Some(t) if t < cutoff && modified <= t => Verdict::Delete,
                    Some(t) if modified <= t => Verdict::Pending,
                    _ => Verdict::Condemn,
                }
            };
            let blob_hex = k.strip_prefix("blobs/").map(str::to_string);
            if !matches!(verdict, Verdict::Delete) {
                kept_blobs.extend(blob_hex.clone());
            }
            apply(
                store,
                o,
                &mut report,
                verdict,
                (&k, size),
                mark.is_some(),
                || {
                    blob_hex
                        .and_then(|h| segments.remove(&h).map(|(n, _)| (format!("index/{h}"), n)))
                },
            )?;
        }
    }
    // Segments of kept blobs are live; one whose blob is gone goes once older than the grace period.
    for (hex, (size, modified)) in segments {
        if kept_blobs.contains(&hex) {
            report.live += 1;
        } else if modified < cutoff || o.grace.is_zero() {
            remove(store, o, &mut report, &format!("index/{hex}"), size)?;
        }
    }
    // Marks of objects that are gone.
    if !o.dry_run {
        for k in marks.keys() {
            store.delete(&key::condemned(k))?;
        }
    }
    report.spool = store.clean_spool(o.grace, o.now, o.dry_run)?;
    Ok(report)
}

/// Carries out `verdict` on object `k` (with `marked`: it has a condemnation mark). A deleted blob's
/// index segment (`segment()`) goes first, the mark last: a crash in between leaves a condemned object.
fn apply(
    store: &Store,
    o: &GcOptions,
    report: &mut GcReport,
    verdict: Verdict,
    (k, size): (&str, u64),
    marked: bool,
    segment: impl FnOnce() -> Option<(String, u64)>,
) -> Result<(), StoreError> {
    match verdict {
        Verdict::Keep => {
            if marked && !o.dry_run {
                store.delete(&key::condemned(k))?;
            }
        }
        Verdict::Pending => report.pending += 1,
        Verdict::Condemn => {
            if !o.dry_run {
                store.put_index(&key::condemned(k), b"condemned by gc\n".to_vec())?;
            }
            report.condemned += 1;
            report.condemned_bytes += size;
        }
        Verdict::Delete => {
            if let Some((seg, n)) = segment() {
                remove(store, o, report, &seg, n)?;
            }
            remove(store, o, report, k, size)?;
            if marked && !o.dry_run {
                store.delete(&key::condemned(k))?;
            }
        }
    }
    Ok(())
}

/// Deletes `k` (not in a dry run) and counts it.
fn remove(
    store: &Store,
    o: &GcOptions,
    report: &mut GcReport,
    k: &str,
    size: u64,
) -> Result<(), StoreError> {
    if !o.dry_run {
        store.delete(k)?;
    }
    report.deleted += 1;
    report.deleted_bytes += size;
    if report.keys.len() < 1000 {
        report.keys.push(k.to_string());
    }
    Ok(())
}

/// What the sweep does with one object.
enum Verdict {
    Keep,
    /// Condemned by an earlier run less than the grace period ago.
    Pending,
    Condemn,
    Delete,
}

#[cfg(test)]
#[path = "gc_tests.rs"]
pub(crate) mod tests;
