//! `fanotify` mode's view files and their disk: trimmed when layers are released, kept to
//! `cache_size` under mounted layers by punching out chunks, and room made when their disk is full
//! (`docs/DAEMON.md`, *The bound*). Each test forces `fanotify` mode and needs pre-content events.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_tests::smallfs::{fill_up, small_ext4, view_files, Umount};
use strata_tests::*;

/// Builds each `(tag, name, data)` as an image of one file, `data/<name>`, and nothing else (not
/// [`build_image`]: its busybox, deduplicated, would make the second layer name the first's blob).
fn one_file_images(store: &StoreEnv, images: &[(&str, &str, &[u8])]) {
    for (tag, name, data) in images {
        let src = scratch("img");
        std::fs::create_dir(src.path().join("data")).expect("mkdir");
        std::fs::write(src.path().join("data").join(name), data).expect("write");
        store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
    }
}

/// A `fanotify` daemon keeping its view files to 4 MiB with a 1 s grace, and a sandbox of an image of
/// one 12 MiB file, `data/<name>` (random from `seed`), read once whole.
/// (Bind every field: one left to `..` is dropped at once, and the store's directory with it.)
struct Evicting {
    d: Daemon,
    file: PathBuf,
    data: Vec<u8>,
    _store: StoreEnv,
    _sdir: tempfile::TempDir,
}

fn evicting(tag: &str, name: &str, seed: u32) -> Evicting {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let data = random_bytes(12 << 20, seed);
    one_file_images(&store, &[(tag, name, &data)]);
    let args = [
        "--mount-mode",
        "fanotify",
        "--cache-size",
        "4M",
        "--view-evict-grace",
        "1",
    ];
    let d = Daemon::start(&store, &args);
    let root = d.ok(&["mount", tag, "--sandbox", "s"]);
    let file = Path::new(&root).join("data").join(name);
    assert!(std::fs::read(&file).expect("first read") == data);
    Evicting {
        d,
        file,
        data,
        _store: store,
        _sdir: sdir,
    }
}

/// Waits (30 s at most) until [`evicting`]'s daemon has punched chunks out and its view files take at
/// most the 4 MiB bound and a chunk: its `fanotify` status then.
fn under_the_bound(d: &Daemon) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let f = json(&d.ok(&["daemon", "status"]))["fanotify"].clone();
        if f["evicted_bytes"].as_u64() > Some(0) && f["disk_bytes"].as_u64() <= Some(5 << 20) {
            return f;
        }
        assert!(Instant::now() < deadline, "not brought to the bound: {f}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Reads `file` a MiB at a time from MiB `start` on, round and round, `pause` apart, until `until`:
/// every MiB must be `data`'s (so what was read a few seconds ago is evicted while the reader reads on).
fn read_by_the_mib(file: &Path, data: &[u8], start: usize, pause: Duration, until: Instant) {
    let f = std::fs::File::open(file).expect("open");
    let mut buf = vec![0u8; 1 << 20];
    let mibs = data.len() >> 20;
    for step in 0.. {
        if Instant::now() >= until {
            break;
        }
        let at = ((start + step) % mibs) << 20;
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, at as u64).expect("read");
        assert!(
            buf[..] == data[at..at + (1 << 20)],
            "MiB {} differs",
            at >> 20
        );
        std::thread::sleep(pause);
    }
}

/// A state directory whose `views` is an ext4 filesystem of `bytes` of its own: the directory, the
/// views path and the mount's guard (drop it after the daemon).
fn small_views(bytes: u64) -> (tempfile::TempDir, PathBuf, Umount) {
    let state = scratch("state");
    let views = state.path().join("views");
    std::fs::create_dir_all(&views).expect("mkdir");
    let small = small_ext4(&views, bytes);
    (state, views, small)
}

#[test]
fn view_files_of_released_layers_are_trimmed_never_a_mounted_layers() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let (a, b) = (random_bytes(2 << 20, 11), random_bytes(2 << 20, 12));
    one_file_images(&store, &[("va:v1", "a.bin", &a), ("vb:v1", "b.bin", &b)]);
    // A bound far below what the two layers read: only files no mounted layer reads may go.
    let d = Daemon::start(&store, &["--mount-mode", "fanotify", "--cache-size", "1M"]);
    let views = d.state.path().join("views");
    let count = || view_files(&views);
    let read = |root: &str, f: &str| std::fs::read(Path::new(root).join("data").join(f));
    let ra = d.ok(&["mount", "va:v1", "--sandbox", "a"]);
    let rb = d.ok(&["mount", "vb:v1", "--sandbox", "b"]);
    assert!(read(&ra, "a.bin").expect("read a") == a);
    assert!(read(&rb, "b.bin").expect("read b") == b);
    assert_eq!(count(), 2, "a view file per layer's blob");
    d.ok(&["umount", "--sandbox", "a", "--purge"]);
    assert_eq!(
        count(),
        1,
        "the released layer's view file goes, the mounted one's stays (both over the bound)"
    );
    // The mounted layer's file stays, though over the bound; its pages dropped, it reads the same.
    strata_tests::readers::drop_caches();
    assert!(read(&rb, "b.bin").expect("read b again") == b);
    let ra = d.ok(&["mount", "va:v1", "--sandbox", "a2"]);
    assert!(read(&ra, "a.bin").expect("read a again") == a, "refilled");
    // The data at rest checks out: both files' filled chunks read back with their digests.
    let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
    assert_eq!(scrub["files"].as_u64(), Some(2), "{scrub}");
    assert_eq!(scrub["bad"].as_u64(), Some(0), "{scrub}");
    assert!(scrub["bytes"].as_u64().unwrap_or(0) >= 4 << 20, "{scrub}");
}

#[test]
fn a_full_view_disk_deletes_view_files_no_layer_reads_and_the_read_goes_on() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let (a, b) = (random_bytes(5 << 20, 31), random_bytes(5 << 20, 32));
    one_file_images(&store, &[("fa:v1", "a.bin", &a), ("fb:v1", "b.bin", &b)]);
    // The view files on 8 MiB: room for one layer's 5 MiB, not for two.
    let (state, views, small) = small_views(8 << 20);
    // The default `cache_size` keeps a released layer's view file; no free share kept and no
    // reserve, so that only a fill finding the disk full can delete it.
    let args = [
        "--mount-mode",
        "fanotify",
        "--view-keep-free",
        "0",
        "--view-reserve",
        "0",
    ];
    let mut d = Daemon::start_in(&store, state, &args);
    let count = || view_files(&views);
    let read = |root: &str, f: &str| std::fs::read(Path::new(root).join("data").join(f));
    let ra = d.ok(&["mount", "fa:v1", "--sandbox", "a"]);
    assert!(read(&ra, "a.bin").expect("read a") == a);
    d.ok(&["umount", "--sandbox", "a", "--purge"]);
    assert_eq!(count(), 1, "a released layer's view file is kept");
    let rb = d.ok(&["mount", "fb:v1", "--sandbox", "b"]);
    assert!(
        read(&rb, "b.bin").expect("read with the view files' disk full") == b,
        "the read goes on once the unused view file is deleted"
    );
    let status = json(&d.ok(&["daemon", "status"]));
    let relieved = status["fanotify"]["relieved"].as_u64().unwrap_or(0);
    assert!(relieved >= 1, "no fill tried again: {}", status["fanotify"]);
    assert_eq!(count(), 1, "only the mounted layer's view file is left");
    d.stop();
    drop(small);
}

/// The `fanotify` status of `d` once `ok` holds of it (30 s at most).
fn fanotify_once(
    d: &Daemon,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let f = json(&d.ok(&["daemon", "status"]))["fanotify"].clone();
        if ok(&f) {
            return f;
        }
        assert!(Instant::now() < deadline, "{what}: {f}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_disk_filled_by_others_gets_the_reserve_then_a_clear_error_never_zeros() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let (a, b) = (random_bytes(2 << 20, 51), random_bytes(8 << 20, 52));
    one_file_images(&store, &[("ra:v1", "a.bin", &a), ("rb:v1", "b.bin", &b)]);
    let (state, views, small) = small_views(64 << 20);
    // A grace longer than the test: nothing is evicted, only the reserve can make room.
    let args = [
        "--mount-mode",
        "fanotify",
        "--view-reserve",
        "4M",
        "--view-evict-grace",
        "600",
    ];
    let mut d = Daemon::start_in(&store, state, &args);
    let room = |d: &Daemon| json(&d.ok(&["daemon", "status"]))["fanotify"]["room"].clone();
    // 4 MiB, or 1/16 of what the filesystem gives (3.7 MiB of the 64).
    let reserve = room(&d)["reserve_bytes"].as_u64().unwrap_or(0);
    assert!((3 << 20..=4 << 20).contains(&reserve), "{}", room(&d));
    // Another writer takes the whole disk; a sandbox then reads a file no view file holds yet.
    let ballast = fill_up(&views, "other-data");
    let ra = d.ok(&["mount", "ra:v1", "--sandbox", "a"]);
    let read = |root: &str, f: &str| std::fs::read(Path::new(root).join("data").join(f));
    assert!(
        read(&ra, "a.bin").expect("read on a full disk") == a,
        "the reserve made room"
    );
    let r = room(&d);
    assert_eq!(r["reserve_released"].as_u64(), Some(1), "{r}");
    assert_eq!(r["reserve_bytes"].as_u64(), Some(0), "{r}");
    // With nothing left to free, a read of data not cached fails, saying so: EIO, never zeros.
    let rb = d.ok(&["mount", "rb:v1", "--sandbox", "b"]);
    let e = read(&rb, "b.bin").expect_err("8 MiB read into 2 MiB of room");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let denied = json(&d.ok(&["daemon", "status"]))["fanotify"]["denied"].as_u64();
    assert!(denied > Some(0), "no read denied");
    // The other writer gone, the reserve comes back (a pass every 5 s), and the read goes through.
    std::fs::remove_file(&ballast).expect("rm ballast");
    fanotify_once(&d, "reserve not allocated again", |f| {
        f["room"]["reserve_bytes"].as_u64() == Some(reserve)
    });
    assert!(read(&rb, "b.bin").expect("read with room") == b);
    d.stop();
    drop(small);
}

#[test]
fn view_files_under_mounted_layers_give_way_when_other_data_fills_their_disk() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let data = random_bytes(16 << 20, 61);
    one_file_images(&store, &[("kf:v1", "k.bin", &data)]);
    let (state, views, small) = small_views(64 << 20);
    // `cache_size` far above the disk: only the free share (10 %, 6.4 MiB) bounds the view files.
    let args = [
        "--mount-mode",
        "fanotify",
        "--view-keep-free",
        "10",
        "--view-evict-grace",
        "1",
    ];
    let mut d = Daemon::start_in(&store, state, &args);
    let root = d.ok(&["mount", "kf:v1", "--sandbox", "k"]);
    let file = Path::new(&root).join("data/k.bin");
    assert!(std::fs::read(&file).expect("first read") == data);
    // Another writer takes the whole disk: the mounted layer's view file gives chunks up (those
    // not read in the last grace) until the free share is back.
    fill_up(&views, "other-data");
    let f = fanotify_once(&d, "the free share not kept", |f| {
        f["evicted_bytes"].as_u64() > Some(0)
            && f["room"]["disk_avail_bytes"].as_u64() >= f["room"]["keep_free_bytes"].as_u64()
    });
    eprintln!("after the disk filled: {f}");
    // The layer reads the same: evicted chunks come back from the store, into the kept share.
    strata_tests::readers::drop_caches();
    assert!(std::fs::read(&file).expect("read again") == data);
    let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
    assert_eq!(scrub["bad"].as_u64(), Some(0), "{scrub}");
    d.stop();
    drop(small);
}

#[test]
fn a_mounted_layers_view_file_is_kept_to_the_bound_and_reads_the_same() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let Evicting {
        d,
        file,
        data,
        _store,
        _sdir,
    } = evicting("ev:v1", "e.bin", 41);
    let fanotify = || json(&d.ok(&["daemon", "status"]))["fanotify"].clone();
    let f = under_the_bound(&d);
    // The layer stayed mounted all along; its evicted chunks come back from the store. Two
    // readers go through it a MiB at a time, slowly, over and over, the page cache dropped
    // meanwhile, so that what they read a few seconds ago is marked and punched out while they
    // read on: every read gives the file's bytes, never a hole.
    let evicted = f["evicted_chunks"].as_u64().unwrap_or(0);
    let until = Instant::now() + Duration::from_secs(8);
    std::thread::scope(|sc| {
        for start in [0, 6] {
            let (file, data) = (&file, &data);
            sc.spawn(move || read_by_the_mib(file, data, start, Duration::from_millis(250), until));
        }
        while Instant::now() < until {
            strata_tests::readers::drop_caches();
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let after = fanotify();
    eprintln!("eviction before the readers: {f}\nafter them: {after}");
    let again = after["evicted_chunks"].as_u64().unwrap_or(0);
    assert!(
        again > evicted,
        "no eviction while the readers read: {after}"
    );
    let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
    assert_eq!(scrub["bad"].as_u64(), Some(0), "{scrub}");
}

#[test]
fn a_successor_evicts_only_from_layers_mounted_with_their_view_files_watched() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let Evicting {
        d,
        file,
        data,
        _store,
        _sdir,
    } = evicting("sv:v1", "s.bin", 43);
    let status = || json(&d.ok(&["daemon", "status"]));
    let layer = status()["layers"][0]["path"]
        .as_str()
        .expect("layer path")
        .to_string();
    let marker = Path::new(&layer).with_extension("watched");
    assert!(marker.exists(), "no marker beside {layer}");
    // A successor of a server killed: the layer was mounted with its files watched, so it evicts.
    d.kill_server();
    assert!(std::fs::read(&file).expect("read") == data);
    under_the_bound(&d);
    // Without the marker (a mount an older stratad made), the next successor leaves it alone.
    std::fs::remove_file(&marker).expect("remove the marker");
    d.kill_server();
    strata_tests::readers::drop_caches();
    assert!(std::fs::read(&file).expect("read again") == data);
    std::thread::sleep(Duration::from_secs(4));
    let f = status()["fanotify"].clone();
    assert_eq!(f["evicted_bytes"].as_u64(), Some(0), "{f}");
    assert_eq!(f["evicting_bytes"].as_u64(), Some(0), "{f}");
    assert!(f["disk_bytes"].as_u64() > Some(8 << 20), "{f}");
}

#[test]
fn readers_lose_nothing_when_servers_evicting_under_them_are_killed() {
    if !have(&[Need::PreContent]) {
        return;
    }
    let Evicting {
        d,
        file,
        data,
        _store,
        _sdir,
    } = evicting("sk:v1", "k.bin", 44);
    // Two readers go through the file a MiB at a time while eviction marks and punches what they
    // read a few seconds ago, the page cache is dropped, and the server is killed every 2.5 s.
    let until = Instant::now() + Duration::from_secs(10);
    let (mut kills, mut evicted) = (0, 0);
    std::thread::scope(|sc| {
        for start in [0, 6] {
            let (file, data) = (&file, &data);
            sc.spawn(move || read_by_the_mib(file, data, start, Duration::from_millis(150), until));
        }
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2500));
            let status = json(&d.ok(&["daemon", "status"]));
            evicted += status["fanotify"]["evicted_chunks"].as_u64().unwrap_or(0);
            strata_tests::readers::drop_caches();
            d.kill_server();
            kills += 1;
        }
    });
    eprintln!("{kills} servers killed; {evicted} chunks punched out by them before");
    assert!(
        kills >= 3 && evicted > 0,
        "{kills} kills, {evicted} chunks evicted"
    );
    assert!(std::fs::read(&file).expect("last read") == data);
    let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
    assert_eq!(scrub["bad"].as_u64(), Some(0), "{scrub}");
}
