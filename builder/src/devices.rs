//! A new layer's device table: which blobs it references, and where each of its chunks lies.
//!
//! Device 1 is the build's new blob (when it stored any chunk), then the parents' blobs that a reachable
//! file still uses (in the parents' order), then the foreign blobs the store-wide index found chunks in
//! (in the order they were chosen, [`crate::dedup`]). A blob no reachable file uses is left out: a file
//! replaced or deleted by the build does not pull in the blob holding its old chunks.

use std::collections::HashMap;

use strata_registry::digest::Digest;
use strata_registry::model::BlobRef;

use crate::chunker::Packed;
use crate::dedup::Known;
use crate::erofs::{BlobSlot, ChunkLoc, DeviceSlot};
use crate::error::BuildError;
use crate::tree::{FileData, NodeKind, Tree};

/// The device table of a layer being sealed.
pub(crate) struct Devices<'a> {
    pub blobs: Vec<BlobRef>,
    /// Foreign blobs among `blobs` (to check again before the layer is written).
    pub foreign: Vec<BlobRef>,
    placed: &'a HashMap<Digest, u32>,
    new_device: u16,
    parent_chunks: &'a HashMap<Digest, (usize, u32)>,
    parent_device: Vec<u16>,
    foreign_chunks: HashMap<Digest, (usize, u32)>,
    foreign_device: Vec<u16>,
}

/// Where a chunk lies in another blob: (index into that group's blobs, block).
type Located = HashMap<Digest, (usize, u32)>;

impl<'a> Devices<'a> {
    /// The devices of `tree` (whose reachable nodes are `seen`), given the new blob `packed` and the
    /// chunks `known` stored already.
    pub fn assign(
        tree: &Tree,
        seen: &[bool],
        packed: &'a Packed,
        known: &'a Known,
    ) -> Result<Devices<'a>, BuildError> {
        let (foreign_blobs, foreign_chunks, _) = known.foreign();
        let mut used_parent = vec![false; known.parent_blobs.len()];
        let mut used_foreign = vec![false; foreign_blobs.len()];
        let mark = |d: &Digest, map: &Located, used: &mut [bool]| match map.get(d) {
            Some((i, _)) => {
                used[*i] = true;
                true
            }
            None => false,
        };
        for (id, node) in tree.nodes.iter().enumerate() {
            let NodeKind::File {
                data: FileData::Chunks(chunks),
                ..
            } = &node.kind
            else {
                continue;
            };
            if !seen[id] {
                continue;
            }
            for d in chunks.iter().flatten() {
                let found = packed.placed.contains_key(d)
                    || mark(d, &known.parent_chunks, &mut used_parent)
                    || mark(d, &foreign_chunks, &mut used_foreign);
                if !found {
                    return Err(BuildError::Unsupported {
                        path: format!("inode {id}"),
                        why: format!("chunk {d} is neither in the new blob nor in a stored blob"),
                    });
                }
            }
        }
        let mut blobs = Vec::new();
        if let Some(b) = &packed.blob {
            blobs.push(BlobRef {
                digest: b.digest,
                size: b.size,
                view_size: b.toc.view_size(),
                toc_offset: b.footer.toc_offset,
                toc_len: b.footer.toc_len,
                toc_digest: b.footer.toc_digest,
                chunks: b.toc.chunks.len() as u64,
            });
        }
        let mut place = |group: &[BlobRef], used: &[bool]| -> Result<Vec<u16>, BuildError> {
            let mut device = vec![0u16; group.len()];
            for (i, b) in group.iter().enumerate().filter(|(i, _)| used[*i]) {
                blobs.push(b.clone());
                device[i] = u16::try_from(blobs.len())
                    .map_err(|_| BuildError::Option("more than 65535 devices".into()))?;
            }
            Ok(device)
        };
        let parent_device = place(&known.parent_blobs, &used_parent)?;
        let foreign_device = place(&foreign_blobs, &used_foreign)?;
        let foreign = foreign_blobs
            .into_iter()
            .zip(&used_foreign)
            .filter(|(_, u)| **u)
            .map(|(b, _)| b)
            .collect();
        Ok(Devices {
            blobs,
            foreign,
            placed: &packed.placed,
            new_device: u16::from(packed.blob.is_some()),
            parent_chunks: &known.parent_chunks,
            parent_device,
            foreign_chunks,
            foreign_device,
        })
    }

    /// The EROFS device table.
    pub fn slots(&self) -> Vec<DeviceSlot> {
        self.blobs
            .iter()
            .map(|b| DeviceSlot::for_blob(&b.digest, (b.view_size / 4096) as u32))
            .collect()
    }

    /// Where chunk `d` lies: the new blob, else a parent's blob, else a foreign blob.
    pub fn resolve(&self, d: &Digest) -> Option<ChunkLoc> {
        if let Some(block) = self.placed.get(d) {
            return Some(ChunkLoc {
                device: self.new_device,
                block: *block,
            });
        }
        let (device, block) = match self.parent_chunks.get(d) {
            Some((i, block)) => (self.parent_device[*i], *block),
            None => {
                let (i, block) = self.foreign_chunks.get(d)?;
                (self.foreign_device[*i], *block)
            }
        };
        Some(ChunkLoc { device, block })
    }
}
