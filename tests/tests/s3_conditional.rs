//! Conditional writes on real S3 servers: what the backend's probe finds (moto: standard; Ceph radosgw
//! 16: `If-Match` only with bare ETags), tags moved by compare-and-swap on the server under test
//! (racing creators, and movers on two clients of one bucket), and a server that ignores the conditional
//! headers — moto behind a proxy that strips them — detected, with nothing overwritten, and tags still
//! safe under the documented lock (`STRATA_TAG_LOCK`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use strata_registry::model::TagName;
use strata_registry::store::conditional::Conditional;
use strata_registry::store::{ObjectStoreBackend, Store, StoreError};
use strata_tests::{numbered_manifest, real_s3, S3Server};

/// Eight threads create one tag from "absent" at once: the number that won.
fn racing_creators(store: &Arc<Store>, tag: &str) -> usize {
    let t = TagName::parse(tag).expect("tag");
    let ms: Vec<_> = (0..8).map(|i| numbered_manifest(store, 100 + i)).collect();
    std::thread::scope(|scope| {
        let hs: Vec<_> = ms
            .iter()
            .map(|m| {
                let (store, t) = (store.clone(), t.clone());
                scope.spawn(move || match store.tag_set(&t, None, m) {
                    Ok(()) => 1,
                    Err(StoreError::TagConflict { .. }) => 0,
                    Err(e) => panic!("racing create: {e}"),
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("join")).sum()
    })
}

#[test]
fn the_probe_finds_what_the_server_does_and_tags_move_by_compare_and_swap() {
    let Some(s3) = S3Server::start("probe") else {
        return;
    };
    s3.set_credentials();
    let b = ObjectStoreBackend::s3("probe", "p", Some(&s3.endpoint())).expect("backend");
    let found = b.conditional_writes().expect("probe");
    eprintln!("conditional writes: {found:?}");
    let expected = match real_s3() {
        true => Conditional::BareETags,
        false => Conditional::Standard,
    };
    assert_eq!(found, expected);
    let store = Arc::new(Store::with_backend(Arc::new(b)));
    let t = TagName::parse("app:v1").expect("tag");
    let (m1, m2) = (numbered_manifest(&store, 1), numbered_manifest(&store, 2));
    store.tag_set(&t, None, &m1).expect("create");
    let seen = store.tag_get(&t).expect("get").expect("set");
    store.tag_set(&t, Some(&seen), &m2).expect("move");
    let e = store.tag_set(&t, Some(&seen), &m1).expect_err("stale move");
    assert!(matches!(e, StoreError::TagConflict { .. }), "{e}");
    let now = store.tag_get(&t).expect("get").expect("set");
    store.tag_delete(&t, &now).expect("delete");
    store
        .tag_set(&t, None, &m1)
        .expect("create over the tombstone");
    assert_eq!(racing_creators(&store, "app:race"), 1);
    // Two clients of the bucket (backends of their own), four writers moving one tag.
    let other = ObjectStoreBackend::s3("probe", "p", Some(&s3.endpoint())).expect("backend");
    let clients = [
        store.clone(),
        Arc::new(Store::with_backend(Arc::new(other))),
    ];
    assert!(strata_tests::tagrace::race(&clients, "app:moving", 4, 15) > 0);
    assert!(
        store.list("tmp").expect("list").is_empty(),
        "the probe left its object"
    );
}

#[test]
fn a_server_that_ignores_conditional_headers_is_found_out() {
    let Some(s3) = S3Server::moto("stripped") else {
        return;
    };
    s3.set_credentials();
    let proxy = strip_conditions(s3.port);
    let endpoint = format!("http://127.0.0.1:{proxy}");
    let b = ObjectStoreBackend::s3("stripped", "", Some(&endpoint)).expect("backend");
    let store = Store::with_backend(Arc::new(b));
    let t = TagName::parse("app:v1").expect("tag");
    let m1 = numbered_manifest(&store, 1);
    let e = store
        .tag_set(&t, None, &m1)
        .expect_err("no conditional writes");
    assert!(
        matches!(e, StoreError::NoConditionalWrites { feature, .. } if feature.contains("If-None-Match")),
        "{e}"
    );
    assert_eq!(store.tag_get(&t).expect("get"), None, "nothing was written");

    let lock = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(store.with_tag_lock(lock.path().join("tags.lock")));
    store.tag_set(&t, None, &m1).expect("create under the lock");
    let seen = store.tag_get(&t).expect("get").expect("set");
    let m2 = numbered_manifest(&store, 2);
    store
        .tag_set(&t, Some(&seen), &m2)
        .expect("move under the lock");
    let e = store.tag_set(&t, Some(&seen), &m1).expect_err("stale");
    assert!(matches!(e, StoreError::TagConflict { .. }), "{e}");
    assert_eq!(racing_creators(&store, "app:race"), 1);
}

/// The same server through the CLI: `strata tag` exits 6 (a store error) naming the missing feature and
/// the fallback, writes nothing, and succeeds with `STRATA_TAG_LOCK` set.
#[test]
fn the_cli_refuses_tags_on_such_a_server_and_takes_the_lock() {
    let Some(s3) = S3Server::moto("stripped-cli") else {
        return;
    };
    let proxy = strip_conditions(s3.port);
    let mut store = s3.store_via("stripped-cli", "p", proxy);
    let src = strata_tests::scratch("cli-src");
    std::fs::write(src.path().join("f"), b"hello").expect("write");
    let layer = store.ok(&["build", src.path().to_str().expect("utf8")]);
    let layer = layer.lines().last().expect("digest").trim().to_string();
    let o = store.run(&["tag", &layer, "app:v1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!("strata tag: {err}");
    assert_eq!(o.status.code(), Some(6), "{err}");
    assert!(
        err.contains("If-None-Match") && err.contains("STRATA_TAG_LOCK"),
        "{err}"
    );
    assert!(!store.ok(&["images"]).contains("app:v1"));
    let lock = strata_tests::scratch("cli-lock");
    let lock = lock.path().join("tags.lock").display().to_string();
    store.env.push(("STRATA_TAG_LOCK".into(), lock));
    store.ok(&["tag", &layer, "app:v1"]);
    assert_eq!(store.ok(&["cat", "app:v1", "/f"]), "hello");
}

/// A proxy on loopback to `port` that drops `If-Match` and `If-None-Match` from every request: a server
/// that ignores conditional writes. Returns its port; it runs until the test process ends.
fn strip_conditions(port: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let me = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            std::thread::spawn(move || relay(client, port));
        }
    });
    me
}

fn relay(client: TcpStream, port: u16) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
        return;
    };
    let (Ok(mut back), Ok(mut to_client)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    std::thread::spawn(move || std::io::copy(&mut back, &mut to_client));
    let mut from = BufReader::new(client);
    let mut to = server;
    loop {
        let mut length = 0usize;
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            match from.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("if-match:") || lower.starts_with("if-none-match:") {
                continue;
            }
            head.extend_from_slice(line.as_bytes());
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0u8; length];
        if from.read_exact(&mut body).is_err() || to.write_all(&head).is_err() {
            return;
        }
        if to.write_all(&body).is_err() {
            return;
        }
    }
}
