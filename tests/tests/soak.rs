//! The soak test of issue 23, point 3: builders, nodes and gc on separate (simulated) machines sharing
//! one store on a distributed filesystem, all at once.
//!
//! Machines ([`strata_tests::machines`]): 3 builders, 4 nodes and one "ops" machine, each a network
//! namespace with its own MooseFS client, local disk, index cache and (nodes) stratad. For
//! `STRATA_SOAK_SECS` (default 25) seconds, and up to a minute longer until gc has deleted something and
//! compaction has rewritten something:
//!
//! - each builder builds round after round ([`strata_tests::soak`]: files common to all builders, one
//!   of its own, one new per round), tags it `bK:rR`, moves `bK:latest` and `shared:latest` (one tag
//!   all builders move: compare-and-swap across machines) to it, and deletes the tag of two rounds ago.
//!   The builders' first builds are staggered (as CI runners start at different times), so that later
//!   ones can find the first one's chunks in the store-wide index;
//! - each node mounts a live tag in a new sandbox, reads every file and compares it byte for byte with
//!   what the image's source held, then removes the sandbox;
//! - the ops machine runs `gc --grace 5s`, every other time with `--compact --min-live 0.9`.
//!
//! Afterwards: no tag is broken, every object a tag reaches is there (walked down to each blob), every
//! remaining tag's own files read back right on the ops machine, every node read exactly the source's bytes,
//! gc deleted and compaction rewrote something, and the builders stored fewer chunks than independent
//! builders would have (each one's first build stores every chunk it has; each later build only its
//! `round` file), by at least the chunks they all share.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_tests::machines::{self, Cluster, Machine};
use strata_tests::soak::{self, CHUNK, OWN_CHUNKS, ROUND_CHUNKS};
use strata_tests::*;

const BUILDERS: u32 = 3;
const NODES: u8 = 4;
const GRACE: &str = "5s";

/// The slowest build and `strata tag` or `rmi` seen, in milliseconds: gc's grace must exceed the longest
/// build (its stated assumption), so the soak prints them beside the grace.
static SLOWEST_BUILD_MS: AtomicU64 = AtomicU64::new(0);
static SLOWEST_TAG_MS: AtomicU64 = AtomicU64::new(0);

fn note_time(slowest: &AtomicU64, since: Instant) {
    slowest.fetch_max(since.elapsed().as_millis() as u64, Ordering::Relaxed);
}

/// What the threads share: the tags nodes may mount, the count of builders done with their first
/// build, and the stop flag.
#[derive(Default)]
struct Board {
    live: Mutex<Vec<String>>,
    first_done: Mutex<u32>,
    first_cv: Condvar,
    stop: AtomicBool,
    /// The collector has deleted something and compaction has rewritten something (both asserted).
    gc_did_both: AtomicBool,
    /// What each collection deleted, and when it ended (for the message of a failed mount).
    deleted: Mutex<Vec<(Instant, Vec<String>)>>,
}

impl Board {
    fn is_live(&self, tag: &str) -> bool {
        self.live.lock().expect("lock").iter().any(|t| t == tag)
    }
    fn add(&self, tag: &str) {
        let mut l = self.live.lock().expect("lock");
        if !l.iter().any(|t| t == tag) {
            l.push(tag.to_string());
        }
    }
    fn remove(&self, tag: &str) {
        self.live.lock().expect("lock").retain(|t| t != tag);
    }
    /// Which collection deleted the object a failed mount's error names, if one did.
    fn deleted_by_gc(&self, err: &str) -> String {
        let Some(key) = err
            .split("not found in store: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        else {
            return "no object named".into();
        };
        let runs = self.deleted.lock().expect("lock");
        match runs
            .iter()
            .position(|(_, keys)| keys.iter().any(|k| k == key))
        {
            Some(i) => format!(
                "gc run {i} (of {}) deleted {key}, {:?} ago",
                runs.len(),
                runs[i].0.elapsed()
            ),
            None => format!("no gc run (of {}) reported deleting {key}", runs.len()),
        }
    }
}

/// One successful build: chunks referenced and chunks stored anew.
#[derive(Clone, Copy, Debug)]
struct Built {
    chunks: u64,
    new_chunks: u64,
}

/// Runs `strata ARGS` on `m`, retrying while it exits with a conflict (4: a tag moved meanwhile,
/// by another builder or by compaction).
fn ok_retrying_conflicts(m: &Machine, store: &StoreEnv, args: &[&str]) -> u32 {
    let mut last = String::new();
    for conflicts in 0..20 {
        let t = Instant::now();
        let o = m.strata(store, args);
        note_time(&SLOWEST_TAG_MS, t);
        if o.status.success() {
            return conflicts;
        }
        assert_eq!(
            o.status.code(),
            Some(4),
            "{}: strata {args:?}: {}",
            m.name,
            String::from_utf8_lossy(&o.stderr)
        );
        last = String::from_utf8_lossy(&o.stderr).into_owned();
    }
    panic!(
        "{}: strata {args:?}: 20 conflicts in a row, the last: {last}",
        m.name
    );
}

/// Builds builder `k`'s round `r` and tags it; retries a build whose foreign blob gc condemned.
fn build_round(m: &Machine, store: &StoreEnv, k: u32, r: u32) -> Built {
    let src = m.disk.path().join(format!("src-{r}"));
    soak::write_source(&src, k, r);
    let (tag, chunk) = (format!("b{k}:r{r}"), CHUNK.to_string());
    let path = src.to_str().expect("utf8");
    let args = ["build", path, "-t", &tag, "--chunk-size", &chunk, "--json"];
    for _ in 0..5 {
        let t = Instant::now();
        let o = m.strata(store, &args);
        note_time(&SLOWEST_BUILD_MS, t);
        let err = String::from_utf8_lossy(&o.stderr);
        if o.status.success() {
            let _ = std::fs::remove_dir_all(&src);
            let v = json(&String::from_utf8_lossy(&o.stdout));
            let n = |f: &str| v["stats"][f].as_u64().expect("build stats");
            return Built {
                chunks: n("chunks"),
                new_chunks: n("new_chunks"),
            };
        }
        assert!(
            err.contains("deleted by gc meanwhile"),
            "{}: build of {tag}: {err}",
            m.name
        );
        eprintln!(
            "{}: {tag}: a foreign blob was condemned, building again",
            m.name
        );
    }
    panic!("{}: build of {tag} failed 5 times", m.name);
}

/// Builder `k`: rounds until told to stop (two at least), each tagged, re-tagged and two rounds later
/// deleted. Returns its builds.
fn builder(m: &Machine, store: &StoreEnv, k: u32, board: &Board) -> Vec<Built> {
    {
        let mut done = board.first_done.lock().expect("lock");
        while *done + 1 < k {
            done = board.first_cv.wait(done).expect("wait");
        }
    }
    let mut builds = Vec::new();
    let mut r = 0;
    while r < 2 || !board.stop.load(Ordering::Relaxed) {
        builds.push(build_round(m, store, k, r));
        let tag = format!("b{k}:r{r}");
        board.add(&tag);
        for moving in [format!("b{k}:latest"), "shared:latest".to_string()] {
            ok_retrying_conflicts(m, store, &["tag", &tag, &moving]);
            board.add(&moving);
        }
        if r == 0 {
            *board.first_done.lock().expect("lock") += 1;
            board.first_cv.notify_all();
        }
        if r >= 2 {
            let old = format!("b{k}:r{}", r - 2);
            board.remove(&old);
            ok_retrying_conflicts(m, store, &["rmi", &old]);
        }
        r += 1;
    }
    builds
}

/// Node `n`: sandboxes of live tags until told to stop, every file of each read and compared.
/// Returns the sandboxes read, the bytes read, and the mounts of tags deleted meanwhile.
fn node(d: &Daemon, n: u8, board: &Board) -> (u32, u64, u32) {
    let (mut sandboxes, mut bytes, mut gone) = (0u32, 0u64, 0u32);
    let mut i = 0usize;
    while !board.stop.load(Ordering::Relaxed) {
        let tag = {
            let live = board.live.lock().expect("lock");
            if live.is_empty() {
                None
            } else {
                Some(live[(i * 5 + usize::from(n)) % live.len()].clone())
            }
        };
        i += 1;
        let Some(tag) = tag else {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        };
        let id = format!("n{n}-{i}");
        let o = d.strata(&["mount", &tag, "--sandbox", &id]);
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                o.status.code() == Some(3) && !board.is_live(&tag),
                "node {n}: mount {tag} failed ({}): {err}; {}",
                o.status,
                board.deleted_by_gc(&err)
            );
            gone += 1;
            continue;
        }
        let root = std::path::PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        let t = Instant::now();
        match soak::check_tree(&root) {
            Ok((_, b)) => bytes += b,
            Err(e) => panic!(
                "node {n}: {tag} in sandbox {id}, after {:?}: {e}",
                t.elapsed()
            ),
        }
        sandboxes += 1;
        d.ok(&["umount", "--sandbox", &id, "--purge"]);
    }
    (sandboxes, bytes, gone)
}

/// What the collections did in all.
#[derive(Debug, Default)]
struct Collected {
    runs: u64,
    deleted: u64,
    condemned: u64,
    compacted: u64,
    tags_moved: u64,
}

/// gc on the ops machine until told to stop, every other run with --compact.
fn collector(m: &Machine, store: &StoreEnv, board: &Board) -> Collected {
    let mut c = Collected::default();
    while !board.stop.load(Ordering::Relaxed) {
        let mut args = vec!["gc", "--grace", GRACE, "--json"];
        if c.runs % 2 == 1 {
            args.extend(["--compact", "--min-live", "0.9"]);
        }
        let o = m.strata(store, &args);
        assert!(
            o.status.success(),
            "gc {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v = json(&String::from_utf8_lossy(&o.stdout));
        let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
        c.runs += 1;
        let keys = v["keys"].as_array().into_iter().flatten();
        let keys = keys
            .filter_map(|k| k.as_str().map(str::to_string))
            .collect();
        board
            .deleted
            .lock()
            .expect("lock")
            .push((Instant::now(), keys));
        c.deleted += n(&v["deleted"]);
        c.condemned += n(&v["condemned"]);
        c.compacted += n(&v["compact"]["compacted"]);
        c.tags_moved += n(&v["compact"]["tags_moved"]);
        if c.deleted > 0 && c.compacted > 0 {
            board.gc_did_both.store(true, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(700));
    }
    c
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().expect("a soak thread failed")
}

fn soak_secs() -> u64 {
    std::env::var("STRATA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(25)
}

/// Where the machines' store is.
enum Backend {
    /// `file://` on each machine's own mount of the MooseFS volume, in this directory.
    MooseFs(String),
    /// radosgw, reached from the machines at this endpoint (on the cluster's bridge).
    Radosgw(S3Server, String),
}

impl Backend {
    fn store(&self, m: &Machine) -> StoreEnv {
        match self {
            Backend::MooseFs(sub) => m.store(sub),
            Backend::Radosgw(s3, endpoint) => m.s3_store(s3, "soak", "p", endpoint),
        }
    }

    fn machine(&self, cluster: &Cluster, role: &str, index: u8) -> Machine {
        match self {
            Backend::MooseFs(_) => Machine::new(cluster, role, index),
            Backend::Radosgw(..) => Machine::without_volume(cluster, role, index),
        }
    }
}

#[test]
fn builders_nodes_and_gc_on_separate_machines_share_one_store_on_moosefs() {
    let Some(cluster) = Cluster::for_nodes() else {
        return;
    };
    soak(
        &cluster,
        Backend::MooseFs(format!("soak-{}", std::process::id())),
    );
}

/// The same on radosgw: `scripts/test-clusters` starts it with an endpoint on the MooseFS cluster's
/// bridge too (`STRATA_CEPH_RGW_ALSO`) and names it in `STRATA_S3_MACHINES_ENDPOINT`.
#[test]
fn builders_nodes_and_gc_on_separate_machines_share_one_store_on_radosgw() {
    let Some(cluster) = Cluster::for_nodes() else {
        return;
    };
    if !real_s3() {
        eprintln!(
            "not run here: on radosgw only (STRATA_TEST_S3=radosgw, as scripts/test-clusters sets)"
        );
        return;
    }
    let endpoint = std::env::var("STRATA_S3_MACHINES_ENDPOINT").unwrap_or_default();
    if !require(
        "radosgw's address on the machines' bridge (STRATA_S3_MACHINES_ENDPOINT)",
        !endpoint.is_empty(),
    ) {
        return;
    }
    let Some(s3) = S3Server::start("soak") else {
        return;
    };
    soak(&cluster, Backend::Radosgw(s3, endpoint));
}

fn soak(cluster: &Cluster, backend: Backend) {
    let t0 = Instant::now();
    let ops = backend.machine(cluster, "ops", 0);
    if let Backend::MooseFs(sub) = &backend {
        std::fs::create_dir_all(ops.shared(sub)).expect("store dir");
    }
    let builders: Vec<Machine> = (1..=BUILDERS)
        .map(|k| backend.machine(cluster, &format!("b{k}"), k as u8))
        .collect();
    let nodes: Vec<Machine> = (1..=NODES)
        .map(|n| backend.machine(cluster, &format!("n{n}"), 10 + n))
        .collect();
    let daemons: Vec<Daemon> = nodes
        .iter()
        .map(|m| m.daemon(&backend.store(m), &[]))
        .collect();
    eprintln!(
        "soak: {} machines up in {:?}",
        1 + builders.len() + nodes.len(),
        t0.elapsed()
    );

    let board = Board::default();
    let backend = &backend;
    let t1 = Instant::now();
    let (builds, reads, gc) = std::thread::scope(|s| {
        let bs: Vec<_> = builders
            .iter()
            .zip(1..)
            .map(|(m, k)| {
                let board = &board;
                s.spawn(move || builder(m, &backend.store(m), k, board))
            })
            .collect();
        let ns: Vec<_> = daemons
            .iter()
            .zip(1..)
            .map(|(d, n)| {
                let board = &board;
                s.spawn(move || node(d, n, board))
            })
            .collect();
        let g = s.spawn(|| collector(&ops, &backend.store(&ops), &board));
        std::thread::sleep(Duration::from_secs(soak_secs()));
        // Garbage is deleted two collections after it is condemned, at least the grace apart, and only
        // once its tag is two rounds old: a slow store (a fresh radosgw on a loaded machine ran 6
        // collections in 25 s and deleted nothing yet) gets up to a minute more, everything still
        // running, before the run ends.
        let more = Instant::now() + Duration::from_secs(60);
        while !board.gc_did_both.load(Ordering::Relaxed) && Instant::now() < more {
            std::thread::sleep(Duration::from_millis(200));
        }
        board.stop.store(true, Ordering::Relaxed);
        let builds: Vec<Vec<Built>> = bs.into_iter().map(join).collect();
        let reads: Vec<(u32, u64, u32)> = ns.into_iter().map(join).collect();
        (builds, reads, join(g))
    });
    eprintln!(
        "soak: ran {:?}; gc {gc:?}; nodes (sandboxes, bytes, tags gone) {reads:?}; slowest build \
         {} ms, slowest tag change {} ms (grace {GRACE})",
        t1.elapsed(),
        SLOWEST_BUILD_MS.load(Ordering::Relaxed),
        SLOWEST_TAG_MS.load(Ordering::Relaxed)
    );

    check_afterwards(&ops, &backend.store(&ops));
    for (n, (sandboxes, bytes, _)) in reads.iter().enumerate() {
        assert!(
            *sandboxes >= 2 && *bytes > 0,
            "node {}: {sandboxes} sandboxes",
            n + 1
        );
    }
    assert!(
        gc.runs >= 2 && gc.deleted > 0,
        "gc never deleted anything: {gc:?}"
    );
    assert!(gc.compacted > 0, "compaction never rewrote a blob: {gc:?}");
    check_dedup(&builds);
    drop(daemons);
    machines::teardown(nodes.into_iter().chain(builders).chain([ops]));
    eprintln!("soak: {:?} in all", t0.elapsed());
}

/// No broken tag, every object a tag reaches present, every tag's own files read back right.
fn check_afterwards(ops: &Machine, store: &StoreEnv) {
    let o = ops.strata(store, &["images", "--json"]);
    assert!(
        o.status.success(),
        "strata images: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let opened = store.open();
    let (tags, objects) = soak::check_reachable(&opened);
    for (t, _) in opened.tags().expect("tags").good {
        let t = t.to_string();
        let id =
            String::from_utf8(ops.strata(store, &["cat", &t, "/data/ID"]).stdout).expect("utf8");
        let mut it = id.split_whitespace().map(|x| x.parse::<u32>().expect("ID"));
        let (k, r) = (it.next().expect("k"), it.next().expect("r"));
        // The files of its own (the common ones every node read many times over).
        for (name, want) in soak::data_files(k, r).into_iter().skip(2).take(2) {
            let got = ops.strata(store, &["cat", &t, &format!("/data/{name}")]);
            assert!(
                got.status.success() && got.stdout == want,
                "{t}: /data/{name}"
            );
        }
    }
    eprintln!("soak: {tags} tags, {objects} objects reachable and present, files read back");
}

/// The builders stored fewer chunks than independent builders would have, by at least the chunks
/// they all share.
fn check_dedup(builds: &[Vec<Built>]) {
    let stored: u64 = builds.iter().flatten().map(|b| b.new_chunks).sum();
    let independent: u64 = builds
        .iter()
        .map(|bs| bs[0].chunks + ROUND_CHUNKS * (bs.len() as u64 - 1))
        .sum();
    let shared = builds[0][0].chunks - OWN_CHUNKS;
    eprintln!(
        "soak: {} builds stored {stored} chunks; independent builders would have stored \
         {independent}; {shared} chunks are common to all",
        builds.iter().map(Vec::len).sum::<usize>()
    );
    assert!(
        stored + shared <= independent,
        "no deduplication across builders: stored {stored}, independent {independent}"
    );
}
