//! Tests of the chunk cache.

use super::*;

fn chunk(i: u8, n: usize) -> (Digest, Vec<u8>) {
    let b = vec![i; n];
    (Digest::of(&b), b)
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn bounded_lru_never_evicts_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let c = ChunkCache::open(dir.path(), 3000).unwrap();
    let (d1, b1) = chunk(1, 1000);
    let (d2, b2) = chunk(2, 1000);
    let (d3, b3) = chunk(3, 1000);
    let (d4, b4) = chunk(4, 1000);
    c.insert(&d1, &b1).unwrap();
    c.insert(&d2, &b2).unwrap();
    c.insert(&d3, &b3).unwrap();
    let pinned = c.get(&d1).unwrap(); // d1 most recent and pinned
    c.insert(&d4, &b4).unwrap(); // evicts d2 (least recent)
    assert!(c.contains(&d1) && !c.contains(&d2) && c.contains(&d3) && c.contains(&d4));
    assert!(c.used() <= 3000);
    let mut buf = [0u8; 10];
    pinned.read_at(&mut buf, 990).unwrap();
    assert_eq!(buf, [1u8; 10]);
    assert!(
        pinned.read_at(&mut buf, 995).is_err(),
        "read past the chunk"
    );
    drop(pinned);
}

#[test]
fn survives_restart_and_drops_rotten_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let (d1, b1) = chunk(1, 500);
    let (d2, b2) = chunk(2, 500);
    {
        let c = ChunkCache::open(dir.path(), 10_000).unwrap();
        c.insert(&d1, &b1).unwrap();
        c.insert(&d2, &b2).unwrap();
    }
    // Rot the second chunk on disk (chunks sit at 4 KiB boundaries).
    let seg = OpenOptions::new()
        .write(true)
        .open(dir.path().join("seg-0"))
        .unwrap();
    seg.write_all_at(&[9u8; 500], 4096).unwrap();
    let c = ChunkCache::open(dir.path(), 10_000).unwrap();
    assert_eq!(c.len(), 2);
    let p = c.get(&d1).expect("intact chunk");
    let mut buf = vec![0u8; 500];
    p.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b1);
    assert!(c.get(&d2).is_none(), "rotten chunk served");
    assert!(!c.contains(&d2));
    // A torn record at the end of an index is ignored.
    drop((p, c));
    let mut idx = OpenOptions::new()
        .append(true)
        .open(dir.path().join("seg-0.idx"))
        .unwrap();
    idx.write_all(&[PUT, 1, 2, 3]).unwrap();
    let c = ChunkCache::open(dir.path(), 10_000).unwrap();
    assert_eq!(c.len(), 1);
    assert!(c.get(&d1).is_some());
}

#[test]
fn evictions_persist_and_empty_segments_go() {
    let dir = tempfile::tempdir().unwrap();
    // Segments of 8 KiB: two 3000-byte chunks each (4 KiB aligned).
    let c = ChunkCache::open_segmented(dir.path(), 6000, 8192).unwrap();
    let cs: Vec<_> = (1..=4).map(|i| chunk(i, 3000)).collect();
    for (d, b) in &cs {
        c.insert(d, b).unwrap();
    }
    // Bound 6000: only the last two remain; the first segment emptied and was deleted.
    assert_eq!(c.len(), 2);
    assert_eq!(c.used(), 6000);
    assert!(!c.contains(&cs[0].0) && !c.contains(&cs[1].0));
    assert_eq!(files(dir.path()), ["seg-1", "seg-1.idx"]);
    drop(c);
    // After a restart with a smaller bound, evictions made then stay made.
    let c = ChunkCache::open_segmented(dir.path(), 3000, 8192).unwrap();
    assert_eq!(c.len(), 1);
    drop(c);
    let c = ChunkCache::open_segmented(dir.path(), 100_000, 8192).unwrap();
    assert_eq!(c.len(), 1, "an evicted chunk came back");
    // A chunk larger than a segment gets one of its own.
    let (big, bb) = chunk(9, 20_000);
    c.insert(&big, &bb).unwrap();
    assert_eq!(c.get(&big).unwrap().size, 20_000);
    let (d, b) = cs[2..].iter().find(|(d, _)| c.contains(d)).unwrap();
    let mut buf = vec![0u8; 3000];
    c.get(d).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b);
}

#[test]
fn a_full_disk_fails_the_insert_and_keeps_what_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: NUL-terminated strings that outlive the call.
    let mounted = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            path.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            c"size=64k".as_ptr().cast(),
        )
    } == 0;
    if !strata_registry::testing::require("root (to mount a small tmpfs)", mounted) {
        return;
    }
    let c = ChunkCache::open(dir.path(), 1 << 30).unwrap();
    let mut stored = Vec::new();
    let err = (1..=8u8)
        .map(|i| chunk(i, 16 << 10))
        .find_map(|(d, b)| match c.insert(&d, &b) {
            Ok(()) => {
                stored.push((d, b));
                None
            }
            Err(e) => Some(e),
        })
        .expect("a 64 KiB filesystem took 128 KiB");
    assert!(err.to_string().contains("seg-0"), "{err}");
    assert!(!stored.is_empty());
    assert_eq!(c.len(), stored.len());
    for (d, b) in &stored {
        let mut buf = vec![0u8; b.len()];
        c.get(d).unwrap().read_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b);
    }
    drop(c);
    // After a restart the same chunks, and only those, are there.
    let c = ChunkCache::open(dir.path(), 1 << 30).unwrap();
    assert_eq!(c.len(), stored.len());
    assert!(stored.iter().all(|(d, _)| c.get(d).is_some()));
    drop(c);
    // SAFETY: as above.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
}

#[test]
fn concurrent_inserts_reads_and_evictions_never_serve_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    // Small bound and segments: constant eviction, segment turnover and hole punching.
    let c = ChunkCache::open_segmented(dir.path(), 100 << 10, 64 << 10).unwrap();
    let chunks: Arc<Vec<(Digest, Vec<u8>)>> = Arc::new(
        (0..64u32)
            .map(|i| {
                let n = 1000 + (i as usize * 7919) % (20 << 10);
                let b: Vec<u8> = (0..n)
                    .map(|j| (j as u32 ^ i.wrapping_mul(2654435761)) as u8)
                    .collect();
                (Digest::of(&b), b)
            })
            .collect(),
    );
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (c, chunks) = (c.clone(), chunks.clone());
            s.spawn(move || {
                let mut x = t.wrapping_mul(0x9e3779b97f4a7c15) | 1;
                for _ in 0..500 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let (d, b) = &chunks[(x % 64) as usize];
                    if x % 3 == 0 {
                        c.insert(d, b).unwrap();
                    } else if let Some(p) = c.get(d) {
                        let mut buf = vec![0u8; b.len()];
                        p.read_at(&mut buf, 0).unwrap();
                        assert_eq!(&buf, b, "wrong bytes for a cached chunk");
                    }
                }
            });
        }
    });
    assert!(c.used() <= 100 << 10, "used {} over the bound", c.used());
    let n = c.len();
    drop(c);
    let c = ChunkCache::open_segmented(dir.path(), 100 << 10, 64 << 10).unwrap();
    assert_eq!(c.len(), n, "a restart changed what is cached");
    for (d, b) in chunks.iter() {
        if let Some(p) = c.get(d) {
            let mut buf = vec![0u8; b.len()];
            p.read_at(&mut buf, 0).unwrap();
            assert_eq!(&buf, b, "wrong bytes after a restart");
        }
    }
    assert_eq!(c.len(), n, "a chunk failed its check after a restart");
}

#[test]
fn the_old_layout_is_cleared() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ab")).unwrap();
    std::fs::write(dir.path().join("ab").join("abcd"), b"x").unwrap();
    let c = ChunkCache::open(dir.path(), 1000).unwrap();
    assert!(c.is_empty());
    assert!(files(dir.path()).is_empty());
}
