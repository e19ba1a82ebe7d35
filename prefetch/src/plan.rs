//! Prefetch plans: which chunks a known run reads, in order, and where they are kept in a store.

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;
use strata_registry::store::{key, Store, StoreError};

/// Version of the plan format.
pub const PLAN_SCHEMA: u32 = 1;

/// One chunk: a blob and the chunk's index in the blob's table of contents *as units* (a pieced chunk is
/// one unit per piece, [`strata_registry::pieces::units`]; a blob without pieces has its chunks as units).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlanEntry {
    pub blob: Digest,
    pub chunk: u32,
}

/// The chunks a run read, first touch first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub schema: u32,
    /// The image the run used.
    pub manifest: Digest,
    /// What was run (for people reading the plan).
    #[serde(default)]
    pub command: Vec<String>,
    pub entries: Vec<PlanEntry>,
}

/// Why a plan could not be stored or read.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("prefetch plan {key}: {why}")]
    Malformed { key: String, why: String },
}

impl Plan {
    /// The plan of image `manifest` from recorded `entries`, keeping only chunks of `blobs` (the image's
    /// own blobs: a recorder sees every read on the node).
    pub fn recorded(
        manifest: Digest,
        command: Vec<String>,
        entries: Vec<PlanEntry>,
        blobs: &std::collections::HashSet<Digest>,
    ) -> Plan {
        Plan {
            schema: PLAN_SCHEMA,
            manifest,
            command,
            entries: entries
                .into_iter()
                .filter(|e| blobs.contains(&e.blob))
                .collect(),
        }
    }

    /// Stores the plan and points its image at it; returns the plan's digest.
    pub fn put(&self, store: &Store) -> Result<Digest, PlanError> {
        put_pointed(store, &key::plan_of(&self.manifest), self)
    }

    /// The plan of the image with manifest `manifest`, if it has one (verified against its digest).
    pub fn get(store: &Store, manifest: &Digest) -> Result<Option<Plan>, PlanError> {
        let pointer = key::plan_of(manifest);
        let Some(plan) = get_pointed::<Plan>(store, &pointer)? else {
            return Ok(None);
        };
        if plan.schema != PLAN_SCHEMA || plan.manifest != *manifest {
            return Err(PlanError::Malformed {
                key: pointer,
                why: format!(
                    "schema {} for image {}, expected schema {PLAN_SCHEMA} for {manifest}",
                    plan.schema, plan.manifest
                ),
            });
        }
        Ok(Some(plan))
    }
}

/// Stores `v` as a content-addressed `plans/<digest>.json` and points the index object `pointer` at it;
/// returns the digest.
pub(crate) fn put_pointed<T: Serialize>(
    store: &Store,
    pointer: &str,
    v: &T,
) -> Result<Digest, PlanError> {
    let bytes = serde_json::to_vec(v).map_err(|e| PlanError::Malformed {
        key: pointer.to_string(),
        why: e.to_string(),
    })?;
    let d = Digest::of(&bytes);
    store.put_bytes(&key::plan(&d), bytes)?;
    store.put_index(pointer, d.to_string().into_bytes())?;
    Ok(d)
}

/// What the index object `pointer` names, read and verified against its digest (`None`: no pointer).
pub(crate) fn get_pointed<T: serde::de::DeserializeOwned>(
    store: &Store,
    pointer: &str,
) -> Result<Option<T>, PlanError> {
    match pointed(store, pointer)? {
        Some(d) => get_plan(store, pointer, &d).map(Some),
        None => Ok(None),
    }
}

/// The digest the index object `pointer` names (`None`: no pointer).
pub(crate) fn pointed(store: &Store, pointer: &str) -> Result<Option<Digest>, PlanError> {
    let Some(b) = store.get_index(pointer)? else {
        return Ok(None);
    };
    let bad = |why: String| PlanError::Malformed {
        key: pointer.to_string(),
        why,
    };
    let d: Digest = std::str::from_utf8(&b)
        .map_err(|e| bad(e.to_string()))?
        .trim()
        .parse()
        .map_err(|e| bad(format!("{e}")))?;
    Ok(Some(d))
}

/// Plan `d` (named by `pointer`), read and verified against its digest.
pub(crate) fn get_plan<T: serde::de::DeserializeOwned>(
    store: &Store,
    pointer: &str,
    d: &Digest,
) -> Result<T, PlanError> {
    let bytes = store.get_verified(&key::plan(d), d)?;
    serde_json::from_slice(&bytes).map_err(|e| PlanError::Malformed {
        key: pointer.to_string(),
        why: e.to_string(),
    })
}
