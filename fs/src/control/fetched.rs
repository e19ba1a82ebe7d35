//! Bytes fetched and reads' waits per sandbox, on the node's side: the data plane charges misses and
//! waits to readers' roots ([`crate::attribution`]); here those counts are read for the API and folded
//! into the sandboxes' records — every few seconds, when a sandbox stops, and before an upgrade or
//! restart hands the node on — so the figures survive a successor and a restart. Also the image sizes
//! `strata ps` shows.

use super::daemon::Daemon;
use super::state::Sandbox;
use crate::attribution::Charge;

/// Seconds between two writes of the counts into the sandboxes' records.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

impl Daemon {
    /// What sandbox `sb`'s reads cost the node: what its record holds (as the node has it now, if it is
    /// still there) and what was charged since.
    pub fn charged_to(&self, sb: &Sandbox) -> Charge {
        let st = self.lock();
        let cur = st.sandboxes.get(&sb.id).unwrap_or(sb);
        let mut c = cur.charged;
        if let Some(k) = cur.root {
            c += self.metrics.attribution.peek(k);
        }
        c
    }

    /// Bytes fetched for misses of no running sandbox (see the module documentation).
    pub fn fetched_unattributed(&self) -> u64 {
        let st = self.lock();
        let roots: std::collections::HashSet<crate::attribution::RootKey> =
            st.sandboxes.values().filter_map(|s| s.root).collect();
        self.metrics.attribution.unattributed(|k| roots.contains(k))
    }

    /// Moves the counts charged since the last flush into the running sandboxes' records, and writes
    /// those records. Nothing is written when nothing was charged.
    pub fn flush_fetched(&self) {
        let a = &self.metrics.attribution;
        if !a.changed_since_last_look() {
            return;
        }
        let changed: Vec<Sandbox> = {
            let mut st = self.lock();
            st.sandboxes
                .values_mut()
                .filter_map(|s| {
                    let c = a.take(s.root?);
                    s.charged += c;
                    (c != Charge::default()).then(|| s.clone())
                })
                .collect()
        };
        for s in changed {
            if let Err(e) = self.node.save_sandbox(&s) {
                tracing::warn!(sandbox = s.id, error = %e, "recording bytes fetched");
            }
        }
    }

    /// Flushes the counts every [`FLUSH_EVERY`] while the daemon lives and serves.
    pub(crate) fn start_flushing(self: &std::sync::Arc<Self>) {
        let weak = std::sync::Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("strata-fetched".into())
            .spawn(move || loop {
                std::thread::sleep(FLUSH_EVERY);
                match weak.upgrade() {
                    Some(d) if !d.metrics.attribution.is_retired() => d.flush_fetched(),
                    _ => return,
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to record bytes fetched: recorded at stops only");
        }
    }

    /// The last flush of this process: before a successor takes the node over (nothing is charged
    /// here after it, and nothing is written: the records are the successor's).
    pub(crate) fn retire_fetched(&self) {
        self.flush_fetched();
        self.metrics.attribution.retire();
    }

    /// Stored bytes of the image of manifest `m` as `strata images` counts them
    /// ([`strata_registry::store::Store::image_size`]), asked of the store once per image; `None` when
    /// not known yet and `compute` is false, or when the store cannot say.
    pub fn image_bytes(&self, m: &strata_registry::digest::Digest, compute: bool) -> Option<u64> {
        if let Some(n) = self.lock().image_sizes.get(m) {
            return Some(*n);
        }
        if !compute {
            return None;
        }
        let manifest = self.store.get_manifest(m).ok()?;
        let (stored, _) = self.store.image_size(&manifest).ok()?;
        self.lock().image_sizes.insert(*m, stored);
        Some(stored)
    }
}
