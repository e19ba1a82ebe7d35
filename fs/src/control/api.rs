//! The control API: HTTP/1.1 and JSON on a Unix socket (`<runtime>/stratad.sock`), documented in
//! `docs/API.md`. Its clients' side (the error kinds, the small client the CLI uses) is the
//! `strata_api` crate.
//!
//! The protocol is deliberately small — one request per connection, `Content-Length` bodies, JSON in
//! and out — so it needs no HTTP framework and any client (`curl --unix-socket`) can speak it. The socket
//! is root's only (mode 0600) unless a group is configured (0660, that group).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::control::daemon::{Daemon, DaemonError};
use crate::control::sandboxes::Reuse;
use crate::control::vm::VmRequest;

/// Largest request body accepted.
const MAX_BODY: usize = 1 << 20;

/// A parsed request.
struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

fn read_request(stream: &mut UnixStream) -> std::io::Result<Request> {
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    if len > MAX_BODY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "body too large",
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Request { method, path, body })
}

fn respond(stream: &mut UnixStream, status: u16, content_type: &str, body: &[u8]) {
    let reason = match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        502 => "Bad Gateway",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // One write: the client, blocked in its read, is woken once for the whole reply, not once for the
    // head and again for the body.
    let mut reply = head.into_bytes();
    reply.extend_from_slice(body);
    let _ = stream.write_all(&reply);
}

pub use strata_api::ErrorKind;

/// An error reply: its status (the kind's) and JSON body.
pub(crate) fn failure(kind: ErrorKind, message: &str) -> (u16, Value) {
    (kind.status(), json!({"error": message, "kind": kind}))
}

pub(crate) fn error_json(e: &DaemonError) -> (u16, Value) {
    failure(e.kind(), &e.to_string())
}

/// A sandbox as the API shows it: its record, with the bytes fetched for its misses and the seconds its
/// reads waited for chunks so far (`read_wait_seconds`, in place of the record's `read_wait_us`), and
/// its image's stored bytes as `strata images` counts them (asked of the store only when `sizes`; else
/// the last known figure).
fn sandbox_json_sized(d: &Daemon, s: &crate::control::daemon::Sandbox, sizes: bool) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.remove("read_wait_us");
    }
    let c = d.charged_to(s);
    v["fetched_bytes"] = json!(c.bytes);
    v["read_wait_seconds"] = json!(c.wait_us as f64 / 1e6);
    if let Some(n) = d.image_bytes(&s.manifest, sizes) {
        v["image_bytes"] = json!(n);
    }
    v
}

fn sandbox_json(d: &Daemon, s: &crate::control::daemon::Sandbox) -> Value {
    sandbox_json_sized(d, s, false)
}

/// A sandbox with the process its image's config starts (user names resolved in its rootfs): for a
/// created sandbox and `GET /v1/sandboxes/<id>` of a running one.
fn sandbox_with_process(d: &Daemon, s: &crate::control::daemon::Sandbox) -> Value {
    let mut v = sandbox_json(d, s);
    if s.state == crate::control::state::SandboxState::Running {
        match crate::process::image_process(&s.rootfs, &s.config) {
            Ok(p) => v["process"] = json!(p),
            Err(e) => v["process_error"] = json!(e.to_string()),
        }
    }
    v
}

fn handle(d: &Daemon, hooks: &Hooks, req: Request) -> (u16, &'static str, Vec<u8>) {
    let json_reply =
        |(status, v): (u16, Value)| (status, "application/json", v.to_string().into_bytes());
    let path = req.path.split('?').next().unwrap_or("");
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let query = req.path.split_once('?').map_or("", |(_, q)| q);
    let flag = |name: &str| {
        query.split('&').any(|kv| {
            kv == name
                || kv
                    .strip_prefix(name)
                    .is_some_and(|v| v == "=1" || v == "=true")
        })
    };
    let (purge, force) = (flag("purge"), flag("force"));
    match (req.method.as_str(), segs.as_slice()) {
        ("GET", ["healthz"]) => (200, "text/plain", b"ok\n".to_vec()),
        ("GET", ["metrics"]) => (
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            d.render_metrics().into_bytes(),
        ),
        ("GET", ["v1", "status"]) => {
            let mut v = d.status();
            let extra = hooks.status.as_ref().map(|f| f());
            if let (Some(v), Some(Value::Object(extra))) = (v.as_object_mut(), extra) {
                v.extend(extra);
            }
            json_reply((200, v))
        }
        ("POST", ["v1", "scrub"]) => json_reply((200, d.scrub())),
        ("POST", ["v1", "upgrade"]) => json_reply(upgrade_route(hooks)),
        ("GET", ["v1", "sandboxes"]) => {
            let v: Vec<Value> = d
                .sandboxes()
                .iter()
                .map(|s| sandbox_json_sized(d, s, true))
                .collect();
            json_reply((200, json!(v)))
        }
        ("GET", ["v1", "sandboxes", id]) => json_reply(match d.sandbox(id) {
            Some(s) => (200, sandbox_with_process(d, &s)),
            None => error_json(&DaemonError::NoSandbox(id.to_string())),
        }),
        ("POST", ["v1", "sandboxes"]) => json_reply(create_route(d, &req.body)),
        ("GET", ["v1", "layers"]) => json_reply((200, json!(d.holds()))),
        ("POST", ["v1", "layers"]) => json_reply(crate::control::layers::hold_route(d, &req.body)),
        ("DELETE", ["v1", "layers", digest]) => {
            json_reply(crate::control::layers::release_route(d, digest, query))
        }
        ("POST", ["v1", "trace", "start"]) => json_reply(match d.trace_start() {
            true => (200, json!({"tracing": true})),
            false => failure(ErrorKind::Conflict, "a trace is already running"),
        }),
        ("POST", ["v1", "trace", "stop"]) => json_reply((200, json!({"entries": d.trace_stop()}))),
        ("POST", ["v1", "sandboxes", "delete"]) => {
            json_reply(crate::control::teardown::delete_route(d, &req.body, |s| {
                sandbox_json(d, s)
            }))
        }
        ("DELETE", ["v1", "sandboxes", id]) => {
            let removed = match purge {
                true => d.purge_sandbox(id, force),
                false => d.remove_sandbox(id),
            };
            json_reply(match removed {
                Ok(s) => (200, sandbox_json(d, &s)),
                Err(e) => error_json(&e),
            })
        }
        _ => json_reply(failure(
            ErrorKind::NotFound,
            &format!("no route {} {}", req.method, req.path),
        )),
    }
}

/// `POST /v1/upgrade`: hands the node to a new binary, through the descriptor holder.
fn upgrade_route(hooks: &Hooks) -> (u16, Value) {
    match &hooks.upgrade {
        None => failure(
            ErrorKind::Conflict,
            "this stratad runs without a descriptor holder (--no-holder): it cannot be upgraded in place",
        ),
        Some(up) => match up() {
            Ok(()) => (202, json!({"pid": std::process::id(), "upgrading": true})),
            Err(e) => failure(ErrorKind::Internal, &format!("starting the upgrade: {e}")),
        },
    }
}

/// `POST /v1/sandboxes`: a sandbox (`{"image", "id", "dir"?, "reuse"?}`) or a microVM (`"kind": "vm"`).
fn create_route(d: &Daemon, body: &[u8]) -> (u16, Value) {
    let body: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return failure(ErrorKind::Invalid, &format!("bad JSON: {e}")),
    };
    if body["kind"] == "vm" {
        return match serde_json::from_value::<VmRequest>(body) {
            Ok(r) => match d.create_vm(&r) {
                Ok(s) => (201, sandbox_json(d, &s)),
                Err(e) => error_json(&e),
            },
            Err(e) => failure(ErrorKind::Invalid, &format!("bad VM request: {e}")),
        };
    }
    let (Some(image), Some(id)) = (body["image"].as_str(), body["id"].as_str()) else {
        return failure(ErrorKind::Invalid, "need \"image\" and \"id\"");
    };
    let dir = body["dir"].as_str().map(PathBuf::from);
    let reuse = match body.get("reuse") {
        None | Some(Value::Null) => Reuse::Refuse,
        Some(v) => match serde_json::from_value::<Reuse>(v.clone()) {
            Ok(r) => r,
            Err(_) => {
                let why = "\"reuse\" must be \"refuse\", \"resume\" or \"fresh\"";
                return failure(ErrorKind::Invalid, why);
            }
        },
    };
    match d.create_sandbox(image, id, dir.as_deref(), reuse) {
        Ok(s) => (201, sandbox_with_process(d, &s)),
        Err(e) => error_json(&e),
    }
}

/// Binds the control socket (root's only, or the group's): done by whoever holds it across servers.
pub fn bind(socket: &Path, group: Option<u32>) -> std::io::Result<UnixListener> {
    // Bound, listening and given its mode under a short temporary name, then renamed into place: a
    // client that waits for the path to appear never finds a socket that refuses it (between bind and
    // listen) or one with the wrong mode. The rename also replaces a stale socket in one step.
    let tmp = socket.with_file_name(format!(".s{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .and_then(|()| match group {
            Some(g) => std::os::unix::fs::chown(&tmp, Some(0), Some(g)),
            None => Ok(()),
        })
        .and_then(|()| std::fs::rename(&tmp, socket));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

/// Asks whoever runs this server for an in-place upgrade (`POST /v1/upgrade`).
pub type UpgradeHook = Box<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// What the process around the daemon adds to `GET /v1/status`, asked at every call.
pub type StatusHook = Box<dyn Fn() -> Value + Send + Sync>;

/// What the process around the daemon adds to the API.
#[derive(Default)]
pub struct Hooks {
    /// Starts an upgrade; `None`: this server cannot be replaced in place.
    pub upgrade: Option<UpgradeHook>,
    /// Merged into `GET /v1/status` (e.g. the descriptor holder's pid, while it lives).
    pub status: Option<StatusHook>,
}

/// Serves the API on a bound listener (possibly inherited: connections made while no server ran wait
/// in its backlog) until the process exits.
pub fn serve_listener(
    d: Arc<Daemon>,
    listener: UnixListener,
    hooks: Arc<Hooks>,
) -> std::io::Result<()> {
    // Each connection on the thread that accepted it (`acceptors`: no thread started per request).
    crate::control::acceptors::serve(
        listener,
        Box::new(move |mut stream: UnixStream| {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
            match read_request(&mut stream) {
                Ok(req) => {
                    let (status, ct, body) = handle(&d, &hooks, req);
                    respond(&mut stream, status, ct, &body);
                }
                Err(e) => respond(&mut stream, 400, "text/plain", e.to_string().as_bytes()),
            }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The socket appears at its path listening and with its mode, replacing a stale one, and no
    /// temporary name is left.
    #[test]
    fn the_socket_appears_ready() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("stratad.sock");
        std::fs::write(&socket, b"stale").expect("stale file");
        let listener = bind(&socket, None).expect("bind");
        let mode = std::fs::metadata(&socket)
            .expect("socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .flatten()
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        UnixStream::connect(&socket).expect("connects");
        drop(listener);
    }
}
