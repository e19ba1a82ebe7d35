//! Deleting blobs without pulling them from under a builder: condemn first, delete a grace period later.
//!
//! Store-wide dedup lets a build reference any blob of the store, including one that no tag reaches at
//! that moment (left by an interrupted build, or by an image just removed), which gc would delete. So gc
//! deletes blobs in two steps, as it does every object ([`crate::gc`]; a blob's index segment goes with it):
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

use crate::digest::Digest;
use crate::store::{key, Store, StoreError};

/// Where blobs' condemnation markers live: gc's marks ([`key::condemned`]) of `blobs/` keys.
const MARKERS: &str = "gc/condemned/blobs";

/// The condemnation marker of blob `d`.
pub fn marker_key(d: &Digest) -> String {
    key::condemned(&key::blob(d))
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

fn hex_of<'k>(k: &'k str, prefix: &str) -> Option<&'k str> {
    k.strip_prefix(prefix)?.strip_prefix('/')
}
