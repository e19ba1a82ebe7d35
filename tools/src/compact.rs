//! `strata gc --compact`: the command-line side of [`strata_builder::compact`].

use anyhow::Result;
use strata_builder::compact::{compact, CompactReport};
use strata_registry::store::Store;

use crate::exit::Usage;
use crate::images::human;

/// Compaction options of `strata gc`.
#[derive(clap::Args, Clone, Debug)]
pub struct CompactArgs {
    /// Before collecting, rewrite blobs whose live fraction is below --min-live into new blobs and
    /// re-point the live layers, manifests and tags at them (nothing readable changes).
    #[arg(long)]
    pub compact: bool,
    /// With --compact: rewrite a blob when less than this fraction of its bytes is live (0 to 1). The
    /// bound is per blob, so it caps the dead bytes kept at 1/min-live of the live ones: 0.8 keeps a store
    /// within 1.25x of its live data (0.5 would allow 2x).
    #[arg(long, default_value_t = 0.8, requires = "compact")]
    pub min_live: f64,
}

impl CompactArgs {
    /// Runs the compaction if asked (not in a dry run: it writes objects and moves tags).
    pub fn run(&self, store: &Store, dry_run: bool) -> Result<Option<CompactReport>> {
        if !self.compact {
            return Ok(None);
        }
        if !(0.0..=1.0).contains(&self.min_live) {
            return Err(Usage(format!("--min-live {} must be from 0 to 1", self.min_live)).into());
        }
        if dry_run {
            return Err(Usage(
                "--compact writes new objects and moves tags: not with --dry-run".into(),
            )
            .into());
        }
        Ok(Some(compact(store, self.min_live, 3)?))
    }
}

/// The human summary of a compaction.
pub fn summary(r: &CompactReport) -> String {
    let mut s = format!(
        "compacted {} of {} blobs ({} -> {}); re-pointed {} layers, {} manifests, moved {} tags in {:.1}s",
        r.compacted,
        r.blobs,
        human(r.bytes_before),
        human(r.bytes_after),
        r.layers,
        r.manifests,
        r.tags_moved,
        r.seconds
    );
    if !r.tags_skipped.is_empty() {
        s.push_str(&format!(
            "; left alone (moved meanwhile): {}",
            r.tags_skipped.join(", ")
        ));
    }
    s
}
