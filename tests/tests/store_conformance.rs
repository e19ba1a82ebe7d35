//! The store seam against real servers: the backend conformance suite over S3 (moto on loopback, or
//! radosgw with `STRATA_TEST_S3=radosgw`: [`S3Server`]), what the conditional-write probe finds there and
//! behind a proxy that strips the conditional headers, and
//! the range-read deadline against servers on loopback that misbehave — one that accepts connections and
//! never answers, one that stops in the middle of its headers, one that trickles its body.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_registry::store::{conformance, ObjectStoreBackend, Store, StoreBackend, StoreError};
use strata_tests::S3Server;

/// Credentials for the misbehaving servers here (which take any), set only where none are: tests run in
/// parallel threads of one process, and `s3_conforms` on radosgw needs the cluster's real keys.
fn credentials() {
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
    ] {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
}

#[test]
fn s3_conforms() {
    let Some(s3) = S3Server::start("conformance") else {
        return;
    };
    s3.set_credentials();
    let endpoint = s3.endpoint();
    for prefix in ["", "some/prefix"] {
        let b = ObjectStoreBackend::s3("conformance", prefix, Some(&endpoint)).expect("s3 backend");
        conformance::run(&b);
        for k in b.list("").expect("list") {
            b.delete(&k).expect("delete");
        }
    }
}

/// What a misbehaving server does with each connection.
#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// Accepts and never reads or writes.
    Silent,
    /// Reads the request, sends half a status line's worth of headers, then nothing.
    StallsInHeaders,
    /// Answers the range with proper headers, then one body byte every 200 ms.
    TricklesBody,
}

/// A server on a loopback port; stops (and drops its connections) when dropped.
struct BadServer {
    port: u16,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn read_request(s: &mut TcpStream) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

fn serve(mut s: TcpStream, how: Misbehaviour, stop: &AtomicBool) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    match how {
        Misbehaviour::Silent => {}
        Misbehaviour::StallsInHeaders => {
            read_request(&mut s);
            let _ = s.write_all(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n");
        }
        Misbehaviour::TricklesBody => {
            read_request(&mut s);
            let head = "HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n\
                        Content-Range: bytes 0-99/1000\r\nETag: \"e\"\r\n\
                        Last-Modified: Tue, 01 Dec 2026 00:00:00 GMT\r\n\r\n";
            let _ = s.write_all(head.as_bytes());
            for _ in 0..100 {
                if stop.load(Ordering::Relaxed) || s.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    // Hold the connection open, saying nothing more, until the test ends.
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl BadServer {
    fn start(how: Misbehaviour) -> BadServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = listener.local_addr().expect("address").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (acc, st) = (accepted.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            std::thread::scope(|scope| {
                while !st.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) => {
                            acc.fetch_add(1, Ordering::Relaxed);
                            let _ = s.set_nonblocking(false);
                            let st = &st;
                            scope.spawn(move || serve(s, how, st));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        });
        BadServer {
            port,
            accepted,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BadServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn a_range_read_returns_at_its_deadline_whatever_the_server_does() {
    credentials();
    let deadline = Duration::from_secs(2);
    for how in [
        Misbehaviour::Silent,
        Misbehaviour::StallsInHeaders,
        Misbehaviour::TricklesBody,
    ] {
        let server = BadServer::start(how);
        // The store as stratad opens it: an s3:// URL, the endpoint from AWS_ENDPOINT_URL.
        std::env::set_var(
            "AWS_ENDPOINT_URL",
            format!("http://127.0.0.1:{}", server.port),
        );
        let mut store = Store::open("s3://bucket/p").expect("open");
        store.range_deadline = deadline;
        let t = Instant::now();
        let r = store.get_range("blobs/x", 0..100);
        let took = t.elapsed();
        eprintln!("{how:?}: {took:?} {r:?}");
        assert!(
            matches!(r, Err(StoreError::Timeout { .. })),
            "{how:?}: expected a timeout, got {r:?}"
        );
        assert!(
            took >= deadline && took < deadline + Duration::from_millis(500),
            "{how:?}: took {took:?} with a deadline of {deadline:?}"
        );
        assert!(
            server.accepted.load(Ordering::Relaxed) > 0,
            "{how:?}: the client never connected"
        );
        // A streamed read (the fetcher's followers) keeps the same deadline over the whole body.
        let t = Instant::now();
        let r = store.get_range_streamed("blobs/x", 0..100, &mut |_| {});
        let took = t.elapsed();
        assert!(
            matches!(r, Err(StoreError::Timeout { .. })),
            "{how:?}: streamed: expected a timeout, got {r:?}"
        );
        assert!(
            took >= deadline && took < deadline + Duration::from_millis(500),
            "{how:?}: streamed: took {took:?} with a deadline of {deadline:?}"
        );
    }
}

/// Issue 22, item 5: whole-object reads and writes, `head`, listings and deletes used to wait 120 s
/// (the HTTP client's own timeout) on a store that accepts and never answers; every operation now
/// fails by the backend's deadline.
#[test]
fn every_operation_fails_at_its_deadline_against_a_silent_store() {
    credentials();
    let deadline = Duration::from_secs(2);
    let spool = tempfile::tempdir().expect("tempdir");
    for how in [Misbehaviour::Silent, Misbehaviour::StallsInHeaders] {
        let server = BadServer::start(how);
        let endpoint = format!("http://127.0.0.1:{}", server.port);
        let b = ObjectStoreBackend::s3("bucket", "p", Some(&endpoint))
            .expect("s3 backend")
            .with_deadline(deadline);
        eprintln!("{how:?}");
        conformance::silent(&b, deadline, &spool.path().join("upload"));
    }
}
