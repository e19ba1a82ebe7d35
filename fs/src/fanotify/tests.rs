//! The parser and journal records (pure), then the server on this kernel's real pre-content events:
//! readers in child processes (`cat`), so the kernel reports them as readers other than the server.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use strata_registry::store::Fault;
use strata_registry::toc::BLOCK_SIZE;

use super::events::read_batch;
use super::sys::{self, Event};
use super::*;
use crate::testkit::{bytes, Kit};

proptest! {
    #[test]
    fn events_parse_back(evs in prop::collection::vec(
        (any::<u64>(), -1i32..4096, any::<u32>(), prop::option::of((any::<u64>(), any::<u64>()))),
        0..8,
    )) {
        let evs: Vec<Event> = evs
            .into_iter()
            .map(|(mask, fd, pid, range)| Event { mask, fd: (fd >= 0).then_some(fd), pid, range })
            .collect();
        let buf: Vec<u8> = evs.iter().flat_map(sys::encode).collect();
        prop_assert_eq!(sys::parse(&buf).expect("parse"), evs);
    }

    #[test]
    fn any_bytes_parse_or_fail_without_panic(buf in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = sys::parse(&buf);
    }

    #[test]
    fn journal_records_round_trip(d in any::<[u8; 32]>(), o in any::<u64>(), c in any::<u64>(), p in any::<u32>()) {
        let rec = encode(&Digest(d), o, c, p);
        prop_assert_eq!(decode(&rec), Some((Digest(d), o, c, p)));
    }
}

#[test]
fn cut_events_are_refused() {
    let ev = Event {
        mask: sys::FAN_PRE_ACCESS,
        fd: Some(7),
        pid: 1,
        range: Some((0, 4096)),
    };
    let buf = sys::encode(&ev);
    for n in [1, 23, 24, 47] {
        assert!(sys::parse(&buf[..n]).is_err(), "{n} bytes");
    }
}

/// A kit, a blob of uneven chunks, and the blob's view as the kernel must read it.
fn blob(kit: &Kit) -> (Arc<BlobHandle>, String, Vec<u8>) {
    let chunks = vec![bytes(100_000, 1), bytes(4096, 2), bytes(70_001, 3)];
    let (h, key) = kit.blob(&chunks);
    let mut view = Vec::new();
    for c in &chunks {
        view.extend_from_slice(c);
        view.resize(
            view.len().div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize,
            0,
        );
    }
    (Arc::new(h), key, view)
}

/// Whether this kernel reports pre-content events to this process (root, Linux 6.14+).
fn have_events(dir: &std::path::Path) -> bool {
    let f = dir.join("probe");
    let ok = std::fs::write(&f, b"x").is_ok() && sys::probe(&f).is_none();
    strata_registry::testing::require("root and fanotify pre-content events (Linux 6.14+)", ok)
}

/// A server of one blob's view file, and what reading it must give.
struct Served {
    _dir: tempfile::TempDir,
    kit: Kit,
    s: Server,
    /// The view file.
    path: std::path::PathBuf,
    /// The view files' directory (a successor's too).
    views: std::path::PathBuf,
    h: Arc<BlobHandle>,
    key: String,
    want: Vec<u8>,
    blob: Digest,
}

/// [`Served`], not reading events yet, where this kernel reports pre-content events to this process.
fn unstarted() -> Option<Served> {
    unstarted_within(Duration::from_secs(5))
}

/// [`unstarted`], its reads due within `deadline`.
fn unstarted_within(deadline: Duration) -> Option<Served> {
    let dir = tempfile::tempdir().expect("tempdir");
    if !have_events(dir.path()) {
        return None;
    }
    let kit = Kit::new(deadline);
    let (h, key, want) = blob(&kit);
    let views = dir.path().join("views");
    let s = Server::new(
        &views,
        None,
        kit.fetcher.clone(),
        kit.metrics.clone(),
        Arc::default(),
    )
    .expect("server");
    let path = s.view(&h).expect("view file");
    Some(Served {
        _dir: dir,
        kit,
        s,
        path,
        views,
        blob: h.blob.digest,
        h,
        key,
        want,
    })
}

/// [`unstarted`], running.
fn served() -> Option<Served> {
    let t = unstarted()?;
    t.s.run();
    Some(t)
}

/// [`served`], its view file read whole (complete, so no longer watched).
fn complete() -> Option<(Served, Arc<ViewFile>)> {
    let t = served()?;
    assert!(cat(&t.path).stdout == t.want);
    let view = t.s.views.get(&t.blob).expect("view");
    crate::testkit::wait_until("complete file unwatched", || {
        view.unmarked.load(Ordering::Acquire)
    });
    Some((t, view))
}

fn cat(path: &std::path::Path) -> std::process::Output {
    Command::new("cat").arg(path).output().expect("run cat")
}

#[test]
fn readers_get_verified_bytes_filled_on_demand() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        key,
        want,
        blob,
        ..
    }) = served()
    else {
        return;
    };
    // The first block only: one chunk filled, then answered from the file without the store.
    let head = |n: &str| {
        let out = Command::new("head").args(["-c", n]).arg(&path).output();
        out.expect("run head").stdout
    };
    assert!(head("4096") == want[..4096]);
    assert!(s.stats.fills.load(Ordering::Relaxed) > 0);
    let fetched = kit.faults.reads(&key);
    assert!(head("4096") == want[..4096]);
    assert!(
        s.stats.hits.load(Ordering::Relaxed) > 0,
        "a filled range is a hit"
    );
    assert_eq!(
        kit.faults.reads(&key),
        fetched,
        "no fetch for a filled chunk"
    );
    let view = s.views.get(&blob).expect("view");
    assert!(!view.complete() && !view.unmarked.load(Ordering::Acquire));
    // The whole file: the exact view bytes, and then every chunk is in the file.
    let out = cat(&path);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout == want, "the reader saw the view's bytes");
    assert!(view.complete());
    // A complete file is no longer watched: its reads cause no event.
    for _ in 0..100 {
        if view.unmarked.load(Ordering::Acquire) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        view.unmarked.load(Ordering::Acquire),
        "complete file unwatched"
    );
    let events = || s.stats.hits.load(Ordering::Relaxed) + s.stats.fills.load(Ordering::Relaxed);
    let before = (events(), kit.faults.reads(&key));
    assert!(cat(&path).stdout == want);
    assert_eq!(
        (events(), kit.faults.reads(&key)),
        before,
        "no event, no fetch"
    );
    s.stop();
}

#[test]
fn a_failed_fetch_is_an_error_never_a_hole() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        key,
        want,
        ..
    }) = served()
    else {
        return;
    };
    let id = kit.faults.inject(Fault::error().key(&key));
    let out = cat(&path);
    assert!(!out.status.success(), "read of unfetchable data failed");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Input/output error"));
    assert!(s.stats.denied.load(Ordering::Relaxed) > 0);
    kit.faults.remove(id);
    assert!(cat(&path).stdout == want, "and works once the store does");
    s.stop();
}

/// How long a read whose store is stuck may take at most in these tests: well past their 500 ms
/// deadline, well short of the stuck store's 20 s hang limit.
const DENIED_WITHIN: Duration = Duration::from_secs(5);

#[test]
fn a_read_whose_store_is_stuck_is_denied_by_its_deadline() {
    let Some(t) = unstarted_within(Duration::from_millis(500)) else {
        return;
    };
    t.s.run();
    let stuck = t.kit.faults.inject(Fault::stuck().key(&t.key));
    let start = std::time::Instant::now();
    let out = cat(&t.path);
    let took = start.elapsed();
    assert!(!out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Input/output error"));
    assert!(
        took < DENIED_WITHIN,
        "denied by the deadline, not by the store: {took:?}"
    );
    t.kit.faults.remove(stuck);
    std::thread::sleep(crate::deadline::FAIL_FAST);
    assert!(
        cat(&t.path).stdout == t.want,
        "and read once the store answers"
    );
    t.s.stop();
}

#[path = "handover_tests.rs"]
mod handover;

#[test]
fn trimming_deletes_only_view_files_no_mounted_layer_uses() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        want,
        blob,
        ..
    }) = served()
    else {
        return;
    };
    let (other, _) = kit.blob(&[bytes(50_000, 9)]);
    let other = Arc::new(other);
    let other_path = s.view(&other).expect("second view file");
    assert!(cat(&path).stdout == want);
    assert!(cat(&other_path).status.success());
    let used: std::collections::HashSet<Digest> = [blob].into();
    // Within the bound: nothing goes.
    assert_eq!(s.trim(&used, u64::MAX), (0, 0));
    let (files, bytes) = s.trim(&used, 0);
    assert_eq!(files, 1);
    assert!(bytes > 0);
    assert!(!other_path.exists() && s.views.get(&other.blob.digest).is_none());
    assert!(
        path.exists(),
        "a used blob's file stays, whatever the bound"
    );
    assert!(cat(&path).stdout == want);
    // A trimmed blob used again starts over as a hole, filled on demand.
    let again = s.view(&other).expect("view file again");
    let out = cat(&again);
    assert!(
        out.status.success() && out.stdout.len() == 53_248,
        "{out:?}"
    );
    s.stop();
}

#[test]
fn a_view_file_is_its_blobs_only_cache() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        want,
        blob,
        h,
        ..
    }) = served()
    else {
        return;
    };
    assert!(cat(&path).stdout == want);
    let view = s.views.get(&blob).expect("view");
    assert!(view.complete());
    // Every chunk went from the fetch into the view file; the chunk cache holds none of them.
    for c in &h.toc.chunks {
        assert!(!kit.fetcher.cache().contains(&c.digest), "cached twice");
    }
    // The fetcher serves a kept chunk from the view file (what another mode's reader of the same
    // blob gets), byte for byte.
    let c = h.toc.chunks[2];
    let kept = kit.fetcher.cached(&h, 2).expect("cached").expect("kept");
    assert!(matches!(kept, crate::fetch::ChunkBytes::Home(..)));
    let mut buf = vec![0u8; 1000];
    kept.read_at(&mut buf, 5).expect("read from the view file");
    let at = c.block as usize * BLOCK_SIZE as usize + 5;
    assert!(buf == want[at..at + 1000]);
    assert!(
        kept.read_at(&mut buf, u64::from(c.len)).is_err(),
        "past its end"
    );
    // A trimmed view file is no longer a home: a fetch of its blob goes to the chunk cache again.
    assert_eq!(s.trim(&Default::default(), 0).0, 1);
    drop((view, kept));
    assert!(h.home().is_none());
    kit.fetcher.chunk(&h, 0).expect("fetched again");
    crate::testkit::wait_until("kept in the cache", || {
        kit.fetcher.cache().contains(&h.toc.chunks[0].digest)
    });
    s.stop();
}

#[test]
fn a_scrub_finds_a_chunk_gone_bad_at_rest_and_its_next_read_refills_it() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        key,
        want,
        blob,
        h,
        ..
    }) = served()
    else {
        return;
    };
    assert!(cat(&path).stdout == want);
    let clean = s.scrub();
    assert_eq!((clean.0, clean.1.chunks, clean.1.bad), (1, 3, 0));
    assert_eq!(
        clean.1.bytes,
        h.toc.chunks.iter().map(|c| u64::from(c.len)).sum::<u64>()
    );
    // A bit flips in the second chunk, on disk.
    let c = h.toc.chunks[1];
    let at = c.block as u64 * BLOCK_SIZE + 100;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open view file");
    std::os::unix::fs::FileExt::write_at(&f, &[want[at as usize] ^ 1], at).expect("flip");
    drop(f);
    let view = s.views.get(&blob).expect("view");
    let (_, found) = s.scrub();
    assert_eq!((found.chunks, found.bad), (3, 1));
    assert!(
        !view.complete() && !view.unmarked.load(Ordering::Acquire),
        "watched again"
    );
    // The next read fetches the chunk again: the reader gets the right bytes.
    let fetched = kit.faults.reads(&key);
    assert!(cat(&path).stdout == want);
    assert!(kit.faults.reads(&key) > fetched, "refetched");
    assert_eq!(s.scrub().1.bad, 0);
    s.stop();
}

#[test]
fn a_mount_of_a_complete_file_still_asks_before_reading_a_chunk_a_scrub_found_bad() {
    let Some((
        Served {
            _dir,
            kit,
            s,
            path,
            key,
            want,
            blob,
            h,
            ..
        },
        view,
    )) = complete()
    else {
        return;
    };
    // A mount of the complete file opens it as EROFS would, between `mounting` and `mounted`.
    s.mounting(&h).expect("mounting");
    assert!(
        !view.unmarked.load(Ordering::Acquire),
        "watched for the mount"
    );
    let mount = std::fs::File::open(&path).expect("the mount's descriptor");
    s.mounted(&[blob]);
    assert!(view.unmarked.load(Ordering::Acquire), "unwatched again");
    // A bit flips on disk; the scrub finds it and makes the chunk a hole, watched again.
    let c = h.toc.chunks[2];
    let at = c.block as u64 * BLOCK_SIZE + 7;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open view file");
    std::os::unix::fs::FileExt::write_at(&f, &[want[at as usize] ^ 1], at).expect("flip");
    drop(f);
    assert_eq!(s.scrub().1.bad, 1);
    // The mount's descriptor asks: the chunk is fetched again and it reads the right bytes.
    let fetched = kit.faults.reads(&key);
    let mut got = vec![0u8; want.len()];
    std::os::unix::fs::FileExt::read_exact_at(&mount, &mut got, 0).expect("read");
    assert!(got == want, "the mount read the bad byte");
    assert!(kit.faults.reads(&key) > fetched, "refetched");
    s.stop();
}

/// Bytes of disk `path` takes.
fn disk(path: &std::path::Path) -> u64 {
    std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(path).expect("stat")) * 512
}

#[test]
fn a_chunk_marked_for_eviction_is_taken_back_when_read_and_punched_out_after_its_grace() {
    let Some((
        Served {
            _dir,
            kit,
            s,
            path,
            key,
            want,
            h,
            ..
        },
        view,
    )) = complete()
    else {
        return;
    };
    let chunk = h.toc.chunks[1].blocks() * BLOCK_SIZE;
    let mark = |i: usize| {
        view.mark_evicting(&[i], std::time::Instant::now(), |p| s.group.mark(p))
            .expect("mark")
    };
    assert_eq!(mark(1), chunk);
    assert!(
        !view.complete() && !view.unmarked.load(Ordering::Acquire),
        "watched again"
    );
    assert_eq!(view.evicting_bytes(), chunk);
    // Read before its punch: taken back, nothing fetched.
    let fetched = kit.faults.reads(&key);
    assert!(cat(&path).stdout == want);
    assert_eq!(kit.faults.reads(&key), fetched, "taken back, not fetched");
    assert!(view.complete() && view.evicting_bytes() == 0);
    // Marked again: not punched before its grace, punched after it.
    let at = std::time::Instant::now();
    mark(1);
    let before = disk(&path);
    assert_eq!(view.punch_evicting(at - Duration::from_secs(1)), (0, 0));
    assert_eq!(view.punch_evicting(std::time::Instant::now()), (1, chunk));
    assert!(
        disk(&path) <= before - chunk,
        "the chunk's blocks are freed"
    );
    // Its next read fetches it again: the right bytes, never a hole.
    assert!(cat(&path).stdout == want);
    assert!(kit.faults.reads(&key) > fetched, "refetched");
    assert_eq!(s.scrub().1.bad, 0);
    s.stop();
}

#[test]
fn a_successor_evicts_chunks_it_has_not_checked_and_checks_those_it_takes_back() {
    let Some((
        Served {
            _dir,
            kit,
            s,
            path,
            views,
            key,
            want,
            blob,
            h,
            ..
        },
        _,
    )) = complete()
    else {
        return;
    };
    s.stop();
    drop(s);
    // A new server on the same files knows none of their chunks.
    let next = Server::new(
        &views,
        None,
        kit.fetcher.clone(),
        kit.metrics.clone(),
        Arc::default(),
    )
    .expect("successor");
    next.view(&h).expect("view file again");
    next.run();
    let view = next.views.get(&blob).expect("view");
    assert_eq!(view.kept(), 0, "nothing checked yet");
    let all: Vec<usize> = view.evictable(evict::clock()).iter().map(|e| e.1).collect();
    assert_eq!(all, vec![0, 1, 2], "unchecked chunks that take disk");
    let now = std::time::Instant::now;
    let mark = |c: &[usize]| {
        view.mark_evicting(c, now(), |p| next.group.mark(p))
            .expect("mark")
    };
    assert!(mark(&all) > 0);
    // Read before their punch: taken back and checked, not fetched.
    let fetched = kit.faults.reads(&key);
    assert!(cat(&path).stdout == want);
    assert_eq!(kit.faults.reads(&key), fetched, "checked, not fetched");
    assert!(view.complete() && view.evicting_bytes() == 0);
    mark(&[1]);
    assert_eq!(view.punch_evicting(now()).0, 1);
    assert!(cat(&path).stdout == want);
    assert!(kit.faults.reads(&key) > fetched, "refetched");
    next.stop();
}

#[test]
fn an_eviction_pass_brings_allowed_view_files_under_the_bound() {
    let Some(Served {
        _dir,
        kit,
        s,
        path,
        key,
        want,
        blob,
        ..
    }) = served()
    else {
        return;
    };
    assert!(cat(&path).stdout == want);
    let full = disk(&path);
    let none = std::collections::HashSet::new();
    assert_eq!(
        s.evict(&none, 0, Duration::ZERO, s.views.disk_bytes()),
        evict::Pass::default(),
        "no blob allowed"
    );
    let allowed: std::collections::HashSet<Digest> = [blob].into_iter().collect();
    let first = s.evict(&allowed, 0, Duration::ZERO, s.views.disk_bytes());
    assert_eq!(first.punched, (0, 0), "marked first");
    assert!(first.marked > 0);
    let second = s.evict(&allowed, 0, Duration::ZERO, s.views.disk_bytes());
    assert_eq!(second.punched.1, first.marked, "then punched");
    assert!(disk(&path) < full);
    let fetched = kit.faults.reads(&key);
    assert!(cat(&path).stdout == want);
    assert!(kit.faults.reads(&key) > fetched, "refetched");
    // Stopped (a handover): no more punches.
    s.stop();
    assert_eq!(
        s.evict(&allowed, 0, Duration::ZERO, s.views.disk_bytes()),
        evict::Pass::default()
    );
}

/// Pages of `path` in the page cache ([`sys::cached_pages`]; not `fincore`, which maps the file).
fn resident(path: &std::path::Path) -> u64 {
    let f = std::fs::File::open(path).expect("open view file");
    sys::cached_pages(std::os::fd::AsFd::as_fd(&f), 0, 0).expect("cachestat")
}

#[test]
fn a_view_files_pages_are_dropped_once_the_kernel_had_them() {
    let Some(Served {
        _dir,
        s,
        path,
        want,
        blob,
        ..
    }) = served()
    else {
        return;
    };
    let view = s.views.get(&blob).expect("view");
    let later = || std::time::Instant::now() + pages::DELAY;
    // A reader's miss: its chunk is written through the page cache, and read from there.
    let out = Command::new("head")
        .args(["-c", "4096"])
        .arg(&path)
        .output();
    assert!(out.expect("run head").stdout == want[..4096]);
    assert!(!view.complete());
    assert!(resident(&path) > 0, "the filled chunk is read from memory");
    // Not before the delay: the kernel may not have read it yet.
    pages::drop_pass(&s.views.all(), std::time::Instant::now());
    assert!(resident(&path) > 0, "young pages stay");
    let dropped = pages::drop_pass(&s.views.all(), later());
    assert_eq!(
        dropped.written_out, 1,
        "written pages are written out before they are dropped"
    );
    assert_eq!(
        resident(&path),
        0,
        "then no page of the view file is cached"
    );
    // Dropped pages come back from the disk, the right bytes, without a fetch (a hit).
    let hits = s.stats.hits.load(Ordering::Relaxed);
    let out = Command::new("head")
        .args(["-c", "4096"])
        .arg(&path)
        .output();
    assert!(out.expect("run head").stdout == want[..4096]);
    assert!(s.stats.hits.load(Ordering::Relaxed) > hits);
    // A complete file is not watched: its reads are not noted, its whole cache goes on each pass.
    assert!(cat(&path).stdout == want);
    crate::testkit::wait_until("complete file unwatched", || {
        view.unmarked.load(Ordering::Acquire)
    });
    // (The server's own pass, every 100 ms, is what drops them: no read of it is noted.)
    assert!(cat(&path).stdout == want);
    crate::testkit::wait_until("a complete file's pages dropped", || resident(&path) == 0);
    s.stop();
}

/// The CPUs a thread of this process may run on, as `/proc` lists them (`0-1`, `1`).
fn allowed(tid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("Cpus_allowed_list:"));
    line.and_then(|l| l.split_whitespace().nth(1))
        .expect("Cpus_allowed_list")
        .to_string()
}

#[test]
fn the_event_loop_keeps_to_its_readers_cpu_and_lets_go_when_idle() {
    let Some(Served { _dir, s, path, .. }) = served() else {
        return;
    };
    let cpus = rustix::thread::sched_getaffinity(None).expect("affinity");
    let mine: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| cpus.is_set(c))
        .collect();
    let ok = mine.len() > 1;
    if !strata_registry::testing::require("two CPUs to run a reader and the event loop on", ok) {
        return;
    }
    crate::testkit::wait_until("the event loop started", || s.loop_tid().is_some());
    let tid = s.loop_tid().map(|t| t.to_string()).unwrap_or_default();
    let free = allowed(&tid);
    // A reader on the last CPU that stays alive a while after its reads (bash's own `read`, so the
    // events are the shell's): the loop moves there.
    let cpu = mine[mine.len() - 1].to_string();
    let mut reader = Command::new("taskset")
        .args([
            "-c",
            &cpu,
            "bash",
            "-c",
            "read -r -N 8192 x < \"$0\"; sleep 2",
        ])
        .arg(&path)
        .spawn()
        .expect("run the reader");
    crate::testkit::wait_until("the loop on the reader's CPU", || allowed(&tid) == cpu);
    assert!(reader.wait().expect("reader").success());
    // No events for a while: the loop may run anywhere again.
    crate::testkit::wait_until("the loop free again", || allowed(&tid) == free);
    s.stop();
}
