//! Round trip of arbitrary trees: written by [`super::write_image`], read back by `strata-erofs`'s reader
//! and compared node by node ([`super::tests::assert_same`]: names, modes, owners, times, xattrs, link
//! counts, hard links as one nid, symlink targets, device numbers, inline bytes, chunk indexes).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::format::makedev;
use super::tests::{assert_same, Chunks};
use super::{ChunkLoc, ErofsImage};
use crate::tree::{Meta, NodeKind, Tree};

/// What one generated entry is.
#[derive(Clone, Debug)]
enum Kind {
    Dir,
    Inline(Vec<u8>),
    /// Size and a seed choosing each chunk's device and block (or a hole).
    Chunked(u64, u64),
    Symlink(Vec<u8>),
    Char(u64, u64),
    Block(u64, u64),
    Fifo,
    Socket,
    Whiteout,
    /// A hard link to the n-th non-directory created before it.
    HardLink(usize),
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::collection::vec(b'a'..=b'e', 1..4),
        1 => proptest::collection::vec(1u8..=255, 1..=255)
            .prop_map(|v| v.into_iter().map(|b| if b == b'/' { b'_' } else { b }).collect()),
        1 => (200usize..=255).prop_map(|n| vec![b'L'; n]),
    ]
    .prop_filter("not . or ..", |n| n != b"." && n != b"..")
}

fn xattrs() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
    let prefix = prop_oneof![
        Just(b"user.".as_slice()),
        Just(b"trusted.".as_slice()),
        Just(b"security.".as_slice()),
    ];
    let entry = (
        prefix,
        proptest::collection::vec(b'a'..=b'z', 1..24),
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(p, s, v)| ([p, &s].concat(), v));
    let acl = prop_oneof![
        Just(None),
        Just(Some((
            b"system.posix_acl_access".to_vec(),
            vec![2, 0, 0, 0]
        ))),
    ];
    (proptest::collection::vec(entry, 0..4), acl).prop_map(|(v, acl)| {
        let sorted: BTreeMap<Vec<u8>, Vec<u8>> = v.into_iter().chain(acl).collect();
        sorted.into_iter().collect()
    })
}

fn meta() -> impl Strategy<Value = Meta> {
    (
        0u32..0o10000,
        any::<u32>(),
        any::<u32>(),
        -(1i64 << 40)..(1i64 << 40),
        0u32..1_000_000_000,
        xattrs(),
    )
        .prop_map(|(perm, uid, gid, mtime, mtime_nsec, xattrs)| Meta {
            perm,
            uid,
            gid,
            mtime,
            mtime_nsec,
            xattrs,
        })
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        3 => Just(Kind::Dir),
        3 => proptest::collection::vec(any::<u8>(), 0..6000).prop_map(Kind::Inline),
        2 => (0u64..(5 << 20), any::<u64>()).prop_map(|(s, seed)| Kind::Chunked(s, seed)),
        1 => proptest::collection::vec(1u8..=255, 1..4096).prop_map(Kind::Symlink),
        1 => (0u64..4096, 0u64..(1 << 20)).prop_map(|(a, b)| Kind::Char(a, b)),
        1 => (0u64..4096, 0u64..(1 << 20)).prop_map(|(a, b)| Kind::Block(a, b)),
        1 => Just(Kind::Fifo),
        1 => Just(Kind::Socket),
        1 => Just(Kind::Whiteout),
        2 => any::<usize>().prop_map(Kind::HardLink),
    ]
}

/// Builds the tree: entry `i` goes under the `parent % dirs`-th directory made so far.
fn build(entries: &[(usize, Vec<u8>, Kind, Meta)], chunk_bits: u8, chunks: &mut Chunks) -> Tree {
    let mut tree = Tree::new();
    let mut dirs: Vec<Vec<u8>> = vec![Vec::new()];
    let mut files: Vec<Vec<u8>> = Vec::new();
    for (parent, name, kind, meta) in entries {
        let dir = &dirs[parent % dirs.len()];
        let path = if dir.is_empty() {
            name.clone()
        } else {
            [dir.as_slice(), b"/", name].concat()
        };
        if tree.lookup(&path).is_some() {
            continue;
        }
        let node = match kind {
            Kind::Dir => NodeKind::Dir(BTreeMap::new()),
            Kind::Inline(b) => NodeKind::File {
                size: b.len() as u64,
                data: crate::tree::FileData::Inline(b.clone()),
            },
            &Kind::Chunked(size, seed) => chunks.file(size, chunk_bits, |k| {
                // Anywhere in the 4096-block devices a whole chunk fits.
                let room = 4096 - (1u64 << (chunk_bits - 12)) + 1;
                let h = seed.wrapping_add(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                (h % 5 != 0).then(|| ChunkLoc {
                    device: (h % 2) as u16 + 1,
                    block: ((h >> 8) % room) as u32,
                })
            }),
            Kind::Symlink(t) => NodeKind::Symlink(t.clone()),
            &Kind::Char(a, b) => NodeKind::CharDev {
                rdev: makedev(a, b),
            },
            &Kind::Block(a, b) => NodeKind::BlockDev {
                rdev: makedev(a, b),
            },
            Kind::Fifo => NodeKind::Fifo,
            Kind::Socket => NodeKind::Socket,
            Kind::Whiteout => NodeKind::CharDev { rdev: 0 },
            &Kind::HardLink(n) => {
                if !files.is_empty() {
                    let target = files[n % files.len()].clone();
                    tree.link(&path, &target).expect("hard link");
                }
                continue;
            }
        };
        let is_dir = matches!(node, NodeKind::Dir(_));
        tree.insert(&path, meta.clone(), node).expect("insert");
        if is_dir {
            dirs.push(path);
        } else {
            files.push(path);
        }
    }
    tree
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_trees_round_trip(
        entries in proptest::collection::vec((any::<usize>(), name(), kind(), meta()), 0..60),
        root in meta(),
        chunk_bits in 12u8..=20,
    ) {
        let mut chunks = Chunks::new();
        let mut tree = build(&entries, chunk_bits, &mut chunks);
        tree.nodes[0].meta = root;
        let bytes = chunks.write(&tree, chunk_bits).expect("write");
        let img = ErofsImage::parse(bytes).expect("parse");
        assert_same(&tree, &img, &chunks);
        let any = tree.nodes.iter().any(|n| !n.meta.xattrs.is_empty());
        prop_assert_eq!(img.any_xattrs().expect("walk"), any);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The reader's fuzzing entry (`strata_erofs::fuzzing::walk`, also the `erofs_walk` fuzz target)
    /// over mutations of real images: errors, never a panic.
    #[test]
    fn mutated_images_never_panic_the_reader(
        entries in proptest::collection::vec((any::<usize>(), name(), kind(), meta()), 0..40),
        chunk_bits in 12u8..=20,
        seed in any::<u64>(),
    ) {
        let mut chunks = Chunks::new();
        let tree = build(&entries, chunk_bits, &mut chunks);
        let bytes = chunks.write(&tree, chunk_bits).expect("write");
        strata_erofs::fuzzing::walk(&bytes);
        for m in strata_registry::testing::mutations(&bytes, seed, 64, 8192) {
            strata_erofs::fuzzing::walk(&m);
        }
    }
}
