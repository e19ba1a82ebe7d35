//! The reader's fuzzing entry: what `fuzz/`'s `erofs_walk` target (cargo-fuzz) and the stable smoke
//! test (`strata-builder`'s `mutated_images_never_panic_the_reader`, over mutations of images the
//! builder wrote) run on arbitrary bytes.
//!
//! A layer's metadata comes from the store, and the node parses it (the `fuse` mode serves trees
//! from it; `pack_diff` and `strata view` walk it), so the contract is the module's: whatever the
//! bytes, [`ErofsImage`] answers with values or an [`crate::ErofsError`] — never a panic, an endless
//! loop or an allocation beyond its documented bounds. The entry walks everything reachable from the
//! root, as a tree server would.
//!
//! A superblock that asks for a checksum gets a right one first: a hostile image can carry a valid
//! checksum, and without it nearly every mutation of a real image would stop at the superblock.

use std::collections::HashSet;

use crate::format::{
    sb_checksum, sb_checksum_span, SuperBlock, FEATURE_COMPAT_SB_CHKSUM, SUPER_OFFSET,
};
use crate::reader::ErofsImage;

/// Inodes visited at most per input: bounds the work of an image of many tiny directories.
const MAX_INODES: usize = 4096;

/// Largest file read whole per input (the reader's own bound for a file of holes is 256 MiB).
const MAX_READ: u64 = 16 << 20;

/// Parses `data` as an image and walks it (see the module documentation); panics only on a bug.
pub fn walk(data: &[u8]) {
    let mut data = data.to_vec();
    reseal(&mut data);
    let Ok(img) = ErofsImage::parse(data) else {
        return;
    };
    let _ = img.any_xattrs();
    let _ = img.lookup(b"/usr/lib/../bin/./sh");
    let mut todo = vec![img.root_nid()];
    let mut seen = HashSet::new();
    while let Some(nid) = todo.pop() {
        if seen.len() >= MAX_INODES || !seen.insert(nid) {
            continue;
        }
        let Ok(inode) = img.inode(nid) else { continue };
        if inode.is_dir() {
            if let Ok(entries) = img.read_dir_all(&inode) {
                todo.extend(entries.iter().map(|e| e.nid));
            }
        } else if inode.size <= MAX_READ {
            let _ = img.data(&inode);
            let _ = img.chunks(&inode);
        }
    }
}

/// Writes the right checksum into a superblock that asks for one.
fn reseal(data: &mut [u8]) {
    let Some(mut sb) = SuperBlock::read(data, SUPER_OFFSET) else {
        return;
    };
    if sb.feature_compat & FEATURE_COMPAT_SB_CHKSUM == 0 || !(9..=16).contains(&sb.blkszbits) {
        return;
    }
    let len = sb_checksum_span(1usize << sb.blkszbits);
    if data.len() < SUPER_OFFSET + len {
        return;
    }
    // The checksum is computed with its own field taken as zero.
    sb.checksum = sb_checksum(&data[SUPER_OFFSET..SUPER_OFFSET + len]);
    sb.write_to(data, SUPER_OFFSET);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The input `erofs_walk` found: a directory whose entry names an ancestor. `any_xattrs` walked it
    /// forever, its stack growing until memory ran out (3.4 GB asked for).
    #[test]
    fn a_directory_cycle_is_an_error_not_an_endless_walk() {
        let mut data = include_bytes!("../tests/data/directory-cycle.img").to_vec();
        walk(&data);
        reseal(&mut data);
        let img = ErofsImage::parse(data).expect("parses");
        let e = img.any_xattrs().expect_err("a cycle");
        assert!(e.to_string().contains("cycle"), "{e}");
    }
}
