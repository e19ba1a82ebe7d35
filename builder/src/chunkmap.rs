//! Chunk digests of stored layers: a chunk index of a layer's EROFS metadata names a device and a block;
//! the layer's device table names the blob (device `i + 1` is the descriptor's `blobs[i]`), and the blob's
//! table of contents gives the digest of the chunk starting at that block. Tables of contents are fetched
//! once per blob, when first needed, and kept for the resolver's lifetime (one build).

use std::collections::HashMap;

use strata_registry::digest::Digest;
use strata_registry::model::BlobRef;
use strata_registry::store::{Store, StoreError};

use crate::erofs::{ChunkLoc, ErofsError, ErofsImage, Inode};

/// Why a chunk index could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ChunkLookupError {
    #[error("chunk index names device {0}, which the layer does not have")]
    NoDevice(u16),
    #[error("no chunk starts at block {block} of blob {blob}")]
    NoBlock { block: u32, blob: Digest },
    #[error("metadata: {0}")]
    Metadata(#[from] ErofsError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Resolves chunk indexes of stored layers to chunk digests.
pub struct ChunkDigests<'s> {
    store: &'s Store,
    maps: HashMap<Digest, HashMap<u32, Digest>>,
}

impl<'s> ChunkDigests<'s> {
    pub fn new(store: &'s Store) -> ChunkDigests<'s> {
        ChunkDigests {
            store,
            maps: HashMap::new(),
        }
    }

    /// The digest of the chunk at `loc` in a layer whose blobs (device table) are `blobs`.
    pub fn digest(&mut self, blobs: &[BlobRef], loc: ChunkLoc) -> Result<Digest, ChunkLookupError> {
        let blob = usize::from(loc.device)
            .checked_sub(1)
            .and_then(|i| blobs.get(i))
            .ok_or(ChunkLookupError::NoDevice(loc.device))?;
        if !self.maps.contains_key(&blob.digest) {
            let toc = self.store.get_toc(blob)?;
            let map = toc.chunks.iter().map(|c| (c.block, c.digest)).collect();
            self.maps.insert(blob.digest, map);
        }
        self.maps
            .get(&blob.digest)
            .and_then(|m| m.get(&loc.block))
            .copied()
            .ok_or(ChunkLookupError::NoBlock {
                block: loc.block,
                blob: blob.digest,
            })
    }

    /// The chunk digests of a chunk-based file of `image` (a layer whose blobs are `blobs`), in order;
    /// `None` is a hole.
    pub fn file_chunks(
        &mut self,
        image: &ErofsImage,
        blobs: &[BlobRef],
        inode: &Inode,
    ) -> Result<Vec<Option<Digest>>, ChunkLookupError> {
        image
            .chunks(inode)?
            .into_iter()
            .map(|loc| loc.map(|l| self.digest(blobs, l)).transpose())
            .collect()
    }
}
