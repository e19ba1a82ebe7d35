//! A layer's content digest: what the layer *is*, independent of where its chunks are stored.
//!
//! A layer's real metadata names each chunk by its place — a device (a blob) and a block in that blob's
//! view — and which blob holds a chunk depends on what the store held when the layer was built (its own
//! new blob, a parent's, a foreign blob the store-wide index found). So the digest of the real metadata
//! cannot name the layer reproducibly. The *canonical* image can: the same EROFS image the writer makes
//! for the same tree, but written against one virtual device that holds every distinct chunk the tree
//! references, sorted by digest, chunk `i` at block `i`, the device's slot tag being the BLAKE3 of those
//! sorted digests (32 bytes each, concatenated) and its size `0xFFFFFFFF` blocks (chunks overlap in this
//! address space: it is a numbering, not a layout). The image fixes every
//! inode, name, xattr and inline byte, and each file's chunk sequence as positions in the sorted list;
//! the tag fixes the list. Its BLAKE3 is the descriptor's `content`
//! ([`strata_registry::model::LayerDescriptor::digest`]). It is a hash input only: never stored, never
//! mounted.

use std::collections::HashMap;

use strata_registry::digest::{Digest, Hasher};

use crate::erofs::{self, BlobSlot, ChunkLoc, DeviceSlot};
use crate::error::BuildError;
use crate::tree::{FileData, NodeKind, Tree};

/// The content digest of `tree` (only nodes marked in `reachable` count), chunked at `1 << chunk_bits`.
pub fn content_digest(
    tree: &Tree,
    reachable: &[bool],
    chunk_bits: u8,
) -> Result<Digest, BuildError> {
    let mut chunks: Vec<Digest> = tree
        .nodes
        .iter()
        .enumerate()
        .filter(|(id, _)| reachable.get(*id).copied().unwrap_or(false))
        .filter_map(|(_, n)| match &n.kind {
            NodeKind::File {
                data: FileData::Chunks(c),
                ..
            } => Some(c.iter().flatten().copied()),
            _ => None,
        })
        .flatten()
        .collect();
    chunks.sort_unstable_by_key(|d| d.0);
    chunks.dedup();
    let count = u32::try_from(chunks.len()).map_err(|_| {
        BuildError::Option(format!("{} distinct chunks: more than 2^32", chunks.len()))
    })?;
    let mut list = Hasher::new();
    let mut at: HashMap<Digest, u32> = HashMap::with_capacity(chunks.len());
    for (i, d) in (0..count).zip(&chunks) {
        list.update(&d.0);
        at.insert(*d, i);
    }
    let devices = if chunks.is_empty() {
        Vec::new()
    } else {
        vec![DeviceSlot::for_blob(&list.finish(), u32::MAX)]
    };
    let image = erofs::write_image(tree, &devices, chunk_bits, &|d: &Digest| {
        at.get(d).map(|block| ChunkLoc {
            device: 1,
            block: *block,
        })
    })?;
    Ok(Digest::of(&image))
}

#[cfg(test)]
#[path = "identity_tests.rs"]
mod tests;
