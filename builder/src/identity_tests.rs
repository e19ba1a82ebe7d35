//! Reproducible layers: one input, one layer digest, whatever the store held before the build.

use std::path::Path;

use proptest::prelude::*;
use strata_registry::digest::Digest;
use strata_registry::model::LayerKind;
use strata_registry::store::Store;

use crate::build::{build_dir, BuildOptions, BuiltLayer};

/// A store in a temporary directory, with its own index cache.
struct TestStore {
    _dir: tempfile::TempDir,
    store: Store,
    cache: std::path::PathBuf,
}

fn new_store() -> TestStore {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().join("store").display());
    let store = Store::open(&url).expect("store");
    let cache = dir.path().join("index");
    TestStore {
        _dir: dir,
        store,
        cache,
    }
}

/// Writes `files` (path, content) under a new directory.
fn tree(files: &[(String, Vec<u8>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (p, content) in files {
        let path = dir.path().join(p);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, content).expect("write");
    }
    // Directory times would follow the writes: fix them, as an unchanged checkout has them.
    let mut dirs = vec![dir.path().to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let e = e.expect("entry");
            if e.file_type().expect("type").is_dir() {
                dirs.push(e.path());
            }
        }
        let f = std::fs::File::open(&d).expect("open dir");
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        f.set_modified(t).expect("set mtime");
    }
    dir
}

/// Builds `root` into `s` with store-wide dedup on, 4 KiB chunks, and every foreign blob referenced
/// however little it gives (so that placement varies as much as it can).
fn build(s: &TestStore, root: &Path) -> BuiltLayer {
    let mut opts = BuildOptions::new(LayerKind::Base);
    opts.chunk_size = 4096;
    opts.threads = 2;
    opts.index = Some(s.cache.clone());
    opts.min_foreign_bytes = 0;
    build_dir(&s.store, root, opts).expect("build")
}

/// Files made of blocks of a shared pool (so that trees share chunks), with a tail of their own.
fn files(pool: &[Vec<u8>], spec: &[(u8, Vec<u8>, u16)]) -> Vec<(String, Vec<u8>)> {
    spec.iter()
        .enumerate()
        .map(|(i, (name, blocks, tail))| {
            let mut content: Vec<u8> = blocks
                .iter()
                .flat_map(|b| pool[*b as usize % pool.len()].clone())
                .collect();
            content.extend((0..*tail).map(|k| (k as u8) ^ *name));
            (format!("d{}/f{i}-{name}", name % 3), content)
        })
        .collect()
}

fn pool() -> Vec<Vec<u8>> {
    (0..6u8)
        .map(|b| {
            (0..4096u32)
                .map(|k| (k as u8).wrapping_mul(b + 1) ^ b)
                .collect()
        })
        .collect()
}

type Spec = Vec<(u8, Vec<u8>, u16)>;

fn spec() -> impl Strategy<Value = Spec> {
    prop::collection::vec(
        (
            any::<u8>(),
            // Up to 80 KiB: files from 64 KiB up are cut into 4 KiB chunks, which files share.
            prop::collection::vec(0u8..6, 0..20),
            0u16..6000,
        ),
        1..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn one_input_gives_one_layer_digest(
        t in spec(),
        others in prop::collection::vec((spec(), any::<u64>()), 1..3),
    ) {
        let pool = pool();
        let mine = files(&pool, &t);
        let input = tree(&mine);
        let first_store = new_store();
        let first = build(&first_store, input.path());
        let again = build(&first_store, input.path());
        prop_assert_eq!(again.digest, first.digest, "rebuild into the store that holds it");
        prop_assert!(again.reused);
        let empty = new_store();
        prop_assert_eq!(build(&empty, input.path()).digest, first.digest, "into an empty store");
        let busy = new_store();
        for (o, mask) in &others {
            // Another tree, with some of this tree's files (so that their chunks are found elsewhere).
            let mut theirs = files(&pool, o);
            theirs.extend(
                mine.iter()
                    .enumerate()
                    .filter(|(i, _)| mask >> (i % 64) & 1 == 1)
                    .map(|(i, (_, c))| (format!("theirs/{i}"), c.clone())),
            );
            let other = tree(&theirs);
            build(&busy, other.path());
        }
        let after = build(&busy, input.path());
        prop_assert_eq!(after.digest, first.digest, "after unrelated builds");
        let stored = busy.store.get_layer(&after.digest).expect("stored layer");
        prop_assert_eq!(stored, after.descriptor);
    }
}

#[test]
fn placement_differs_but_the_name_does_not() {
    let pool = pool();
    let shared = files(&pool, &[(1, vec![0, 1, 2], 100)]);
    let mut mine = shared.clone();
    mine.extend(files(&pool, &[(2, vec![3, 4], 10), (5, vec![], 3000)]));
    let input = tree(&mine);
    let fresh = new_store();
    let a = build(&fresh, input.path());
    let busy = new_store();
    build(&busy, tree(&shared).path());
    let b = build(&busy, input.path());
    assert_eq!(a.digest, b.digest);
    assert!(!b.reused);
    assert_ne!(
        a.descriptor.meta.digest, b.descriptor.meta.digest,
        "the second build references the blob of the first tree: another placement"
    );
    assert_eq!(
        b.descriptor.blobs.len(),
        2,
        "its new blob and a foreign one"
    );
    // Both placements resolve every file to the same chunks.
    let resolved = |s: &TestStore, layer: &BuiltLayer| -> Vec<Vec<Option<Digest>>> {
        let image = crate::erofs::ErofsImage::parse(
            s.store
                .get_meta(&layer.descriptor.meta.digest)
                .expect("meta"),
        )
        .expect("erofs");
        let mut digests = crate::chunkmap::ChunkDigests::new(&s.store);
        mine.iter()
            .map(|(p, _)| {
                let inode = image.lookup(p.as_bytes()).expect("lookup").expect("found");
                digests
                    .file_chunks(&image, &layer.descriptor.blobs, &inode)
                    .expect("chunks")
            })
            .collect()
    };
    let chunks = resolved(&fresh, &a);
    assert!(chunks.iter().flatten().flatten().count() >= 3);
    assert_eq!(chunks, resolved(&busy, &b));
}

#[test]
fn a_rebuild_after_the_layers_blob_is_condemned_stores_a_new_placement() {
    let pool = pool();
    let input = tree(&files(&pool, &[(7, vec![0, 5], 5000)]));
    let s = new_store();
    let a = build(&s, input.path());
    let blob = a.descriptor.blobs[0].digest;
    let mark = format!("gc/condemned/blobs/{}", blob.hex());
    s.store
        .put_index(&mark, b"condemned".to_vec())
        .expect("condemn");
    let b = build(&s, input.path());
    assert_eq!(a.digest, b.digest);
    assert!(!b.reused, "a condemned placement is not relied on");
    assert_eq!(s.store.get_layer(&a.digest).expect("layer"), b.descriptor);
}
