//! The layer service: named holds on layer mounts, apart from sandboxes.
//!
//! A sandbox takes its image's layers and builds its own overlay; a containerd snapshotter only needs
//! the layers themselves (containerd mounts the overlay) and names them one at a time. So the daemon
//! offers layer mounts on their own: `POST /v1/layers {"digest", "holder", "store"?}` mounts the layer
//! if needed (the very mount sandboxes share: one per node, one page-cache copy, the same chunk cache)
//! and records a *hold* on it; `DELETE /v1/layers/<digest>?holder=<name>` drops the hold;
//! `GET /v1/layers` lists every hold. A holder is a name its owner can find again after a restart
//! (`snapshotter:<snapshot name>`): a hold taken twice under one name is one hold, so a client that
//! crashed between asking and recording can simply ask again, and reconcile by listing.
//!
//! **Durable.** Holds are records in `<state>/node/holds/` (one file each, written atomically before
//! the reply; removed after the layer is released), counted into the layers' references when a
//! daemon starts ([`Daemon::count_holds`]): a successor that adopted the node finds the mounts still
//! there; a daemon that started a fresh node mounts every held layer again
//! ([`Daemon::remount_held_layers`]) at the same path, so a client's recorded path stays valid.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;

use crate::control::daemon::{Daemon, DaemonError};
use crate::control::state::StateError;

/// A named hold on a layer mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub digest: Digest,
    pub holder: String,
    /// Where the layer is mounted.
    pub path: PathBuf,
}

/// Serializes taking and dropping holds (one hold per name even when a client asks twice at once).
/// Process-wide: holds are rare next to reads, and a daemon's struct stays as it is.
static HOLDS: Mutex<()> = Mutex::new(());

/// Longest holder name.
const MAX_HOLDER: usize = 1024;

fn holds_dir(d: &Daemon) -> PathBuf {
    d.config.state_dir.join("node").join("holds")
}

/// A hold's record file: named by a digest of holder and layer (holders are free-form text).
fn hold_path(dir: &Path, digest: &Digest, holder: &str) -> PathBuf {
    let name = Digest::of(format!("{holder}\n{digest}").as_bytes());
    dir.join(format!("{}.json", name.hex()))
}

fn state_io(path: &Path, source: std::io::Error) -> DaemonError {
    DaemonError::State(StateError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Every recorded hold (records that do not parse are reported and kept).
fn read_holds(dir: &Path) -> Vec<Hold> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut holds = Vec::new();
    for p in entries.flatten().map(|e| e.path()) {
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        match std::fs::read(&p).map(|b| serde_json::from_slice::<Hold>(&b)) {
            Ok(Ok(h)) => holds.push(h),
            Ok(Err(e)) => {
                tracing::error!(path = %p.display(), error = %e, "layer hold unreadable: kept")
            }
            Err(e) => {
                tracing::error!(path = %p.display(), error = %e, "layer hold unreadable: kept")
            }
        }
    }
    holds.sort_by(|a, b| (&a.holder, a.digest).cmp(&(&b.holder, b.digest)));
    holds
}

impl Daemon {
    /// Takes `holder`'s hold on layer `digest` (mounting it if no one uses it): its mount point. A
    /// hold already taken under that name is returned as it is. `store` is where the asker saw the
    /// layer; a daemon serves one store, and looks there (a digest names the same layer anywhere).
    pub fn hold_layer(
        &self,
        digest: &Digest,
        holder: &str,
        store: Option<&str>,
    ) -> Result<Hold, DaemonError> {
        if holder.is_empty() || holder.len() > MAX_HOLDER || holder.contains('\0') {
            return Err(DaemonError::Invalid(format!(
                "holder must be 1 to {MAX_HOLDER} bytes without NUL"
            )));
        }
        if let Some(s) =
            store.filter(|s| s.trim_end_matches('/') != self.config.store.trim_end_matches('/'))
        {
            // Layers are named by their content: this store's copy, if it has one, is the same layer.
            tracing::debug!(layer = %digest, asked = s, serving = self.config.store,
                "layer asked for from another store: looking in this one");
        }
        let dir = holds_dir(self);
        std::fs::create_dir_all(&dir).map_err(|e| state_io(&dir, e))?;
        let record = hold_path(&dir, digest, holder);
        // One hold per name: serialized with layer mounts so two equal requests take one reference.
        let _g = HOLDS.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(Ok(h)) = std::fs::read(&record).map(|b| serde_json::from_slice::<Hold>(&b)) {
            if self.lock().layers.contains_key(digest) {
                return Ok(h);
            }
        }
        let (path, _) = self.acquire_layer(digest)?;
        let hold = Hold {
            digest: *digest,
            holder: holder.to_string(),
            path,
        };
        let bytes = serde_json::to_vec_pretty(&hold).unwrap_or_default();
        if let Err(e) = crate::control::state::write_atomic(&record, &bytes) {
            self.release_layer(digest);
            return Err(e.into());
        }
        Ok(hold)
    }

    /// Drops `holder`'s hold on layer `digest` (unmounting it if no one else uses it); `None`: there
    /// was no such hold.
    pub fn release_hold(&self, digest: &Digest, holder: &str) -> Result<Option<Hold>, DaemonError> {
        let record = hold_path(&holds_dir(self), digest, holder);
        let _g = HOLDS.lock().unwrap_or_else(|p| p.into_inner());
        let hold = match std::fs::read(&record) {
            Ok(b) => serde_json::from_slice::<Hold>(&b).map_err(|e| {
                DaemonError::State(StateError::Parse {
                    path: record.clone(),
                    source: e,
                })
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(state_io(&record, e)),
        };
        std::fs::remove_file(&record).map_err(|e| state_io(&record, e))?;
        self.release_layer(digest);
        Ok(Some(hold))
    }

    /// Every hold on the node.
    pub fn holds(&self) -> Vec<Hold> {
        read_holds(&holds_dir(self))
    }

    /// Adds one reference per recorded hold to `refs` (a starting daemon's count of layer users).
    pub(crate) fn count_holds(&self, refs: &mut BTreeMap<Digest, usize>) {
        for h in self.holds() {
            *refs.entry(h.digest).or_default() += 1;
        }
    }

    /// Mounts again every held layer whose mount is gone (a fresh node: the daemon and its descriptor
    /// holder both died, or the machine rebooted), at the same path. Called once the blob server runs:
    /// the kernel opens the layer's blob files while mounting.
    pub(crate) fn remount_held_layers(&self) {
        let held: HashSet<Digest> = self.holds().into_iter().map(|h| h.digest).collect();
        let mounted: HashSet<PathBuf> =
            crate::control::state::mount_points(&self.config.runtime_dir.join("layers"))
                .into_iter()
                .collect();
        for d in held {
            let refs = {
                let mut st = self.lock();
                match st.layers.get(&d) {
                    Some(l) if mounted.contains(&l.path) => continue,
                    Some(_) => st.layers.remove(&d).map_or(1, |l| l.refs),
                    None => 1,
                }
            };
            match self.acquire_layer(&d) {
                Ok((path, _)) => {
                    if let Some(l) = self.lock().layers.get_mut(&d) {
                        l.refs = refs;
                    }
                    tracing::info!(layer = %d, path = %path.display(), "held layer mounted again");
                }
                Err(e) => tracing::error!(layer = %d, error = %e,
                    "cannot mount a held layer again: its holders' mounts fail"),
            }
        }
    }
}

/// The body of `POST /v1/layers`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldRequest {
    digest: Digest,
    holder: String,
    #[serde(default)]
    store: Option<String>,
}

/// `POST /v1/layers`: status and JSON reply.
pub(crate) fn hold_route(d: &Daemon, body: &[u8]) -> (u16, serde_json::Value) {
    use crate::control::api::{error_json, failure, ErrorKind};
    let r: HoldRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            let msg = format!("need {{\"digest\", \"holder\", \"store\"?}}: {e}");
            return failure(ErrorKind::Invalid, &msg);
        }
    };
    match d.hold_layer(&r.digest, &r.holder, r.store.as_deref()) {
        Ok(h) => (200, serde_json::json!(h)),
        Err(e) => error_json(&e),
    }
}

/// `DELETE /v1/layers/<digest>?holder=<percent-encoded name>`: status and JSON reply.
pub(crate) fn release_route(d: &Daemon, digest: &str, query: &str) -> (u16, serde_json::Value) {
    use crate::control::api::{error_json, failure, ErrorKind};
    let holder = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("holder="))
        .map(percent_decode);
    let (Ok(digest), Some(Some(holder))) = (digest.parse::<Digest>(), holder) else {
        return failure(ErrorKind::Invalid, "need a layer digest and ?holder=");
    };
    match d.release_hold(&digest, &holder) {
        Ok(Some(h)) => (200, serde_json::json!(h)),
        Ok(None) => failure(
            ErrorKind::NotFound,
            &format!("no hold of {holder} on layer {digest}"),
        ),
        Err(e) => error_json(&e),
    }
}

/// Decodes `%XX` escapes (and `+` as a space); `None` for a bad escape or bytes that are not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Encodes everything but unreserved characters as `%XX` (for `?holder=`).
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (c as char).to_string()
            }
            c => format!("%{c:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_names_round_trip_through_a_query() {
        for name in ["snapshotter:default/12/sha256:ab cd", "a+b%c", "é"] {
            assert_eq!(percent_decode(&percent_encode(name)).as_deref(), Some(name));
        }
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%zz"), None);
    }

    #[test]
    fn hold_records_are_named_per_holder_and_layer() {
        let d1 = Digest::of(b"one");
        let d2 = Digest::of(b"two");
        let dir = Path::new("/x");
        assert_ne!(hold_path(dir, &d1, "a"), hold_path(dir, &d2, "a"));
        assert_ne!(hold_path(dir, &d1, "a"), hold_path(dir, &d1, "b"));
        assert_eq!(hold_path(dir, &d1, "a"), hold_path(dir, &d1, "a"));
    }
}
