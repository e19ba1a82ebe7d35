//! Our EROFS writer against the real kernel and erofs-utils.
//!
//! Builds a tree holding every kind of entry and metadata, writes two device files with the chunk bytes and
//! the image, checks it with `fsck.erofs`, mounts it file-backed through the new mount API and compares
//! every entry with the tree (lstat, readlink, read, xattrs, hard-link groups); then reads the image back
//! with our reader and compares again.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use strata_tests::{have, Need};

use strata_builder::erofs::format::{makedev, BLKSZ};
use strata_builder::erofs::{write_image, BlobSlot, ChunkLoc, DeviceSlot, ErofsImage};
use strata_builder::tree::{FileData, Meta, NodeId, NodeKind, Tree};
use strata_fs::mount::{mount_erofs, unmount};
use strata_registry::digest::Digest;

const CHUNK_BITS: u8 = 20;
const CHUNK: u64 = 1 << CHUNK_BITS;

/// Deterministic pseudo-random bytes.
fn pattern(seed: &str, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

fn meta(perm: u32, mtime: i64, nsec: u32) -> Meta {
    Meta {
        perm,
        uid: 1000,
        gid: 100,
        mtime,
        mtime_nsec: nsec,
        xattrs: Vec::new(),
    }
}

fn inline(bytes: &[u8]) -> NodeKind {
    NodeKind::File {
        size: bytes.len() as u64,
        data: FileData::Inline(bytes.to_vec()),
    }
}

/// The blobs (devices) chunks are stored in, 4 KiB aligned, deduplicated by digest.
struct Blobs {
    devs: Vec<Vec<u8>>,
    locs: HashMap<Digest, ChunkLoc>,
    bytes: HashMap<Digest, Vec<u8>>,
}

impl Blobs {
    fn add(&mut self, dev: usize, chunk: &[u8]) -> Digest {
        let d = Digest::of(chunk);
        if !self.locs.contains_key(&d) {
            let blob = &mut self.devs[dev];
            let block = (blob.len() / BLKSZ) as u32;
            blob.extend_from_slice(chunk);
            blob.resize(blob.len().div_ceil(BLKSZ) * BLKSZ, 0);
            self.locs.insert(
                d,
                ChunkLoc {
                    device: dev as u16 + 1,
                    block,
                },
            );
            self.bytes.insert(d, chunk.to_vec());
        }
        d
    }

    /// A chunked file: `content`'s chunks on the given devices (None = hole, which must be zeros).
    fn file(&mut self, content: &[u8], devs: &[Option<usize>]) -> NodeKind {
        let chunks = content
            .chunks(CHUNK as usize)
            .zip(devs)
            .map(|(c, dev)| dev.map(|dev| self.add(dev, c)))
            .collect::<Vec<_>>();
        assert_eq!(chunks.len() as u64, (content.len() as u64).div_ceil(CHUNK));
        NodeKind::File {
            size: content.len() as u64,
            data: FileData::Chunks(chunks),
        }
    }

    fn content(&self, size: u64, chunks: &[Option<Digest>]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, c) in chunks.iter().enumerate() {
            let len = (size - k as u64 * CHUNK).min(CHUNK) as usize;
            match c {
                Some(d) => out.extend_from_slice(&self.bytes[d]),
                None => out.resize(out.len() + len, 0),
            }
        }
        out
    }
}

/// A POSIX ACL xattr value: version 2, then (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Inserts a node into the test tree.
fn ins(t: &mut Tree, path: &[u8], m: Meta, k: NodeKind) {
    t.insert(path, m, k).expect("insert");
}

/// The test tree: every kind of entry and metadata the writer must get right, files inline and
/// chunked over two devices of `blobs`.
fn build(blobs: &mut Blobs) -> Tree {
    let mut t = Tree::new();
    let mut root = meta(0o755, 1_700_000_000, 1);
    root.xattrs = vec![(b"user.root".to_vec(), b"yes".to_vec())];
    ins(&mut t, b"", root, NodeKind::Dir(BTreeMap::new()));

    inline_files_and_hard_links(&mut t);
    special_bits_ids_and_acls(&mut t);
    links_devices_fifo_socket(&mut t);
    chunked_files(&mut t, blobs);
    wide_directories_and_odd_names(&mut t);
    t
}

/// Regular files stored inline, of sizes around the block size; hard links and whiteouts.
fn inline_files_and_hard_links(t: &mut Tree) {
    let mut passwd = meta(0o644, 1_600_000_000, 999_999_999);
    passwd.xattrs = vec![
        (b"security.selinux_like".to_vec(), b"label\0".to_vec()),
        (b"trusted.blob".to_vec(), vec![0, 1, 2, 255]),
        (b"user.comment".to_vec(), b"hello".to_vec()),
        (
            format!("user.{}", "n".repeat(200)).into_bytes(),
            pattern("big-xattr", 3000),
        ),
    ];
    ins(
        t,
        b"etc/passwd",
        passwd,
        inline(b"root:x:0:0:root:/root:/bin/sh\n"),
    );
    ins(t, b"empty", meta(0o600, 0, 0), inline(b""));
    for size in [1usize, 4000, 4096, 5000, 12_289, 70_000] {
        let m = meta(0o640, 1_000 + size as i64, size as u32);
        ins(
            t,
            format!("sizes/{size}").as_bytes(),
            m,
            inline(&pattern(&size.to_string(), size)),
        );
    }
    // Hard links: three names for one file, two whiteouts sharing a node (as overlay makes them).
    t.link(b"etc/passwd.hard", b"etc/passwd").expect("link");
    t.link(b"sizes/also-passwd", b"etc/passwd").expect("link");
    ins(t, b"wh/gone", meta(0, 0, 0), NodeKind::CharDev { rdev: 0 });
    t.link(b"wh/gone2", b"wh/gone").expect("link");
    t.set_opaque(b"wh").expect("opaque");
}

/// Special bits, big ids, times before the epoch, ACLs.
fn special_bits_ids_and_acls(t: &mut Tree) {
    let mut su = meta(0o4755, -1_000_000_000, 5);
    su.uid = 0;
    su.gid = 0;
    su.xattrs = vec![(
        b"security.capability".to_vec(),
        vec![1, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    )];
    ins(t, b"bin/su", su, inline(b"#!/bin/sh\nexec id\n"));
    ins(t, b"bin/sg", meta(0o2711, -1, 999_999_999), inline(b"sg"));
    ins(
        t,
        b"tmp",
        meta(0o1777, 86_400, 0),
        NodeKind::Dir(BTreeMap::new()),
    );
    let mut big_ids = meta(0o640, 1_234_567_890, 42);
    big_ids.uid = 100_000;
    big_ids.gid = 4_000_000_000;
    big_ids.xattrs = vec![(
        b"system.posix_acl_access".to_vec(),
        acl(&[
            (1, 6, u32::MAX),
            (2, 4, 1234),
            (4, 4, u32::MAX),
            (0x10, 4, u32::MAX),
            (0x20, 0, u32::MAX),
        ]),
    )];
    ins(t, b"home/big-ids", big_ids, inline(b"ids"));
    let mut shared = meta(0o2775, 1, 0);
    shared.xattrs = vec![(
        b"system.posix_acl_default".to_vec(),
        acl(&[
            (1, 7, u32::MAX),
            (4, 5, u32::MAX),
            (8, 7, 50),
            (0x10, 7, u32::MAX),
            (0x20, 5, u32::MAX),
        ]),
    )];
    ins(t, b"home/shared", shared, NodeKind::Dir(BTreeMap::new()));
}

fn links_devices_fifo_socket(t: &mut Tree) {
    let mut link = meta(0o777, 5, 5);
    link.xattrs = vec![(b"trusted.overlay.redirect".to_vec(), b"/x".to_vec())];
    ins(t, b"link", link, NodeKind::Symlink(b"etc/passwd".to_vec()));
    ins(
        t,
        b"longlink",
        meta(0o777, 6, 6),
        NodeKind::Symlink(pattern("t", 4095).iter().map(|b| b'a' + b % 26).collect()),
    );
    ins(
        t,
        b"dev/null",
        meta(0o666, 7, 7),
        NodeKind::CharDev {
            rdev: makedev(1, 3),
        },
    );
    ins(
        t,
        b"dev/sda",
        meta(0o660, 8, 8),
        NodeKind::BlockDev {
            rdev: makedev(8, 0),
        },
    );
    ins(
        t,
        b"dev/wide",
        meta(0o600, 9, 9),
        NodeKind::CharDev {
            rdev: makedev(300, 70_000),
        },
    );
    ins(t, b"dev/fifo", meta(0o644, 10, 10), NodeKind::Fifo);
    ins(t, b"dev/sock", meta(0o755, 11, 11), NodeKind::Socket);
}

/// Chunked files over two devices: a hole, a short last chunk, a shared chunk, all-hole, empty.
fn chunked_files(t: &mut Tree, blobs: &mut Blobs) {
    let big = pattern("big", (3 * CHUNK + 10 * 1024 + 5) as usize);
    let mut big_with_hole = big.clone();
    big_with_hole[CHUNK as usize..2 * CHUNK as usize].fill(0);
    let kind = blobs.file(&big_with_hole, &[Some(0), None, Some(1), Some(0)]);
    ins(t, b"data/big", meta(0o644, 12, 12), kind);
    let mut dup = big[..CHUNK as usize].to_vec();
    dup.extend_from_slice(&pattern("dup", CHUNK as usize));
    let kind = blobs.file(&dup, &[Some(1), Some(1)]);
    ins(t, b"data/dup", meta(0o644, 13, 13), kind);
    let kind = blobs.file(&vec![0; (2 * CHUNK + 1) as usize], &[None, None, None]);
    ins(t, b"data/sparse", meta(0o644, 14, 14), kind);
    let kind = blobs.file(&[], &[]);
    ins(t, b"data/zero", meta(0o644, 15, 15), kind);
    let kind = blobs.file(&pattern("small", 100), &[Some(1)]);
    ins(t, b"data/small", meta(0o644, 16, 16), kind);
}

/// A 5,000-entry directory, 255-byte and non-UTF-8 names, a deep path.
fn wide_directories_and_odd_names(t: &mut Tree) {
    for i in 0..5000u32 {
        let name = format!("many/f{i:04}{}", "x".repeat((i % 50) as usize));
        let kind = match i % 4 {
            0 => NodeKind::Fifo,
            1 => NodeKind::Symlink(format!("../t{i}").into_bytes()),
            _ => inline(&i.to_le_bytes()),
        };
        ins(t, name.as_bytes(), meta(0o644, i64::from(i), i), kind);
    }
    t.link(b"many/hard-to-passwd", b"etc/passwd").expect("link");
    let names: [Vec<u8>; 4] = [
        vec![0xff; 255],
        (0..255u32)
            .map(|i| (i % 200) as u8 + 50)
            .map(|b| if b == b'/' { b'_' } else { b })
            .collect(),
        vec![b'-', 0x80, 0xfe],
        b".-dot".to_vec(),
    ];
    for n in &names {
        let mut p = b"names/".to_vec();
        p.extend_from_slice(n);
        ins(t, &p, meta(0o644, 17, 17), inline(n));
    }
    let deep: Vec<u8> = (0..600)
        .flat_map(|i| format!("{}/", i % 10).into_bytes())
        .collect();
    let mut leaf = deep.clone();
    leaf.extend_from_slice(b"leaf");
    ins(t, &leaf, meta(0o644, 18, 18), inline(b"deep"));
}

/// Unmounts when dropped, whether the test passed or not.
struct MountGuard(PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Err(e) = unmount(&self.0, false) {
            eprintln!("unmount {}: {e}; detaching", self.0.display());
            let _ = unmount(&self.0, true);
        }
    }
}

fn join(base: &Path, rel: &[u8]) -> PathBuf {
    if rel.is_empty() {
        base.to_path_buf()
    } else {
        base.join(OsStr::from_bytes(rel))
    }
}

/// Every reachable node with one of its paths, in depth-first order (explicit stack).
fn entries(tree: &Tree) -> Vec<(Vec<u8>, NodeId)> {
    let mut out = Vec::new();
    let mut stack = vec![(Vec::new(), 0usize)];
    while let Some((path, id)) = stack.pop() {
        for (name, child) in tree.children(id) {
            let mut p = path.clone();
            if !p.is_empty() {
                p.push(b'/');
            }
            p.extend_from_slice(name);
            stack.push((p, child));
        }
        out.push((path, id));
    }
    out
}

fn expected_content(blobs: &Blobs, node: &NodeKind) -> Option<Vec<u8>> {
    match node {
        NodeKind::File {
            data: FileData::Inline(b),
            ..
        } => Some(b.clone()),
        NodeKind::File {
            size,
            data: FileData::Chunks(c),
        } => Some(blobs.content(*size, c)),
        _ => None,
    }
}

/// Compares the mounted tree at `root` with `tree`, entry by entry.
fn compare_mounted(tree: &Tree, blobs: &Blobs, root: &Path) {
    let mut ino_of: HashMap<NodeId, u64> = HashMap::new();
    let mut node_of: HashMap<u64, NodeId> = HashMap::new();
    let all = entries(tree);
    assert_eq!(
        all.len() as u64,
        tree.entry_count(),
        "every name is compared"
    );
    for (rel, id) in all {
        let node = &tree.nodes[id];
        let path = join(root, &rel);
        let show = String::from_utf8_lossy(&rel).into_owned();
        let st = std::fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("lstat {show}: {e}"));
        assert_eq!(st.mode(), node.mode(), "mode of {show}");
        assert_eq!(
            (st.uid(), st.gid()),
            (node.meta.uid, node.meta.gid),
            "owner of {show}"
        );
        assert_eq!(
            (st.mtime(), st.mtime_nsec()),
            (node.meta.mtime, i64::from(node.meta.mtime_nsec)),
            "mtime of {show}"
        );
        assert_eq!(st.nlink(), u64::from(node.nlink(tree)), "nlink of {show}");
        // Hard-link groups: one st_ino per node, distinct nodes distinct inodes.
        assert_eq!(
            *ino_of.entry(id).or_insert(st.ino()),
            st.ino(),
            "hard link {show}"
        );
        assert_eq!(
            *node_of.entry(st.ino()).or_insert(id),
            id,
            "inode shared by {show}"
        );
        match &node.kind {
            NodeKind::Dir(children) => {
                let mut got: Vec<Vec<u8>> = std::fs::read_dir(&path)
                    .unwrap_or_else(|e| panic!("readdir {show}: {e}"))
                    .map(|e| e.expect("dirent").file_name().as_bytes().to_vec())
                    .collect();
                got.sort();
                let want: Vec<Vec<u8>> = children.keys().cloned().collect();
                assert_eq!(got, want, "entries of {show}");
            }
            NodeKind::File { size, .. } => {
                assert_eq!(st.size(), *size, "size of {show}");
                let want = expected_content(blobs, &node.kind).expect("file");
                let got = std::fs::read(&path).unwrap_or_else(|e| panic!("read {show}: {e}"));
                assert!(got == want, "content of {show} differs");
            }
            NodeKind::Symlink(target) => {
                let got =
                    std::fs::read_link(&path).unwrap_or_else(|e| panic!("readlink {show}: {e}"));
                assert_eq!(
                    got.as_os_str().as_bytes(),
                    target.as_slice(),
                    "target of {show}"
                );
            }
            NodeKind::CharDev { rdev } | NodeKind::BlockDev { rdev } => {
                assert_eq!(st.rdev(), *rdev, "rdev of {show}")
            }
            NodeKind::Fifo | NodeKind::Socket => {}
        }
        let mut names: Vec<Vec<u8>> = xattr::list(&path)
            .unwrap_or_else(|e| panic!("llistxattr {show}: {e}"))
            .map(|n| n.as_bytes().to_vec())
            .collect();
        names.sort();
        let mut want: Vec<&(Vec<u8>, Vec<u8>)> = node.meta.xattrs.iter().collect();
        want.sort();
        let want_names: Vec<Vec<u8>> = want.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, want_names, "xattr names of {show}");
        for (name, value) in want {
            let got = xattr::get(&path, OsStr::from_bytes(name)).unwrap_or_else(|e| {
                panic!("lgetxattr {show} {}: {e}", String::from_utf8_lossy(name))
            });
            assert_eq!(
                got.as_ref(),
                Some(value),
                "xattr {} of {show}",
                String::from_utf8_lossy(name)
            );
        }
    }
}

/// Compares what our reader sees with `tree`.
fn compare_read_back(tree: &Tree, blobs: &Blobs, img: &ErofsImage) {
    let mut nid_of: HashMap<NodeId, u64> = HashMap::new();
    for (rel, id) in entries(tree) {
        let node = &tree.nodes[id];
        let show = String::from_utf8_lossy(&rel).into_owned();
        let ino = img
            .lookup(&rel)
            .expect("lookup")
            .unwrap_or_else(|| panic!("{show} missing"));
        assert_eq!(
            *nid_of.entry(id).or_insert(ino.nid),
            ino.nid,
            "hard link {show}"
        );
        assert_eq!(ino.mode, node.mode(), "{show}");
        assert_eq!(
            (ino.uid, ino.gid, ino.mtime, ino.mtime_nsec),
            (
                node.meta.uid,
                node.meta.gid,
                node.meta.mtime,
                node.meta.mtime_nsec
            ),
            "{show}"
        );
        assert_eq!(ino.nlink, node.nlink(tree), "{show}");
        assert_eq!(ino.xattrs, node.meta.xattrs, "{show}");
        match &node.kind {
            NodeKind::Dir(children) => {
                let names: Vec<Vec<u8>> = img
                    .read_dir(&ino)
                    .expect("readdir")
                    .into_iter()
                    .map(|e| e.name)
                    .collect();
                assert_eq!(
                    names,
                    children.keys().cloned().collect::<Vec<_>>(),
                    "{show}"
                );
            }
            NodeKind::File {
                data: FileData::Inline(b),
                ..
            } => assert_eq!(&img.data(&ino).expect("data"), b, "{show}"),
            NodeKind::File {
                data: FileData::Chunks(c),
                ..
            } => {
                let want: Vec<Option<ChunkLoc>> =
                    c.iter().map(|d| d.map(|d| blobs.locs[&d])).collect();
                assert_eq!(img.chunks(&ino).expect("chunks"), want, "{show}");
            }
            NodeKind::Symlink(target) => {
                assert_eq!(&img.data(&ino).expect("target"), target, "{show}")
            }
            NodeKind::CharDev { rdev } | NodeKind::BlockDev { rdev } => {
                assert_eq!(ino.rdev, *rdev, "{show}")
            }
            NodeKind::Fifo | NodeKind::Socket => {}
        }
    }
    assert_eq!(img.inode_count(), nid_of.len() as u64);
}

#[test]
fn kernel_mounts_what_we_write() {
    let mut blobs = Blobs {
        devs: vec![Vec::new(), Vec::new()],
        locs: HashMap::new(),
        bytes: HashMap::new(),
    };
    let tree = build(&mut blobs);
    let slots: Vec<DeviceSlot> = blobs
        .devs
        .iter()
        .map(|d| DeviceSlot::for_blob(&Digest::of(d), (d.len() / BLKSZ) as u32))
        .collect();
    let image = write_image(&tree, &slots, CHUNK_BITS, &|d| blobs.locs.get(d).copied())
        .expect("write image");

    // Our reader first: it needs no privileges.
    let read_back = ErofsImage::parse(image.clone()).expect("parse");
    assert_eq!(read_back.devices(), slots.as_slice());
    compare_read_back(&tree, &blobs, &read_back);

    // The metadata file must live on a disk filesystem: /var/tmp, not a tmpfs /tmp.
    let dir = tempfile::Builder::new()
        .prefix("strata-erofs-")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let meta_path = dir.path().join("meta.erofs");
    std::fs::write(&meta_path, &image).expect("write image");
    let mut dev_paths = Vec::new();
    for (k, d) in blobs.devs.iter().enumerate() {
        let p = dir.path().join(format!("blob{}", k + 1));
        std::fs::write(&p, d).expect("write blob");
        dev_paths.push(p);
    }

    // For debugging: STRATA_EROFS_KEEP=<dir> keeps a copy of the image and the blobs.
    if let Some(keep) = std::env::var_os("STRATA_EROFS_KEEP") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).expect("keep dir");
        std::fs::copy(&meta_path, keep.join("meta.erofs")).expect("keep image");
        for p in &dev_paths {
            std::fs::copy(p, keep.join(p.file_name().expect("name"))).expect("keep blob");
        }
    }

    if have(&[Need::ErofsUtils]) {
        let out = Command::new("fsck.erofs")
            .args(
                dev_paths
                    .iter()
                    .map(|p| format!("--device={}", p.display())),
            )
            .arg(&meta_path)
            .output()
            .expect("run fsck.erofs");
        assert!(
            out.status.success(),
            "fsck.erofs failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    if !have(&[Need::KernelErofs]) {
        return;
    }
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    mount_erofs(&meta_path, &dev_paths, &mnt).expect("mount erofs");
    let _guard = MountGuard(mnt.clone());
    compare_mounted(&tree, &blobs, &mnt);
    // The deep leaf, read through a 1,200-byte relative path.
    let deep: Vec<u8> = (0..600)
        .flat_map(|i| format!("{}/", i % 10).into_bytes())
        .chain(*b"leaf")
        .collect();
    assert_eq!(std::fs::read(join(&mnt, &deep)).expect("deep"), b"deep");

    // A mount with a device missing fails with a typed error naming the step, the path and the errno.
    let mnt2 = dir.path().join("mnt2");
    std::fs::create_dir(&mnt2).expect("mkdir");
    match mount_erofs(&meta_path, &dev_paths[..1], &mnt2) {
        Ok(()) => {
            let _guard2 = MountGuard(mnt2.clone());
            panic!("a mount without all devices succeeded");
        }
        Err(e) => {
            assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
            let text = e.to_string();
            // (The kernel logs "extra devices don't match" to dmesg, not to the mount context.)
            assert!(
                text.contains("fsconfig create") && text.contains("meta.erofs"),
                "{text}"
            );
        }
    }
}

/// Our reader on an image made by `mkfs.erofs` (compact inodes, tail packing, shared xattrs).
#[test]
fn reader_reads_mkfs_images() {
    if !have(&[Need::ErofsUtils]) {
        return;
    }
    let src = tempfile::Builder::new()
        .prefix("strata-mkfs-")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let root = src.path().join("root");
    let mk = |rel: &str| root.join(rel);
    std::fs::create_dir_all(mk("a/b/c")).expect("mkdir");
    std::fs::create_dir_all(mk("wide")).expect("mkdir");
    for (rel, len) in [
        ("small", 10usize),
        ("a/block", 4096),
        ("a/b/tail", 6000),
        ("a/b/c/big", 100_000),
    ] {
        std::fs::write(mk(rel), pattern(rel, len)).expect("write");
    }
    std::fs::write(mk("empty"), b"").expect("write");
    std::fs::hard_link(mk("small"), mk("a/small.hard")).expect("link");
    std::os::unix::fs::symlink("a/b/tail", mk("link")).expect("symlink");
    for i in 0..300 {
        std::fs::write(mk(&format!("wide/entry-{i:03}")), i.to_string()).expect("write");
    }
    // The same xattr on many files makes mkfs share it.
    for rel in [
        "small",
        "a/block",
        "a/b/tail",
        "wide/entry-000",
        "wide/entry-001",
    ] {
        xattr::set(mk(rel), "user.shared", b"same value").expect("setxattr");
    }
    xattr::set(mk("a/block"), "user.own", b"x").expect("setxattr");
    // Without -T, mtimes differ from the build time and mkfs writes extended inodes; with -T, compact ones.
    for fixed_time in [None, Some(1_000_000i64)] {
        let compact = check_mkfs_image(src.path(), &root, fixed_time);
        assert_eq!(
            compact > 0,
            fixed_time.is_some(),
            "compact inodes with -T {fixed_time:?}"
        );
    }
}

/// Makes an image of `root` with mkfs.erofs and compares our reader's view with the directory. Returns how
/// many compact inodes it met.
fn check_mkfs_image(work: &Path, root: &Path, fixed_time: Option<i64>) -> usize {
    let image = work.join("img.erofs");
    let mut cmd = Command::new("mkfs.erofs");
    if let Some(t) = fixed_time {
        cmd.arg(format!("-T{t}"));
    }
    let out = cmd.arg(&image).arg(root).output().expect("run mkfs.erofs");
    assert!(
        out.status.success(),
        "mkfs.erofs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let img =
        ErofsImage::parse(std::fs::read(&image).expect("read image")).expect("parse mkfs image");
    let mut compact = 0;
    for entry in walkdir::WalkDir::new(root) {
        let entry = entry.expect("walk");
        let rel = entry.path().strip_prefix(root).expect("prefix");
        let show = rel.display().to_string();
        let st = entry.path().symlink_metadata().expect("lstat");
        let ino = img
            .lookup(rel.as_os_str().as_bytes())
            .expect("lookup")
            .unwrap_or_else(|| panic!("{show} missing"));
        compact += usize::from(!ino.extended);
        assert_eq!(ino.mode, st.mode(), "{show}");
        assert_eq!((ino.uid, ino.gid), (st.uid(), st.gid()), "{show}");
        assert_eq!(u64::from(ino.nlink), st.nlink(), "{show}");
        assert_eq!(ino.mtime, fixed_time.unwrap_or(st.mtime()), "{show}");
        let mut want: Vec<(Vec<u8>, Vec<u8>)> = xattr::list(entry.path())
            .expect("list")
            .map(|n| {
                let v = xattr::get(entry.path(), &n)
                    .expect("get")
                    .unwrap_or_default();
                (n.as_bytes().to_vec(), v)
            })
            .collect();
        want.sort();
        let mut got = ino.xattrs.clone();
        got.sort();
        assert_eq!(got, want, "xattrs of {show}");
        let ft = entry.file_type();
        if ft.is_file() {
            assert_eq!(
                img.data(&ino).expect("data"),
                std::fs::read(entry.path()).expect("read"),
                "{show}"
            );
        } else if ft.is_symlink() {
            let target = std::fs::read_link(entry.path()).expect("readlink");
            assert_eq!(
                img.data(&ino).expect("target"),
                target.as_os_str().as_bytes(),
                "{show}"
            );
        } else if ft.is_dir() {
            let mut names: Vec<Vec<u8>> = img
                .read_dir(&ino)
                .expect("readdir")
                .into_iter()
                .map(|e| e.name)
                .collect();
            names.sort();
            let mut want: Vec<Vec<u8>> = std::fs::read_dir(entry.path())
                .expect("readdir")
                .map(|e| e.expect("entry").file_name().as_bytes().to_vec())
                .collect();
            want.sort();
            assert_eq!(names, want, "{show}");
        }
    }
    compact
}
