//! What the holder tells the world: `<runtime_dir>/holder.json`, rewritten (atomically, 0600) at every
//! change. The serving server merges it into `GET /v1/status` as `holder`, so `strata daemon upgrade`
//! learns whether its upgrade happened, and an operator sees the server starts that failed — even
//! though the holder itself answers no API (it runs as little code as it can).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The file's name in the runtime directory.
pub const FILE: &str = "holder.json";

/// The outcome of one upgrade request (SIGHUP).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Upgrade {
    /// Counts the requests: a client compares it with the one it saw before asking.
    pub seq: u64,
    pub ok: bool,
    /// Why the upgrade did not happen, and what serves instead.
    pub error: Option<String>,
    /// The version now serving.
    pub version: Option<String>,
    /// Unix seconds.
    pub at: u64,
}

/// A server that could not be started, or died.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Failure {
    pub error: String,
    pub at: u64,
}

/// The holder's state as servers and clients see it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub holder_pid: u32,
    /// The server now running (none while a successor is being started).
    pub server_pid: Option<u32>,
    /// Where upgrades are installed (stratad's path).
    pub exe: PathBuf,
    /// What the running server was started from: the binary at `exe` when it was checked, or the last
    /// binary that served (kept open by the holder) after a start from `exe` failed.
    pub serving: String,
    pub upgrade: Option<Upgrade>,
    pub last_failure: Option<Failure>,
    /// Servers that exited or failed to start since the holder started.
    pub failures: u64,
    /// Descriptors kept for the servers (`fuse` mode: two per mounted layer), as of the last start.
    #[serde(default)]
    pub kept: usize,
}

pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Report {
    /// Writes the report into `runtime_dir` (errors are logged: a report must never stop the holder).
    pub fn publish(&self, runtime_dir: &Path) {
        let path = runtime_dir.join(FILE);
        let bytes = match serde_json::to_vec_pretty(self) {
            Ok(b) => b,
            Err(e) => return tracing::warn!(error = %e, "holder report"),
        };
        if let Err(e) = strata_fs::state::write_atomic(&path, &bytes) {
            tracing::warn!(error = %e, "writing the holder report");
        }
    }

    /// The report in `runtime_dir`, if a holder wrote one.
    pub fn read(runtime_dir: &Path) -> Option<Report> {
        let bytes = std::fs::read(runtime_dir.join(FILE)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn fail(&mut self, error: String) {
        tracing::error!(%error, "stratad server");
        self.failures += 1;
        self.last_failure = Some(Failure { error, at: now() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_round_trips_through_its_file_and_is_private() {
        let t = tempfile::tempdir().unwrap();
        let mut r = Report {
            holder_pid: 7,
            server_pid: Some(8),
            exe: "/usr/bin/stratad".into(),
            serving: "installed".into(),
            ..Report::default()
        };
        r.fail("exec failed".into());
        r.upgrade = Some(Upgrade {
            seq: 2,
            ok: false,
            error: Some("bad".into()),
            version: Some("stratad 1".into()),
            at: 5,
        });
        r.publish(t.path());
        assert_eq!(Report::read(t.path()), Some(r));
        let mode =
            std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(t.path().join(FILE)).unwrap());
        assert_eq!(mode & 0o777, 0o600);
    }
}
