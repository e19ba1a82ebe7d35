//! strata's EROFS writer; the format, reader and re-pointing live in `strata-erofs` and are re-exported
//! here, so `crate::erofs::{format, reader, repoint}` keep their paths.
//!
//! A layer's metadata is a real EROFS image that Linux mounts file-backed, with one `device=` per blob; file
//! data never lives in it (except the bytes of tiny files). No Rust crate writes chunk indexes with a device
//! table, so the writer is ours; the reader reads what the writer produces (and compact inodes, plain and
//! inline flat layouts, chunk maps, shared xattrs) for `strata ls/cat/inspect` and for tests.
//!
//! # Image layout ([`write_image`])
//!
//! ```text
//! block 0          superblock at byte 1024 (crc32c checksum, SB_CHKSUM), device table at byte 1280
//! (more blocks     if the device table does not fit in block 0)
//! meta_blkaddr..   metadata area: 64-byte extended inodes with inline xattrs and their inline tails or
//!                  chunk index arrays, packed best-fit into blocks; the root is the first inode (nid 0)
//! ..blocks         data area: full blocks of directories, symlinks and inline-stored files
//! ```
//!
//! * Only nodes reachable from the root are written, in breadth-first order (an explicit queue: no
//!   recursion, any depth). Hard links are several dirents with one nid; `st_ino` is the nid.
//! * Every inode is extended (full uid/gid, mtime with nanoseconds, 32-bit nlink).
//! * Directories, symlinks and `FileData::Inline` files are flat: the last partial block is stored inline
//!   after the inode when it fits in the inode's block (FLAT_INLINE), otherwise everything goes to the
//!   data area (FLAT_PLAIN). The packer never lets an inode of at most one block cross a block boundary,
//!   so inline data never crosses one either.
//! * Directory data is a sequence of independent dirent blocks holding `.` and `..` and the children,
//!   sorted bytewise across blocks; an entry never spans blocks.
//! * `FileData::Chunks` files are CHUNK_BASED with 8-byte indexes `(device id, block)`; a hole is block
//!   `0xFFFFFFFF`. Chunks are resolved through a caller's function into the device table's blobs.
//! * Device numbers use the kernel's `new_encode_dev`; whiteouts are 0:0 character devices.
//! * Xattrs are inline with the short prefixes `user.`, `trusted.`, `security.` and the POSIX ACL names;
//!   anything else is an error.
//! * The output is a pure function of the input: the uuid is derived from the image's content.
//!
//! The on-disk structures are in [`format`], with compile-time size checks. The features written are
//! pinned to what Linux 5.16 reads (`strata_erofs::features::WRITER_INCOMPAT`).

pub use strata_erofs::{format, reader, repoint};
mod write_error;
pub mod writer;

pub use strata_erofs::{ChunkLoc, DeviceSlot, DirEntry, ErofsError, ErofsImage, Inode, Layout};
pub use writer::{write_image, NodeFault, WriteError};

use strata_registry::digest::Digest;

/// A device slot named by a blob digest (the reader's [`DeviceSlot`] knows no digest type).
pub trait BlobSlot {
    /// The slot of a blob named `digest` whose uncompressed view is `blocks` 4 KiB blocks.
    fn for_blob(digest: &Digest, blocks: u32) -> Self;
    /// The blob digest the tag names, if it holds 64 hex digits.
    fn digest(&self) -> Option<Digest>;
}

impl BlobSlot for DeviceSlot {
    fn for_blob(digest: &Digest, blocks: u32) -> DeviceSlot {
        DeviceSlot::with_tag(digest.hex().as_bytes(), blocks)
    }

    fn digest(&self) -> Option<Digest> {
        self.tag_hex().and_then(|s| Digest::from_hex(s).ok())
    }
}

/// The metadata a source entry for `inode` carries (permission bits, owner, times, xattrs).
pub fn meta_of(inode: &Inode) -> crate::tree::Meta {
    crate::tree::Meta {
        perm: inode.mode & 0o7777,
        uid: inode.uid,
        gid: inode.gid,
        mtime: inode.mtime,
        mtime_nsec: inode.mtime_nsec,
        xattrs: inode.xattrs.clone(),
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod reader_tests;
#[cfg(test)]
mod repoint_tests;

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, HashMap};

    use strata_registry::digest::Digest;

    use super::format::*;
    use super::*;
    use crate::tree::{FileData, Meta, NodeId, NodeKind, Tree};
    use crate::BuildError;

    pub(crate) fn meta(perm: u32) -> Meta {
        Meta {
            perm,
            uid: 1000,
            gid: 1000,
            mtime: 1_700_000_000,
            mtime_nsec: 123_456_789,
            xattrs: Vec::new(),
        }
    }

    fn inline(bytes: &[u8]) -> NodeKind {
        NodeKind::File {
            size: bytes.len() as u64,
            data: FileData::Inline(bytes.to_vec()),
        }
    }

    /// Chunk locations and the device table: 2 devices of 16 MiB.
    pub(crate) struct Chunks {
        pub locs: HashMap<Digest, ChunkLoc>,
        pub devices: Vec<DeviceSlot>,
    }

    impl Chunks {
        pub(crate) fn new() -> Chunks {
            let devices = (0..2u8)
                .map(|d| DeviceSlot::for_blob(&Digest::of(&[d]), 4096))
                .collect();
            Chunks {
                locs: HashMap::new(),
                devices,
            }
        }

        /// A chunked file of `size` bytes with chunk `k` given by `f(k)` (None = hole).
        pub(crate) fn file(
            &mut self,
            size: u64,
            bits: u8,
            f: impl Fn(u64) -> Option<ChunkLoc>,
        ) -> NodeKind {
            let n = size.div_ceil(1 << bits);
            let chunks = (0..n)
                .map(|k| {
                    f(k).map(|loc| {
                        let d = Digest::of(format!("{size}/{k}/{loc:?}").as_bytes());
                        self.locs.insert(d, loc);
                        d
                    })
                })
                .collect();
            NodeKind::File {
                size,
                data: FileData::Chunks(chunks),
            }
        }

        pub(crate) fn write(&self, tree: &Tree, bits: u8) -> Result<Vec<u8>, crate::BuildError> {
            write_image(tree, &self.devices, bits, &|d| self.locs.get(d).copied())
        }
    }

    /// Metadata with an xattr of each prefix (one empty, one long).
    fn meta_with_xattrs() -> Meta {
        let mut m = meta(0o755);
        m.xattrs = vec![
            (
                b"security.capability".to_vec(),
                vec![1, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
            (
                b"system.posix_acl_access".to_vec(),
                vec![2, 0, 0, 0, 1, 0, 7, 0],
            ),
            (b"system.posix_acl_default".to_vec(), vec![2, 0, 0, 0]),
            (b"trusted.overlay.opaque".to_vec(), b"y".to_vec()),
            (b"user.empty".to_vec(), Vec::new()),
            (b"user.k".to_vec(), vec![0xAB; 300]),
        ];
        m
    }

    /// A tree with every kind of node, hard links, xattrs of each prefix and an orphan.
    pub(crate) fn sample_tree(chunks: &mut Chunks) -> Tree {
        let mut t = Tree::new();
        let m = meta_with_xattrs();
        t.insert(b"", m.clone(), NodeKind::Dir(BTreeMap::new()))
            .expect("root");
        t.insert(b"etc", meta(0o755), NodeKind::Dir(BTreeMap::new()))
            .expect("dir");
        t.insert(b"etc/passwd", m.clone(), inline(b"root:x:0:0\n"))
            .expect("file");
        let mut odd = meta(0o7777);
        odd.uid = 100_000;
        odd.gid = 4_000_000_000;
        odd.mtime = -1_234_567;
        odd.mtime_nsec = 999_999_999;
        t.insert(b"bin/su", odd, inline(b"#!/bin/sh\n"))
            .expect("setuid");
        t.insert(b"empty", meta(0o644), inline(b"")).expect("empty");
        for (name, len) in [
            ("4000", 4000usize),
            ("4096", 4096),
            ("5000", 5000),
            ("12289", 12289),
        ] {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            t.insert(
                format!("sizes/{name}").as_bytes(),
                meta(0o600),
                inline(&bytes),
            )
            .expect("sized");
        }
        t.insert(
            b"link",
            meta(0o777),
            NodeKind::Symlink(b"etc/passwd".to_vec()),
        )
        .expect("symlink");
        t.insert(
            b"longlink",
            meta(0o777),
            NodeKind::Symlink(vec![b'x'; 4095]),
        )
        .expect("symlink");
        t.insert(
            b"dev/null",
            meta(0o666),
            NodeKind::CharDev {
                rdev: makedev(1, 3),
            },
        )
        .expect("chr");
        t.insert(
            b"dev/sda1",
            meta(0o660),
            NodeKind::BlockDev {
                rdev: makedev(259, 65_536),
            },
        )
        .expect("blk");
        t.insert(b"dev/fifo", meta(0o644), NodeKind::Fifo)
            .expect("fifo");
        t.insert(b"dev/sock", meta(0o755), NodeKind::Socket)
            .expect("sock");
        t.insert(b"gone", meta(0), NodeKind::CharDev { rdev: 0 })
            .expect("whiteout");
        t.link(b"etc/passwd.hard", b"etc/passwd").expect("link");
        t.link(b"dev/null2", b"dev/null").expect("link");
        // Chunked: 1 MiB chunks over 2 devices, a hole and a short last chunk.
        let big = chunks.file(3 * (1 << 20) + 5, 20, |k| match k {
            1 => None,
            k => Some(ChunkLoc {
                device: (k % 2) as u16 + 1,
                block: 256 * k as u32,
            }),
        });
        t.insert(b"data/big", meta(0o644), big).expect("chunked");
        let sparse = chunks.file(1 << 22, 20, |_| None);
        t.insert(b"data/sparse", meta(0o644), sparse)
            .expect("sparse");
        let zero = chunks.file(0, 20, |_| None);
        t.insert(b"data/zero", meta(0o644), zero).expect("zero");
        // An orphan: replaced entries stay in `nodes` but are unreachable.
        t.insert(b"data/orphan", meta(0o644), inline(b"old"))
            .expect("orphan");
        t.insert(b"data/orphan", meta(0o644), inline(b"new"))
            .expect("replacement");
        t
    }

    /// Walks the tree and the image side by side (explicit stack) and checks they agree.
    pub(crate) fn assert_same(tree: &Tree, img: &ErofsImage, chunks: &Chunks) {
        let mut nid_of: HashMap<NodeId, u64> = HashMap::new();
        let mut stack = vec![(0usize, img.root_nid(), img.root_nid())];
        let mut seen = 0u64;
        while let Some((id, nid, parent)) = stack.pop() {
            let node = &tree.nodes[id];
            if let Some(&prev) = nid_of.get(&id) {
                assert_eq!(prev, nid, "hard links share one nid");
                continue;
            }
            nid_of.insert(id, nid);
            seen += 1;
            let ino = img.inode(nid).expect("inode");
            assert!(ino.extended);
            assert_eq!(ino.mode, node.mode(), "mode of node {id}");
            assert_eq!((ino.uid, ino.gid), (node.meta.uid, node.meta.gid));
            assert_eq!(
                (ino.mtime, ino.mtime_nsec),
                (node.meta.mtime, node.meta.mtime_nsec)
            );
            assert_eq!(ino.nlink, node.nlink(tree));
            assert_eq!(ino.xattrs, node.meta.xattrs);
            // Inodes that fit in a block never cross one.
            let bsz = img.block_size();
            let header = ino.tail_offset - ino.offset;
            if header <= bsz {
                assert!(
                    ino.offset % bsz + header <= bsz,
                    "nid {nid} crosses a block"
                );
            }
            match &node.kind {
                NodeKind::Dir(children) => {
                    let all = img.read_dir_all(&ino).expect("read_dir_all");
                    assert!(all.windows(2).all(|w| w[0].name < w[1].name), "sorted");
                    let dot = all.iter().find(|e| e.name == b".").expect(".");
                    let dotdot = all.iter().find(|e| e.name == b"..").expect("..");
                    assert_eq!(dot.nid, nid);
                    assert_eq!(dotdot.nid, parent);
                    let entries = img.read_dir(&ino).expect("read_dir");
                    assert_eq!(entries.len(), children.len());
                    for (e, (name, &child)) in entries.iter().zip(children) {
                        assert_eq!(&e.name, name);
                        assert_eq!(e.file_type, file_type_of_mode(tree.nodes[child].mode()));
                        stack.push((child, e.nid, nid));
                    }
                }
                NodeKind::File { size, data } => {
                    assert_eq!(ino.size, *size);
                    match data {
                        FileData::Inline(bytes) => {
                            assert_eq!(&img.data(&ino).expect("data"), bytes)
                        }
                        FileData::Chunks(list) => {
                            assert_eq!(ino.layout, Layout::ChunkBased);
                            let got = img.chunks(&ino).expect("chunks");
                            let want: Vec<Option<ChunkLoc>> =
                                list.iter().map(|d| d.map(|d| chunks.locs[&d])).collect();
                            assert_eq!(got, want);
                        }
                    }
                }
                NodeKind::Symlink(target) => assert_eq!(&img.data(&ino).expect("target"), target),
                NodeKind::CharDev { rdev } | NodeKind::BlockDev { rdev } => {
                    assert_eq!(ino.rdev, *rdev)
                }
                NodeKind::Fifo | NodeKind::Socket => assert_eq!(ino.size, 0),
            }
        }
        assert_eq!(img.inode_count(), seen);
        let mut nids: Vec<u64> = nid_of.values().copied().collect();
        nids.sort_unstable();
        nids.dedup();
        assert_eq!(nids.len() as u64, seen, "distinct nodes have distinct nids");
    }

    fn round_trip(tree: &Tree, chunks: &Chunks) -> ErofsImage {
        let bytes = chunks.write(tree, 20).expect("write");
        assert_eq!(bytes.len() % BLKSZ, 0);
        let img = ErofsImage::parse(bytes).expect("parse");
        assert_same(tree, &img, chunks);
        img
    }

    #[test]
    fn every_kind_of_node() {
        let mut chunks = Chunks::new();
        let tree = sample_tree(&mut chunks);
        let img = round_trip(&tree, &chunks);
        assert_eq!(img.devices(), chunks.devices.as_slice());
        assert_eq!(img.devices()[0].digest(), Some(Digest::of(&[0])));
        let sb = img.superblock();
        assert_eq!(sb.root_nid, 0);
        assert_eq!(
            sb.feature_incompat,
            FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE
        );
        assert_eq!(sb.extra_devices, 2);
        assert_eq!(u64::from(sb.blocks) * 4096, img.bytes().len() as u64);
        assert_ne!(sb.uuid, [0; 16]);
        let su = img.lookup(b"/bin//su").expect("lookup").expect("exists");
        assert_eq!(su.mode, 0o107777);
        assert_eq!(img.lookup(b"etc/../bin/./su").expect("lookup"), Some(su));
        assert!(img.lookup(b"etc/passwd/x").expect("lookup").is_none());
        assert!(img.lookup(b"nope").expect("lookup").is_none());
        let a = img.lookup(b"etc/passwd").expect("a").expect("a");
        let b = img.lookup(b"etc/passwd.hard").expect("b").expect("b");
        assert_eq!((a.nid, a.nlink), (b.nid, 2));
        let layout = |p: &[u8]| img.lookup(p).expect("l").expect("l").layout;
        assert_eq!(layout(b"empty"), Layout::FlatPlain);
        assert_eq!(layout(b"sizes/4000"), Layout::FlatInline);
        assert_eq!(layout(b"sizes/4096"), Layout::FlatPlain);
        assert_eq!(layout(b"sizes/5000"), Layout::FlatInline);
        assert_eq!(layout(b"longlink"), Layout::FlatPlain);
        let gone = img.lookup(b"gone").expect("l").expect("l");
        assert_eq!((gone.mode, gone.rdev, gone.raw_u), (0o20000, 0, 0));
    }

    #[test]
    fn deterministic() {
        let mut chunks = Chunks::new();
        let tree = sample_tree(&mut chunks);
        let a = chunks.write(&tree, 20).expect("a");
        assert_eq!(a, chunks.write(&tree, 20).expect("b"));
        let mut other = tree.clone();
        other.nodes[0].meta.mtime += 1;
        let c = chunks.write(&other, 20).expect("c");
        assert_ne!(
            a[1024 + 48..1024 + 64],
            c[1024 + 48..1024 + 64],
            "uuid follows content"
        );
    }

    #[test]
    fn no_devices() {
        let mut t = Tree::new();
        t.insert(b"a", meta(0o644), inline(b"x")).expect("a");
        let bytes = write_image(&t, &[], 12, &|_| None).expect("write");
        let img = ErofsImage::parse(bytes).expect("parse");
        assert!(img.devices().is_empty());
        assert_eq!(
            img.superblock().feature_incompat,
            FEATURE_INCOMPAT_CHUNKED_FILE
        );
        assert_same(&t, &img, &Chunks::new());
    }

    #[test]
    fn twenty_thousand_entries() {
        let mut t = Tree::new();
        for i in 0..20_000u32 {
            let kind = if i % 3 == 0 {
                NodeKind::Fifo
            } else {
                inline(&i.to_le_bytes())
            };
            t.insert(
                format!("big/entry-{i:05}-{}", "n".repeat((i % 40) as usize)).as_bytes(),
                meta(0o644),
                kind,
            )
            .expect("insert");
        }
        let img = round_trip(&t, &Chunks::new());
        let dir = img.lookup(b"big").expect("big").expect("big");
        assert!(dir.size > 100 * 4096, "multi-block directory");
        let e = img
            .lookup(format!("big/entry-19999-{}", "n".repeat(39)).as_bytes())
            .expect("l");
        assert_eq!(
            img.data(&e.expect("entry")).expect("data"),
            19_999u32.to_le_bytes()
        );
    }

    #[test]
    fn ten_thousand_deep() {
        let mut t = Tree::new();
        let path: Vec<u8> = (0..10_000)
            .flat_map(|i| format!("d{}/", i % 10).into_bytes())
            .collect();
        let mut file = path.clone();
        file.extend_from_slice(b"leaf");
        t.insert(&file, meta(0o644), inline(b"deep")).expect("deep");
        let img = round_trip(&t, &Chunks::new());
        let leaf = img.lookup(&file).expect("lookup").expect("leaf");
        assert_eq!(img.data(&leaf).expect("data"), b"deep");
    }

    #[test]
    fn long_and_binary_names() {
        let mut t = Tree::new();
        let long: Vec<u8> = (0..255u32)
            .map(|i| (i % 254 + 1) as u8)
            .map(|b| if b == b'/' { b'!' } else { b })
            .collect();
        let names: Vec<Vec<u8>> = vec![
            long.clone(),
            vec![0xff; 255],
            vec![0x80, 0xfe, b'x'],
            b"-".to_vec(),
            b".-".to_vec(),
            b".a".to_vec(),
            b"...".to_vec(),
            vec![1],
            b"\xc3\x28".to_vec(),
        ];
        for n in &names {
            t.insert(n, meta(0o644), inline(n)).expect("insert");
            let mut sub = vec![b'D'; 255];
            sub.push(b'/');
            sub.extend_from_slice(n);
            t.insert(&sub, meta(0o644), inline(b"s")).expect("nested");
        }
        let img = round_trip(&t, &Chunks::new());
        for n in &names {
            let ino = img.lookup(n).expect("lookup").expect("exists");
            assert_eq!(&img.data(&ino).expect("data"), n);
        }
    }

    #[test]
    fn many_chunks_and_devices() {
        let mut chunks = Chunks::new();
        chunks.devices = (0..40u8)
            .map(|d| DeviceSlot::for_blob(&Digest::of(&[d]), 1 << 20))
            .collect();
        let mut t = Tree::new();
        // 4 KiB chunks: 2,000 indexes span several blocks.
        let f = chunks.file(2000 * 4096 - 1, 12, |k| {
            (k % 7 != 3).then_some(ChunkLoc {
                device: (k % 40) as u16 + 1,
                block: k as u32,
            })
        });
        t.insert(b"f", meta(0o644), f).expect("f");
        let bytes = chunks.write(&t, 12).expect("write");
        let img = ErofsImage::parse(bytes).expect("parse");
        assert_eq!(img.devices().len(), 40);
        assert_eq!(
            img.superblock().meta_blkaddr,
            2,
            "device table spills into block 1"
        );
        assert_same(&t, &img, &chunks);
        let f = img.lookup(b"f").expect("l").expect("f");
        assert_eq!(f.chunk_bits, 12);
        assert_eq!(f.raw_u, 0x20);
    }

    fn write_err(t: &Tree, chunks: &Chunks, bits: u8) -> String {
        match chunks.write(t, bits) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn errors_are_clear() {
        let chunks = Chunks::new();
        let mut t = Tree::new();
        let mut m = meta(0o644);
        m.xattrs = vec![(b"os2.foo".to_vec(), b"v".to_vec())];
        t.insert(b"d/x", m, inline(b"")).expect("x");
        let e = write_err(&t, &chunks, 20);
        assert!(e.contains("os2.foo") && e.contains("/d/x"), "{e}");

        let mut t = Tree::new();
        t.insert(
            b"c",
            meta(0o644),
            NodeKind::File {
                size: 5,
                data: FileData::Chunks(vec![Some(Digest::of(b"?"))]),
            },
        )
        .expect("c");
        let e = write_err(&t, &chunks, 20);
        assert!(e.contains("no location"), "{e}");
        assert!(write_err(&t, &chunks, 11).contains("outside 12..=24"));
        assert!(write_err(&t, &chunks, 25).contains("outside 12..=24"));
        // Typed, for callers that tell the refusals apart (the path of the node kept apart too).
        assert!(matches!(
            chunks.write(&t, 11),
            Err(BuildError::Erofs(WriteError::ChunkBits(11)))
        ));
        match chunks.write(&t, 20) {
            Err(BuildError::Erofs(WriteError::Node { path, fault })) => {
                assert_eq!(path, "/c");
                assert!(
                    matches!(fault, NodeFault::NoLocation { k: 0, .. }),
                    "{fault}"
                );
            }
            other => panic!("expected a node's fault, got {:?}", other.map(|_| ())),
        }

        let mut chunks2 = Chunks::new();
        let mut t = Tree::new();
        let f = chunks2.file(10, 20, |_| {
            Some(ChunkLoc {
                device: 3,
                block: 0,
            })
        });
        t.insert(b"f", meta(0o644), f).expect("f");
        assert!(write_err(&t, &chunks2, 20).contains("device 3"));
        let mut t = Tree::new();
        let f = chunks2.file(8192, 20, |_| {
            Some(ChunkLoc {
                device: 1,
                block: 4095,
            })
        });
        t.insert(b"f", meta(0o644), f).expect("f");
        assert!(write_err(&t, &chunks2, 20).contains("outside the device"));

        let mut t = Tree::new();
        t.insert(
            b"f",
            meta(0o644),
            NodeKind::File {
                size: 1 << 21,
                data: FileData::Chunks(vec![None]),
            },
        )
        .expect("f");
        assert!(write_err(&t, &chunks, 20).contains("needs 2 chunks"));

        let mut t = Tree::new();
        t.insert(
            b"dev",
            meta(0o644),
            NodeKind::CharDev {
                rdev: makedev(5000, 1),
            },
        )
        .expect("dev");
        let e = write_err(&t, &chunks, 20);
        assert!(e.contains("5000:1"), "{e}");

        let mut t = Tree::new();
        let d = t
            .insert(b"d", meta(0o755), NodeKind::Dir(BTreeMap::new()))
            .expect("d");
        if let NodeKind::Dir(c) = &mut t.nodes[0].kind {
            c.insert(b"again".to_vec(), d);
        }
        assert!(write_err(&t, &chunks, 20).contains("more than one name"));

        let mut t = Tree::new();
        if let NodeKind::Dir(c) = &mut t.nodes[0].kind {
            c.insert(b"a/b".to_vec(), 0);
        }
        assert!(write_err(&t, &chunks, 20).contains("invalid entry name"));
    }
}
