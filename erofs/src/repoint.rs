//! Re-pointing a layer's metadata at other blobs, byte for byte otherwise: what compaction does when it
//! moves a blob's live chunks into a new blob.
//!
//! Only three things change in the image: the device table slots of the replaced blobs (tag = the new
//! blob's digest, size = its view), the 8-byte chunk indexes that name those devices (the block moves to
//! the chunk's block in the new blob), and the superblock's uuid and checksum (recomputed as the writer
//! does). Inodes, directories, xattrs, inline data, device ids — everything a reader sees — stay as they
//! were, so the layer reads the same bytes before and after.

use std::collections::HashMap;

use crate::device::{seal_superblock, DeviceSlot};
use crate::format::*;
use crate::reader::{ErofsError, ErofsImage, Layout};

/// A device's replacement: the new slot, and the new block of each chunk by its old block.
pub struct Replacement<'a> {
    pub slot: DeviceSlot,
    pub blocks: &'a HashMap<u32, u32>,
}

/// Where the chunk indexes of every chunk-based file of `image` lie: (byte offset, count). Each inode is
/// listed once, however many names it has.
pub fn chunk_tables(image: &ErofsImage) -> Result<Vec<(u64, u64)>, ErofsError> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![image.root_nid()];
    while let Some(nid) = stack.pop() {
        if !seen.insert(nid) {
            continue;
        }
        let inode = image.inode(nid)?;
        if inode.is_dir() {
            for e in image.read_dir_all(&inode)? {
                if e.name != b"." && e.name != b".." {
                    stack.push(e.nid);
                }
            }
        } else if inode.layout == Layout::ChunkBased {
            if (inode.raw_u as u16) & CHUNK_FORMAT_INDEXES == 0 {
                return Err(ErofsError::Inode {
                    nid,
                    why: "chunk block map without device ids (not written by strata)".into(),
                });
            }
            let count = inode.size.div_ceil(1u64 << inode.chunk_bits);
            out.push((align_up(inode.tail_offset, 8), count));
        }
    }
    Ok(out)
}

/// The image with the devices in `replace` (by device id, 1-based) re-pointed. A chunk index naming a
/// replaced device at a block the replacement does not map is an error (the compaction missed a live
/// chunk): nothing is written then.
pub fn repoint(
    image: &ErofsImage,
    replace: &HashMap<u16, Replacement<'_>>,
) -> Result<Vec<u8>, ErofsError> {
    let mut img = image.bytes().to_vec();
    let tables = chunk_tables(image)?;
    for (offset, count) in tables {
        for k in 0..count {
            let at = (offset + k * 8) as usize;
            let ci = ChunkIndex::read(&img, at).ok_or(ErofsError::OutOfBounds {
                what: "chunk index",
                offset: at as u64,
                len: 8,
                size: img.len() as u64,
            })?;
            if ci.startblk_lo == NULL_ADDR {
                continue;
            }
            let Some(r) = replace.get(&ci.device_id) else {
                continue;
            };
            let block = r.blocks.get(&ci.startblk_lo).ok_or_else(|| {
                ErofsError::Repoint(format!(
                    "device {} block {} has no place in the replacement blob",
                    ci.device_id, ci.startblk_lo
                ))
            })?;
            ChunkIndex {
                startblk_lo: *block,
                ..ci
            }
            .write_to(&mut img, at);
        }
    }
    let sb = *image.superblock();
    for (device, r) in replace {
        let k = usize::from(*device)
            .checked_sub(1)
            .filter(|k| *k < image.devices().len())
            .ok_or_else(|| ErofsError::Repoint(format!("no device {device} to replace")))?;
        let at = usize::from(sb.devt_slotoff) * DEVT_SLOT_SIZE + k * DEVT_SLOT_SIZE;
        let mut slot = RawDeviceSlot::read(&img, at).ok_or(ErofsError::OutOfBounds {
            what: "device slot",
            offset: at as u64,
            len: DEVT_SLOT_SIZE as u64,
            size: img.len() as u64,
        })?;
        slot.tag = r.slot.tag;
        slot.blocks_lo = r.slot.blocks;
        slot.write_to(&mut img, at);
    }
    seal_superblock(&mut img, sb);
    Ok(img)
}
