//! `strata rm` against a daemon older than the batch route: a fake daemon on a Unix socket that
//! answers `POST /v1/sandboxes/delete` with "no route", lists three sandboxes and refuses one delete.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

/// Serves `n` requests, one per connection, recording each request line.
fn old_daemon(listener: UnixListener, n: usize, seen: Arc<Mutex<Vec<String>>>) {
    for _ in 0..n {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let mut r = BufReader::new(stream.try_clone().expect("clone"));
        let mut line = String::new();
        r.read_line(&mut line).expect("request line");
        let mut len = 0;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).expect("header");
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().expect("length");
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).expect("body");
        let line = line.trim().trim_end_matches(" HTTP/1.1").to_string();
        let sb = |id: &str, image: &str, state: &str| json!({"id": id, "image": image, "manifest": format!("blake3:{id}"), "state": state});
        let (status, reply): (u16, Value) = match line.as_str() {
            "POST /v1/sandboxes/delete" => (
                404,
                json!({"error": "no route POST /v1/sandboxes/delete", "kind": "not_found"}),
            ),
            "GET /v1/sandboxes" => (
                200,
                json!([
                    sb("a", "x:v1", "running"),
                    sb("b", "y:v1", "running"),
                    sb("c", "x:v1", "stopped")
                ]),
            ),
            "DELETE /v1/sandboxes/c?purge=1" => (
                409,
                json!({"error": "processes 7 still in c", "kind": "sandbox"}),
            ),
            l if l.starts_with("DELETE /v1/sandboxes/") => (200, json!({"id": "gone"})),
            _ => (500, json!({"error": "unexpected", "kind": "internal"})),
        };
        seen.lock().expect("seen").push(line);
        let body = reply.to_string();
        let mut s = stream;
        let _ = write!(
            s,
            "HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    }
}

#[test]
fn rm_by_image_falls_back_to_one_delete_per_sandbox_on_an_old_daemon() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("stratad.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let server = {
        let seen = seen.clone();
        std::thread::spawn(move || old_daemon(listener, 4, seen))
    };
    let body = json!({"image": "x:v1", "purge": true, "force": false});
    let reply = super::delete(&socket, &body).expect("delete");
    server.join().expect("server");
    assert_eq!(
        reply["removed"].as_array().map(Vec::len),
        Some(1),
        "a removed"
    );
    let e = anyhow::Error::from(strata_cli::node::failures(&reply).expect("c refused"));
    assert_eq!(crate::exit::code(&e), 7, "a sandbox-state failure: {e}");
    assert!(e.to_string().contains("c: processes 7"), "{e}");
    assert_eq!(
        *seen.lock().expect("seen"),
        [
            "POST /v1/sandboxes/delete",
            "GET /v1/sandboxes",
            "DELETE /v1/sandboxes/a?purge=1",
            "DELETE /v1/sandboxes/c?purge=1",
        ]
    );
}
