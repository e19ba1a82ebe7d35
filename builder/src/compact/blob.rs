//! Copying a blob's live chunks into a new blob.
//!
//! The live chunks are read in runs (neighbouring frames in one range request, [`BlobReader`]), each
//! verified against its digest, and written in the old order into a new blob laid out as a build lays
//! one out: a chunk of at least [`GROUP_FILE_MAX`] bytes in a frame of its own, smaller chunks grouped into
//! frames of about [`GROUP_TARGET`] bytes so that they compress together. The new blob is stored with its
//! index segment; the caller gets the old-block → new-block map that re-points the metadata.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use strata_registry::blobread::BlobReader;
use strata_registry::index::Segment;
use strata_registry::model::BlobRef;
use strata_registry::pieces;
use strata_registry::store::Store;
use strata_registry::toc::{self, ChunkEntry, Toc, BLOCK_SIZE};

use crate::chunker::{append_frames, compress_chunk, BlobSpool};
use crate::error::BuildError;

const GROUP_FILE_MAX: usize = 64 << 10;
const GROUP_TARGET: usize = 128 << 10;

/// A blob written by compaction.
pub struct Rewritten {
    pub blob: BlobRef,
    /// Old view block → new view block, for every live chunk.
    pub blocks: HashMap<u32, u32>,
}

struct Writer {
    out: BlobSpool,
    toc: Toc,
    level: i32,
    /// Chunks waiting to share a frame: (old block, entry with its offset in `group`).
    pending: Vec<(u32, ChunkEntry)>,
    group: Vec<u8>,
    blocks: HashMap<u32, u32>,
}

impl Writer {
    /// Writes `data` as one frame holding `chunks` (old block, entry with `frame_offset` set).
    fn frame(&mut self, data: &[u8], chunks: Vec<(u32, ChunkEntry)>) -> Result<(), BuildError> {
        let frame = [(toc::compress(data, self.level), data.len() as u32)];
        let index = append_frames(&mut self.out, &mut self.toc, &frame)?;
        for (old, c) in chunks {
            self.place(old, ChunkEntry { frame: index, ..c })?;
        }
        Ok(())
    }

    /// Puts chunk `c` (old view block `old`) at the end of the new blob's view.
    fn place(&mut self, old: u32, c: ChunkEntry) -> Result<(), BuildError> {
        let block = u32::try_from(self.toc.view_blocks)
            .map_err(|_| BuildError::Option("blob view larger than 16 TiB".into()))?;
        self.blocks.insert(old, block);
        self.toc.view_blocks += (c.len as u64).div_ceil(BLOCK_SIZE);
        self.toc.chunks.push(ChunkEntry { block, ..c });
        Ok(())
    }

    fn flush_group(&mut self) -> Result<(), BuildError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let group = std::mem::take(&mut self.group);
        let pending = std::mem::take(&mut self.pending);
        self.frame(&group, pending)
    }

    /// Writes a chunk longer than the piece size as its pieces' frames.
    fn pieced(&mut self, c: &ChunkEntry, bytes: &[u8]) -> Result<(), BuildError> {
        let (frames, pieces) = compress_chunk(bytes, self.level, self.toc.piece_size);
        let frame = append_frames(&mut self.out, &mut self.toc, &frames)?;
        let index = self.toc.chunks.len() as u32;
        self.toc
            .pieces
            .extend(pieces.into_iter().map(|p| (index, p)));
        let entry = ChunkEntry {
            frame,
            frame_offset: 0,
            ..*c
        };
        self.place(c.block, entry)
    }

    fn add(&mut self, c: &ChunkEntry, bytes: &[u8]) -> Result<(), BuildError> {
        let entry = |frame_offset: u32| ChunkEntry { frame_offset, ..*c };
        if pieces::count(c.len, self.toc.piece_size) > 0 {
            self.flush_group()?;
            return self.pieced(c, bytes);
        }
        if bytes.len() >= GROUP_FILE_MAX {
            self.flush_group()?;
            return self.frame(bytes, vec![(c.block, entry(0))]);
        }
        let at = self.group.len() as u32;
        self.group.extend_from_slice(bytes);
        self.pending.push((c.block, entry(at)));
        if self.group.len() >= GROUP_TARGET {
            self.flush_group()?;
        }
        Ok(())
    }
}

/// Copies the chunks of `old` whose view block is in `live` into a new blob, stores it (and its index
/// segment) and returns it. `spool` is a directory for the blob being written.
pub fn rewrite(
    store: &Store,
    old: &BlobRef,
    live: &HashSet<u32>,
    level: i32,
    spool: &Path,
) -> Result<Rewritten, BuildError> {
    let reader = BlobReader::open(store, old)?;
    let mut w = Writer {
        out: BlobSpool::create(spool, "compact")?,
        // The old blob's piece size: compaction moves chunks, it does not change how they are stored.
        toc: Toc {
            piece_size: reader.toc.piece_size,
            ..Toc::default()
        },
        level,
        pending: Vec::new(),
        group: Vec::new(),
        blocks: HashMap::new(),
    };
    let copied = for_each_live_chunk(&reader, live, |c, bytes| w.add(c, bytes))
        .and_then(|()| w.flush_group());
    if let Err(e) = copied {
        w.out.discard();
        return Err(e);
    }
    seal(store, w)
}

/// Calls `f` with each chunk of `reader`'s blob whose view block is in `live`, verified, in blob order,
/// reading runs of consecutive live chunks together (compaction, and builds giving up a foreign blob).
pub fn for_each_live_chunk(
    reader: &BlobReader<'_>,
    live: &HashSet<u32>,
    mut f: impl FnMut(&ChunkEntry, &[u8]) -> Result<(), BuildError>,
) -> Result<(), BuildError> {
    let chunks = &reader.toc.chunks;
    let mut i = 0;
    while i < chunks.len() {
        if !live.contains(&chunks[i].block) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chunks.len() && live.contains(&chunks[j].block) {
            j += 1;
        }
        let mut failed = None;
        reader.for_each_chunk(i..j, |c, bytes| {
            if failed.is_none() {
                failed = f(c, bytes).err();
            }
            Ok(())
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        i = j;
    }
    Ok(())
}

/// Writes the TOC and footer, stores the blob and its segment.
fn seal(store: &Store, w: Writer) -> Result<Rewritten, BuildError> {
    let path = w.out.path.clone();
    let (digest, size, footer) = w.out.seal(&w.toc)?;
    let blob = BlobRef {
        digest,
        size,
        view_size: w.toc.view_size(),
        toc_offset: footer.toc_offset,
        toc_len: footer.toc_len,
        toc_digest: footer.toc_digest,
        chunks: w.toc.chunks.len() as u64,
    };
    store.put_blob_file(&digest, &path)?;
    store.put_segment(&Segment {
        blob: blob.clone(),
        toc: w.toc,
    })?;
    Ok(Rewritten {
        blob,
        blocks: w.blocks,
    })
}
