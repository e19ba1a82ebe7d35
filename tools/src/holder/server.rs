//! Starting a server, and knowing which binary to start it from.
//!
//! The holder keeps an open descriptor to the binary of the last server that answered on the control
//! socket (at first, its own: the holder and its servers are one program). Every server is started from
//! a descriptor (`/proc/self/fd/N`), never from the path alone, so what runs is exactly the file that
//! was checked — a binary renamed over stratad's path between the check and the start changes nothing,
//! and a broken or missing file at the path cannot stop the holder from starting the last one that
//! worked. A candidate binary (an upgrade) is first asked for its version (`--version`, bounded): a file
//! that is not executable, a program that is not stratad, or one that hangs is refused before the
//! serving server is stopped.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::store::KEPT_ENV;
use super::ENV;

/// Why a server could not be started or did not come up.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot open the stratad binary {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot execute {path}: {source}")]
    Exec {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a working stratad: `--version` {what}")]
    Probe { path: PathBuf, what: String },
    #[error("the new server exited before answering ({status})")]
    Exited { status: std::process::ExitStatus },
    #[error("the new server did not answer within {0:?}")]
    Silent(Duration),
    #[error("the descriptor store's socket for the new server: {0}")]
    Store(#[source] std::io::Error),
}

/// A stratad binary held open: what a server is started from.
pub struct Binary {
    file: File,
    /// Where it was opened from (for messages; the file may since have been replaced there).
    pub path: PathBuf,
}

impl Binary {
    /// The binary now at `path`.
    pub fn open(path: &Path) -> Result<Binary, StartError> {
        Binary::open_as(path, path)
    }

    /// The binary this process runs (it works: it is running), known by `path`.
    pub fn running(path: &Path) -> Result<Binary, StartError> {
        Binary::open_as(Path::new("/proc/self/exe"), path)
    }

    /// Opens `file`, to be named `path` in messages.
    fn open_as(file: &Path, path: &Path) -> Result<Binary, StartError> {
        let file = File::open(file).map_err(|source| StartError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Binary {
            file,
            path: path.to_path_buf(),
        })
    }

    fn command(&self) -> Command {
        // The child resolves /proc/self/fd/N before exec closes N (it is close-on-exec).
        let mut c = Command::new(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        c.arg0(&self.path);
        c
    }

    fn exec_error(&self, source: std::io::Error) -> StartError {
        StartError::Exec {
            path: self.path.clone(),
            source,
        }
    }

    /// Runs `--version` within `limit`: it must exit 0 and name stratad.
    pub fn probe(&self, limit: Duration) -> Result<String, StartError> {
        let mut child = self
            .command()
            .arg("--version")
            .env_remove(ENV)
            .env_remove(KEPT_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| self.exec_error(e))?;
        let probe = |what: String| StartError::Probe {
            path: self.path.clone(),
            what,
        };
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().map_err(|e| self.exec_error(e))? {
                break s;
            }
            if start.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                return Err(probe(format!("did not exit within {limit:?}")));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        if let Some(mut o) = child.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        if !status.success() {
            return Err(probe(format!("failed ({status})")));
        }
        match out.trim() {
            v if v.starts_with("stratad ") => Ok(v.to_string()),
            v => Err(probe(format!(
                "printed {:?}, not a stratad version",
                truncate(v)
            ))),
        }
    }

    /// Starts a server from this binary with `args`, the inherited-descriptor spec `env` and the kept
    /// descriptors `kept` ([`KEPT_ENV`]).
    pub fn spawn(
        &self,
        args: &[std::ffi::OsString],
        env: &str,
        kept: &str,
    ) -> Result<Child, StartError> {
        self.command()
            .args(args)
            .env(ENV, env)
            .env(KEPT_ENV, kept)
            .spawn()
            .map_err(|e| self.exec_error(e))
    }

    /// A second descriptor to the same file.
    pub fn try_clone(&self) -> std::io::Result<Binary> {
        Ok(Binary {
            file: self.file.try_clone()?,
            path: self.path.clone(),
        })
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// Waits until `server` answers on the control socket, up to `limit` (`None`: as long as it lives).
pub fn wait_ready(
    server: &mut Child,
    socket: &Path,
    limit: Option<Duration>,
) -> Result<(), StartError> {
    let client = strata_api::Client {
        socket: socket.to_path_buf(),
    };
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = server.try_wait() {
            return Err(StartError::Exited { status });
        }
        let probe = Some(Duration::from_millis(500));
        if client.call_within("GET", "/v1/status", None, probe).is_ok() {
            return Ok(());
        }
        if let Some(limit) = limit.filter(|l| start.elapsed() > *l) {
            return Err(StartError::Silent(limit));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A copy of a system program (ELF: a `#!` script cannot be run from a close-on-exec descriptor,
    /// and stratad is never one).
    fn copy(dir: &Path, from: &str, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::copy(from, &p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// The probe's refusal of `p`, asked again while the file is busy: another test thread's fork can
    /// hold the copy's write descriptor for a moment (`ETXTBSY`), which is not what is under test.
    fn refusal(b: &Binary, limit: Duration) -> StartError {
        for _ in 0..100 {
            match b.probe(limit).unwrap_err() {
                StartError::Exec { source, .. } if source.raw_os_error() == Some(libc::ETXTBSY) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                e => return e,
            }
        }
        panic!("the binary stayed busy");
    }

    #[test]
    fn the_probe_refuses_what_is_not_a_working_stratad() {
        let t = tempfile::tempdir().unwrap();
        let limit = Duration::from_secs(5);
        // Missing.
        let e = Binary::open(&t.path().join("nope")).err().unwrap();
        assert!(matches!(e, StartError::Open { .. }), "{e}");
        // Not executable.
        let p = copy(t.path(), "/bin/true", "noexec");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Binary::open(&p).unwrap().probe(limit).unwrap_err();
        assert!(matches!(e, StartError::Exec { .. }), "{e}");
        // Exits at once, says nothing.
        let p = copy(t.path(), "/bin/true", "true");
        let e = refusal(&Binary::open(&p).unwrap(), limit);
        assert!(e.to_string().contains("not a stratad version"), "{e}");
        // Fails.
        let p = copy(t.path(), "/bin/false", "false");
        let e = refusal(&Binary::open(&p).unwrap(), limit);
        assert!(e.to_string().contains("failed"), "{e}");
    }

    #[test]
    fn a_binary_replaced_at_its_path_still_starts_the_one_that_was_opened() {
        let t = tempfile::tempdir().unwrap();
        let p = copy(t.path(), "/bin/true", "stratad");
        let held = Binary::open(&p).unwrap();
        // An upgrade renames a non-executable file over the path.
        let tmp = t.path().join("new");
        std::fs::write(&tmp, b"garbage").unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        let e = refusal(&held, Duration::from_secs(5));
        assert!(
            matches!(e, StartError::Probe { .. }),
            "the held /bin/true ran (and is no stratad): {e}"
        );
        let e = Binary::open(&p)
            .unwrap()
            .probe(Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(e, StartError::Exec { .. }), "{e}");
    }
}
