//! Store-wide dedup on the command line: the options builds share, and `strata index`.

use std::path::PathBuf;

use anyhow::Result;
use serde_json::json;
use strata_builder::BuildOptions;
use strata_registry::index::cache::{self, IndexCache};
use strata_registry::store::Store;

/// Store-wide dedup options of `build` and `import`.
#[derive(clap::Args, Clone, Debug)]
pub struct DedupArgs {
    /// Store only chunks the parents hold (no store-wide index lookup).
    #[arg(long)]
    pub no_dedup: bool,
    /// Directory of the local index caches (default: ~/.cache/strata/index).
    #[arg(long, env = "STRATA_INDEX_CACHE")]
    pub index_cache: Option<PathBuf>,
    /// Cap on the blobs of other builds one layer may reference (more devices per mount).
    #[arg(long, default_value_t = strata_builder::dedup::MAX_FOREIGN_BLOBS)]
    pub max_foreign_blobs: usize,
    /// A blob of another build that would give the layer fewer bytes than this is not referenced: its
    /// chunks are stored again.
    #[arg(long, default_value_t = strata_builder::dedup::MIN_FOREIGN_BYTES)]
    pub min_foreign_bytes: u64,
}

impl DedupArgs {
    /// Sets the store-wide dedup fields of `opts`.
    pub fn apply(&self, opts: &mut BuildOptions) {
        opts.index = (!self.no_dedup).then(|| self.dir());
        opts.max_foreign_blobs = self.max_foreign_blobs;
        opts.min_foreign_bytes = self.min_foreign_bytes;
    }

    fn dir(&self) -> PathBuf {
        self.index_cache.clone().unwrap_or_else(cache::default_dir)
    }
}

/// `strata index`.
#[derive(clap::Subcommand)]
pub enum IndexCmd {
    /// Bring this machine's index cache up to date with the store (`--backfill`: first write the index
    /// segments of blobs that have none, e.g. stored before the index existed).
    Sync {
        #[arg(long)]
        backfill: bool,
        /// Delete the cache first and rebuild it from the store.
        #[arg(long)]
        rebuild: bool,
        /// Directory of the local index caches (default: ~/.cache/strata/index).
        #[arg(long, env = "STRATA_INDEX_CACHE")]
        index_cache: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

/// Runs `strata index`.
pub fn index(store: &Store, cmd: IndexCmd) -> Result<()> {
    let IndexCmd::Sync {
        backfill,
        rebuild,
        index_cache,
        json,
    } = cmd;
    let dir = index_cache.unwrap_or_else(cache::default_dir);
    let mut backfilled = 0u64;
    if backfill {
        let have: std::collections::HashSet<_> = store.list_segments()?.into_iter().collect();
        for k in store.list("blobs")? {
            let Some(d) = k
                .strip_prefix("blobs/")
                .and_then(|h| strata_registry::digest::Digest::from_hex(h).ok())
            else {
                continue;
            };
            if !have.contains(&d) && store.backfill_segment(&d)? {
                backfilled += 1;
            }
        }
    }
    let path = cache::store_dir(&dir, store);
    if rebuild && path.exists() {
        std::fs::remove_dir_all(&path)?;
    }
    let (_, r) = IndexCache::sync_and_open(store, &dir)?;
    if json {
        println!(
            "{}",
            json!({"cache": path, "backfilled": backfilled, "sync": r})
        );
    } else {
        println!(
            "{}: {} segments ({} fetched, {} chunks added, {} blobs dead), {} backfilled, in {:.1}s",
            path.display(),
            r.segments,
            r.fetched,
            r.chunks,
            r.dead,
            backfilled,
            r.seconds
        );
    }
    Ok(())
}
