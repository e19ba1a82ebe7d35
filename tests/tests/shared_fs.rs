//! `file://` stores on a filesystem shared by several clients: the backend conformance suite on every
//! client's mount, objects written through one client read through another, and tags moved by
//! compare-and-swap from several clients at once with no update lost, and gc on one client while a
//! builder on another has an image in flight.
//!
//! The clients are the mount points in `STRATA_MFS_MOUNTS` (space-separated: one MooseFS volume mounted
//! several times by `scripts/cluster/moosefs start`, each mount its own FUSE client, session and caches).
//! Without it the "clients" are one local directory seen twice, so the tests still run (quickly) in
//! every `cargo test`; `scripts/test` runs them again on MooseFS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use strata_registry::store::{
    conformance, ObjectStoreBackend, PutMode, Store, StoreBackend, StoreError,
};

/// The same directory as each client sees it, and what to remove afterwards.
struct Clients {
    roots: Vec<PathBuf>,
    _local: Option<tempfile::TempDir>,
}

impl Drop for Clients {
    fn drop(&mut self) {
        if self._local.is_none() {
            let _ = std::fs::remove_dir_all(&self.roots[0]);
        }
    }
}

/// A fresh directory named `name` on the shared volume, as every client sees it.
fn clients(name: &str) -> Clients {
    let unique = format!(
        "{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    match std::env::var("STRATA_MFS_MOUNTS") {
        Ok(m) if !m.trim().is_empty() => {
            let roots: Vec<PathBuf> = m
                .split_whitespace()
                .map(|p| Path::new(p).join(&unique))
                .collect();
            assert!(
                roots.len() >= 2,
                "STRATA_MFS_MOUNTS needs two mounts or more: {m}"
            );
            std::fs::create_dir_all(&roots[0]).expect("mkdir on the shared volume");
            for r in &roots {
                assert!(r.is_dir(), "{} is not seen by every client", r.display());
            }
            eprintln!("clients: {roots:?}");
            Clients {
                roots,
                _local: None,
            }
        }
        _ => {
            let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
            let root = dir.path().join(&unique);
            Clients {
                roots: vec![root.clone(), root],
                _local: Some(dir),
            }
        }
    }
}

#[test]
fn a_file_store_conforms_on_every_client_and_clients_see_each_others_objects() {
    let c = clients("conformance");
    for (i, root) in c.roots.iter().enumerate() {
        let b = ObjectStoreBackend::local(&root.join(format!("own-{i}"))).expect("local");
        conformance::run(&b);
    }
    let shared: Vec<_> = c
        .roots
        .iter()
        .map(|r| ObjectStoreBackend::local(&r.join("shared")).expect("local"))
        .collect();
    let data = Bytes::from((0..300_000u32).map(|i| (i % 253) as u8).collect::<Vec<_>>());
    shared[0]
        .put("blobs/x", data.clone(), PutMode::Overwrite)
        .expect("put");
    for b in &shared[1..] {
        assert_eq!(b.get("blobs/x").expect("get").0, data);
        assert_eq!(b.list("blobs").expect("list"), ["blobs/x"]);
        let r = b.put("blobs/x", Bytes::from_static(b"other"), PutMode::Create);
        assert!(matches!(r, Err(StoreError::Precondition(_))), "{r:?}");
    }
    // Create-only from every client at once: exactly one wins.
    let wins: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let b = &shared[i % shared.len()];
                s.spawn(move || {
                    b.put("race/one", Bytes::from(vec![i as u8; 64]), PutMode::Create)
                        .is_ok() as usize
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("join")).sum()
    });
    assert_eq!(wins, 1);
    // If-match from every client at once, many rounds: exactly one winner each time.
    for round in 0..20u8 {
        let k = format!("race/if-match-{round}");
        let v = shared[0]
            .put(&k, Bytes::from_static(b"start"), PutMode::Overwrite)
            .expect("put");
        let wins: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..6)
                .map(|i| {
                    let (b, k, v) = (&shared[i % shared.len()], &k, v.clone());
                    s.spawn(move || {
                        b.put(k, Bytes::from(vec![i as u8; 64]), PutMode::IfMatch(v))
                            .is_ok() as usize
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("join")).sum()
        });
        assert_eq!(wins, 1, "round {round}: {wins} if-match writers won");
    }
}

/// Writers on every client move one tag at once: compare-and-swap holds ([`strata_tests::tagrace`]).
#[test]
fn tag_compare_and_swap_holds_across_clients() {
    let c = clients("tags");
    let stores: Vec<Arc<Store>> = c
        .roots
        .iter()
        .map(|r| {
            let url = format!("file://{}", r.join("store").display());
            Arc::new(Store::open(&url).expect("open"))
        })
        .collect();
    assert!(strata_tests::tagrace::race(&stores, "app:latest", 4, 25) > 0);
}

/// The store of client `i`, with an index cache of its own on local disk (as on separate machines).
fn client_store(c: &Clients, i: usize, cache: &Path) -> strata_tests::StoreEnv {
    let mut s = strata_tests::StoreEnv::local(&c.roots[i].join("store"));
    for (k, v) in s.env.iter_mut() {
        if k == "STRATA_INDEX_CACHE" {
            *v = cache.join(format!("client-{i}")).display().to_string();
        }
    }
    s
}

/// A builder on one client, gc on another: an image still untagged is young and kept; what no tag
/// reaches goes once past the grace period; every tagged image stays readable from every client.
#[test]
fn gc_on_one_client_keeps_what_a_builder_on_another_needs() {
    let c = clients("gc");
    let cache = strata_tests::scratch("shared-index");
    let builder = client_store(&c, 0, cache.path());
    let collector = client_store(&c, c.roots.len() - 1, cache.path());
    let files = |seed: u32| vec![("a.bin", strata_tests::random_bytes(300_000, seed))];
    strata_tests::build_image(&builder, "app:v1", &files(1));
    // An image built and not yet tagged (a builder in flight), and one no tag will ever name.
    let src = strata_tests::scratch("gc-untagged");
    std::fs::write(
        src.path().join("b.bin"),
        strata_tests::random_bytes(200_000, 2),
    )
    .expect("write");
    let manifest = builder.ok(&["build", src.path().to_str().expect("utf8")]);
    let young = strata_tests::json(&collector.ok(&["gc", "--json"]));
    assert_eq!(young["deleted"].as_u64(), Some(0), "{young}");
    assert!(young["young"].as_u64().expect("young") >= 3, "{young}");
    // The builder finishes: the image gets its tag; a collection with no grace keeps it.
    let digest = manifest.lines().last().expect("digest").trim();
    builder.ok(&["tag", digest, "app:v2"]);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    strata_tests::build_image(&builder, "gone:v1", &files(3));
    builder.ok(&["rmi", "gone:v1"]);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let done = strata_tests::json(&collector.ok(&["gc", "--grace", "0s", "--json"]));
    assert!(done["deleted"].as_u64().expect("deleted") >= 1, "{done}");
    for s in [&builder, &collector] {
        let a = s.run(&["cat", "app:v1", "/data/a.bin"]);
        assert!(
            a.status.success() && a.stdout == files(1)[0].1,
            "app:v1 {:?}",
            a.status
        );
        let b = s.run(&["cat", "app:v2", "/b.bin"]);
        assert!(b.status.success() && b.stdout == strata_tests::random_bytes(200_000, 2));
    }
}
