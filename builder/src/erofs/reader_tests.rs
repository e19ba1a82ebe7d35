//! The reader against images the writer made, damaged in every way (moved here with the reader's tests
//! when the reader became `strata-erofs`: the images come from the builder's writer).

use std::collections::HashSet;

use strata_erofs::format::*;
use strata_erofs::{ErofsError, ErofsImage};

use crate::erofs::tests::{sample_tree, Chunks};

/// Reads everything reachable; any `Err` is fine, a panic is not. Bounded by a visited set. Returns
/// how many inodes decoded.
fn exercise(bytes: Vec<u8>) -> usize {
    let Ok(img) = ErofsImage::parse(bytes) else {
        return 0;
    };
    let _ = img.lookup(b"etc/passwd");
    let _ = img.lookup(b"a/../../b/./c");
    let mut seen = HashSet::new();
    let mut stack = vec![img.root_nid()];
    while let Some(nid) = stack.pop() {
        if !seen.insert(nid) || seen.len() > 1000 {
            continue;
        }
        let Ok(ino) = img.inode(nid) else { continue };
        let _ = img.data(&ino);
        let _ = img.chunks(&ino);
        if let Ok(entries) = img.read_dir(&ino) {
            stack.extend(entries.iter().map(|e| e.nid));
        }
    }
    seen.len()
}

fn valid_image() -> Vec<u8> {
    let mut chunks = Chunks::new();
    let mut tree = sample_tree(&mut chunks);
    // Keep the image small so that every byte can be flipped.
    for name in [b"sizes".as_slice(), b"longlink"] {
        if let crate::tree::NodeKind::Dir(c) = &mut tree.nodes[0].kind {
            c.remove(name);
        }
    }
    chunks.write(&tree, 20).expect("write")
}

#[test]
fn truncation_never_panics() {
    let img = valid_image();
    for len in (0..img.len())
        .step_by(7)
        .chain([1023, 1024, 1151, 1152, 4095, 4096])
    {
        let _ = exercise(img[..len.min(img.len())].to_vec());
    }
}

#[test]
fn flipped_bytes_never_panic() {
    let img = valid_image();
    let full = exercise(img.clone());
    assert!(full > 15, "the valid image has {full} inodes");
    let mut decoded = 0;
    for at in 0..img.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bad = img.clone();
            bad[at] ^= mask;
            if (SUPER_OFFSET..BLKSZ).contains(&at) {
                // Re-seal the checksum so that the superblock's other fields get exercised too.
                let mut sb = SuperBlock::read(&bad, SUPER_OFFSET).expect("sb");
                sb.checksum = sb_checksum(&bad[SUPER_OFFSET..BLKSZ]);
                let off = SUPER_OFFSET + 4;
                if at < off || at >= off + 4 {
                    sb.write_to(&mut bad, SUPER_OFFSET);
                }
            }
            decoded += exercise(bad);
        }
    }
    // Most flips leave most of the tree readable: the test reaches deep into the reader.
    assert!(
        decoded > img.len() * 3 * full / 2,
        "{decoded} inodes decoded"
    );
}

#[test]
fn hostile_values() {
    let img = valid_image();
    let reseal = |mut b: Vec<u8>| {
        let mut sb = SuperBlock::read(&b, SUPER_OFFSET).expect("sb");
        sb.checksum = sb_checksum(&b[SUPER_OFFSET..BLKSZ]);
        sb.write_to(&mut b, SUPER_OFFSET);
        b
    };
    let base = ErofsImage::parse(img.clone()).expect("valid");
    let meta = u64::from(base.superblock().meta_blkaddr) * 4096;
    // Huge sizes, nids and block addresses in every inode field.
    let mut nids = Vec::new();
    let mut stack = vec![base.root_nid()];
    while let Some(nid) = stack.pop() {
        nids.push(nid);
        if let Ok(ino) = base.inode(nid) {
            if let Ok(es) = base.read_dir(&ino) {
                stack.extend(es.iter().filter(|e| !nids.contains(&e.nid)).map(|e| e.nid));
            }
        }
    }
    for nid in nids {
        let at = (meta + nid * 32) as usize;
        for field in [2usize, 4, 6, 8, 12, 16, 20, 24, 40, 48] {
            for v in [0u8, 0x7f, 0xff] {
                let mut bad = img.clone();
                for b in &mut bad[at + field..at + field + 4] {
                    *b = v;
                }
                let _ = exercise(bad);
            }
        }
    }
    // Superblock fields set to extremes.
    for field in [12usize, 13, 14, 36, 40, 44, 80, 86, 88, 90] {
        for v in [0u8, 1, 0x7f, 0xff] {
            let mut bad = img.clone();
            bad[SUPER_OFFSET + field] = v;
            bad[SUPER_OFFSET + field + 1] = v;
            let _ = exercise(reseal(bad));
        }
    }
    assert!(matches!(
        ErofsImage::parse(vec![0; 100]),
        Err(ErofsError::TooShort { .. })
    ));
    let mut bad = img.clone();
    bad[SUPER_OFFSET + 40] ^= 1;
    assert!(matches!(
        ErofsImage::parse(bad),
        Err(ErofsError::Checksum { .. })
    ));
}
