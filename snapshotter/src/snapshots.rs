//! The snapshotter's logic, apart from gRPC: containerd's snapshot model over plain directories and
//! stratad's layer mounts.
//!
//! **Plain layers** work as containerd's own overlayfs snapshotter: `Prepare` makes an empty upper
//! directory (a bind mount when there is no parent, else an overlay over the parents) that containerd's
//! unpacker writes the layer into, and `Commit` turns it into a committed snapshot, a lower of later
//! ones.
//!
//! **Strata layers** are never unpacked. When `Prepare`'s labels carry the target name
//! (`containerd.io/snapshot.ref`, what containerd will call the committed layer) and strata's
//! annotations ([`LAYER_LABEL`], [`STORE_LABEL`], which `strata export` writes on each layer
//! descriptor and containerd passes through), the snapshotter asks stratad for a hold on that layer's
//! mount, records a committed snapshot under the target name whose files are that mount, and answers
//! "already exists": containerd then skips the layer's download and unpack (the remote-snapshot
//! protocol stargz and nydus use). If stratad cannot serve it, the layer falls back to the plain path.
//! A container's snapshot is an overlay whose lowers are the parents' directories, strata mounts and
//! plain ones mixed, top first. Removing a strata snapshot drops the hold; stratad unmounts the layer
//! when nothing else uses it.
//!
//! **Restarts.** Overlays containerd mounted reference only directories and stratad's layer mounts,
//! never this process: the snapshotter can die and come back while containers run. On start,
//! [`Snapshots::reconcile`] compares its strata snapshots with stratad's holds under its prefix: a
//! hold no snapshot records is dropped (a removal interrupted), a snapshot without a hold takes it
//! again (a hold stratad lost).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use strata_registry::digest::Digest;

use crate::meta::{now, Kind, Meta, MetaError, Record, StrataLayer};
use crate::stratad::{holder, LayerError, LayerService, HOLDER_PREFIX};

/// The label naming the committed snapshot a `Prepare` is for (containerd's chain ID).
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";
/// The strata layer digest on a layer descriptor (written by `strata export`).
pub const LAYER_LABEL: &str = "containerd.io/snapshot/strata.layer";
/// The store URL the layer lives in.
pub const STORE_LABEL: &str = "containerd.io/snapshot/strata.store";

/// Errors, by what containerd should make of them (its errdefs).
#[derive(Debug, thiserror::Error)]
pub enum SnapError {
    #[error("snapshot {0} does not exist")]
    NotFound(String),
    #[error("snapshot {0} already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stratad: {0}")]
    Layer(#[from] LayerError),
}

fn io(path: &std::path::Path, source: std::io::Error) -> SnapError {
    SnapError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A mount, as containerd's `Mount` message carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// A snapshot's description (containerd's `Info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub parent: String,
    pub kind: Kind,
    pub created: u64,
    pub updated: u64,
    pub labels: BTreeMap<String, String>,
}

impl From<&Record> for Info {
    fn from(r: &Record) -> Info {
        Info {
            name: r.key.clone(),
            parent: r.parent.clone().unwrap_or_default(),
            kind: r.kind,
            created: r.created,
            updated: r.updated,
            labels: r.labels.clone(),
        }
    }
}

/// The snapshotter.
pub struct Snapshots {
    meta: Mutex<Meta>,
    layers: Box<dyn LayerService>,
}

impl Snapshots {
    pub fn new(meta: Meta, layers: Box<dyn LayerService>) -> Snapshots {
        Snapshots {
            meta: Mutex::new(meta),
            layers,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Prepare` (`view: false`) or `View`.
    pub fn prepare(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
        view: bool,
    ) -> Result<Vec<Mount>, SnapError> {
        if key.is_empty() {
            return Err(SnapError::InvalidArgument("empty snapshot key".into()));
        }
        let mut m = self.lock();
        if m.get(key).is_some() {
            return Err(SnapError::AlreadyExists(key.into()));
        }
        let parent = (!parent.is_empty()).then(|| parent.to_string());
        if let Some(p) = &parent {
            match m.get(p) {
                Some(r) if r.kind == Kind::Committed => {}
                Some(_) => {
                    let msg = format!("parent {p} is not committed");
                    return Err(SnapError::FailedPrecondition(msg));
                }
                None => return Err(SnapError::NotFound(p.clone())),
            }
        }
        if !view {
            if let Some(target) = self.remote(&mut m, key, parent.as_deref(), &labels)? {
                return Err(SnapError::AlreadyExists(target));
            }
        }
        let t = now();
        let r = Record {
            key: key.to_string(),
            id: m.new_id(),
            kind: if view { Kind::View } else { Kind::Active },
            parent,
            labels,
            created: t,
            updated: t,
            layer: None,
        };
        m.put(r.clone())?;
        mounts(&m, &r)
    }

    /// The strata path of `Prepare`: `Some(target)` when the layer is now a committed snapshot.
    fn remote(
        &self,
        m: &mut Meta,
        key: &str,
        parent: Option<&str>,
        labels: &BTreeMap<String, String>,
    ) -> Result<Option<String>, SnapError> {
        let (Some(target), Some(layer)) = (labels.get(TARGET_LABEL), labels.get(LAYER_LABEL))
        else {
            return Ok(None);
        };
        if m.get(target).is_some() {
            return Ok(Some(target.clone()));
        }
        let Ok(digest) = layer.parse::<Digest>() else {
            tracing::warn!(
                key,
                layer,
                "bad strata layer label: unpacking the layer instead"
            );
            return Ok(None);
        };
        let store = labels.get(STORE_LABEL).map(String::as_str);
        let path = match self.layers.hold(&digest, &holder(target), store) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(key, layer = %digest, error = %e,
                    "stratad cannot serve the layer: unpacking it instead");
                return Ok(None);
            }
        };
        let t = now();
        let r = Record {
            key: target.clone(),
            id: m.new_id(),
            kind: Kind::Committed,
            parent: parent.map(str::to_string),
            labels: labels.clone(),
            created: t,
            updated: t,
            layer: Some(StrataLayer { digest, path }),
        };
        if let Err(e) = m.put(r) {
            let _ = self.layers.release(&digest, &holder(target));
            return Err(e.into());
        }
        tracing::info!(target, layer = %digest, "strata layer mounted: download skipped");
        Ok(Some(target.clone()))
    }

    /// `Mounts` of an active snapshot or a view.
    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, SnapError> {
        let m = self.lock();
        let r = m.get(key).ok_or_else(|| SnapError::NotFound(key.into()))?;
        if r.kind == Kind::Committed {
            let msg = format!("{key} is committed: it has no mounts of its own");
            return Err(SnapError::FailedPrecondition(msg));
        }
        mounts(&m, r)
    }

    /// `Commit`: the active snapshot `key` becomes the committed `name`.
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(), SnapError> {
        let mut m = self.lock();
        let r = m.get(key).ok_or_else(|| SnapError::NotFound(key.into()))?;
        if r.kind != Kind::Active {
            let msg = format!("{key} is not active");
            return Err(SnapError::FailedPrecondition(msg));
        }
        if m.get(name).is_some() {
            return Err(SnapError::AlreadyExists(name.into()));
        }
        let mut c = r.clone();
        c.key = name.to_string();
        c.kind = Kind::Committed;
        c.labels = labels;
        c.updated = now();
        let work = m.dir(c.id).join("work");
        m.put(c)?;
        m.delete(key)?;
        let _ = std::fs::remove_dir_all(work);
        Ok(())
    }

    /// `Remove`: a snapshot without children; a strata layer's hold is dropped.
    pub fn remove(&self, key: &str) -> Result<(), SnapError> {
        let mut m = self.lock();
        if m.get(key).is_none() {
            return Err(SnapError::NotFound(key.into()));
        }
        if m.has_children(key) {
            let msg = format!("snapshot {key} has children");
            return Err(SnapError::FailedPrecondition(msg));
        }
        let Some(r) = m.delete(key)? else {
            return Ok(());
        };
        match &r.layer {
            Some(l) => {
                if let Err(e) = self.layers.release(&l.digest, &holder(key)) {
                    tracing::warn!(key, layer = %l.digest, error = %e,
                        "releasing the layer failed: released when the snapshotter next starts");
                }
            }
            None => remove_dir(&m.dir(r.id)),
        }
        Ok(())
    }

    /// `Stat`.
    pub fn stat(&self, key: &str) -> Result<Info, SnapError> {
        let m = self.lock();
        m.get(key)
            .map(Info::from)
            .ok_or_else(|| SnapError::NotFound(key.into()))
    }

    /// `Update`: only labels change (`paths` empty: all of them; `labels.<key>`: that one).
    pub fn update(
        &self,
        key: &str,
        labels: BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Info, SnapError> {
        let mut m = self.lock();
        let mut r = m
            .get(key)
            .cloned()
            .ok_or_else(|| SnapError::NotFound(key.into()))?;
        if paths.is_empty() || paths.iter().any(|p| p == "labels") {
            r.labels = labels;
        } else {
            for p in paths {
                let Some(k) = p.strip_prefix("labels.") else {
                    let msg = format!("cannot update field {p}");
                    return Err(SnapError::InvalidArgument(msg));
                };
                match labels.get(k) {
                    Some(v) => r.labels.insert(k.to_string(), v.clone()),
                    None => r.labels.remove(k),
                };
            }
        }
        r.updated = now();
        m.put(r.clone())?;
        Ok(Info::from(&r))
    }

    /// `List` (containerd's `Walk`): every snapshot. Filters are containerd's to apply (its metadata
    /// store walks its own records); a backend returns all.
    pub fn list(&self) -> Vec<Info> {
        self.lock().all().map(Info::from).collect()
    }

    /// `Usage`: bytes and inodes of the snapshot's own directory (0 for a strata layer: its data is
    /// the node cache's, shared and bounded).
    pub fn usage(&self, key: &str) -> Result<(u64, u64), SnapError> {
        let m = self.lock();
        let r = m.get(key).ok_or_else(|| SnapError::NotFound(key.into()))?;
        if r.layer.is_some() {
            return Ok((0, 0));
        }
        Ok(du(&m.dir(r.id).join("fs")))
    }

    /// `Cleanup`: removes directories no snapshot owns.
    pub fn cleanup(&self) {
        let m = self.lock();
        for p in m.orphans() {
            remove_dir(&p);
        }
    }

    /// Makes stratad's holds under this snapshotter's name match its strata snapshots.
    pub fn reconcile(&self) -> Result<(usize, usize), SnapError> {
        let holds = self.layers.holds()?;
        let m = self.lock();
        let mut dropped = 0;
        for h in holds.iter().filter(|h| h.holder.starts_with(HOLDER_PREFIX)) {
            let name = &h.holder[HOLDER_PREFIX.len()..];
            let recorded = m.get(name).and_then(|r| r.layer.as_ref());
            if recorded.is_none_or(|l| l.digest != h.digest) {
                self.layers.release(&h.digest, &h.holder)?;
                dropped += 1;
            }
        }
        let mut taken = 0;
        for r in m.all() {
            let Some(l) = &r.layer else { continue };
            let name = holder(&r.key);
            if !holds
                .iter()
                .any(|h| h.holder == name && h.digest == l.digest)
            {
                let path = self.layers.hold(&l.digest, &name, None)?;
                if path != l.path {
                    tracing::warn!(snapshot = r.key, was = %l.path.display(), now = %path.display(),
                        "stratad mounts the layer elsewhere now");
                }
                taken += 1;
            }
        }
        Ok((dropped, taken))
    }
}

fn remove_dir(p: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %p.display(), error = %e, "removing a snapshot directory");
        }
    }
}

/// Bytes and inodes under `dir` (not following links, each hard-linked inode once).
fn du(dir: &std::path::Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut inodes) = (0u64, 0u64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if seen.insert((md.dev(), md.ino())) {
                bytes += md.blocks() * 512;
                inodes += 1;
            }
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, inodes)
}

/// The lower directories of snapshot `r`'s parents, top first.
fn lowers(m: &Meta, r: &Record) -> Result<Vec<PathBuf>, SnapError> {
    let mut out = Vec::new();
    let mut next = r.parent.clone();
    while let Some(p) = next {
        let pr = m.get(&p).ok_or_else(|| SnapError::NotFound(p.clone()))?;
        out.push(match &pr.layer {
            Some(l) => l.path.clone(),
            None => m.dir(pr.id).join("fs"),
        });
        next = pr.parent.clone();
    }
    Ok(out)
}

/// The mounts of an active snapshot or a view (creating its directories if a crash lost them).
fn mounts(m: &Meta, r: &Record) -> Result<Vec<Mount>, SnapError> {
    let lower = lowers(m, r)?;
    let dir = m.dir(r.id);
    let (fs, work) = (dir.join("fs"), dir.join("work"));
    let bind = |p: &std::path::Path, ro: bool| Mount {
        kind: "bind".into(),
        source: p.display().to_string(),
        options: vec![if ro { "ro" } else { "rw" }.into(), "rbind".into()],
    };
    let lowerdir = || {
        let l: Vec<String> = lower.iter().map(|p| p.display().to_string()).collect();
        format!("lowerdir={}", l.join(":"))
    };
    let overlay = |options: Vec<String>| Mount {
        kind: "overlay".into(),
        source: "overlay".into(),
        options,
    };
    if r.kind == Kind::View {
        return Ok(vec![match lower.as_slice() {
            [] => {
                std::fs::create_dir_all(&fs).map_err(|e| io(&fs, e))?;
                bind(&fs, true)
            }
            [one] => bind(one, true),
            _ => overlay(vec![lowerdir()]),
        }]);
    }
    for d in [&fs, &work] {
        std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
    }
    if lower.is_empty() {
        return Ok(vec![bind(&fs, false)]);
    }
    Ok(vec![overlay(vec![
        format!("workdir={}", work.display()),
        format!("upperdir={}", fs.display()),
        lowerdir(),
    ])])
}

#[cfg(test)]
#[path = "snapshots_tests.rs"]
mod tests;
