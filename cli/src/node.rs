//! `strata mount`, `umount` and `rm` against stratad's control socket, and what the full CLI shares
//! with them: the `reuse` a request asks for, the batch delete's request and the reading of its reply.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use strata_api::{Client, ClientError, ErrorKind};

use crate::args::{MountArgs, RmArgs, UmountArgs};

/// A failure of `mount` or `umount`.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Options that cannot go together.
    #[error("{0}")]
    Usage(&'static str),
    #[error(transparent)]
    Daemon(#[from] ClientError),
    #[error("--upper {path}")]
    Upper {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing to standard output")]
    Output(#[source] std::io::Error),
    /// stratad answers without the batch delete route (an older daemon): the full CLI, which knows
    /// how to delete one by one, does the command instead.
    #[error("stratad has no batch delete route")]
    NoBatchRoute,
}

impl NodeError {
    /// The documented exit code (`docs/CLI.md`).
    pub fn exit_code(&self) -> i32 {
        match self {
            NodeError::Usage(_) => 2,
            NodeError::Daemon(e) => e.exit_code(),
            NodeError::Upper { .. } | NodeError::Output(_) | NodeError::NoBatchRoute => 1,
        }
    }
}

/// The `reuse` a sandbox request asks for, from `--resume` and `--fresh` (`mount`, `vm`): what to do
/// with a stopped sandbox of the same id.
pub fn reuse(resume: bool, fresh: bool) -> &'static str {
    match (resume, fresh) {
        (true, _) => "resume",
        (_, true) => "fresh",
        _ => "refuse",
    }
}

/// `strata mount`: creates a sandbox of the image for each id, in order, and prints each rootfs path
/// (or, with `--json`, each sandbox as a JSON line). Stops at the first failure; the sandboxes created
/// before it stay (and were printed).
pub fn mount(socket: &Path, a: &MountArgs) -> Result<(), NodeError> {
    if a.upper.is_some() && a.sandbox.len() > 1 {
        return Err(NodeError::Usage(
            "--upper takes one --sandbox (each sandbox needs its own directory)",
        ));
    }
    let upper = match &a.upper {
        Some(u) => Some(std::path::absolute(u).map_err(|source| NodeError::Upper {
            path: u.clone(),
            source,
        })?),
        None => None,
    };
    let c = Client::at(socket);
    let mut out = std::io::stdout().lock();
    for id in &a.sandbox {
        let mut body = json!({"image": a.image, "id": id, "reuse": reuse(a.resume, a.fresh)});
        if let Some(u) = &upper {
            body["dir"] = json!(u);
        }
        let v = c.call("POST", "/v1/sandboxes", Some(&body))?;
        match a.json {
            true => writeln!(out, "{v}"),
            false => writeln!(out, "{}", v["rootfs"].as_str().unwrap_or_default()),
        }
        .map_err(NodeError::Output)?;
    }
    Ok(())
}

/// `strata umount`: stops the sandboxes (one batch request), or with `--purge` removes them.
pub fn umount(socket: &Path, a: &UmountArgs) -> Result<(), NodeError> {
    let reply = batch(socket, &umount_request(a))?.ok_or(NodeError::NoBatchRoute)?;
    failures(&reply).map_or(Ok(()), |e| Err(e.into()))
}

/// `strata rm`: purges the sandboxes the arguments name (ids, `--all`, `--image`, `--stopped`: see
/// `POST /v1/sandboxes/delete` in docs/API.md) in one request; all are tried, the first failure is
/// reported after the removed ones are listed.
pub fn rm(socket: &Path, a: &RmArgs) -> Result<(), NodeError> {
    let reply = batch(socket, &rm_request(a))?.ok_or(NodeError::NoBatchRoute)?;
    print_removed(&reply, a.json)?;
    failures(&reply).map_or(Ok(()), |e| Err(e.into()))
}

/// The batch delete `strata umount` sends.
pub fn umount_request(a: &UmountArgs) -> Value {
    json!({"ids": a.sandbox, "purge": a.purge, "force": a.force})
}

/// The batch delete `strata rm` sends.
pub fn rm_request(a: &RmArgs) -> Value {
    json!({"ids": a.sandboxes, "stopped": a.stopped, "all": a.all, "image": a.image,
           "purge": true, "force": a.force})
}

/// One batch delete (`POST /v1/sandboxes/delete`): its reply, or `None` from a daemon older than the
/// route.
pub fn batch(socket: &Path, body: &Value) -> Result<Option<Value>, ClientError> {
    let c = Client::at(socket);
    match c.call("POST", "/v1/sandboxes/delete", Some(body)) {
        Err(e) if is_no_route(&e) => Ok(None),
        r => r.map(Some),
    }
}

/// Prints the ids a batch delete removed, one a line or as `{"removed": [...]}`.
pub fn print_removed(reply: &Value, json_out: bool) -> Result<(), NodeError> {
    let removed = reply["removed"].as_array().into_iter().flatten();
    let ids: Vec<&str> = removed.filter_map(|s| s["id"].as_str()).collect();
    let mut out = std::io::stdout().lock();
    match json_out {
        true => writeln!(out, "{}", json!({"removed": ids})),
        false => ids.iter().try_for_each(|id| writeln!(out, "{id}")),
    }
    .map_err(NodeError::Output)
}

/// Whether a batch request failed only because the daemon predates its route.
pub fn is_no_route(e: &ClientError) -> bool {
    matches!(e, ClientError::Api { status: 404, message, .. } if message.starts_with("no route"))
}

/// A batch delete's reply (`{"removed": [...], "failed": [...]}`): each failed sandbox is said on
/// standard error; the first becomes the command's error, with the kind the daemon gave it.
pub fn failures(reply: &Value) -> Option<ClientError> {
    let mut first = None;
    for f in reply["failed"].as_array().into_iter().flatten() {
        let (id, message) = (f["id"].as_str().unwrap_or("?"), f["error"].as_str());
        eprintln!("strata: {id}: {}", message.unwrap_or("failed"));
        first.get_or_insert_with(|| {
            let kind: ErrorKind =
                serde_json::from_value(f["kind"].clone()).unwrap_or(ErrorKind::Internal);
            ClientError::Api {
                status: kind.status(),
                kind,
                message: format!("{id}: {}", message.unwrap_or("failed")),
            }
        });
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_reply_fails_with_its_first_failure_and_kind() {
        let reply = json!({"removed": [{"id": "a"}], "failed": [
            {"id": "b", "error": "processes still run", "kind": "sandbox"},
            {"id": "c", "error": "no such sandbox", "kind": "not_found"},
        ]});
        let e = failures(&reply).expect("a failure");
        assert!(matches!(
            &e,
            ClientError::Api { kind: ErrorKind::Sandbox, message, .. } if message == "b: processes still run"
        ));
        assert_eq!(NodeError::from(e).exit_code(), 7);
        assert!(failures(&json!({"removed": [], "failed": []})).is_none());
        let odd = failures(&json!({"failed": [{"id": "d"}]})).expect("kindless");
        assert!(matches!(
            odd,
            ClientError::Api {
                kind: ErrorKind::Internal,
                ..
            }
        ));
    }

    #[test]
    fn only_a_missing_route_is_an_old_daemon() {
        let api = |status, message: &str| ClientError::Api {
            status,
            kind: ErrorKind::from_status(status),
            message: message.into(),
        };
        assert!(is_no_route(&api(404, "no route POST /v1/sandboxes/delete")));
        assert!(!is_no_route(&api(404, "no such sandbox a")));
        assert!(!is_no_route(&api(400, "no route")));
    }

    /// A daemon older than the batch route: every request gets its 404.
    fn old_daemon(n: usize) -> (tempfile::TempDir, std::thread::JoinHandle<()>) {
        use std::io::{BufRead, BufReader};
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = std::os::unix::net::UnixListener::bind(dir.path().join("s")).expect("bind");
        let server = std::thread::spawn(move || {
            for stream in listener.incoming().take(n).flatten() {
                let mut r = BufReader::new(&stream);
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let body = r#"{"error":"no route POST /v1/sandboxes/delete","kind":"not_found"}"#;
                let mut w = &stream;
                let _ = write!(
                    w,
                    "HTTP/1.1 404 X\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (dir, server)
    }

    #[test]
    fn an_old_daemon_leaves_rm_and_umount_to_the_full_cli() {
        let (dir, server) = old_daemon(2);
        let socket = dir.path().join("s");
        let rm_args = RmArgs {
            sandboxes: vec!["a".into()],
            stopped: false,
            all: false,
            image: None,
            force: false,
            json: false,
        };
        assert!(matches!(
            rm(&socket, &rm_args),
            Err(NodeError::NoBatchRoute)
        ));
        let umount_args = UmountArgs {
            sandbox: vec!["a".into()],
            purge: true,
            force: false,
        };
        assert!(matches!(
            umount(&socket, &umount_args),
            Err(NodeError::NoBatchRoute)
        ));
        server.join().expect("server");
    }

    #[test]
    fn reuse_follows_resume_then_fresh() {
        assert_eq!(reuse(true, false), "resume");
        assert_eq!(reuse(false, true), "fresh");
        assert_eq!(reuse(false, false), "refuse");
    }
}
