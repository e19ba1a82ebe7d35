//! Re-pointing an image the writer made.

use strata_registry::digest::Digest;

use std::collections::HashMap;

use strata_erofs::format::*;
use strata_erofs::repoint::{chunk_tables, repoint, Replacement};
use strata_erofs::{ErofsError, ErofsImage};

use super::BlobSlot;
use crate::erofs::tests::{sample_tree, Chunks};

/// Re-pointing device 2 changes its slot and the chunk indexes naming it, and no other byte but the
/// superblock's uuid and checksum (which the reader verifies).
#[test]
fn repoint_changes_only_the_replaced_device() {
    let mut c = Chunks::new();
    let tree = sample_tree(&mut c);
    let before = c.write(&tree, 20).expect("write");
    let image = ErofsImage::parse(before.clone()).expect("parse");
    let blocks: HashMap<u32, u32> = c
        .locs
        .values()
        .filter(|l| l.device == 2)
        .map(|l| (l.block, l.block / 256 + 7))
        .collect();
    assert!(!blocks.is_empty());
    let slot = strata_erofs::DeviceSlot::for_blob(&Digest::of(b"new blob"), 99);
    let replace = HashMap::from([(
        2u16,
        Replacement {
            slot: slot.clone(),
            blocks: &blocks,
        },
    )]);
    let after = repoint(&image, &replace).expect("repoint");
    let parsed = ErofsImage::parse(after.clone()).expect("parse after");
    assert_eq!(parsed.devices()[0], image.devices()[0]);
    assert_eq!(parsed.devices()[1], slot);
    assert_eq!(before.len(), after.len());
    let mut allowed = vec![false; before.len()];
    allowed[SUPER_OFFSET..SUPER_OFFSET + 128].fill(true);
    let slot2 = usize::from(image.superblock().devt_slotoff) * DEVT_SLOT_SIZE + DEVT_SLOT_SIZE;
    allowed[slot2..slot2 + DEVT_SLOT_SIZE].fill(true);
    let mut moved = 0;
    for (offset, count) in chunk_tables(&image).expect("tables") {
        for k in 0..count {
            let at = (offset + k * 8) as usize;
            let old = ChunkIndex::read(&before, at).expect("old");
            let new = ChunkIndex::read(&after, at).expect("new");
            assert_eq!(old.device_id, new.device_id);
            if old.device_id == 2 && old.startblk_lo != NULL_ADDR {
                assert_eq!(new.startblk_lo, blocks[&old.startblk_lo]);
                moved += 1;
            } else {
                assert_eq!(old, new);
            }
            allowed[at..at + 8].fill(true);
        }
    }
    assert!(moved > 0);
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        assert!(a == b || allowed[i], "byte {i} changed");
    }
    // A block the replacement does not map is an error, not a dangling index.
    let partial: HashMap<u32, u32> = blocks.iter().skip(1).map(|(a, b)| (*a, *b)).collect();
    let replace = HashMap::from([(
        2u16,
        Replacement {
            slot,
            blocks: &partial,
        },
    )]);
    assert!(matches!(
        repoint(&image, &replace),
        Err(ErofsError::Repoint(_))
    ));
}
