//! The snapshotter's metadata: one JSON record per snapshot, crash-safe.
//!
//! ```text
//! <root>/metadata/<digest of the key>.json   the snapshot's record (key, id, kind, parent, labels, …)
//! <root>/snapshots/<id>/fs                   a plain snapshot's files (an active one's upper directory)
//! <root>/snapshots/<id>/work                 overlay's work directory of an active snapshot
//! ```
//!
//! Every record is written whole under a temporary name and renamed over the old one (the node state's
//! [`write_atomic`]), so a kill leaves the old or the new version. The order of steps makes every crash
//! recoverable on load: a record is written before its directories exist (a record whose directories
//! are missing gets them again when mounted); a commit writes the committed record before it removes
//! the active one (both surviving under one id: the committed one wins); a removal deletes the record
//! before the directories ([`Meta::orphans`] finds what is left, and ids are never handed out again
//! while such a directory exists). All records are loaded at start and kept in memory; containerd
//! keeps a few hundred snapshots per node, so no database is needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use strata_fs::state::{write_atomic, StateError};
use strata_registry::digest::Digest;

/// Errors of the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    State(#[from] StateError),
}

fn io(path: &Path, source: std::io::Error) -> MetaError {
    MetaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A snapshot's kind, as containerd names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    View,
    Active,
    Committed,
}

/// A layer served by stratad (a committed snapshot containerd never unpacked).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrataLayer {
    pub digest: Digest,
    /// Where stratad mounted it.
    pub path: PathBuf,
}

/// One snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The key (active, view) or name (committed).
    pub key: String,
    /// Names its directories under `snapshots/`.
    pub id: u64,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Nanoseconds since the epoch.
    pub created: u64,
    pub updated: u64,
    /// Set for a strata layer: no directories of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<StrataLayer>,
}

/// Now, in nanoseconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The records, in memory, mirrored on disk.
pub struct Meta {
    root: PathBuf,
    records: BTreeMap<String, Record>,
    next_id: u64,
}

impl Meta {
    /// Opens (creating) the store under `root` and loads every record.
    pub fn open(root: &Path) -> Result<Meta, MetaError> {
        for d in ["metadata", "snapshots"] {
            let p = root.join(d);
            std::fs::create_dir_all(&p).map_err(|e| io(&p, e))?;
        }
        let dir = root.join("metadata");
        let mut loaded: Vec<Record> = Vec::new();
        for p in std::fs::read_dir(&dir)
            .map_err(|e| io(&dir, e))?
            .flatten()
            .map(|e| e.path())
        {
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match std::fs::read(&p).map(|b| serde_json::from_slice::<Record>(&b)) {
                Ok(Ok(r)) => loaded.push(r),
                Ok(Err(e)) => {
                    tracing::error!(path = %p.display(), error = %e, "snapshot record unreadable: kept, not listed")
                }
                Err(e) => {
                    tracing::error!(path = %p.display(), error = %e, "snapshot record unreadable: kept, not listed")
                }
            }
        }
        let mut meta = Meta {
            root: root.to_path_buf(),
            records: BTreeMap::new(),
            next_id: 1,
        };
        // A commit interrupted after writing the committed record: the active one it replaced goes.
        let committed: std::collections::HashSet<u64> = loaded
            .iter()
            .filter(|r| r.kind == Kind::Committed && r.layer.is_none())
            .map(|r| r.id)
            .collect();
        for r in loaded {
            if r.kind == Kind::Active && committed.contains(&r.id) {
                meta.delete_file(&r.key)?;
                continue;
            }
            meta.next_id = meta.next_id.max(r.id + 1);
            meta.records.insert(r.key.clone(), r);
        }
        for (id, _) in meta.dirs() {
            meta.next_id = meta.next_id.max(id + 1);
        }
        Ok(meta)
    }

    fn record_path(&self, key: &str) -> PathBuf {
        let name = Digest::of(key.as_bytes());
        self.root
            .join("metadata")
            .join(format!("{}.json", name.hex()))
    }

    fn delete_file(&self, key: &str) -> Result<(), MetaError> {
        let p = self.record_path(key);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&p, e)),
            _ => Ok(()),
        }
    }

    /// A snapshot's directory (`fs` and `work` are under it).
    pub fn dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// The snapshot directories on disk, by id.
    fn dirs(&self) -> Vec<(u64, PathBuf)> {
        let dir = self.root.join("snapshots");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
            .collect()
    }

    /// Snapshot directories no record names (left by a removal or a prepare a crash interrupted).
    pub fn orphans(&self) -> Vec<PathBuf> {
        let used: std::collections::HashSet<u64> = self.records.values().map(|r| r.id).collect();
        self.dirs()
            .into_iter()
            .filter(|(id, _)| !used.contains(id))
            .map(|(_, p)| p)
            .collect()
    }

    /// A new id, never used by a record or a directory.
    pub fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub fn get(&self, key: &str) -> Option<&Record> {
        self.records.get(key)
    }

    /// Every record, by key.
    pub fn all(&self) -> impl Iterator<Item = &Record> {
        self.records.values()
    }

    /// Whether some snapshot has `key` as its parent.
    pub fn has_children(&self, key: &str) -> bool {
        self.records
            .values()
            .any(|r| r.parent.as_deref() == Some(key))
    }

    /// Writes a record (new or replacing one with the same key).
    pub fn put(&mut self, r: Record) -> Result<(), MetaError> {
        let p = self.record_path(&r.key);
        let bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
        write_atomic(&p, &bytes)?;
        self.records.insert(r.key.clone(), r);
        Ok(())
    }

    /// Forgets a record (its directories are the caller's to remove).
    pub fn delete(&mut self, key: &str) -> Result<Option<Record>, MetaError> {
        self.delete_file(key)?;
        Ok(self.records.remove(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, id: u64, kind: Kind) -> Record {
        Record {
            key: key.into(),
            id,
            kind,
            parent: None,
            labels: BTreeMap::new(),
            created: 1,
            updated: 1,
            layer: None,
        }
    }

    #[test]
    fn records_survive_a_reopen() {
        let t = tempfile::tempdir().unwrap();
        let mut m = Meta::open(t.path()).unwrap();
        let id = m.new_id();
        m.put(record("a/b c", id, Kind::Active)).unwrap();
        let m = Meta::open(t.path()).unwrap();
        assert_eq!(m.get("a/b c").unwrap().id, id);
    }

    #[test]
    fn an_interrupted_commit_keeps_the_committed_record() {
        let t = tempfile::tempdir().unwrap();
        let mut m = Meta::open(t.path()).unwrap();
        m.put(record("active", 7, Kind::Active)).unwrap();
        m.put(record("done", 7, Kind::Committed)).unwrap();
        let m = Meta::open(t.path()).unwrap();
        assert!(m.get("active").is_none());
        assert_eq!(m.get("done").unwrap().kind, Kind::Committed);
    }

    #[test]
    fn ids_of_orphaned_directories_are_not_reused() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("snapshots/41/fs")).unwrap();
        let mut m = Meta::open(t.path()).unwrap();
        assert_eq!(m.orphans(), vec![t.path().join("snapshots/41")]);
        assert_eq!(m.new_id(), 42);
    }
}
