//! Faults across machines (issue 23, point 4) on MooseFS, with builders and nodes as separate
//! (simulated) machines ([`strata_tests::machines`]): a chunk server killed while nodes read, and a
//! builder killed mid-push. (A node cut from the store is `tests/tests/nodes.rs`.)
//!
//! **A chunk server killed** (SIGKILL, by PID): the store's directory has goal 2, and every file in it
//! is checked to have a copy on each of the two chunk servers first. Three images, each with blobs of
//! its own (a node's MooseFS client never read them before its phase), a sandbox of each started on
//! both nodes first: both nodes read the first with both servers up; the server a node's client is
//! talking to is killed 150 ms into both nodes' (paced) reads of the second — the reads go on from the
//! other copy, with the right bytes, well within stratad's deadline; the server comes back (its copies
//! register again) and the *other* one is killed the same way under the reads of the third, served by
//! the server that came back; then it comes back too. Either way one of the two phases has the copy
//! a client would have chosen gone.
//!
//! **The only copy's server killed** (goal 1): a node's uncached read fails with EIO by stratad's
//! deadline and never hangs, and reads again once the server is back.
//!
//! **A builder killed mid-push**: a build that moves an existing tag (`-t k:v1 --force`) is SIGKILLed at
//! three moments — its first spool file in `tmp/`, its blob in place, its layer descriptor in place —
//! and afterwards no tag is broken, `k:v1` still names the old image, everything tags reach is there,
//! and both nodes mount every tag and read every file; gc then collects what the killed builds left, and
//! the same build run to the end moves the tag.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_tests::machines::{self, Cluster, Machine};
use strata_tests::soak;
use strata_tests::*;

/// stratad's read deadline on the nodes, seconds.
const DEADLINE: u64 = 10;

/// True when every non-empty file under `dir` (on `m`'s mount) has a copy on each of the two chunk
/// servers. The MooseFS tools run in the machine's namespace: the master answers them only from the
/// address of the mount's session.
fn two_copies_everywhere(m: &Machine, dir: &Path) -> bool {
    let o = m
        .command("mfscheckfile")
        .args(walkdir::WalkDir::new(dir).into_iter().filter_map(|e| {
            let e = e.ok()?;
            (e.file_type().is_file() && e.metadata().ok()?.len() > 0).then(|| e.into_path())
        }))
        .output()
        .expect("mfscheckfile (moosefs-client)");
    let out = String::from_utf8_lossy(&o.stdout);
    o.status.success()
        && out.contains("with 2 copies")
        && !out
            .lines()
            .any(|l| l.contains("chunks with") && !l.contains("with 2 copies"))
}

fn wait_two_copies(m: &Machine, dir: &Path, within: Duration) {
    let start = Instant::now();
    while !two_copies_everywhere(m, dir) {
        assert!(
            start.elapsed() < within,
            "the files under {} do not have 2 copies after {within:?}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The chunk server (1 or 2) machine `m`'s MooseFS client has a connection to, if any (ports 9422
/// and 9522, as `scripts/cluster/moosefs` configures them).
fn chunkserver_in_use(m: &Machine) -> Option<u8> {
    let o = m.command("ss").args(["-tnH"]).output().expect("ss");
    let out = String::from_utf8_lossy(&o.stdout);
    [(1, ":9422"), (2, ":9522")]
        .into_iter()
        .find(|(_, port)| out.lines().any(|l| l.contains("ESTAB") && l.contains(port)))
        .map(|(n, _)| n)
}

/// Mounts `tag` on `d` as sandbox `id`, reads every file, checks it against the source; returns the
/// time the reads took.
fn read_sandbox(d: &Daemon, tag: &str, id: &str) -> Duration {
    read_sandbox_with(d, tag, id, &[])
}

/// [`read_sandbox`] of an image with `extra` files in `/data` besides the usual ones.
fn read_sandbox_with(d: &Daemon, tag: &str, id: &str, extra: &[(String, Vec<u8>)]) -> Duration {
    let root = std::path::PathBuf::from(d.ok(&["mount", tag, "--sandbox", id]));
    let t = Instant::now();
    if let Err(e) = soak::check_tree_with(&root, extra) {
        panic!("{tag} in sandbox {id}: {e}");
    }
    let took = t.elapsed();
    d.ok(&["umount", "--sandbox", id, "--purge"]);
    took
}

fn kill9(pid: i32) {
    // SAFETY: a signal to a process whose PID this test's cluster recorded (or its own child).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
}

/// A chunk server this test killed: started again when dropped (also when the test fails), so that
/// the cluster stays whole for the tests after.
struct Down<'a> {
    cluster: &'a Cluster,
    n: u8,
}

impl Down<'_> {
    /// Starts it again now.
    fn back(self) {
        self.cluster.start_chunkserver(self.n);
        std::mem::forget(self);
    }
}

impl Drop for Down<'_> {
    fn drop(&mut self) {
        let (cluster, n) = (self.cluster, self.n);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cluster.start_chunkserver(n)
        }));
    }
}

/// SIGKILLs chunk server `n` and waits until it is dead (gone, or a zombie waiting for its reaper).
fn kill_chunkserver(cluster: &Cluster, n: u8) -> Down<'_> {
    let pid = cluster.chunkserver_pid(n);
    kill9(pid);
    let start = Instant::now();
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "chunk server {n} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Down { cluster, n }
}

/// Directory `sub` of the volume as `m` sees it, created, with MooseFS goal `goal` (copies per chunk)
/// for what is written in it.
fn store_dir(m: &Machine, sub: &str, goal: u8) -> PathBuf {
    let dir = m.shared(sub);
    std::fs::create_dir_all(&dir).expect("store dir");
    let o = m
        .command("mfssetgoal")
        .args(["-r", &goal.to_string()])
        .arg(&dir)
        .output()
        .expect("mfssetgoal");
    assert!(
        o.status.success(),
        "mfssetgoal -r {goal}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

/// Builds builder `k`'s round `r` ([`soak::write_source`]) on `m` and tags it `tag`.
fn build_tagged(m: &Machine, store: &StoreEnv, k: u32, r: u32, tag: &str) {
    let src = m.disk.path().join(format!("src-{k}-{r}"));
    soak::write_source(&src, k, r);
    let o = m.strata(store, &["build", src.to_str().expect("utf8"), "-t", tag]);
    assert!(
        o.status.success(),
        "build of {tag}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A store in directory `sub` of the volume with goal 2, holding images `f:0`, `f:1` and `f:2` (their
/// own blobs, built on `ops`), every file of it with a copy on each chunk server. Returns the directory.
fn images_with_two_copies(ops: &Machine, sub: &str) -> PathBuf {
    let dir = store_dir(ops, sub, 2);
    let store = ops.store(sub);
    for r in 0..3 {
        build_tagged(ops, &store, 10 + r, r, &format!("f:{r}"));
    }
    wait_two_copies(ops, &dir, Duration::from_secs(30));
    dir
}

/// Reads every regular file under `root` in 64 KiB pieces, `pace` apart: a sandbox's reads stretched
/// out, so that a fault can land in the middle of them.
fn read_paced(root: &Path, pace: Duration) -> Result<(), String> {
    use std::io::Read;
    for e in walkdir::WalkDir::new(root).sort_by_file_name() {
        let e = e.map_err(|e| e.to_string())?;
        if !e.file_type().is_file() {
            continue;
        }
        let mut f = std::fs::File::open(e.path())
            .map_err(|err| format!("{}: {err}", e.path().display()))?;
        let mut buf = vec![0u8; 64 << 10];
        while f
            .read(&mut buf)
            .map_err(|err| format!("{}: {err}", e.path().display()))?
            > 0
        {
            std::thread::sleep(pace);
        }
    }
    Ok(())
}

/// Reads image `r`'s sandbox on every node at once (`roots[node][r]`: paced, then every file compared
/// with the source), running `during` while they read; returns each node's time.
fn read_everywhere(roots: &[Vec<PathBuf>], r: usize, during: impl FnOnce()) -> Vec<Duration> {
    std::thread::scope(|s| {
        let hs: Vec<_> = roots
            .iter()
            .map(|node| {
                let root = &node[r];
                s.spawn(move || {
                    let t = Instant::now();
                    if let Err(e) = read_paced(root, Duration::from_millis(5))
                        .and_then(|()| soak::check_tree(root).map(drop))
                    {
                        panic!("f:{r} at {}: {e}", root.display());
                    }
                    t.elapsed()
                })
            })
            .collect();
        during();
        hs.into_iter()
            .map(|h| h.join().expect("a node's reads failed"))
            .collect()
    })
}

#[test]
fn a_chunk_server_killed_while_nodes_read_is_replaced_by_its_copy() {
    let Some(cluster) = Cluster::for_nodes() else {
        return;
    };
    let t0 = Instant::now();
    let sub = format!("cs-kill-{}", std::process::id());
    let ops = Machine::new(&cluster, "fops", 30);
    let dir = images_with_two_copies(&ops, &sub);
    let nodes: Vec<Machine> = (1..=2)
        .map(|n| Machine::new(&cluster, &format!("fn{n}"), 30 + n))
        .collect();
    let flags = ["--read-timeout", "10", "--max-fetch-span", "1M"];
    let daemons: Vec<Daemon> = nodes
        .iter()
        .map(|m| m.daemon(&m.store(&sub), &flags))
        .collect();
    // Every sandbox starts before any chunk server dies (its metadata is on the node's disk); what the
    // phases read is the file data, which no node has read yet.
    let roots: Vec<Vec<PathBuf>> = daemons
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (0..3)
                .map(|r| {
                    PathBuf::from(d.ok(&[
                        "mount",
                        &format!("f:{r}"),
                        "--sandbox",
                        &format!("s{i}-{r}"),
                    ]))
                })
                .collect()
        })
        .collect();
    let base = read_everywhere(&roots, 0, || {});
    let first = chunkserver_in_use(&nodes[0]).unwrap_or(1);
    let other = 3 - first;
    // Each chunk server is killed 150 ms into the nodes' reads of an image (paced, about 0.6 s).
    let mut down = None;
    let without_first = read_everywhere(&roots, 1, || {
        std::thread::sleep(Duration::from_millis(150));
        down = Some(kill_chunkserver(&cluster, first));
    });
    down.take().expect("killed").back();
    wait_two_copies(&ops, &dir, Duration::from_secs(60));
    let without_other = read_everywhere(&roots, 2, || {
        std::thread::sleep(Duration::from_millis(150));
        down = Some(kill_chunkserver(&cluster, other));
    });
    down.take().expect("killed").back();
    wait_two_copies(&ops, &dir, Duration::from_secs(60));
    drop(daemons);
    machines::teardown(nodes.into_iter().chain([ops]));
    eprintln!(
        "chunk server kill: reads with both up {base:?}; chunk server {first} killed: {without_first:?}; \
         back, and {other} killed: {without_other:?}; test {:?}",
        t0.elapsed()
    );
    for d in without_first.iter().chain(&without_other) {
        assert!(
            *d < Duration::from_secs(DEADLINE),
            "a read took {d:?}, past stratad's deadline"
        );
    }
}

/// Starts `strata build SRC -t k:v1 --force` on `m`, waits until `when` holds of the store directory,
/// SIGKILLs it. Returns false when the build finished before.
fn kill_build_when(m: &Machine, store: &StoreEnv, src: &Path, when: &dyn Fn() -> bool) -> bool {
    let mut c = m.command(strata_bin());
    c.arg("--store").arg(&store.url);
    for (k, v) in &store.env {
        c.env(k, v);
    }
    c.args([
        "build",
        src.to_str().expect("utf8"),
        "-t",
        "k:v1",
        "--force",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut child = c.spawn().expect("start a build");
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            assert!(st.success(), "the build failed by itself: {st}");
            return false;
        }
        if when() {
            kill9(child.id() as i32);
            let _ = child.wait();
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn count(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |r| r.count())
}

/// A new version of `k:v1`'s source on `b`: its own files and 32 MiB more (a new blob for each
/// seed), so that a push takes a while.
fn new_version(b: &Machine, seed: u32) -> PathBuf {
    let src = b.disk.path().join(format!("src-big-{seed}"));
    soak::write_source(&src, 1, seed);
    std::fs::write(src.join("data/big"), random_bytes(32 << 20, seed)).expect("write");
    src
}

/// Pushes of new versions of `k:v1` on `b`, each SIGKILLed at one of three points, the store checked
/// after each; returns the points hit (a build may finish before its point).
fn kill_at_three_points(b: &Machine, store: &StoreEnv, dir: &Path) -> Vec<&'static str> {
    let inspect = || {
        String::from_utf8_lossy(&b.strata(store, &["inspect", "k:v1", "--json"]).stdout).to_string()
    };
    let mut before = inspect();
    let (tmp, blobs, layers) = (dir.join("tmp"), dir.join("blobs"), dir.join("layers"));
    let mut killed = Vec::new();
    for (stage, what) in [
        "a spool file",
        "its blob in place",
        "its layer descriptor in place",
    ]
    .into_iter()
    .enumerate()
    {
        let src = new_version(b, 100 + stage as u32);
        let watched = [&tmp, &blobs, &layers][stage];
        let n = count(watched);
        if kill_build_when(b, store, &src, &|| count(watched) > n) {
            killed.push(what);
        } else {
            before = inspect(); // it finished first: k:v1 moved, rightly
        }
        check_store_after_kill(b, store, &before);
    }
    killed
}

#[test]
fn a_builder_killed_mid_push_leaves_no_broken_tag() {
    let Some(cluster) = Cluster::for_nodes() else {
        return;
    };
    let t0 = Instant::now();
    let sub = format!("push-kill-{}", std::process::id());
    let b = Machine::new(&cluster, "kb", 40);
    let dir = b.shared(&sub);
    std::fs::create_dir_all(&dir).expect("store dir");
    let store = b.store(&sub);
    build_tagged(&b, &store, 1, 0, "k:v1");
    build_tagged(&b, &store, 2, 0, "other:v1");
    let killed = kill_at_three_points(&b, &store, &dir);
    let big = new_version(&b, 200);
    eprintln!("builder kill: killed at {killed:?}");
    assert!(
        killed.len() >= 2,
        "the build finished before the kills: {killed:?}"
    );
    let nodes: Vec<Machine> = (1..=2)
        .map(|n| Machine::new(&cluster, &format!("kn{n}"), 40 + n))
        .collect();
    let daemons: Vec<Daemon> = nodes
        .iter()
        .map(|m| m.daemon(&m.store(&sub), &[]))
        .collect();
    for (i, d) in daemons.iter().enumerate() {
        for tag in ["k:v1", "other:v1"] {
            read_sandbox(d, tag, &format!("after-kill-{i}-{}", tag.replace(':', "-")));
        }
    }
    let gc = json(&String::from_utf8_lossy(
        &b.strata(&store, &["gc", "--grace", "0s", "--json"]).stdout,
    ));
    assert!(
        gc["deleted"].as_u64().unwrap_or(0) > 0,
        "gc left the killed builds' objects: {gc}"
    );
    let o = b.strata(
        &store,
        &[
            "build",
            big.to_str().expect("utf8"),
            "-t",
            "k:v1",
            "--force",
        ],
    );
    assert!(
        o.status.success(),
        "the build again: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let extra = [("big".to_string(), random_bytes(32 << 20, 200))];
    for (i, d) in daemons.iter().enumerate() {
        read_sandbox_with(d, "k:v1", &format!("new-{i}"), &extra);
    }
    drop(daemons);
    machines::teardown(nodes.into_iter().chain([b]));
    eprintln!("builder kill: test {:?}", t0.elapsed());
}

/// After a killed build: no broken tag, `k:v1` unchanged, everything reachable present.
fn check_store_after_kill(b: &Machine, store: &StoreEnv, before: &str) {
    let o = b.strata(store, &["images", "--json"]);
    assert!(
        o.status.success(),
        "strata images after a kill: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let now = b.strata(store, &["inspect", "k:v1", "--json"]);
    assert!(
        now.status.success() && String::from_utf8_lossy(&now.stdout) == before,
        "k:v1 changed under a killed build"
    );
    let s = strata_registry::store::Store::open(&store.url).expect("open the store");
    soak::check_reachable(&s);
}

/// The chunk server (1 or 2) holding copy 1 of `file`'s first chunk, as `mfsfileinfo` on `m` says.
fn holder_of(m: &Machine, file: &Path) -> u8 {
    let o = m
        .command("mfsfileinfo")
        .arg(file)
        .output()
        .expect("mfsfileinfo");
    let out = String::from_utf8_lossy(&o.stdout);
    let copies: Vec<&str> = out.lines().filter(|l| l.contains("copy ")).collect();
    assert_eq!(copies.len(), 1, "{} with goal 1: {out}", file.display());
    if copies[0].contains(":9422") {
        1
    } else {
        2
    }
}

/// Goal 1, the only copy's server killed: a node's uncached read fails with EIO by stratad's deadline
/// (the MooseFS client itself would retry for minutes), never hangs; once the server is back, the
/// same read returns the right bytes.
#[test]
fn the_only_copy_killed_gives_eio_by_the_deadline_and_reads_recover() {
    let Some(cluster) = Cluster::for_nodes() else {
        return;
    };
    let t0 = Instant::now();
    let sub = format!("goal1-{}", std::process::id());
    let ops = Machine::new(&cluster, "gops", 50);
    let dir = store_dir(&ops, &sub, 1);
    build_tagged(&ops, &ops.store(&sub), 20, 0, "g:1");
    let blobs: Vec<PathBuf> = std::fs::read_dir(dir.join("blobs"))
        .expect("blobs")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(blobs.len(), 1, "one blob: {blobs:?}");
    let node = Machine::new(&cluster, "gn1", 51);
    let d = node.daemon(&node.store(&sub), &["--read-timeout", "3"]);
    let root = PathBuf::from(d.ok(&["mount", "g:1", "--sandbox", "g"]));
    let down = kill_chunkserver(&cluster, holder_of(&ops, &blobs[0]));
    let file = root.join("data/round");
    let (tx, rx) = std::sync::mpsc::channel();
    let f = file.clone();
    std::thread::spawn(move || {
        let t = Instant::now();
        let _ = tx.send((std::fs::read(&f), t.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a read hung for 60 s with its chunk server dead");
    let err = r.expect_err("a read whose only copy is gone");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        took < Duration::from_secs(DEADLINE),
        "EIO after {took:?}, past the 3 s deadline plus slack"
    );
    down.back();
    let back = Instant::now();
    let got = read_when_back(&file, Duration::from_secs(60));
    assert!(
        got == soak::data_files(20, 0)[3].1,
        "data/round after the server came back"
    );
    eprintln!(
        "only copy killed: EIO after {took:?}; read again {:?} after the server came back; test {:?}",
        back.elapsed(),
        t0.elapsed()
    );
    d.ok(&["umount", "--sandbox", "g", "--purge"]);
    drop(d);
    machines::teardown([node, ops]);
}
