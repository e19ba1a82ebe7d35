//! The one conformance suite of [`StoreBackend`]s: what the contract in [`super::object`] promises,
//! checked against a real implementation. The registry's unit tests run it over the [`super::MemoryStore`]
//! and a `file://` store; `tests/tests/store_conformance.rs` runs it over S3 (moto on loopback).
//!
//! [`run`] takes an empty store (or one whose `conformance/` prefix is unused) and panics, naming the
//! check and the backend, at the first broken promise. It is test support, public so that other crates'
//! tests can call it; it is not part of the registry's API.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;

use super::object::{PutMode, StoreBackend, Version};
use super::StoreError;

const DEADLINE: Duration = Duration::from_secs(20);

/// Every check, in turn.
pub fn run(b: &dyn StoreBackend) {
    whole_objects(b);
    missing_objects(b);
    ranges(b);
    listing(b);
    deletion(b);
    create_only(b);
    if_match(b);
    one_winner_among_racing_writers(b);
    file_upload(b);
}

fn key(name: &str) -> String {
    format!("conformance/{name}")
}

fn pattern(n: usize) -> Bytes {
    (0..n).map(|i| (i * 7 + i / 256) as u8).collect()
}

fn put(b: &dyn StoreBackend, k: &str, data: &[u8]) -> Version {
    b.put(k, Bytes::copy_from_slice(data), PutMode::Overwrite)
        .unwrap_or_else(|e| panic!("{}: put {k}: {e}", b.url()))
}

fn get(b: &dyn StoreBackend, k: &str) -> Bytes {
    b.get(k)
        .unwrap_or_else(|e| panic!("{}: get {k}: {e}", b.url()))
        .0
}

fn assert_precondition(b: &dyn StoreBackend, what: &str, r: &Result<Version, StoreError>) {
    assert!(
        matches!(r, Err(StoreError::Precondition(_))),
        "{}: {what}: expected a failed precondition, got {r:?}",
        b.url()
    );
}

fn assert_not_found<T: std::fmt::Debug>(
    b: &dyn StoreBackend,
    what: &str,
    r: Result<T, StoreError>,
) {
    assert!(
        matches!(r, Err(StoreError::NotFound(_))),
        "{}: {what}: expected not found, got {r:?}",
        b.url()
    );
}

/// Put, get, overwrite; versions agree between put, get and head.
pub fn whole_objects(b: &dyn StoreBackend) {
    let k = key("whole/a");
    let v1 = put(b, &k, b"first");
    let (data, gv) = b.get(&k).expect("get");
    assert_eq!(&data[..], b"first", "{}", b.url());
    let meta = b.head(&k).expect("head").expect("head finds the object");
    assert_eq!(
        (meta.key.as_str(), meta.size),
        (k.as_str(), 5),
        "{}",
        b.url()
    );
    assert_eq!(
        meta.version,
        gv,
        "{}: head and get disagree on the version",
        b.url()
    );
    if v1.e_tag.is_some() || v1.version.is_some() {
        assert_eq!(v1, gv, "{}: put and get disagree on the version", b.url());
    }
    let v2 = put(b, &k, b"second, longer");
    assert_eq!(&get(b, &k)[..], b"second, longer", "{}", b.url());
    assert_ne!(v1, v2, "{}: an overwrite keeps the version", b.url());
    put(b, &key("whole/empty"), b"");
    assert!(get(b, &key("whole/empty")).is_empty(), "{}", b.url());
    // Streamed whole: the same bytes, in order (an object longer than a local read's piece).
    let big = pattern((5 << 20) / 2 + 123);
    put(b, &key("whole/big"), &big);
    for (k, want) in [("whole/big", &big[..]), ("whole/empty", &b""[..])] {
        let got = streamed_whole(b, &key(k)).unwrap_or_else(|e| panic!("{}: {k}: {e}", b.url()));
        assert!(got == want, "{}: {k} streamed", b.url());
    }
}

/// A streamed whole read's pieces, joined.
fn streamed_whole(b: &dyn StoreBackend, k: &str) -> Result<Vec<u8>, StoreError> {
    let mut got = Vec::new();
    b.get_streamed(k, &mut |piece| got.extend_from_slice(piece))?;
    Ok(got)
}

/// A missing object: not found for reads, `None` for head, deleting it succeeds.
pub fn missing_objects(b: &dyn StoreBackend) {
    let k = key("missing/none");
    assert_not_found(b, "get", b.get(&k));
    assert_not_found(b, "get_streamed", streamed_whole(b, &k));
    assert_not_found(b, "get_range", b.get_range(&k, 0..4, DEADLINE));
    assert_not_found(b, "empty get_range", b.get_range(&k, 0..0, DEADLINE));
    assert_eq!(b.head(&k).expect("head"), None, "{}", b.url());
    b.delete(&k).expect("deleting a missing object");
}

/// Exact ranges anywhere; empty ranges; ranges past the end are refused, never cut short.
pub fn ranges(b: &dyn StoreBackend) {
    let k = key("ranges/obj");
    let data = pattern(1000);
    put(b, &k, &data);
    let good: [Range<u64>; 6] = [0..10, 990..1000, 500..501, 0..1000, 5..5, 1000..1000];
    for r in good {
        let got = b
            .get_range(&k, r.clone(), DEADLINE)
            .unwrap_or_else(|e| panic!("{}: range {r:?}: {e}", b.url()));
        assert_eq!(
            got,
            data.slice(r.start as usize..r.end as usize),
            "{}: range {r:?}",
            b.url()
        );
    }
    for r in [990..1001, 999..2000, 1001..1002, 2000..3000] {
        let got = b.get_range(&k, r.clone(), DEADLINE);
        assert!(
            matches!(got, Err(StoreError::Malformed { .. })),
            "{}: range {r:?} past the end of 1000 bytes: {got:?}",
            b.url()
        );
        let streamed = streamed(b, &k, r.clone());
        assert!(
            matches!(streamed, Err(StoreError::Malformed { .. })),
            "{}: streamed range {r:?} past the end of 1000 bytes: {streamed:?}",
            b.url()
        );
    }
    for r in [0..10, 990..1000, 0..1000, 5..5] {
        let got = streamed(b, &k, r.clone())
            .unwrap_or_else(|e| panic!("{}: streamed range {r:?}: {e}", b.url()));
        assert_eq!(
            got,
            data.slice(r.start as usize..r.end as usize),
            "{}: streamed {r:?}",
            b.url()
        );
    }
    let missing = streamed(b, &key("ranges/none"), 0..4);
    assert_not_found(b, "get_range_streamed", missing);
}

/// A streamed range read's pieces, joined.
fn streamed(b: &dyn StoreBackend, k: &str, r: Range<u64>) -> Result<Vec<u8>, StoreError> {
    let mut got = Vec::new();
    b.get_range_streamed(k, r, DEADLINE, &mut |piece| got.extend_from_slice(piece))?;
    Ok(got)
}

/// Listing is recursive, by directory prefix, sorted, with sizes.
pub fn listing(b: &dyn StoreBackend) {
    let names = [
        "list/l/a",
        "list/l/b/c",
        "list/l/b/d",
        "list/lx/e",
        "list/l2",
    ];
    for (i, n) in names.iter().enumerate() {
        put(b, &key(n), &pattern(i * 10));
    }
    let keys = |p: &str| {
        b.list(&key(p))
            .unwrap_or_else(|e| panic!("{}: list {p}: {e}", b.url()))
    };
    let want: Vec<String> = ["list/l/a", "list/l/b/c", "list/l/b/d"].map(key).to_vec();
    assert_eq!(keys("list/l"), want, "{}", b.url());
    assert_eq!(keys("list/l/"), want, "{}", b.url());
    assert_eq!(keys("list/l/b"), want[1..], "{}", b.url());
    assert!(keys("list/nothing").is_empty(), "{}", b.url());
    let info = b.list_info(&key("list/l/b")).expect("list_info");
    let sizes: Vec<u64> = info.iter().map(|m| m.size).collect();
    assert_eq!(sizes, [10, 20], "{}", b.url());
    let all = b.list("").expect("list everything");
    for n in names {
        assert!(
            all.contains(&key(n)),
            "{}: {n} not listed under \"\"",
            b.url()
        );
    }
}

/// A deleted object is gone for every operation.
pub fn deletion(b: &dyn StoreBackend) {
    let k = key("delete/a");
    put(b, &k, b"doomed");
    b.delete(&k).expect("delete");
    assert_not_found(b, "get after delete", b.get(&k));
    assert_eq!(b.head(&k).expect("head"), None, "{}", b.url());
    assert!(
        b.list(&key("delete")).expect("list").is_empty(),
        "{}",
        b.url()
    );
}

/// Create-only writes once; a second create fails and changes nothing.
pub fn create_only(b: &dyn StoreBackend) {
    let k = key("create/a");
    b.put(&k, Bytes::from_static(b"one"), PutMode::Create)
        .unwrap_or_else(|e| panic!("{}: create: {e}", b.url()));
    let again = b.put(&k, Bytes::from_static(b"two"), PutMode::Create);
    assert_precondition(b, "second create", &again);
    assert_eq!(&get(b, &k)[..], b"one", "{}", b.url());
}

/// If-match writes only over the version it names; an absent object matches no version.
pub fn if_match(b: &dyn StoreBackend) {
    let k = key("ifmatch/a");
    put(b, &k, b"v1");
    let v1 = b.get(&k).expect("get").1;
    let v2 = b
        .put(&k, Bytes::from_static(b"v2"), PutMode::IfMatch(v1.clone()))
        .unwrap_or_else(|e| panic!("{}: if-match on the current version: {e}", b.url()));
    assert_eq!(&get(b, &k)[..], b"v2", "{}", b.url());
    let stale = b.put(&k, Bytes::from_static(b"v3"), PutMode::IfMatch(v1.clone()));
    assert_precondition(b, "if-match on a replaced version", &stale);
    assert_eq!(&get(b, &k)[..], b"v2", "{}", b.url());
    let current = b.get(&k).expect("get").1;
    if v2.e_tag.is_some() || v2.version.is_some() {
        assert_eq!(v2, current, "{}", b.url());
    }
    let absent = b.put(
        &key("ifmatch/absent"),
        Bytes::from_static(b"x"),
        PutMode::IfMatch(current),
    );
    assert_precondition(b, "if-match on an absent object", &absent);
    assert_eq!(
        b.head(&key("ifmatch/absent")).expect("head"),
        None,
        "{}",
        b.url()
    );
}

/// Writers racing from one version: exactly one wins.
pub fn one_winner_among_racing_writers(b: &dyn StoreBackend) {
    let k = key("race/tag");
    put(b, &k, b"start");
    let v = b.get(&k).expect("get").1;
    let results: Vec<Result<Version, StoreError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6u8)
            .map(|i| {
                let (k, v) = (&k, v.clone());
                s.spawn(move || b.put(k, Bytes::from(vec![i; 4]), PutMode::IfMatch(v)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("writer thread"))
            .collect()
    });
    let winners: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_ok()).collect();
    assert_eq!(winners.len(), 1, "{}: {results:?}", b.url());
    for (i, r) in results.iter().enumerate() {
        if r.is_err() {
            assert_precondition(b, "racing writer", r);
        } else {
            assert_eq!(&get(b, &k)[..], &[i as u8; 4], "{}", b.url());
        }
    }
}

/// A file uploads whole.
pub fn file_upload(b: &dyn StoreBackend) {
    let path = std::env::temp_dir().join(format!("strata-conformance-{}", std::process::id()));
    let data = pattern(300_000);
    std::fs::write(&path, &data).expect("write a temporary file");
    let k = key("file/a");
    let r = b.put_file(&k, &path);
    let _ = std::fs::remove_file(&path);
    r.unwrap_or_else(|e| panic!("{}: put_file: {e}", b.url()));
    assert_eq!(get(b, &k), data, "{}", b.url());
}

/// Every operation of a backend whose server accepts connections and never answers (or stops
/// mid-answer) fails with [`StoreError::Timeout`] within `deadline` (the backend's own, for all but range
/// reads) and a little: no call waits on a silent store for longer. `spool` is a scratch file to upload.
pub fn silent(b: &dyn StoreBackend, deadline: Duration, spool: &std::path::Path) {
    let slack = Duration::from_millis(1500);
    let timed = |what: &str, f: &dyn Fn() -> Result<(), StoreError>| {
        let t = std::time::Instant::now();
        let r = f();
        let took = t.elapsed();
        assert!(
            matches!(r, Err(StoreError::Timeout { .. })),
            "{} {what}: expected a timeout, got {r:?}",
            b.url()
        );
        assert!(
            took < deadline + slack,
            "{} {what}: failed after {took:?} with a deadline of {deadline:?}",
            b.url()
        );
    };
    let k = key("silent");
    let data = Bytes::from_static(b"never stored");
    std::fs::write(spool, vec![7u8; 1 << 20]).expect("write the spool file");
    timed("get", &|| b.get(&k).map(|_| ()));
    timed("get_streamed", &|| b.get_streamed(&k, &mut |_| {}));
    timed("head", &|| b.head(&k).map(|_| ()));
    timed("put", &|| {
        b.put(&k, data.clone(), PutMode::Overwrite).map(|_| ())
    });
    timed("put (create)", &|| {
        b.put(&k, data.clone(), PutMode::Create).map(|_| ())
    });
    timed("put (if-match)", &|| {
        let v = Version {
            e_tag: Some("\"e\"".into()),
            version: None,
        };
        b.put(&k, data.clone(), PutMode::IfMatch(v)).map(|_| ())
    });
    timed("put_file", &|| b.put_file(&k, spool));
    timed("list", &|| b.list("conformance").map(|_| ()));
    timed("delete", &|| b.delete(&k));
    timed("get_range", &|| {
        b.get_range(&k, 0..10, deadline).map(|_| ())
    });
}
