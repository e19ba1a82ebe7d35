//! The node's durable state: what a restarted or successor daemon needs that a crash forgot.
//!
//! ```text
//! <state>/node/sandboxes/<id>.json   one record per sandbox (running or left over)
//! <state>/node/layers/<hex>.json     descriptor of each layer the node mounted
//! <state>/node/tocs/<hex>            each served blob's table of contents (named by its digest)
//! ```
//!
//! **Crash-safe.** Every file is written whole to a temporary name and renamed over the old one, so a
//! kill at any moment leaves the old or the new version, never a torn one; a record that still fails to
//! parse (a disk that lost it) is reported and kept, never deleted. A sandbox's record is written before
//! its overlay is mounted and removed only after its directories are, so no mount exists without one.
//!
//! **Running or stopped is seen, not trusted from the record.** A sandbox runs when its rootfs is mounted
//! (`/proc/self/mountinfo`); after a crash of the whole node or of both the daemon and its descriptor
//! holder, its mounts are gone and it is listed as stopped with its upper directory intact.
//!
//! **No store needed to resume.** Layer descriptors and tables of contents are kept here (tables of
//! contents verified against their digests when read back), so a successor serves the blobs of every
//! running sandbox before it talks to the store at all — with the store down, cached data keeps flowing.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_registry::digest::Digest;
use strata_registry::model::{BlobRef, ImageConfig, LayerDescriptor};
use strata_registry::toc::Toc;

/// Errors reading or writing the node's state.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("node state {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("node state {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

fn io(path: &Path, source: std::io::Error) -> StateError {
    StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether a sandbox's rootfs is mounted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    #[default]
    Running,
    /// Not mounted: its upper directory is left for `pack_diff`, `--resume` or `strata rm`.
    Stopped,
}

/// A sandbox, as recorded on disk and reported by the API.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub image: String,
    pub manifest: Digest,
    /// Layers bottom first.
    pub layers: Vec<Digest>,
    pub rootfs: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub created: u64,
    /// Stored bytes of the image (metadata and blobs).
    pub image_bytes: u64,
    #[serde(default)]
    pub state: SandboxState,
    /// The image's config (what a process started in the sandbox should get; records written before
    /// configs were kept read as empty).
    #[serde(default)]
    pub config: ImageConfig,
    /// A microVM sandbox's drives (`None`: a container sandbox, with an overlay rootfs). For a VM,
    /// `upper` is its scratch image and `work` the directory holding it; `rootfs` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<crate::control::vm::VmDrives>,
    /// What this sandbox's reads cost the node — compressed bytes fetched for its misses
    /// (`fetched_bytes`) and microseconds they waited for chunks not in the cache (`read_wait_us`) — up
    /// to the last time the daemon wrote the record ([`crate::attribution`]; the API adds what was
    /// counted since).
    #[serde(flatten)]
    pub charged: crate::attribution::Charge,
    /// Its rootfs's device and inode while it runs (what its processes have as their root).
    #[serde(skip)]
    pub root: Option<RootKey>,
}

/// The state directory's `node/` part.
pub struct NodeState {
    dir: PathBuf,
}

/// Seconds since the Unix epoch (a record's `created`).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Threads reading sandbox records at start.
const READERS: usize = 16;

fn read_record(p: &Path) -> Result<Sandbox, StateError> {
    let b = std::fs::read(p).map_err(|e| io(p, e))?;
    serde_json::from_slice::<Sandbox>(&b).map_err(|e| StateError::Parse {
        path: p.to_path_buf(),
        source: e,
    })
}

/// Writes `bytes` to `path` so that a crash leaves the old or the new content. The file is 0600 from
/// its creation: records hold image configs (an image's env may carry secrets), never for other users.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let how = strata_registry::fsutil::Atomic {
        mode: 0o600,
        sync: false,
    };
    strata_registry::fsutil::write_atomic(path, bytes, how).map_err(|e| io(path, e))
}

impl NodeState {
    /// Opens (creating) `<state_dir>/node`.
    pub fn open(state_dir: &Path) -> Result<NodeState, StateError> {
        let dir = state_dir.join("node");
        for d in ["sandboxes", "layers", "tocs"] {
            let p = dir.join(d);
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&p)
                .map_err(|e| io(&p, e))?;
        }
        Ok(NodeState { dir })
    }

    fn sandbox_path(&self, id: &str) -> PathBuf {
        self.dir.join("sandboxes").join(format!("{id}.json"))
    }

    /// Records a sandbox (replacing its record).
    pub fn save_sandbox(&self, sb: &Sandbox) -> Result<(), StateError> {
        let p = self.sandbox_path(&sb.id);
        let bytes = serde_json::to_vec_pretty(sb).map_err(|e| StateError::Parse {
            path: p.clone(),
            source: e,
        })?;
        write_atomic(&p, &bytes)
    }

    /// Forgets a sandbox.
    pub fn remove_sandbox(&self, id: &str) -> Result<(), StateError> {
        let p = self.sandbox_path(id);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&p, e)),
            _ => Ok(()),
        }
    }

    /// Every recorded sandbox, and the records that could not be read. Records are read by several
    /// threads: a successor reads them all before it serves, and with the page cache cold each is a disk
    /// read (measured: ~80 µs a record one at a time, 0.8 s for 10,000 sandboxes).
    pub fn sandboxes(&self) -> (Vec<Sandbox>, Vec<StateError>) {
        let dir = self.dir.join("sandboxes");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) => return (Vec::new(), vec![io(&dir, e)]),
        };
        let paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        let per = paths.len().div_ceil(READERS).max(1);
        let parsed: Vec<Result<Sandbox, StateError>> = std::thread::scope(|s| {
            let handles: Vec<_> = paths
                .chunks(per)
                .map(|part| {
                    s.spawn(move || part.iter().map(|p| read_record(p)).collect::<Vec<_>>())
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let (mut good, mut bad) = (Vec::new(), Vec::new());
        for r in parsed {
            match r {
                Ok(sb) => good.push(sb),
                Err(e) => bad.push(e),
            }
        }
        good.sort_by(|a, b| a.id.cmp(&b.id));
        (good, bad)
    }

    /// Keeps a layer's descriptor.
    pub fn save_layer(&self, d: &Digest, desc: &LayerDescriptor) -> Result<(), StateError> {
        let p = self.dir.join("layers").join(format!("{}.json", d.hex()));
        let bytes = serde_json::to_vec(desc).map_err(|e| StateError::Parse {
            path: p.clone(),
            source: e,
        })?;
        write_atomic(&p, &bytes)
    }

    /// A layer's kept descriptor, if any.
    pub fn layer(&self, d: &Digest) -> Option<LayerDescriptor> {
        let p = self.dir.join("layers").join(format!("{}.json", d.hex()));
        let b = std::fs::read(p).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Keeps a blob's table of contents.
    pub fn save_toc(&self, b: &BlobRef, toc: &Toc) -> Result<(), StateError> {
        let p = self.dir.join("tocs").join(b.toc_digest.hex());
        if p.exists() {
            return Ok(());
        }
        write_atomic(&p, &toc.encode())
    }

    /// A blob's kept table of contents, if present and intact.
    pub fn toc(&self, b: &BlobRef) -> Option<Toc> {
        let p = self.dir.join("tocs").join(b.toc_digest.hex());
        let bytes = std::fs::read(p).ok()?;
        if !b.toc_digest.matches(&bytes) {
            tracing::warn!(blob = %b.digest, "kept table of contents fails its digest; refetching");
            return None;
        }
        Toc::decode(&bytes).ok()
    }
}

/// Mount points at or below `under`, from `/proc/self/mountinfo`, in mount order (a point mounted over
/// twice is listed twice).
pub fn mount_points(under: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(under))
        .collect()
}

pub use crate::attribution::{process_root, root_key, RootKey};

/// The processes (other than this one) whose root directory is one `wanted` accepts, by root: one
/// scan of `/proc` for any number of roots.
pub fn pids_by_root(
    wanted: impl Fn(RootKey) -> bool,
) -> std::io::Result<std::collections::HashMap<RootKey, Vec<i32>>> {
    let me = std::process::id() as i32;
    let mut out: std::collections::HashMap<RootKey, Vec<i32>> = Default::default();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // A process may exit while we look: skip it.
        match process_root(pid as u32) {
            Some(k) if pid != me && wanted(k) => out.entry(k).or_default().push(pid),
            _ => {}
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
    }
    Ok(out)
}

/// The processes (other than this one) whose root directory is `rootfs`.
pub fn sandbox_pids(rootfs: &Path) -> std::io::Result<Vec<i32>> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(rootfs)?;
    let key = (m.dev(), m.ino());
    Ok(pids_by_root(|k| k == key)?.remove(&key).unwrap_or_default())
}

/// The processes in `rootfs` once those already exiting are gone: while every process listed is
/// exiting (its sandbox's PID 1 a moment after the runtime that started it was killed, say), asks again
/// for up to `wait`. A process that is not exiting is returned at once: the sandbox is busy.
pub fn settled_sandbox_pids(rootfs: &Path, wait: std::time::Duration) -> std::io::Result<Vec<i32>> {
    let start = std::time::Instant::now();
    loop {
        let pids = sandbox_pids(rootfs)?;
        if pids.is_empty() || !pids.iter().all(|&p| exiting(p)) || start.elapsed() >= wait {
            return Ok(pids);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// True if process `pid` is exiting or gone.
pub(crate) fn exiting(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| exiting_from_stat(&s))
        .unwrap_or(true)
}

/// The kernel's exiting flag (`PF_EXITING`), or a zombie or dead state, in a `/proc/PID/stat` line.
fn exiting_from_stat(stat: &str) -> bool {
    const PF_EXITING: u64 = 0x4;
    // The command name is in parentheses and may hold anything: fields follow the last `)`.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return false;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().copied().unwrap_or("");
    let flags = fields
        .get(6)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// Undoes mountinfo's octal escapes (`\\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let esc = b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c));
        if esc {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str) -> Sandbox {
        Sandbox {
            id: id.into(),
            image: "a:b".into(),
            manifest: Digest::of(b"m"),
            layers: vec![Digest::of(b"l")],
            rootfs: "/r".into(),
            upper: "/u".into(),
            work: "/w".into(),
            created: 1,
            image_bytes: 2,
            state: SandboxState::Running,
            config: ImageConfig::default(),
            vm: None,
            charged: Default::default(),
            root: None,
        }
    }

    #[test]
    fn exiting_processes_are_told_from_stat() {
        let line = |comm: &str, state: &str, flags: u64| {
            format!("4242 ({comm}) {state} 1 4242 4242 0 -1 {flags} 100 0 0 0 0 0 0 0 20 0 1 0")
        };
        assert!(!exiting_from_stat(&line("sleep", "S", 0x400100)));
        assert!(exiting_from_stat(&line("sleep", "R", 0x400104)));
        assert!(exiting_from_stat(&line("sh", "Z", 0)));
        // A command name with spaces and parentheses does not shift the fields.
        assert!(exiting_from_stat(&line("a) S 1 (b", "D", 0x4)));
        assert!(!exiting_from_stat(&line("a) Z 1 (b", "S", 0)));
        assert!(!exiting_from_stat("garbage"));
        // This process is not exiting; a pid that does not exist is gone.
        assert!(!exiting(std::process::id() as i32));
        assert!(exiting(i32::MAX));
    }

    #[test]
    fn records_round_trip_and_a_broken_one_is_reported_not_lost() {
        let t = tempfile::tempdir().expect("tempdir");
        let st = NodeState::open(t.path()).expect("open");
        st.save_sandbox(&sandbox("a")).expect("save");
        st.save_sandbox(&sandbox("b")).expect("save");
        st.remove_sandbox("b").expect("remove");
        st.remove_sandbox("never")
            .expect("removing nothing is fine");
        let broken = t.path().join("node/sandboxes/c.json");
        std::fs::write(&broken, b"{\"id\": ").expect("write");
        let (good, bad) = st.sandboxes();
        assert_eq!(
            good.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        assert_eq!(bad.len(), 1);
        assert!(bad[0].to_string().contains("c.json"), "{}", bad[0]);
        assert!(broken.exists(), "a broken record is kept");
        // A leftover temporary file from a kill mid-write is not a record.
        std::fs::write(t.path().join("node/sandboxes/d.tmp99"), b"x").expect("write");
        assert_eq!(st.sandboxes().0.len(), 1);
        // A record written before sandboxes kept their image's config reads with an empty one.
        let mut old = serde_json::to_value(sandbox("e")).expect("json");
        old.as_object_mut().expect("object").remove("config");
        let old = old.to_string();
        assert!(!old.contains("config"));
        std::fs::write(t.path().join("node/sandboxes/e.json"), old).expect("write");
        let (good, _) = st.sandboxes();
        let e = good.iter().find(|s| s.id == "e").expect("old record read");
        assert_eq!(e.config, ImageConfig::default());
    }

    #[test]
    fn what_a_sandbox_was_charged_is_kept_flat_and_old_records_read() {
        let mut sb = sandbox("f");
        sb.charged.bytes = 7;
        sb.charged.wait_us = 9;
        let v = serde_json::to_value(&sb).expect("json");
        assert_eq!(
            (v["fetched_bytes"].as_u64(), v["read_wait_us"].as_u64()),
            (Some(7), Some(9))
        );
        // A record written before waits were kept: its bytes read, no wait.
        let mut old = v;
        old.as_object_mut().expect("object").remove("read_wait_us");
        let back: Sandbox = serde_json::from_value(old).expect("old record");
        assert_eq!((back.charged.bytes, back.charged.wait_us), (7, 0));
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape("/a\\040b/c"), "/a b/c");
        assert_eq!(unescape("/plain\\"), "/plain\\");
    }
}
