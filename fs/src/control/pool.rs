//! Sandboxes made ahead (`sandbox_pool`): a create of an image that already has running sandboxes
//! takes one that is ready instead of making it.
//!
//! Making a sandbox is mostly the kernel's work — its directories (`mkdir`s that each allocate a
//! block) and its overlay mount (a work directory, private clones of the layers): ~0.4 of the 0.6 ms a
//! create takes (BENCHMARKS.md, eleventh session). With `sandbox_pool = N`, each image with running
//! sandboxes keeps up to N more ready on one background thread: layers acquired, upper and work
//! directories made (the upper with the image root's owner, mode and time), the overlay mounted —
//! under `state_dir/sandboxes/.pool/<slot>/` and `runtime_dir/sandboxes/.pool/<slot>/rootfs`. A
//! create that would start empty in the default directories takes one: two renames put its
//! directories where the sandbox's belong (a mount moves with a directory renamed above it; the same
//! filesystems, so a rename), its record is written, and the thread makes the next one.
//!
//! **Nothing ready outlives the need.** When an image's last running sandbox stops, its ready ones
//! are unmounted and deleted and their layers released by that stop, so a layer still goes when its
//! last sandbox does. One the thread is making meanwhile is thrown away when it is done (it checks,
//! under the pool's lock, that the image still runs before it keeps one). A pool sandbox is never
//! recorded: a server that starts (after a crash, a restart or an upgrade) detaches every mount under
//! `runtime_dir` that no record names, and deletes both `.pool` directories ([`Daemon::clear_pool`]).
//!
//! Measured (`benches/clirate.py --pool 8`): creates through the socket 1,336–1,415/s without,
//! 2,521–3,131/s with; a pooled create 0.35–0.37 ms (BENCHMARKS.md, twenty-second session).
//!
//! What the pool does not take: a request with its own `dir`, or whose id has a stopped sandbox's
//! leftovers (resume or fresh), or a microVM: those are made as before. The overlay's mount options
//! keep naming the pool's upper directory (`/proc/mounts`); the record names the right one.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use strata_registry::digest::Digest;
use strata_registry::model::Manifest;

use crate::control::daemon::{Daemon, DaemonError};
use crate::control::state::SandboxState;
use crate::mount;

/// The pool's directory under `state_dir/sandboxes` and `runtime_dir/sandboxes` (never an id: ids
/// do not start with a dot).
pub const POOL_DIR: &str = ".pool";

/// One sandbox made ahead: its layers (acquired for it) and the image's stored bytes.
struct Ready {
    slot: u64,
    layers: Vec<Digest>,
    image_bytes: u64,
}

#[derive(Default)]
struct State {
    ready: HashMap<Digest, Vec<Ready>>,
    /// Images to top up, with their manifests, in the order asked (each once).
    wanted: VecDeque<(Digest, Arc<Manifest>)>,
    next_slot: u64,
}

/// The sandboxes made ahead, per manifest (see the module documentation).
#[derive(Default)]
pub struct Pool {
    /// Ready sandboxes kept per image (0: no pool).
    size: usize,
    state: Mutex<State>,
    wake: Condvar,
}

/// A sandbox taken from the pool: where its directories are now, its layers and the image's bytes.
pub(crate) struct Taken {
    pub layers: Vec<Digest>,
    pub image_bytes: u64,
}

impl Pool {
    pub fn new(size: usize) -> Pool {
        Pool {
            size,
            state: Mutex::default(),
            wake: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether sandboxes are made ahead at all.
    pub fn on(&self) -> bool {
        self.size > 0
    }

    /// Asks the thread to top up `manifest`'s ready sandboxes.
    pub(crate) fn want(&self, manifest: Digest, m: &Arc<Manifest>) {
        if !self.on() {
            return;
        }
        let mut st = self.lock();
        st.wanted.retain(|(d, _)| *d != manifest);
        st.wanted.push_back((manifest, m.clone()));
        drop(st);
        self.wake.notify_one();
    }

    fn pop(&self, manifest: &Digest) -> Option<Ready> {
        self.lock().ready.get_mut(manifest)?.pop()
    }

    /// Ready sandboxes per manifest, for the status.
    pub fn status(&self) -> serde_json::Value {
        let st = self.lock();
        let ready: serde_json::Map<String, serde_json::Value> = st
            .ready
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(d, v)| (d.to_string(), v.len().into()))
            .collect();
        serde_json::json!({ "size": self.size, "ready": ready })
    }
}

impl Daemon {
    /// Slot `slot`'s directories: `(state side, runtime side)`.
    fn slot_dirs(&self, slot: u64) -> (PathBuf, PathBuf) {
        let at = |d: &Path| d.join("sandboxes").join(POOL_DIR).join(slot.to_string());
        (at(&self.config.state_dir), at(&self.config.runtime_dir))
    }

    /// Takes a ready sandbox of `manifest` for `id`: its directories renamed to `id`'s (state side
    /// holding `upper/` and `work/`, runtime side `rootfs/`, mounted). `None` when none is ready or it
    /// could not be moved (then it is thrown away, and the caller makes the sandbox as usual).
    pub(crate) fn take_ready(&self, manifest: &Digest, id: &str) -> Option<Taken> {
        let r = self.pool.pop(manifest)?;
        let (state, run) = self.slot_dirs(r.slot);
        let to_state = self.config.state_dir.join("sandboxes").join(id);
        let to_run = self.config.runtime_dir.join("sandboxes").join(id);
        if let Err(e) = std::fs::rename(&state, &to_state) {
            tracing::warn!(sandbox = id, error = %e, "a ready sandbox could not be taken: made anew");
            self.discard_ready(r, &state, &run);
            return None;
        }
        if let Err(e) = std::fs::rename(&run, &to_run) {
            tracing::warn!(sandbox = id, error = %e, "a ready sandbox could not be taken: made anew");
            let back = std::fs::rename(&to_state, &state);
            let state = if back.is_ok() { state } else { to_state };
            self.discard_ready(r, &state, &run);
            return None;
        }
        Some(Taken {
            layers: r.layers,
            image_bytes: r.image_bytes,
        })
    }

    /// Unmounts and deletes a ready sandbox whose directories are `state` and `run`, and releases its
    /// layers.
    fn discard_ready(&self, r: Ready, state: &Path, run: &Path) {
        self.discard_made(&r.layers, state, run);
    }

    /// Unmounts and deletes a sandbox made but not recorded — its directories `state` (holding
    /// `upper/` and `work/`) and `run` (holding `rootfs/`) — and releases its `layers`.
    pub(crate) fn discard_made(&self, layers: &[Digest], state: &Path, run: &Path) {
        let rootfs = run.join("rootfs");
        if let Err(e) = mount::unmount(&rootfs, true) {
            tracing::warn!(error = %e, path = %rootfs.display(), "unmounting a ready sandbox");
        }
        // Never deleted through a mount (that would whiteout the image in its upper directory).
        let run = (!crate::control::sandboxes::is_mount(&rootfs)).then_some(run);
        for d in std::iter::once(state).chain(run) {
            if let Err(e) = self.trash.discard(d) {
                tracing::warn!(error = %e, path = %d.display(), "deleting a ready sandbox");
            }
        }
        for l in layers {
            self.release_layer(l);
        }
    }

    /// Makes one sandbox of `m` ahead, in a new slot.
    fn make_ready(&self, m: &Manifest) -> Result<Ready, DaemonError> {
        let slot = {
            let mut st = self.pool.lock();
            st.next_slot += 1;
            st.next_slot
        };
        let (state, run) = self.slot_dirs(slot);
        let (mut lowers, layers, image_bytes) = self.acquire_layers(&m.layers)?;
        lowers.reverse(); // overlay wants the top layer first
        let r = Ready {
            slot,
            layers,
            image_bytes,
        };
        let (upper, work, rootfs) = (state.join("upper"), state.join("work"), run.join("rootfs"));
        let made = (|| {
            for p in [&upper, &work, &rootfs] {
                std::fs::create_dir_all(p).map_err(|e| DaemonError::Io {
                    path: p.clone(),
                    source: e,
                })?;
            }
            if let Some(top) = lowers.first() {
                crate::control::sandboxes::root_attrs(top, &upper).map_err(|e| {
                    DaemonError::Io {
                        path: upper.clone(),
                        source: e,
                    }
                })?;
            }
            mount::mount_overlay(&lowers, &upper, &work, &rootfs)?;
            Ok(())
        })();
        match made {
            Ok(()) => Ok(r),
            Err(e) => {
                self.discard_ready(r, &state, &run);
                Err(e)
            }
        }
    }

    /// Whether `manifest` has a running (non-VM) sandbox.
    fn runs(&self, manifest: &Digest) -> bool {
        self.lock()
            .sandboxes
            .values()
            .any(|s| s.manifest == *manifest && s.state == SandboxState::Running && s.vm.is_none())
    }

    /// Drains the ready sandboxes of `manifest` if none of its sandboxes runs any more (called by
    /// each stop, so that the layers go with the last sandbox).
    pub(crate) fn drain_if_idle(&self, manifest: &Digest) {
        if !self.pool.on() || self.runs(manifest) {
            return;
        }
        let gone = self.pool.lock().ready.remove(manifest).unwrap_or_default();
        for r in gone {
            let (state, run) = self.slot_dirs(r.slot);
            self.discard_ready(r, &state, &run);
        }
    }

    /// Tops `manifest`'s ready sandboxes up to the pool's size while it has running ones. Returns
    /// whether it stopped early for another image waiting (this one is then to be topped up again).
    fn top_up(&self, manifest: &Digest, m: &Manifest) -> bool {
        loop {
            let have = self.pool.lock().ready.get(manifest).map_or(0, Vec::len);
            if have >= self.pool.size || !self.runs(manifest) {
                return false;
            }
            let r = match self.make_ready(m) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(manifest = %manifest, error = %e, "a sandbox could not be made ahead");
                    return false;
                }
            };
            // Kept only while the image runs, checked under the pool's lock: a stop that drained the
            // image meanwhile marked its last sandbox stopped first, so either this sees it, or the
            // drain (which takes the lock after) takes this one too.
            let mut st = self.pool.lock();
            if !self.runs(manifest) {
                drop(st);
                let (state, run) = self.slot_dirs(r.slot);
                self.discard_ready(r, &state, &run);
                return false;
            }
            st.ready.entry(*manifest).or_default().push(r);
            if !st.wanted.is_empty() {
                return true;
            }
        }
    }

    /// Starts the pool's thread (with `sandbox_pool` > 0).
    pub(crate) fn start_pool(self: &Arc<Self>) {
        if !self.pool.on() {
            return;
        }
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("strata-pool".into())
            .spawn(move || pool_thread(weak));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to make sandboxes ahead: each is made on request");
        }
    }

    /// Unmounts and deletes every ready sandbox (the node is torn down).
    pub(crate) fn drain_pool(&self) {
        let all: Vec<Ready> = self
            .pool
            .lock()
            .ready
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for r in all {
            let (state, run) = self.slot_dirs(r.slot);
            self.discard_ready(r, &state, &run);
        }
    }

    /// Deletes what a previous server's pool left (its mounts were detached with the other
    /// unrecorded ones by [`Daemon::restore`]).
    pub(crate) fn clear_pool(&self) {
        for root in [&self.config.state_dir, &self.config.runtime_dir] {
            let dir = root.join("sandboxes").join(POOL_DIR);
            if !dir.exists() {
                continue;
            }
            if let Err(e) = self.trash.discard(&dir) {
                tracing::warn!(error = %e, path = %dir.display(), "deleting an earlier server's ready sandboxes");
            }
        }
    }
}

/// The pool's thread: tops up the images asked for, one sandbox at a time each while several wait;
/// ends with the daemon.
fn pool_thread(daemon: std::sync::Weak<Daemon>) {
    loop {
        let Some(d) = daemon.upgrade() else { return };
        let work = {
            let mut st = d.pool.lock();
            loop {
                if d.metrics.attribution.is_retired() {
                    return;
                }
                if let Some(w) = st.wanted.pop_front() {
                    break w;
                }
                // Woken by a request; the timeout lets a daemon that went away end this.
                st = d
                    .pool
                    .wake
                    .wait_timeout(st, std::time::Duration::from_secs(1))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        };
        let (manifest, m) = work;
        if d.top_up(&manifest, &m) {
            // Others wait: back in line, after them.
            d.pool.want(manifest, &m);
        }
    }
}
