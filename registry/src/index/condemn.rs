//! Deleting blobs without pulling them from under a builder: condemn first, delete a grace period later.
//!
//! Store-wide dedup lets a build reference any blob of the store, including one that no tag reaches at
//! that moment (left by an interrupted build, or by an image just removed), which gc would delete. So gc
//! deletes blobs in two steps ([`sweep_blobs`]):
//!
//! 1. An unreachable blob older than the grace period is **condemned**: gc writes the marker
//!    `gc/condemned/blobs/<blob hex>` (its modification time is the condemnation's; the same marks
//!    [`crate::gc`] leaves on the other objects it deletes in two steps).
//! 2. A later gc, whose marking started at least the grace period after the condemnation, deletes the blob
//!    if it is still unreachable: its index segment first, then the blob, then the marker (a crash in
//!    between leaves a condemned blob without a segment, which the next gc deletes). A condemned blob that
//!    is reachable again (a build referenced it before it was condemned) is pardoned: the marker goes.
//!
//! Builders never choose a condemned blob, and check again just before writing their layer descriptor
//! that each foreign blob exists and is not condemned ([`Store::blob_usable`]). If that check passed at
//! time `t`, the blob was condemned after `t`, so it is deleted no earlier than `t + grace`; the build's tag
//! is written by then (the grace period exceeds the longest build, as gc already requires), and the gc
//! that would delete it marks it reachable instead. With `--grace 0` there is no protection (nor is there
//! for a build's own young objects): a condemned blob is deleted in the same run.
//!
//! Index segments follow their blob: a segment whose blob is gone is deleted once older than the grace
//! period; markers whose blob is gone are deleted.

use std::collections::{HashMap, HashSet};

use crate::digest::Digest;
use crate::store::{key, Store, StoreError};

/// Where blobs' condemnation markers live: gc's marks ([`key::condemned`]) of `blobs/` keys.
const MARKERS: &str = "gc/condemned/blobs";

/// The condemnation marker of blob `d`.
pub fn marker_key(d: &Digest) -> String {
    key::condemned(&key::blob(d))
}

fn marker_of_hex(hex: &str) -> String {
    format!("{MARKERS}/{hex}")
}

impl Store {
    /// True if gc has condemned blob `d` (it will be deleted if nothing reaches it a grace period later).
    pub fn is_condemned(&self, d: &Digest) -> Result<bool, StoreError> {
        self.exists(&marker_key(d))
    }

    /// True if a new layer may reference blob `d`: it exists and is not condemned.
    pub fn blob_usable(&self, d: &Digest) -> Result<bool, StoreError> {
        self.reusable(&key::blob(d))
    }

    /// Condemned blobs.
    pub fn list_condemned(&self) -> Result<Vec<Digest>, StoreError> {
        Ok(self
            .list(MARKERS)?
            .iter()
            .filter_map(|k| Digest::from_hex(hex_of(k, MARKERS)?).ok())
            .collect())
    }
}

/// What [`sweep_blobs`] did.
#[derive(Debug, Default)]
pub struct BlobSweep {
    /// Live blobs and segments of kept blobs.
    pub live: u64,
    /// Unreferenced blobs kept because they are younger than the grace period.
    pub young: u64,
    /// Blobs condemned by this run, and their bytes.
    pub condemned: u64,
    pub condemned_bytes: u64,
    /// Blobs condemned by an earlier run, not yet deletable.
    pub pending: u64,
    /// Condemnations lifted (the blob is reachable again).
    pub pardoned: u64,
    /// Deleted (or, in a dry run, deletable) keys and sizes: blobs, segments, markers.
    pub deleted: Vec<(String, u64)>,
}

fn hex_of<'k>(k: &'k str, prefix: &str) -> Option<&'k str> {
    k.strip_prefix(prefix)?.strip_prefix('/')
}

/// Sweeps `blobs/`, `index/` and the blobs' marks (see the module documentation). `live` holds the keys gc
/// marked; objects modified after `cutoff` (Unix seconds) are young; `immediate` (a zero grace period)
/// deletes a blob in the run that condemns it.
pub fn sweep_blobs(
    store: &Store,
    live: &HashSet<String>,
    cutoff: i64,
    immediate: bool,
    dry_run: bool,
) -> Result<BlobSweep, StoreError> {
    let mut out = BlobSweep::default();
    let markers: HashMap<String, i64> = store
        .list_info(MARKERS)?
        .into_iter()
        .filter_map(|(k, _, m)| Some((hex_of(&k, MARKERS)?.to_string(), m)))
        .collect();
    let mut segments: HashMap<String, (String, u64, i64)> = store
        .list_info("index")?
        .into_iter()
        .filter_map(|(k, size, m)| Some((hex_of(&k, "index")?.to_string(), (k, size, m))))
        .collect();
    let mut kept: HashSet<String> = HashSet::new();
    let delete = |out: &mut BlobSweep, k: String, size: u64| -> Result<(), StoreError> {
        if !dry_run {
            store.delete(&k)?;
        }
        out.deleted.push((k, size));
        Ok(())
    };
    for (k, size, modified) in store.list_info("blobs")? {
        let Some(hex) = hex_of(&k, "blobs").map(str::to_string) else {
            continue;
        };
        let marker = markers.get(&hex).copied();
        if live.contains(&k) {
            out.live += 1;
            if marker.is_some() {
                out.pardoned += 1;
                if !dry_run {
                    store.delete(&marker_of_hex(&hex))?;
                }
            }
            kept.insert(hex);
            continue;
        }
        if modified > cutoff {
            out.young += 1;
            kept.insert(hex);
            continue;
        }
        let due = match marker {
            Some(m) => m <= cutoff || immediate,
            None if immediate => true,
            None => {
                if !dry_run {
                    store.put_index(&marker_of_hex(&hex), b"condemned by gc\n".to_vec())?;
                }
                out.condemned += 1;
                out.condemned_bytes += size;
                kept.insert(hex);
                continue;
            }
        };
        if !due {
            out.pending += 1;
            kept.insert(hex);
            continue;
        }
        if let Some((seg, seg_size, _)) = segments.remove(&hex) {
            delete(&mut out, seg, seg_size)?;
        }
        delete(&mut out, k, size)?;
        if !dry_run {
            // The marker goes last: a crash before this leaves a condemned blob, deleted next time.
            let _ = store.delete(&marker_of_hex(&hex));
        }
        kept.remove(&hex);
    }
    // Segments of kept blobs stay; a segment without its blob goes once older than the grace period.
    for (hex, (k, size, modified)) in segments {
        if kept.contains(&hex) {
            out.live += 1;
        } else if modified <= cutoff {
            delete(&mut out, k, size)?;
        }
    }
    for hex in markers.keys() {
        if !kept.contains(hex) && !dry_run {
            let _ = store.delete(&marker_of_hex(hex));
        }
    }
    Ok(out)
}
