//! Sandboxes: created, stopped, resumed, removed — and found again after a restart.
//!
//! A sandbox is an overlay of its image's layers (top first) with its own upper and work directories.
//! Its record ([`crate::control::state`]) is written before the overlay is mounted and outlives it: unmounting
//! (`strata umount`) stops a sandbox, leaving its upper directory for `pack_diff` and its record for
//! `strata ps`; only a purge (`strata rm`) deletes both.
//!
//! **Ids are safe to reuse.** An id whose upper directory is still there is never silently laid over
//! another image: the request must say [`Reuse::Resume`] (same image only: continue where it was) or
//! [`Reuse::Fresh`] (discard it). A purge refuses while processes still run in the rootfs, unless forced.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;

use crate::control::daemon::{detach, valid_id, Daemon, DaemonError, LayerMount};
use crate::control::state::{self, Sandbox, SandboxState};
use crate::mount;

/// What to do when the requested id still has a stopped sandbox's upper directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reuse {
    /// Refuse ([`DaemonError::Leftover`]).
    #[default]
    Refuse,
    /// Continue with it (the same image only).
    Resume,
    /// Delete it and start empty.
    Fresh,
}

fn io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What to do with what a stopped sandbox of the same id left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leftovers {
    /// Nothing is left: start empty.
    None,
    /// Continue with it.
    Resume,
    /// Delete it, then start empty.
    Discard,
}

/// Decides, for a request of `image` (`manifest`) under `id` with `reuse`, what happens to a stopped
/// sandbox's leftovers: its record `prior`, or files at the new sandbox's place (`files`). Refusals are
/// errors: leftovers without `resume` or `fresh`, or a resume of another image.
pub(crate) fn leftovers(
    id: &str,
    image: &str,
    manifest: &Digest,
    prior: Option<&Sandbox>,
    files: bool,
    reuse: Reuse,
) -> Result<Leftovers, DaemonError> {
    if prior.is_none() && !files {
        return Ok(Leftovers::None);
    }
    match (reuse, prior) {
        (Reuse::Refuse, _) => Err(DaemonError::Leftover {
            id: id.to_string(),
            image: prior.map(|p| p.image.clone()),
        }),
        (Reuse::Resume, Some(p)) if p.manifest != *manifest => Err(DaemonError::OtherImage {
            id: id.to_string(),
            was: p.image.clone(),
            was_manifest: p.manifest,
            image: image.to_string(),
        }),
        (Reuse::Resume, _) => Ok(Leftovers::Resume),
        (Reuse::Fresh, _) => Ok(Leftovers::Discard),
    }
}

/// Removes `dir` if it is empty (gone already is as good), and with `parent` its parent too if that
/// is left empty.
fn remove_empty_dir(dir: &Path, parent: bool) -> std::io::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    if let Some(p) = dir.parent().filter(|_| parent) {
        // Not empty (something else there) or gone: left as it is.
        let _ = std::fs::remove_dir(p);
    }
    Ok(())
}

/// Whether `dir` is a mount point (its device differs from its parent's).
pub(crate) fn is_mount(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::symlink_metadata(p).map(|m| m.dev()).ok();
    match (dev(dir), dir.parent().and_then(dev)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// Gives directory `dir` the owner, permissions and modification time of directory `from`.
pub(crate) fn root_attrs(from: &Path, dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(from)?;
    std::os::unix::fs::chown(dir, Some(m.uid()), Some(m.gid()))?;
    std::fs::set_permissions(dir, m.permissions())?;
    let f = std::fs::File::open(dir)?;
    f.set_times(std::fs::FileTimes::new().set_modified(m.modified()?))
}

impl Daemon {
    /// Creates a sandbox of `image`: an overlay rootfs with its own upper directory (in `dir`, or the
    /// state directory). `reuse` says what to do with a stopped sandbox of the same id.
    pub fn create_sandbox(
        &self,
        image: &str,
        id: &str,
        dir: Option<&Path>,
        reuse: Reuse,
    ) -> Result<Sandbox, DaemonError> {
        if !valid_id(id) {
            return Err(DaemonError::Invalid(format!(
                "sandbox id {id:?}: use 1 to 128 of [A-Za-z0-9._-], not starting with '.'"
            )));
        }
        let prior = self.lock().sandboxes.get(id).cloned();
        if prior
            .as_ref()
            .is_some_and(|p| p.state == SandboxState::Running)
        {
            return Err(DaemonError::SandboxExists(id.to_string()));
        }
        let started = std::time::Instant::now();
        let (manifest, m) = self.resolve(image)?;
        let base = match dir {
            Some(d) => d.to_path_buf(),
            None => self.config.state_dir.join("sandboxes").join(id),
        };
        let (mut upper, mut work) = (base.join("upper"), base.join("work"));
        if prior.as_ref().is_some_and(|p| p.vm.is_some()) && reuse == Reuse::Resume {
            return Err(DaemonError::Invalid(format!(
                "sandbox {id} is a microVM: resume it with `strata vm --resume`"
            )));
        }
        let left = leftovers(id, image, &manifest, prior.as_ref(), upper.exists(), reuse)?;
        match left {
            Leftovers::Resume => {
                if let (Some(p), None) = (&prior, dir) {
                    (upper, work) = (p.upper.clone(), p.work.clone());
                }
            }
            Leftovers::Discard => {
                if let Some(p) = &prior {
                    self.delete_sandbox_files(p)?;
                }
                self.delete_dirs(&upper, &work)?;
            }
            Leftovers::None => {}
        }
        // The plan's lookup overlaps the layers' fetch and mount.
        self.warming.sandbox_requested(&manifest);
        if left == Leftovers::None && dir.is_none() && self.pool.on() {
            if let Some(sb) = self.create_from_pool(image, id, manifest, &m)? {
                tracing::info!(
                    sandbox = id,
                    image,
                    ms = started.elapsed().as_millis() as u64,
                    "sandbox created (made ahead)"
                );
                return Ok(sb);
            }
        }
        let (mut lowers, acquired, image_bytes) = self.acquire_layers(&m.layers)?;
        let mut sb = self.new_record(id, image, manifest, &m, acquired.clone(), image_bytes);
        (sb.upper, sb.work) = (upper, work);
        // A resumed sandbox goes on counting.
        if let (Reuse::Resume, Some(p)) = (reuse, &prior) {
            sb.charged = p.charged;
        }
        lowers.reverse(); // overlay wants the top layer first
        if let Err(e) = self.mount_sandbox(&sb, &lowers) {
            self.release_all(&acquired);
            self.undo_create(&sb, left, prior.as_ref());
            return Err(e);
        }
        sb.root = state::root_key(&sb.rootfs);
        self.lock().sandboxes.insert(id.to_string(), sb.clone());
        self.pool.want(manifest, &m);
        tracing::info!(
            sandbox = id,
            image,
            ms = started.elapsed().as_millis() as u64,
            "sandbox created"
        );
        Ok(sb)
    }

    /// The record of sandbox `id` of `image` starting now on `layers`: running, in the default
    /// directories (`state_dir/sandboxes/<id>/{upper,work}`, `runtime_dir/sandboxes/<id>/rootfs`),
    /// nothing charged yet.
    fn new_record(
        &self,
        id: &str,
        image: &str,
        manifest: Digest,
        m: &strata_registry::model::Manifest,
        layers: Vec<Digest>,
        image_bytes: u64,
    ) -> Sandbox {
        let base = self.config.state_dir.join("sandboxes").join(id);
        Sandbox {
            id: id.to_string(),
            image: image.to_string(),
            manifest,
            layers,
            rootfs: self
                .config
                .runtime_dir
                .join("sandboxes")
                .join(id)
                .join("rootfs"),
            upper: base.join("upper"),
            work: base.join("work"),
            created: crate::control::state::unix_now(),
            image_bytes,
            state: SandboxState::Running,
            config: m.config.clone(),
            vm: None,
            charged: Default::default(),
            root: None,
        }
    }

    /// A sandbox of `manifest` for `id` made ahead ([`crate::control::pool`]), recorded and running;
    /// `None` when none was ready.
    fn create_from_pool(
        &self,
        image: &str,
        id: &str,
        manifest: Digest,
        m: &std::sync::Arc<strata_registry::model::Manifest>,
    ) -> Result<Option<Sandbox>, DaemonError> {
        let Some(taken) = self.take_ready(&manifest, id) else {
            return Ok(None);
        };
        // The pool is one short whether or not the sandbox is recorded below.
        self.pool.want(manifest, m);
        let mut sb = self.new_record(id, image, manifest, m, taken.layers, taken.image_bytes);
        if let Err(e) = self.node.save_sandbox(&sb) {
            if let (Some(state), Some(run)) = (sb.upper.parent(), sb.rootfs.parent()) {
                self.discard_made(&sb.layers, state, run);
            }
            return Err(e.into());
        }
        sb.root = state::root_key(&sb.rootfs);
        self.lock().sandboxes.insert(id.to_string(), sb.clone());
        Ok(Some(sb))
    }

    /// Undoes what a create that failed to mount `sb` left. A resume (`left`) puts the `prior`
    /// sandbox's record back, or removes the one it wrote, and keeps the upper and work directories:
    /// they hold what the sandbox wrote. Any other create removes its record and the directories it
    /// made, so a retry finds no leftover to resume or discard. Undoing is best effort, each step on
    /// its own (what made the create fail may make one of them fail too): what fails is logged, and
    /// the create's own error is what the caller reports.
    fn undo_create(&self, sb: &Sandbox, left: Leftovers, prior: Option<&Sandbox>) {
        let record = match (left, prior) {
            (Leftovers::Resume, Some(p)) => self.node.save_sandbox(p),
            _ => self.node.remove_sandbox(&sb.id),
        };
        let dirs = match left {
            Leftovers::Resume => Ok(()),
            Leftovers::None | Leftovers::Discard => self.delete_made_dirs(sb),
        };
        let rootfs = remove_empty_dir(&sb.rootfs, true).map_err(|e| io(&sb.rootfs, e));
        let steps = [record.map_err(DaemonError::from), dirs, rootfs];
        for e in steps.into_iter().filter_map(Result::err) {
            tracing::warn!(sandbox = %sb.id, error = %e, "cleaning up after a failed create");
        }
    }

    /// Deletes the upper and work directories a failed create made: to the trash in the state
    /// directory; in a directory the caller gave (`--upper`) only while empty, so nothing of theirs
    /// goes.
    fn delete_made_dirs(&self, sb: &Sandbox) -> Result<(), DaemonError> {
        let own = self.config.state_dir.join("sandboxes").join(&sb.id);
        if sb.upper.parent() == Some(own.as_path()) {
            return self.delete_dirs(&sb.upper, &sb.work);
        }
        for d in [&sb.upper, &sb.work] {
            remove_empty_dir(d, false).map_err(|e| io(d, e))?;
        }
        Ok(())
    }

    /// Makes the sandbox's directories, records it, mounts its overlay.
    fn mount_sandbox(&self, sb: &Sandbox, lowers: &[PathBuf]) -> Result<(), DaemonError> {
        let fresh = !sb.upper.exists();
        for p in [&sb.upper, &sb.work, &sb.rootfs] {
            std::fs::create_dir_all(p).map_err(|e| io(p, e))?;
        }
        // The overlay's root shows the upper directory's attributes: a new one takes the image's.
        if let (true, Some(top)) = (fresh, lowers.first()) {
            root_attrs(top, &sb.upper).map_err(|e| io(&sb.upper, e))?;
        }
        self.node.save_sandbox(sb)?;
        mount::mount_overlay(lowers, &sb.upper, &sb.work, &sb.rootfs)?;
        Ok(())
    }

    /// Deletes what a stopped sandbox keeps: its upper and work directories, or a VM's scratch image.
    pub(crate) fn delete_sandbox_files(&self, sb: &Sandbox) -> Result<(), DaemonError> {
        match sb.vm.is_some() {
            true => self.delete_files(sb),
            false => self.delete_dirs(&sb.upper, &sb.work),
        }
    }

    /// Moves a sandbox's upper and work directories to the trash: their parent at once if it is the
    /// sandbox's own directory in the state directory (left empty by them), else each of them.
    fn delete_dirs(&self, upper: &Path, work: &Path) -> Result<(), DaemonError> {
        let base = upper.parent().filter(|b| {
            Some(*b) == work.parent()
                && b.parent() == Some(&self.config.state_dir.join("sandboxes"))
        });
        let dirs = match base {
            Some(b) => vec![b],
            None => vec![upper, work],
        };
        for d in dirs {
            self.trash.discard(d).map_err(|e| io(d, e))?;
        }
        Ok(())
    }

    fn release_all(&self, layers: &[Digest]) {
        for l in layers {
            self.release_layer(l);
        }
    }

    /// Stops a sandbox: unmounts its rootfs (its upper directory and record stay, for `pack_diff`,
    /// `--resume` or a purge).
    pub fn remove_sandbox(&self, id: &str) -> Result<Sandbox, DaemonError> {
        let sb = self.stop(id)?;
        self.node.save_sandbox(&sb)?;
        tracing::info!(sandbox = id, "sandbox stopped");
        Ok(sb)
    }

    /// Unmounts a running sandbox (its rootfs directory to the trash) and marks it stopped, without
    /// recording that. The mark is taken under the lock first: of two concurrent stops, one does it.
    fn stop(&self, id: &str) -> Result<Sandbox, DaemonError> {
        let sb = {
            let mut st = self.lock();
            let sb = st
                .sandboxes
                .get_mut(id)
                .ok_or_else(|| DaemonError::NoSandbox(id.to_string()))?;
            if sb.state == SandboxState::Stopped {
                return Err(DaemonError::NotRunning(id.to_string()));
            }
            sb.state = SandboxState::Stopped;
            if let Some(k) = sb.root.take() {
                sb.charged += self.metrics.attribution.take(k);
            }
            sb.clone()
        };
        if sb.vm.is_some() {
            self.stop_vm(&sb);
        } else {
            if let Err(e) = mount::unmount(&sb.rootfs, true) {
                tracing::warn!(error = %e, sandbox = id, "unmounting rootfs");
            }
            // Never deleted through a mount: the directory goes once nothing is mounted on it.
            if !is_mount(&sb.rootfs) {
                let dir = sb.rootfs.parent().unwrap_or(&sb.rootfs);
                if let Err(e) = self.trash.discard(dir) {
                    tracing::warn!(error = %e, sandbox = id, "removing the rootfs directory");
                }
            }
            self.release_all(&sb.layers);
            self.drain_if_idle(&sb.manifest);
        }
        Ok(sb)
    }

    /// Removes a sandbox for good: stops it, deletes its upper and work directories and its record.
    /// Refuses while processes run in its rootfs, unless `force`.
    pub fn purge_sandbox(&self, id: &str, force: bool) -> Result<Sandbox, DaemonError> {
        let ids = [id.to_string()];
        let r = self.delete_sandboxes(&ids, crate::control::teardown::Teardown::Purge { force });
        r.into_iter()
            .next()
            .unwrap_or_else(|| Err(DaemonError::NoSandbox(id.to_string())))
    }

    /// [`Daemon::purge_sandbox`] once its processes were checked (or need not be).
    pub(crate) fn purge_unchecked(&self, id: &str) -> Result<Sandbox, DaemonError> {
        let sb = self
            .sandbox(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.to_string()))?;
        let sb = match sb.state {
            SandboxState::Running => self.stop(id)?,
            SandboxState::Stopped => sb,
        };
        self.delete_sandbox_files(&sb)?;
        self.node.remove_sandbox(id)?;
        self.lock().sandboxes.remove(id);
        tracing::info!(sandbox = id, "sandbox removed");
        Ok(sb)
    }

    /// Loads the recorded sandboxes: a sandbox runs if its rootfs is mounted. The layers of running
    /// sandboxes are counted and their blobs served (from kept descriptors and tables of contents, else
    /// the store); mounts under the runtime directory that nothing recorded uses are detached.
    pub(crate) fn restore(&self) -> Result<(), DaemonError> {
        let runtime = &self.config.runtime_dir;
        let mounted: HashSet<PathBuf> = state::mount_points(runtime).into_iter().collect();
        let (records, broken) = self.node.sandboxes();
        for e in broken {
            tracing::error!(error = %e, "sandbox record unreadable: kept, not listed");
        }
        let mut refs: std::collections::BTreeMap<Digest, usize> = Default::default();
        let mut vm_refs: std::collections::BTreeMap<Digest, usize> = Default::default();
        let mut st = self.lock();
        for mut sb in records {
            let recorded = sb.state;
            sb.state = match (&sb.vm, mounted.contains(&sb.rootfs)) {
                (Some(_), _) => crate::control::vm::restored_state(self.adopted, recorded),
                (None, true) => SandboxState::Running,
                (None, false) => SandboxState::Stopped,
            };
            if sb.vm.is_some() && sb.state != recorded {
                // Not seen from the mounts: a successor must not take this VM for running.
                if let Err(e) = self.node.save_sandbox(&sb) {
                    tracing::error!(error = %e, sandbox = sb.id, "recording a VM as stopped");
                }
            }
            if sb.state == SandboxState::Running {
                if sb.vm.is_none() {
                    sb.root = state::root_key(&sb.rootfs);
                }
                let counts = match sb.vm.is_some() {
                    true => &mut vm_refs,
                    false => &mut refs,
                };
                for l in &sb.layers {
                    *counts.entry(*l).or_default() += 1;
                }
            }
            st.sandboxes.insert(sb.id.clone(), sb);
        }
        self.count_holds(&mut refs);
        self.restore_vm_layers(&mut st, vm_refs);
        for (d, n) in refs {
            match self.serve_layer(&d) {
                Ok((blobs, bytes)) => {
                    let path = runtime.join("layers").join(d.hex());
                    // Mounted before: its view files are evicted from only if it was mounted
                    // with them watched (`fanotify::evict`).
                    let views_watched = crate::control::loops::watched_marker(&path).exists();
                    st.layers.insert(
                        d,
                        LayerMount {
                            refs: n,
                            path,
                            bytes,
                            blobs,
                            views_watched,
                        },
                    );
                }
                Err(e) => tracing::error!(layer = %d, error = %e,
                    "cannot serve a running sandbox's layer: its uncached reads fail"),
            }
        }
        let running: HashSet<&Path> = st
            .sandboxes
            .values()
            .filter(|s| s.state == SandboxState::Running && s.vm.is_none())
            .map(|s| s.rootfs.as_path())
            .collect();
        let layers: HashSet<&Path> = st.layers.values().map(|l| l.path.as_path()).collect();
        let stray: Vec<PathBuf> = mounted
            .iter()
            .filter(|p| {
                p.starts_with(runtime.join("sandboxes")) || p.starts_with(runtime.join("layers"))
            })
            .filter(|p| !running.contains(p.as_path()) && !layers.contains(p.as_path()))
            .cloned()
            .collect();
        detach(stray, "detaching a mount no sandbox uses");
        self.clear_pool();
        let n = st.sandboxes.len();
        tracing::info!(
            sandboxes = n,
            running = running.len(),
            adopted = self.adopted,
            "node state loaded"
        );
        Ok(())
    }

    /// Serves the blobs of an already mounted layer; returns them and the layer's stored bytes.
    pub(crate) fn serve_layer(&self, d: &Digest) -> Result<(Vec<Digest>, u64), DaemonError> {
        let desc = match self.node.layer(d) {
            Some(desc) => desc,
            None => self.store.get_layer(d)?,
        };
        for b in &desc.blobs {
            if self.table.contains(&b.digest) {
                continue;
            }
            self.table.add(self.blob_handle(b)?)?;
        }
        let bytes = desc.stored_bytes();
        Ok((desc.blobs.iter().map(|b| b.digest).collect(), bytes))
    }
}
