//! The daemon's side of prefetch: trace recording hooks and warming an image's plan when it is mounted.
//!
//! When a sandbox is requested, [`Warming::sandbox_requested`] looks (in a background thread: sandbox
//! creation never waits on it) for a prefetch plan of the sandbox's image in the store, at most once a
//! minute per image, and if there is one and it is not already being warmed, warms it with
//! [`strata_prefetch::warm`]: chunks fetched through the same [`Fetcher`] demand reads use, so they are
//! verified, cached, merged into range requests and shared with any demand read of the same chunk. Only
//! chunks of blobs the node serves are warmed; a plan entry naming an unknown chunk is skipped. Progress
//! shows in the status document and the metrics. The lookup starts as soon as the image's manifest is
//! known, while the layers are still being fetched and mounted, so that its round trips overlap the
//! mount's; warming itself starts once the plan's blobs are served. Recording ([`strata_prefetch::Recorder`]) lives in the
//! blob table, where the FUSE read path sees every chunk it touches.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_prefetch::{warm, ChunkSource, Plan, WarmOptions, WarmStats};
use strata_registry::digest::Digest;
use strata_registry::store::Store;

use crate::blobfs::BlobTable;
use crate::fetch::Fetcher;

/// How long a plan waits for its blobs to be served (the sandbox's layers mounted).
const BLOBS_WAIT: Duration = Duration::from_secs(60);

/// How often an image without a plan is looked up again.
const RECHECK: Duration = Duration::from_secs(60);

enum State {
    /// Looked up (or being looked up) at this time; no plan then.
    NoPlan(Instant),
    Warming(Arc<WarmStats>),
}

/// Plans being warmed, per image (manifest digest).
pub struct Warming {
    store: Arc<Store>,
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    opts: Option<WarmOptions>,
    images: Arc<Mutex<HashMap<Digest, State>>>,
}

/// Fetches plan chunks through the daemon's fetcher.
struct Source {
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
}

impl ChunkSource for Source {
    fn fetch(&self, blob: &Digest, chunks: &[u32]) -> Result<(u64, u64), String> {
        let h = self
            .table
            .handle(blob)
            .ok_or_else(|| format!("blob {blob} is not served"))?;
        let idx: Vec<usize> = chunks.iter().map(|&c| c as usize).collect();
        self.fetcher
            .fetch_chunks(&h, &idx)
            .map_err(|e| e.to_string())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Warming {
    /// `opts: None` turns warming off (tracing still works).
    pub fn new(
        store: Arc<Store>,
        table: Arc<BlobTable>,
        fetcher: Arc<Fetcher>,
        opts: Option<WarmOptions>,
    ) -> Warming {
        Warming {
            store,
            table,
            fetcher,
            opts,
            images: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A sandbox of image `manifest` is being created: warm its plan, if it has one and it is not
    /// warming, once the plan's blobs are served (or [`BLOBS_WAIT`] passed).
    pub fn sandbox_requested(&self, manifest: &Digest) {
        let Some(opts) = self.opts.clone() else {
            return;
        };
        {
            let mut images = lock(&self.images);
            match images.get(manifest) {
                Some(State::Warming(_)) => return,
                Some(State::NoPlan(t)) if t.elapsed() < RECHECK => return,
                _ => {}
            }
            images.insert(*manifest, State::NoPlan(Instant::now()));
        }
        let (store, images, m) = (self.store.clone(), self.images.clone(), *manifest);
        let fetcher = self.fetcher.clone();
        let src = Arc::new(Source {
            table: self.table.clone(),
            fetcher: self.fetcher.clone(),
        });
        let spawned = std::thread::Builder::new()
            .name("strata-plan".into())
            .spawn(move || {
                let plan = match Plan::get(&store, &m) {
                    Ok(Some(p)) => p,
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(image = %m, error = %e, "prefetch plan unreadable");
                        return;
                    }
                };
                let stats = Arc::new(WarmStats::default());
                tracing::info!(image = %m, chunks = plan.entries.len(), "warming prefetch plan");
                // While the plan is fetched, demand reads of its blobs fetch no further than their
                // own frame: the plan knows what will be read better than fetching ahead does.
                let mut blobs: Vec<Digest> = plan.entries.iter().map(|e| e.blob).collect();
                blobs.sort_unstable();
                blobs.dedup();
                if !src.table.wait_for(&blobs, BLOBS_WAIT) {
                    // A failed mount, or a plan naming a blob the image does not have: what is
                    // served is warmed, the rest skipped.
                    tracing::warn!(image = %m, "some blobs of the prefetch plan are not served");
                }
                fetcher.set_planned(&blobs, true);
                match warm(Arc::new(plan.entries), src, opts, stats.clone()) {
                    Ok(h) => {
                        lock(&images).insert(m, State::Warming(stats));
                        let _ = h.join();
                    }
                    Err(e) => tracing::warn!(image = %m, error = %e, "cannot start prefetch"),
                }
                fetcher.set_planned(&blobs, false);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start prefetch lookup");
        }
    }

    /// Per image: chunks planned, fetched, bytes, errors, done.
    pub fn status(&self) -> serde_json::Value {
        let images = lock(&self.images);
        let m: serde_json::Map<String, serde_json::Value> = images
            .iter()
            .filter_map(|(d, s)| match s {
                State::Warming(w) => Some((d.to_string(), serde_json::json!(w.as_ref()))),
                State::NoPlan(_) => None,
            })
            .collect();
        serde_json::Value::Object(m)
    }

    /// Totals over every image: (chunks fetched, bytes fetched).
    pub fn totals(&self) -> (u64, u64) {
        lock(&self.images)
            .values()
            .filter_map(|s| match s {
                State::Warming(w) => Some((
                    w.fetched.load(Ordering::Relaxed),
                    w.bytes.load(Ordering::Relaxed),
                )),
                State::NoPlan(_) => None,
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Stops every warming run (daemon shutdown).
    pub fn stop(&self) {
        for s in lock(&self.images).values() {
            if let State::Warming(w) = s {
                w.stop.store(true, Ordering::SeqCst);
            }
        }
    }
}
