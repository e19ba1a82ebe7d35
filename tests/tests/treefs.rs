//! The tree server (`fuse` mount mode): a layer built into a `file://` store is mounted through
//! `strata_fs::treefs` alone — no kernel EROFS, no daemon — and compared entry by entry with its source
//! (content, modes, owners, times, xattrs, link groups, device numbers); then an overlay stacks two
//! such trees, the upper with a whiteout and an opaque directory, and shows overlay's semantics.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use strata_builder::erofs::format::makedev;
use strata_builder::erofs::write_image;
use strata_builder::tree::{FileData, Meta, NodeKind, Tree, OPAQUE_XATTR};
use strata_fs::blobfs::BlobTable;
use strata_fs::cache::ChunkCache;
use strata_fs::fetch::{BlobHandle, Fetcher};
use strata_fs::metrics::Metrics;
use strata_fs::treefs::{self, TreeMount, TreeOptions};
use strata_registry::digest::Digest;
use strata_tests::*;

/// The node side of one test: blobs served, cache, fetcher.
struct Node {
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    store: Arc<strata_registry::store::Store>,
}

impl Node {
    fn new(store: &StoreEnv, cache: &Path) -> Node {
        let store = Arc::new(store.open());
        let metrics = Arc::new(Metrics::default());
        let cache = ChunkCache::open(cache, 1 << 30).expect("cache");
        let fetcher = Arc::new(Fetcher::new(
            store.clone(),
            cache,
            metrics.clone(),
            4 << 20,
            Duration::from_secs(10),
        ));
        Node {
            table: Arc::new(BlobTable::default()),
            fetcher,
            metrics,
            store,
        }
    }

    /// Registers the layer's blobs and writes its metadata to `dir`; returns the metadata file.
    fn fetch_layer(&self, layer: &str, dir: &Path) -> PathBuf {
        let d: Digest = layer.parse().expect("digest");
        let desc = self.store.get_layer(&d).expect("layer");
        for b in &desc.blobs {
            let h = BlobHandle::open(&self.store, b).expect("blob");
            self.table.add(h).expect("add blob");
        }
        let meta = dir.join(format!("{}.erofs", d.hex()));
        let bytes = self.store.get_meta(&desc.meta.digest).expect("meta");
        std::fs::write(&meta, bytes).expect("write meta");
        meta
    }

    fn mount(&self, meta: &Path, target: &Path) -> Mounted {
        std::fs::create_dir_all(target).expect("mountpoint");
        let m = treefs::mount_layer(
            meta,
            target,
            self.table.clone(),
            self.fetcher.clone(),
            self.metrics.clone(),
            &TreeOptions::default(),
        )
        .expect("tree mount");
        Mounted(Some(m))
    }
}

/// A tree mount, unmounted on drop.
struct Mounted(Option<TreeMount>);

impl Mounted {
    fn path(&self) -> &Path {
        self.0.as_ref().expect("mounted").path()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            let _ = m.unmount(true);
        }
    }
}

/// Unmounts a plain mount (the overlay) on drop.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = strata_fs::mount::unmount(&self.0, true);
    }
}

fn build(store: &StoreEnv, src: &Path, tag: &str) -> String {
    let out = store.ok(&[
        "build",
        src.to_str().expect("utf8"),
        "--kind",
        "base",
        "-t",
        tag,
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    v["digest"].as_str().expect("digest").to_string()
}

fn meta(perm: u32) -> Meta {
    Meta {
        perm,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_000,
        mtime_nsec: 0,
        xattrs: Vec::new(),
    }
}

/// An upper layer written directly (no blobs): a whiteout over `etc/hostname`, `usr/share/doc` made
/// opaque with one new file, and a new file at the top.
fn upper_image(path: &Path) {
    let mut t = Tree::new();
    t.insert(b"", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("root");
    t.insert(b"etc", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("etc");
    t.insert(b"etc/hostname", meta(0), NodeKind::CharDev { rdev: 0 })
        .expect("whiteout");
    let mut opaque = meta(0o755);
    opaque.xattrs = vec![(OPAQUE_XATTR.to_vec(), b"y".to_vec())];
    t.insert(b"usr", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("usr");
    t.insert(b"usr/share", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("share");
    t.insert(b"usr/share/doc", opaque, NodeKind::Dir(Default::default()))
        .expect("opaque");
    let file = |b: &[u8]| NodeKind::File {
        size: b.len() as u64,
        data: FileData::Inline(b.to_vec()),
    };
    t.insert(b"usr/share/doc/new.txt", meta(0o644), file(b"new doc\n"))
        .expect("new");
    t.insert(b"added", meta(0o644), file(b"added\n"))
        .expect("added");
    t.insert(
        b"null",
        meta(0o666),
        NodeKind::CharDev {
            rdev: makedev(1, 3),
        },
    )
    .expect("device");
    let img = write_image(&t, &[], 20, &|_| None).expect("write upper");
    std::fs::write(path, img).expect("write upper image");
}

#[test]
fn tree_server_serves_a_layer_and_stacks_under_overlay() {
    if !have(&[Need::Fuse]) {
        return;
    }
    let work = scratch("treefs");
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).expect("src");
    generate_tree(&src);
    let store = StoreEnv::local(&work.path().join("store"));
    let layer = build(&store, &src, "test/tree:v1");
    let node = Node::new(&store, &work.path().join("cache"));
    let meta_dir = work.path().join("meta");
    std::fs::create_dir_all(&meta_dir).expect("meta dir");
    let lower_meta = node.fetch_layer(&layer, &meta_dir);

    // The whole tree, cold (every chunk fetched), then warm (from the cache).
    let lower = node.mount(&lower_meta, &work.path().join("lower"));
    let source = snapshot(&src);
    for pass in ["cold", "warm"] {
        let d = diff(&source, &snapshot(lower.path()));
        assert!(d.is_empty(), "{pass} tree differs:\n{}", d.join("\n"));
    }
    // Stable node ids: st_ino is the EROFS nid + 1 (the root is 1), whatever was looked up before.
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata(lower.path()).expect("stat root");
    assert_eq!(root.ino(), 1);
    let a = std::fs::metadata(lower.path().join("etc/hostname")).expect("stat");
    let b = std::fs::metadata(lower.path().join("etc/hostname.hard")).expect("stat");
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));

    // An overlay of an upper layer (whiteout, opaque directory) over the lower tree.
    let upper_meta = meta_dir.join("upper.erofs");
    upper_image(&upper_meta);
    let upper = node.mount(&upper_meta, &work.path().join("upper"));
    assert_eq!(
        xattr::get(upper.path().join("usr/share/doc"), "trusted.overlay.opaque").expect("getxattr"),
        Some(b"y".to_vec())
    );
    let merged = work.path().join("merged");
    std::fs::create_dir_all(&merged).expect("merged");
    let opts = std::ffi::CString::new(format!(
        "lowerdir={}:{}",
        upper.path().display(),
        lower.path().display()
    ))
    .expect("options");
    rustix::mount::mount(
        "overlay",
        &merged,
        "overlay",
        rustix::mount::MountFlags::RDONLY,
        opts.as_c_str(),
    )
    .expect("overlay over two tree mounts");
    let _overlay = Unmount(merged.clone());
    assert!(
        !merged.join("etc/hostname").exists(),
        "whiteout hides the file"
    );
    assert!(
        merged.join("etc/hostname.hard").exists(),
        "its hard link stays"
    );
    assert_eq!(
        std::fs::read(merged.join("etc/small.conf")).expect("lower file"),
        vec![b'x'; 3000]
    );
    let doc: Vec<_> = std::fs::read_dir(merged.join("usr/share/doc"))
        .expect("opaque dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(doc, vec![std::ffi::OsString::from("new.txt")], "opaque dir");
    assert_eq!(
        std::fs::read(merged.join("added")).expect("upper file"),
        b"added\n"
    );
    assert_eq!(
        std::fs::read(merged.join("usr/lib/big.bin")).expect("chunked lower file"),
        std::fs::read(src.join("usr/lib/big.bin")).expect("source")
    );
    let null = std::fs::symlink_metadata(merged.join("null")).expect("device");
    assert_eq!(null.rdev(), makedev(1, 3));
}

/// A layer of twenty small files in `d/`, a symlink to one, and no xattr anywhere (written directly).
fn plain_image(path: &Path) {
    let mut t = Tree::new();
    t.insert(b"", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("root");
    t.insert(b"d", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("d");
    for i in 0..20 {
        let body = format!("file {i}\n").into_bytes();
        let kind = NodeKind::File {
            size: body.len() as u64,
            data: FileData::Inline(body),
        };
        t.insert(format!("d/f{i}").as_bytes(), meta(0o644), kind)
            .expect("file");
    }
    t.insert(b"l", meta(0o777), NodeKind::Symlink(b"d/f7".to_vec()))
        .expect("symlink");
    let img = write_image(&t, &[], 20, &|_| None).expect("write image");
    std::fs::write(path, img).expect("write image file");
}

#[test]
fn a_listed_directory_costs_no_lookups_and_a_layer_without_xattrs_no_xattr_requests() {
    if !have(&[Need::Fuse]) {
        return;
    }
    let work = scratch("treefs-plain");
    let store = StoreEnv::local(&work.path().join("store"));
    let node = Node::new(&store, &work.path().join("cache"));
    let img = work.path().join("plain.erofs");
    plain_image(&img);
    let m = node.mount(&img, &work.path().join("plain"));
    let tree = m.0.as_ref().expect("mounted");
    let requests = || {
        tree.stats()
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // Rust's stat asks for the birth time too, so the kernel's first stat of the connection sends one
    // FUSE_STATX (ENOSYS: never again); have it done before counting.
    std::fs::symlink_metadata(m.path()).expect("stat root");
    // READDIRPLUS: the listing brings every entry's attributes; stat of each then asks nothing.
    let names: Vec<_> = std::fs::read_dir(m.path().join("d"))
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names.len(), 20);
    let before = requests();
    for n in &names {
        let md = std::fs::symlink_metadata(m.path().join("d").join(n)).expect("stat");
        assert_eq!(
            md.len(),
            format!("file {}\n", &n.to_string_lossy()[1..]).len() as u64
        );
    }
    assert_eq!(requests() - before, 0, "lookups of listed names");
    // Symlink targets stay in the kernel's page cache: one READLINK for any number of reads.
    let link = m.path().join("l");
    assert_eq!(
        std::fs::read_link(&link).expect("readlink"),
        Path::new("d/f7")
    );
    let before = requests();
    for _ in 0..5 {
        assert_eq!(
            std::fs::read_link(&link).expect("readlink"),
            Path::new("d/f7")
        );
    }
    assert_eq!(requests() - before, 0, "READLINKs of a cached link");
    // Once the background walk found no xattr, GETXATTR is ENOSYS: the kernel answers EOPNOTSUPP
    // itself from then on, and asks the server nothing more.
    let file = m.path().join("d/f3");
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match xattr::get(&file, "trusted.overlay.opaque") {
            Ok(None) => {}
            Ok(Some(v)) => panic!("an xattr nobody wrote: {v:?}"),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => break,
            Err(e) => panic!("getxattr: {e}"),
        }
        assert!(
            std::time::Instant::now() < end,
            "GETXATTR never became ENOSYS"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = requests();
    let e = xattr::get(&file, "user.any").expect_err("no xattrs");
    assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
    assert_eq!(requests() - before, 0, "GETXATTR after ENOSYS");
    // Reads are unchanged.
    assert_eq!(std::fs::read(&link).expect("read"), b"file 7\n");
}

/// A directory of 3,000 files and 1,100 directories of one file each (more than the tree server keeps
/// decoded: its directory cache is emptied on the way).
fn wide_image(path: &Path) {
    let mut t = Tree::new();
    let file = |body: String| NodeKind::File {
        size: body.len() as u64,
        data: FileData::Inline(body.into_bytes()),
    };
    t.insert(b"", meta(0o755), NodeKind::Dir(Default::default()))
        .expect("root");
    for d in ["big", "t"] {
        t.insert(d.as_bytes(), meta(0o755), NodeKind::Dir(Default::default()))
            .expect("dir");
    }
    for i in 0..3000 {
        t.insert(
            format!("big/f{i:05}").as_bytes(),
            meta(0o644),
            file(format!("{i}\n")),
        )
        .expect("file");
    }
    for i in 0..1100 {
        t.insert(
            format!("t/d{i:04}").as_bytes(),
            meta(0o755),
            NodeKind::Dir(Default::default()),
        )
        .expect("dir");
        t.insert(
            format!("t/d{i:04}/x").as_bytes(),
            meta(0o644),
            file(format!("x{i}\n")),
        )
        .expect("file");
    }
    let img = write_image(&t, &[], 20, &|_| None).expect("write image");
    std::fs::write(path, img).expect("write image file");
}

#[test]
fn wide_directories_list_and_look_up_right_past_the_directory_cache() {
    if !have(&[Need::Fuse]) {
        return;
    }
    let work = scratch("treefs-wide");
    let store = StoreEnv::local(&work.path().join("store"));
    let node = Node::new(&store, &work.path().join("cache"));
    let img = work.path().join("wide.erofs");
    wide_image(&img);
    let m = node.mount(&img, &work.path().join("wide"));
    let list = |p: &Path| {
        let mut n: Vec<String> = std::fs::read_dir(p)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    let big = m.path().join("big");
    let want: Vec<String> = (0..3000).map(|i| format!("f{i:05}")).collect();
    // Many READDIRPLUS requests for one listing, each served from the one decoded directory.
    assert_eq!(list(&big), want);
    let read_all = || {
        for i in (0..3000).step_by(7) {
            let got = std::fs::read_to_string(big.join(format!("f{i:05}"))).expect("read");
            assert_eq!(got, format!("{i}\n"));
        }
    };
    read_all();
    assert!(
        std::fs::metadata(big.join("f03000")).is_err(),
        "no such name"
    );
    // More directories than the server keeps decoded: each still lists and looks up right.
    for i in 0..1100 {
        let d = m.path().join(format!("t/d{i:04}"));
        assert_eq!(list(&d), vec!["x".to_string()]);
        assert_eq!(
            std::fs::read_to_string(d.join("x")).expect("read"),
            format!("x{i}\n")
        );
    }
    assert_eq!(list(&m.path().join("t")).len(), 1100);
    // And the first directory, decoded again, with the kernel's dentries dropped.
    std::fs::write("/proc/sys/vm/drop_caches", "2").ok();
    assert_eq!(list(&big), want);
    read_all();
}
