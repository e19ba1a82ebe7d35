//! strata's data prefetch: trace recording, plans, background warming.
//!
//! A lazily mounted image costs one store round trip per first read of a chunk; a cold start that reads
//! a few hundred chunks one after another pays that latency a few hundred times. Prefetch removes most of
//! it for runs that are known in advance:
//!
//! 1. **Trace** (`strata trace IMAGE -- CMD`): while a [`Recorder`] is on, the daemon's blob server notes
//!    every chunk a read touches, first touch only, in order. The node's page cache must be cold for the
//!    trace to be complete (the CLI drops it).
//! 2. **Plan** ([`Plan`]): the recorded `(blob, chunk)` list, stored with the image: a content-addressed
//!    `plans/<digest>.json` and an index object `plans/by-manifest/<manifest>` naming it (the store layout
//!    is in `docs/FORMAT.md`).
//! 3. **Warm** ([`warm`]): when a sandbox of an image with a plan is created, the daemon fetches the plan's
//!    chunks in the background, in plan order, with a few threads and under a bandwidth cap, skipping
//!    chunks already cached. Demand reads never queue behind it: they fetch on their own threads, and
//!    when one needs a chunk prefetch is already fetching, it waits for that one fetch (single flight)
//!    rather than starting another.
//!
//! 4. **Layer plans** ([`layerplan`]): every recorded run is also merged into the plans of the layers it
//!    read from, so that a sandbox of an image that has no plan of its own — a new workspace on a traced
//!    base — warms what is known of each of its layers. A layer with no plan yet (a rebuilt base: a new
//!    digest, mostly the old base's chunks, found in its blob by store-wide dedup) takes, by content,
//!    what the plans of its blobs say of them (`plans/by-blob/`, [`layerplan::inherited`]).
//!
//! This crate knows nothing of FUSE or of the cache's layout: the daemon gives [`warm`] a [`ChunkSource`].

pub mod layerplan;
pub mod plan;
pub mod recorder;
pub mod warm;

pub use layerplan::LayerPlan;
pub use plan::{Plan, PlanEntry, PlanError};
pub use recorder::Recorder;
pub use warm::{warm, ChunkSource, WarmOptions, WarmStats};
