//! A client of the control API: one request per connection, a `Content-Length` body, the reply read
//! to the end. An error reply becomes [`ClientError::Api`] with the kind the daemon gave (or, from a
//! daemon older than `"kind"`, the kind its status implies).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::ErrorKind;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach stratad at {socket}: {source} (is the daemon running? start it with `stratad`)")]
    Connect {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stratad: {message}")]
    Api {
        status: u16,
        kind: ErrorKind,
        message: String,
    },
    /// The request could not be sent or its reply not read (a timeout included).
    #[error("talking to stratad at {socket}")]
    Io {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The reply is not an HTTP response.
    #[error("stratad sent a bad reply: {0}")]
    Reply(&'static str),
}

impl ClientError {
    /// `strata`'s exit code for this error: the kind's for a failure the daemon reported, 1 for a
    /// daemon that could not be reached or did not answer.
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::Api { kind, .. } => kind.exit_code(),
            ClientError::Connect { .. } | ClientError::Io { .. } | ClientError::Reply(_) => 1,
        }
    }
}

/// A client of the control API.
pub struct Client {
    pub socket: PathBuf,
}

impl Client {
    /// The client of the daemon listening on `socket`.
    pub fn at(socket: &std::path::Path) -> Client {
        Client {
            socket: socket.to_path_buf(),
        }
    }

    /// Sends one request; returns the JSON reply (or text, as a JSON string).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        self.call_within(method, path, body, None)
    }

    /// [`Client::call`] that gives up waiting for the reply after `timeout`.
    pub fn call_within(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<Value, ClientError> {
        let mut s = UnixStream::connect(&self.socket).map_err(|source| ClientError::Connect {
            socket: self.socket.clone(),
            source,
        })?;
        let io = |source| ClientError::Io {
            socket: self.socket.clone(),
            source,
        };
        s.set_read_timeout(timeout).map_err(io)?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: stratad\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).map_err(io)?;
        // Room for a usual reply up front: from an empty vector `read_to_end` starts with 32-byte
        // reads and doubles, seven `recvfrom`s for a sandbox's 0.7 KiB reply instead of two.
        let mut resp = Vec::with_capacity(16 << 10);
        s.read_to_end(&mut resp).map_err(io)?;
        parse_reply(&resp)
    }
}

/// A reply's JSON (or its text as a JSON string), or the error it reports.
fn parse_reply(resp: &[u8]) -> Result<Value, ClientError> {
    let text = String::from_utf8_lossy(resp);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or(ClientError::Reply("no end of the header"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or(ClientError::Reply("no status"))?;
    let v: Value = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
    if status >= 300 {
        let message = v["error"]
            .as_str()
            .map_or_else(|| body.to_string(), str::to_string);
        let kind = serde_json::from_value(v["kind"].clone())
            .unwrap_or_else(|_| ErrorKind::from_status(status));
        return Err(ClientError::Api {
            status,
            kind,
            message,
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_into_values_and_typed_failures() {
        let ok = parse_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"a\":1}").expect("ok");
        assert_eq!(ok["a"], 1);
        let text = parse_reply(b"HTTP/1.1 200 OK\r\n\r\nplain").expect("text");
        assert_eq!(text, Value::String("plain".into()));
        let e = parse_reply(
            b"HTTP/1.1 409 Conflict\r\n\r\n{\"error\":\"in use\",\"kind\":\"sandbox\"}",
        )
        .expect_err("409");
        assert!(matches!(
            &e,
            ClientError::Api { status: 409, kind: ErrorKind::Sandbox, message } if message == "in use"
        ));
        assert_eq!(e.exit_code(), ErrorKind::Sandbox.exit_code());
        // A daemon older than "kind": the status says it.
        let old = parse_reply(b"HTTP/1.1 404 Not Found\r\n\r\nno such sandbox").expect_err("404");
        assert!(matches!(
            old,
            ClientError::Api {
                kind: ErrorKind::NotFound,
                ..
            }
        ));
        for bad in [&b"HTTP/1.1 200 OK"[..], b"garbage\r\n\r\n", b""] {
            assert!(
                matches!(parse_reply(bad), Err(ClientError::Reply(_))),
                "{bad:?}"
            );
        }
    }
}
