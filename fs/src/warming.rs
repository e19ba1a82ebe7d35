//! The daemon's side of prefetch: trace recording hooks and warming an image's plan when it is mounted.
//!
//! When a sandbox is requested, [`Warming::sandbox_requested`] looks (in a background thread: sandbox
//! creation never waits on it) for a prefetch plan of the sandbox's image in the store — the image's own,
//! else the plans of its layers ([`strata_prefetch::layerplan`]: a new workspace on a traced base
//! inherits the base's) — at most once a minute per image, and if there is one and it is not already
//! being warmed, warms it with
//! [`strata_prefetch::warm`]: chunks fetched through the same [`Fetcher`] demand reads use, so they are
//! verified, cached, merged into range requests and shared with any demand read of the same chunk. Only
//! chunks of blobs the node serves are warmed; a plan entry naming an unknown chunk is skipped. Progress
//! shows in the status document and the metrics.
//!
//! **Recorded plans** (opt-in, `record_plans_secs`): when an image has no plan, the node records the chunks
//! read during the first seconds after its sandbox was requested, with the same recorder `strata trace`
//! uses, and stores them as the image's plan if it still has none, so that every other node starts the
//! image warm; the run is also merged into the plans of the layers it read from. Only chunks of the
//! image's own blobs go in; a plan holds chunk references, never data, and
//! warming verifies every chunk, so a sandbox can at worst make a plan useless, not wrong. An explicit
//! `strata trace` takes the recorder over (the recording is dropped); one recording runs at a time.
//!
//! The lookup starts as soon as the image's manifest is
//! known, while the layers are still being fetched and mounted, so that its round trips overlap the
//! mount's; warming itself starts once the plan's blobs are served. Recording ([`strata_prefetch::Recorder`]) lives in the
//! blob table, where the FUSE read path sees every chunk it touches.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_prefetch::{layerplan, warm, ChunkSource, Plan, PlanEntry, WarmOptions, WarmStats};
use strata_registry::digest::Digest;
use strata_registry::store::Store;

use crate::blobfs::BlobTable;
use crate::fetch::{FetchError, Fetcher};

/// How long a plan waits for its blobs to be served (the sandbox's layers mounted).
const BLOBS_WAIT: Duration = Duration::from_secs(60);

/// How often an image without a plan is looked up again.
const RECHECK: Duration = Duration::from_secs(60);

enum State {
    /// Looked up (or being looked up) at this time; no plan then.
    NoPlan(Instant),
    Warming(Arc<WarmStats>, PlanSource),
}

/// Where the chunks being warmed come from.
#[derive(Clone, Debug)]
enum PlanSource {
    /// The image's own plan.
    Image,
    /// The plans of these layers of the image (it has none of its own).
    Layers(Vec<Digest>),
}

impl std::fmt::Display for PlanSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanSource::Image => f.write_str("image"),
            PlanSource::Layers(l) => write!(f, "{} layer plan(s)", l.len()),
        }
    }
}

/// The chunks to warm for image `m` — its own plan, else its layers' — or `None`. Without an image plan,
/// starts recording one when `record` says so.
fn find_plan(
    store: &Arc<Store>,
    table: &Arc<BlobTable>,
    recording: &Arc<Mutex<Option<Digest>>>,
    m: Digest,
    record: Option<Duration>,
) -> Option<(Vec<PlanEntry>, PlanSource)> {
    match Plan::get(store, &m) {
        Ok(Some(p)) => return Some((p.entries, PlanSource::Image)),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(image = %m, error = %e, "prefetch plan unreadable");
            return None;
        }
    }
    if let Some(window) = record {
        let (store, table, recording) = (store.clone(), table.clone(), recording.clone());
        let spawned = std::thread::Builder::new()
            .name("strata-record".into())
            .spawn(move || record_plan(&store, &table, &recording, m, window));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start plan recording");
        }
    }
    let layers: Vec<Digest> = match store.get_manifest(&m) {
        Ok(manifest) => manifest.layers.iter().map(|l| l.digest).collect(),
        Err(e) => {
            tracing::warn!(image = %m, error = %e, "manifest unreadable for layer plans");
            return None;
        }
    };
    let blobs_of = |l: &Digest| {
        let desc = store.get_layer(l)?;
        Ok(desc.blobs.iter().map(|b| b.digest).collect())
    };
    match layerplan::inherited(store, &layers, blobs_of) {
        Ok((entries, planned)) if !entries.is_empty() => {
            Some((entries, PlanSource::Layers(planned)))
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(image = %m, error = %e, "layer plans unreadable");
            None
        }
    }
}

/// Plans being warmed, per image (manifest digest).
pub struct Warming {
    store: Arc<Store>,
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    opts: Option<WarmOptions>,
    images: Arc<Mutex<HashMap<Digest, State>>>,
    /// How long to record an image without a plan (`None`: never).
    record: Option<Duration>,
    /// The image being recorded.
    recording: Arc<Mutex<Option<Digest>>>,
}

/// Fetches plan chunks through the daemon's fetcher.
struct Source {
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
}

impl ChunkSource for Source {
    type Error = FetchError;

    fn fetch(&self, blob: &Digest, chunks: &[u32]) -> Result<(u64, u64), FetchError> {
        let h = self
            .table
            .handle(blob)
            .ok_or(FetchError::NotServed { blob: *blob })?;
        let idx: Vec<usize> = chunks.iter().map(|&c| c as usize).collect();
        self.fetcher.fetch_chunks(&h, &idx)
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
        record: Option<Duration>,
    ) -> Warming {
        Warming {
            store,
            table,
            fetcher,
            opts,
            images: Arc::new(Mutex::new(HashMap::new())),
            record,
            recording: Arc::new(Mutex::new(None)),
        }
    }

    /// The image whose plan is being recorded, if any.
    pub fn recording(&self) -> Option<Digest> {
        *lock(&self.recording)
    }

    /// Drops a recording in progress (an explicit trace takes the recorder, or the daemon stops).
    pub fn cancel_recording(&self) {
        if let Some(m) = lock(&self.recording).take() {
            self.table.trace.stop();
            tracing::info!(image = %m, "plan recording dropped");
        }
    }

    /// A sandbox of image `manifest` is being created: warm its plan, if it has one and it is not
    /// warming, once the plan's blobs are served (or [`BLOBS_WAIT`] passed).
    pub fn sandbox_requested(&self, manifest: &Digest) {
        let (opts, record) = (self.opts.clone(), self.record);
        if opts.is_none() && record.is_none() {
            return;
        }
        {
            let mut images = lock(&self.images);
            match images.get(manifest) {
                Some(State::Warming(..)) => return,
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
        let recording = self.recording.clone();
        let spawned = std::thread::Builder::new()
            .name("strata-plan".into())
            .spawn(move || {
                let Some((entries, source)) = find_plan(&store, &src.table, &recording, m, record)
                else {
                    return;
                };
                let Some(opts) = opts else {
                    return;
                };
                let stats = Arc::new(WarmStats::default());
                tracing::info!(image = %m, chunks = entries.len(), source = %source, "warming prefetch plan");
                // While the plan is fetched, demand reads of its blobs fetch no further than their
                // own frame: the plan knows what will be read better than fetching ahead does.
                let mut blobs: Vec<Digest> = entries.iter().map(|e| e.blob).collect();
                blobs.sort_unstable();
                blobs.dedup();
                if !src.table.wait_for(&blobs, BLOBS_WAIT) {
                    // A failed mount, or a plan naming a blob the image does not have: what is
                    // served is warmed, the rest skipped.
                    tracing::warn!(image = %m, "some blobs of the prefetch plan are not served");
                }
                fetcher.set_planned(&blobs, true);
                match warm(Arc::new(entries), src, opts, stats.clone()) {
                    Ok(h) => {
                        lock(&images).insert(m, State::Warming(stats, source));
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
                State::Warming(w, source) => {
                    let mut v = serde_json::json!(w.as_ref());
                    let (kind, layers) = match source {
                        PlanSource::Image => ("image", vec![]),
                        PlanSource::Layers(l) => {
                            ("layers", l.iter().map(|d| d.to_string()).collect())
                        }
                    };
                    v["source"] = kind.into();
                    v["layers"] = layers.into();
                    Some((d.to_string(), v))
                }
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
                State::Warming(w, _) => Some((
                    w.fetched.load(Ordering::Relaxed),
                    w.bytes.load(Ordering::Relaxed),
                )),
                State::NoPlan(_) => None,
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Stops every warming run and drops a recording (daemon shutdown).
    pub fn stop(&self) {
        self.cancel_recording();
        for s in lock(&self.images).values() {
            if let State::Warming(w, _) = s {
                w.stop.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// Records the chunks read during `window` as image `m`'s plan and stores it if the image still has none
/// (see the module documentation). Returns at once if the recorder is taken.
fn record_plan(
    store: &Store,
    table: &BlobTable,
    recording: &Mutex<Option<Digest>>,
    m: Digest,
    window: Duration,
) {
    {
        let mut r = lock(recording);
        if r.is_some() || !table.trace.start() {
            return;
        }
        *r = Some(m);
    }
    tracing::info!(image = %m, seconds = window.as_secs_f64(), "recording a prefetch plan");
    let end = Instant::now() + window;
    while Instant::now() < end {
        if *lock(recording) != Some(m) {
            return; // taken over
        }
        std::thread::sleep(
            Duration::from_millis(100).min(end.saturating_duration_since(Instant::now())),
        );
    }
    let entries = {
        let r = lock(recording);
        if *r != Some(m) {
            return;
        }
        table.trace.stop()
    };
    // `recording` names the image until its plan is stored (the status document shows it).
    match store_recorded(store, m, entries, window) {
        Ok(Some((d, n))) => {
            tracing::info!(image = %m, plan = %d, chunks = n, "prefetch plan recorded")
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(image = %m, error = %e, "recorded prefetch plan not stored"),
    }
    let mut r = lock(recording);
    if *r == Some(m) {
        *r = None;
    }
}

/// Stores recorded entries (those of image `m`'s blobs) as its plan unless it has one by now or nothing
/// of it was read; the plan's digest and length.
fn store_recorded(
    store: &Store,
    m: Digest,
    entries: Vec<PlanEntry>,
    window: Duration,
) -> Result<Option<(Digest, usize)>, strata_prefetch::plan::PlanError> {
    let manifest = store.get_manifest(&m)?;
    let mut blobs = std::collections::HashSet::new();
    let mut layers = Vec::new();
    for l in &manifest.layers {
        let desc = store.get_layer(&l.digest)?;
        blobs.extend(desc.blobs.iter().map(|b| b.digest));
        layers.push((l.digest, desc));
    }
    layerplan::record_run(store, &layers, &entries)?;
    let command = format!(
        "(recorded by stratad: the first {} s of a sandbox)",
        window.as_secs_f64()
    );
    let plan = Plan::recorded(m, vec![command], entries, &blobs);
    if plan.entries.is_empty() || Plan::get(store, &m)?.is_some() {
        return Ok(None);
    }
    let n = plan.entries.len();
    Ok(Some((plan.put(store)?, n)))
}
