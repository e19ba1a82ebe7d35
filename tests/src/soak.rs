//! What the builders of the machine tests build and what their nodes check (see `tests/tests/soak.rs`).
//!
//! Builder `k`'s round `r` is a busybox root filesystem with, in `/data`: two files every builder
//! builds alike (`common-0`, `common-1`: chunks the builders can deduplicate against each other), one
//! file that is the same in all of one builder's rounds (`tool`), one file new in every round (`round`),
//! and `ID` = `"k r"`. A node that mounts any tag reads `ID` first and so knows every byte the image
//! must hold ([`expected`]); [`check_tree`] reads every regular file of the rootfs and compares.
//! [`check_reachable`] walks the store from every tag down to each blob and fails on anything missing.

use std::collections::BTreeMap;
use std::path::Path;

use strata_registry::store::{key, Store};

use crate::{busybox_rootfs, random_bytes};

/// Chunk size of the builds: small, so that little data makes many chunks.
pub const CHUNK: u64 = 256 << 10;
/// Sizes of the files in `/data`.
const COMMON: usize = 1 << 20;
const TOOL: usize = 512 << 10;
const ROUND: usize = 1 << 20;

/// Chunks a builder's own files (`tool` and `round`) add to a build, and `round` alone.
pub const OWN_CHUNKS: u64 = ((TOOL + ROUND) as u64).div_ceil(CHUNK);
pub const ROUND_CHUNKS: u64 = (ROUND as u64).div_ceil(CHUNK);

/// The files of `/data` in builder `k`'s round `r`.
pub fn data_files(k: u32, r: u32) -> Vec<(String, Vec<u8>)> {
    vec![
        ("common-0".into(), random_bytes(COMMON, 1000)),
        ("common-1".into(), random_bytes(COMMON, 1001)),
        ("tool".into(), random_bytes(TOOL, 2000 + k)),
        ("round".into(), random_bytes(ROUND, 3000 + 100 * k + r)),
        ("ID".into(), format!("{k} {r}\n").into_bytes()),
    ]
}

/// Writes the source tree of builder `k`'s round `r` into `dir`.
pub fn write_source(dir: &Path, k: u32, r: u32) {
    busybox_rootfs(dir);
    for (name, data) in data_files(k, r) {
        std::fs::write(dir.join("data").join(name), data).expect("write source");
    }
}

/// Every regular file of builder `k`'s round `r`, by path relative to the root.
pub fn expected(k: u32, r: u32) -> BTreeMap<String, Vec<u8>> {
    let mut m: BTreeMap<String, Vec<u8>> = data_files(k, r)
        .into_iter()
        .map(|(n, d)| (format!("data/{n}"), d))
        .collect();
    m.insert(
        "bin/busybox".into(),
        std::fs::read("/bin/busybox").expect("busybox-static"),
    );
    m.insert("etc/os-release".into(), b"ID=strata-test\n".to_vec());
    m.insert(
        "etc/passwd".into(),
        b"root:x:0:0:root:/root:/bin/sh\n".to_vec(),
    );
    m
}

/// Reads every regular file under `root` (a sandbox's rootfs) and compares it with what the image's
/// source held; returns the image's `(k, r)` and the bytes read, or what differs.
pub fn check_tree(root: &Path) -> Result<((u32, u32), u64), String> {
    check_tree_with(root, &[])
}

/// [`check_tree`] of an image with `extra` files in `/data` besides the usual ones.
pub fn check_tree_with(
    root: &Path,
    extra: &[(String, Vec<u8>)],
) -> Result<((u32, u32), u64), String> {
    let id = std::fs::read_to_string(root.join("data/ID")).map_err(|e| format!("data/ID: {e}"))?;
    let mut it = id.split_whitespace().map(str::parse::<u32>);
    let (Some(Ok(k)), Some(Ok(r))) = (it.next(), it.next()) else {
        return Err(format!("data/ID holds {id:?}"));
    };
    let mut want = expected(k, r);
    for (name, data) in extra {
        want.insert(format!("data/{name}"), data.clone());
    }
    let mut seen = 0usize;
    let mut bytes = 0u64;
    for e in walkdir::WalkDir::new(root).sort_by_file_name() {
        let e = e.map_err(|e| format!("walk: {e}"))?;
        if !e.file_type().is_file() {
            continue;
        }
        let rel = e
            .path()
            .strip_prefix(root)
            .map_err(|e| e.to_string())?
            .to_string_lossy()
            .into_owned();
        let got = std::fs::read(e.path()).map_err(|err| format!("{rel}: {err}"))?;
        match want.get(&rel) {
            Some(w) if *w == got => {}
            Some(w) => {
                return Err(format!(
                    "{rel}: {} bytes differ from the source's {}",
                    got.len(),
                    w.len()
                ))
            }
            None => return Err(format!("{rel}: not in the source")),
        }
        seen += 1;
        bytes += got.len() as u64;
    }
    if seen != want.len() {
        return Err(format!("{seen} files of the source's {}", want.len()));
    }
    Ok(((k, r), bytes))
}

/// Walks `store` from every tag: each manifest, layer descriptor and metadata (read and verified) and
/// each blob (present) must be there, and no tag may be broken. Returns the tags and objects checked.
pub fn check_reachable(store: &Store) -> (usize, usize) {
    let tags = store.tags().expect("list tags");
    assert!(tags.broken.is_empty(), "broken tags: {:?}", tags.broken);
    let mut seen = std::collections::BTreeSet::new();
    for (t, m) in &tags.good {
        let manifest = store
            .get_manifest(m)
            .unwrap_or_else(|e| panic!("{t}: manifest {m}: {e}"));
        seen.insert(key::manifest(m));
        for l in &manifest.layers {
            if !seen.insert(key::layer(&l.digest)) {
                continue;
            }
            let d = store
                .get_layer(&l.digest)
                .unwrap_or_else(|e| panic!("{t}: layer {}: {e}", l.digest));
            store
                .get_meta(&d.meta.digest)
                .unwrap_or_else(|e| panic!("{t}: metadata {}: {e}", d.meta.digest));
            seen.insert(key::meta(&d.meta.digest));
            for b in &d.blobs {
                let k = key::blob(&b.digest);
                assert!(
                    store.exists(&k).expect("head"),
                    "{t}: blob {} is missing",
                    b.digest
                );
                seen.insert(k);
            }
        }
    }
    (tags.good.len(), seen.len())
}
