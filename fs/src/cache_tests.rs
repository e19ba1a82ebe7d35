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
fn bounded_lru_and_readers_keep_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let c = ChunkCache::open(dir.path(), 3000).unwrap();
    let (d1, b1) = chunk(1, 1000);
    let (d2, b2) = chunk(2, 1000);
    let (d3, b3) = chunk(3, 1000);
    let (d4, b4) = chunk(4, 1000);
    let (d5, b5) = chunk(5, 1000);
    c.insert(&d1, &b1).unwrap();
    c.insert(&d2, &b2).unwrap();
    c.insert(&d3, &b3).unwrap();
    let reading = c.get(&d1).unwrap(); // d1 most recent
    c.insert(&d4, &b4).unwrap(); // evicts d2 (least recent)
    assert!(c.contains(&d1) && !c.contains(&d2) && c.contains(&d3) && c.contains(&d4));
    assert!(c.used() <= 3000);
    c.insert(&d5, &b5).unwrap(); // evicts d3
    c.get(&d4).unwrap();
    c.insert(&d2, &b2).unwrap(); // evicts d1, which is being read
    assert!(!c.contains(&d1));
    let mut buf = [0u8; 10];
    reading.read_at(&mut buf, 990).unwrap();
    assert_eq!(buf, [1u8; 10], "an eviction changed a read in progress");
    assert!(
        reading.read_at(&mut buf, 995).is_err(),
        "read past the chunk"
    );
}

/// Flips one byte of a cache file at `at`.
fn flip(path: &Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}

#[test]
fn a_byte_flipped_on_disk_while_open_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    // No verified copies in memory: every get reads the segment.
    let c = ChunkCache::open_with(dir.path(), 1 << 20, SEGMENT_BYTES, 0).unwrap();
    let (d1, b1) = chunk(1, 10_000);
    let (d2, b2) = chunk(2, 10_000);
    c.insert(&d1, &b1).unwrap();
    c.insert(&d2, &b2).unwrap();
    let mut buf = vec![0u8; 10_000];
    c.get(&d2).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b2);
    // The second chunk starts at 12 KiB; flip its last byte, after it was read once.
    flip(&dir.path().join("seg-0"), 12_288 + 9_999);
    assert!(c.get(&d2).is_none(), "a flipped chunk was served");
    assert!(!c.contains(&d2), "a flipped chunk stayed cached");
    assert_eq!(c.stats.rejected.load(Ordering::Relaxed), 1);
    // Its neighbour is intact; the chunk can be cached again (a refetch) and is served from its new place.
    c.get(&d1).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b1);
    c.insert(&d2, &b2).unwrap();
    c.get(&d2).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b2);

    // With verified copies in memory: a copy is served as it was verified; once it leaves memory the
    // disk is checked again.
    let dir = tempfile::tempdir().unwrap();
    let c = ChunkCache::open_with(dir.path(), 1 << 20, SEGMENT_BYTES, 10_000).unwrap();
    c.insert(&d1, &b1).unwrap();
    flip(&dir.path().join("seg-0"), 5);
    c.get(&d1).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b1, "the verified copy");
    c.insert(&d2, &b2).unwrap(); // pushes d1's copy out of memory
    assert!(c.get(&d1).is_none(), "a flipped chunk was served");
    assert_eq!(c.stats.checked.load(Ordering::Relaxed), 1);
}

/// A cache in `dir` holding `b` on disk only (inserted, then the cache reopened: nothing in memory).
fn on_disk_only(dir: &Path, d: &Digest, b: &[u8]) -> Arc<ChunkCache> {
    ChunkCache::open(dir, 64 << 20)
        .unwrap()
        .insert(d, b)
        .unwrap();
    ChunkCache::open(dir, 64 << 20).unwrap()
}

#[test]
fn concurrent_readers_of_a_chunk_check_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let (d, b) = chunk(7, 4 << 20);
    let c = on_disk_only(dir.path(), &d, &b);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let mut buf = vec![0u8; 4096];
                c.get(&d).unwrap().read_at(&mut buf, 1 << 20).unwrap();
                assert_eq!(buf, b[1 << 20..(1 << 20) + 4096]);
            });
        }
    });
    assert_eq!(c.stats.checked.load(Ordering::Relaxed), 1);
}

#[test]
fn advised_chunks_are_checked_ahead_of_their_reader() {
    let dir = tempfile::tempdir().unwrap();
    let (d, b) = chunk(3, 1 << 20);
    let c = on_disk_only(dir.path(), &d, &b);
    c.advise(&d);
    let start = std::time::Instant::now();
    while c.stats.checked.load(Ordering::Relaxed) == 0 {
        assert!(
            start.elapsed().as_secs() < 10,
            "the advised chunk was not checked"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // The reader finds it checked: no second read and hash.
    let mut buf = vec![0u8; 4096];
    c.get(&d).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b[..4096]);
    assert_eq!(c.stats.checked.load(Ordering::Relaxed), 1);
    // A chunk in memory already is not checked again.
    c.advise(&d);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(c.stats.checked.load(Ordering::Relaxed), 1);
}

#[test]
fn files_are_the_daemons_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
    let (d, b) = chunk(1, 100);
    c.insert(&d, &b).unwrap();
    drop(c);
    let mode = |n: &str| {
        std::fs::metadata(dir.path().join(n))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!((mode("seg-0"), mode("seg-0.idx")), (0o600, 0o600));
    // An older daemon's world-readable files are fixed when the cache opens.
    for n in ["seg-0", "seg-0.idx"] {
        std::fs::set_permissions(dir.path().join(n), std::fs::Permissions::from_mode(0o644))
            .unwrap();
    }
    let _c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
    assert_eq!((mode("seg-0"), mode("seg-0.idx")), (0o600, 0o600));
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

/// The cost of checking chunks read from disk, on a sequential read of 128 KiB requests (as the FUSE
/// blob server gets them) over 256 MiB of 1 MiB chunks — more than the verified copies in memory hold, so
/// every chunk is read from its segment (page cache) and hashed once: before (a `pread` per request,
/// unchecked, as the cache served before checking on every read) and after. Run with
/// `cargo test -p strata-fs --release verify_cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn verify_cost() {
    const CHUNK: usize = 1 << 20;
    const REQ: usize = 128 << 10;
    let dir = tempfile::tempdir().unwrap();
    let c = ChunkCache::open(dir.path(), 1 << 30).unwrap();
    let chunks: Vec<Digest> = (0..256u32)
        .map(|i| {
            let b: Vec<u8> = (0..CHUNK)
                .map(|j| (j as u32 ^ i.wrapping_mul(2654435761)) as u8)
                .collect();
            let d = Digest::of(&b);
            c.insert(&d, &b).unwrap();
            d
        })
        .collect();
    let places: Vec<(Arc<File>, u64)> = {
        let st = c.lock();
        chunks
            .iter()
            .map(|d| {
                let e = &st.entries[d];
                (st.segments[&e.seg].data.clone(), e.offset)
            })
            .collect()
    };
    let mut buf = vec![0u8; REQ];
    let mb = (chunks.len() * CHUNK) as f64 / (1 << 20) as f64;
    for round in 0..3 {
        let t = std::time::Instant::now();
        for (file, offset) in &places {
            for r in (0..CHUNK).step_by(REQ) {
                file.read_exact_at(&mut buf, offset + r as u64).unwrap();
            }
        }
        let before = mb / t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for d in &chunks {
            for r in (0..CHUNK).step_by(REQ) {
                c.get(d).unwrap().read_at(&mut buf, r as u64).unwrap();
            }
        }
        let after = mb / t.elapsed().as_secs_f64();
        let copy = c.get(&chunks[0]).unwrap().bytes().clone();
        let t = std::time::Instant::now();
        for _ in 0..64 {
            assert!(chunks[0].matches(&copy));
        }
        let hash = 64.0 / t.elapsed().as_secs_f64();
        eprintln!(
            "round {round}: unchecked pread {before:.0} MiB/s, checked get+read_at {after:.0} MiB/s, \
             BLAKE3 alone {hash:.0} MiB/s, checks {}",
            c.stats.checked.load(Ordering::Relaxed)
        );
    }
}

#[test]
fn a_reopened_cache_appends_to_its_last_segment() {
    let dir = tempfile::tempdir().unwrap();
    let (d1, b1) = chunk(1, 5000);
    let (d2, b2) = chunk(2, 5000);
    {
        let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
        c.insert(&d1, &b1).unwrap();
    }
    let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
    c.insert(&d2, &b2).unwrap();
    assert_eq!(
        files(dir.path()),
        ["seg-0", "seg-0.idx"],
        "a restart started a segment"
    );
    drop(c);
    // Both chunks there after another reopen, each with its own bytes.
    let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
    let mut buf = vec![0u8; 5000];
    c.get(&d1).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b1);
    c.get(&d2).unwrap().read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, b2);
}

/// Bytes of `path` in the page cache (util-linux `fincore`).
fn resident(path: &Path) -> u64 {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn segment_pages_leave_the_page_cache() {
    // On a disk filesystem: tmpfs pages are the file itself.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let c = ChunkCache::open_with(dir.path(), 64 << 20, SEGMENT_BYTES, 0).unwrap();
    let chunks: Vec<_> = (0..8u8)
        .map(|i| {
            // Odd sizes: chunks straddle the page cache's large folios.
            let n = (1u32 << 20) - 3000 * u32::from(i);
            let b: Vec<u8> = (0..n).map(|j| (j % 251) as u8 ^ i).collect();
            (Digest::of(&b), b)
        })
        .collect();
    for (d, b) in &chunks {
        c.insert(d, b).unwrap();
    }
    // Written pages go once they are on disk, by the settler thread. Looking (fincore) while it drops
    // would keep the pages looked at: wait for it to finish, then look.
    let seg = dir.path().join("seg-0");
    let start = std::time::Instant::now();
    while c.settler.pending() > 0 {
        assert!(start.elapsed().as_secs() < 20, "the settler never finished");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(resident(&seg), 0, "written pages stay cached");
    // A chunk read back from disk (none is kept verified in memory here) leaves no page behind.
    for (d, b) in &chunks {
        assert_eq!(&c.get(d).unwrap().bytes()[..], &b[..]);
    }
    assert_eq!(resident(&seg), 0);
}

#[test]
fn a_scrub_drops_a_chunk_gone_bad_on_disk_and_nothing_else() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    // Nothing kept verified in memory: reads go to disk.
    let c = ChunkCache::open_with(dir.path(), 64 << 20, SEGMENT_BYTES, 0).unwrap();
    let chunks: Vec<_> = (0..4u8)
        .map(|i| {
            let b: Vec<u8> = (0..100_000u32).map(|j| (j % 251) as u8 ^ i).collect();
            (Digest::of(&b), b)
        })
        .collect();
    for (d, b) in &chunks {
        c.insert(d, b).unwrap();
    }
    let clean = c.scrub();
    assert_eq!((clean.chunks, clean.bytes, clean.bad), (4, 400_000, 0));
    // A bit flips on disk in the third chunk.
    let (seg, offset) = {
        let st = c.lock();
        let e = &st.entries[&chunks[2].0];
        (e.seg, e.offset)
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(format!("seg-{seg}")))
        .unwrap();
    std::os::unix::fs::FileExt::write_at(&f, &[chunks[2].1[10] ^ 1], offset + 10).unwrap();
    drop(f);
    let found = c.scrub();
    assert_eq!((found.chunks, found.bad), (4, 1));
    assert!(!c.contains(&chunks[2].0), "the bad chunk is dropped");
    for (i, (d, b)) in chunks.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert_eq!(&c.get(d).unwrap().bytes()[..], &b[..], "chunk {i}");
    }
    assert_eq!(c.scrub().bad, 0);
}
