//! The store-wide chunk index: which blob of the store holds a chunk, whoever built it.
//!
//! **In the store**, the index is a set of immutable *segments*, one per blob: `index/<blob hex>` holds
//! the blob's [`BlobRef`] (what a layer's device table needs) and a verbatim copy of its table of
//! contents (chunk digest → view block, length). A builder writes the segment of its new blob after the
//! blob and before the layer descriptor (the store's order: blob → index segment → metadata → layer →
//! manifest → tag), so an interrupted build leaves at worst an unreferenced blob with its segment, which
//! gc collects like any unreferenced object. A segment is derived from its blob: writing it again is
//! idempotent, and every field is checked against the blob ([`Segment::decode`] verifies the TOC copy
//! against the digest the header records, the header against the key and itself; a builder checks the
//! blob still exists before its layer names it).
//!
//! **On a builder**, [`cache::IndexCache`] keeps the index in a local RocksDB (chunk digest → blob,
//! block, length), synced incrementally: a sync lists `index/` and fetches only the segments it has not
//! seen, so a lookup is a local point read whose cost stays flat however large the store grows. Deleting
//! the cache loses nothing: the next sync rebuilds it from the segments.
//!
//! **Against a concurrent gc** ([`condemn`]): a blob nothing reaches is first *condemned* (a marker
//! `gc/condemned/blobs/<blob hex>`) and deleted only by a later gc, at least the grace period after, if still
//! unreachable. Builders never pick a condemned blob and check again, just before writing their layer,
//! that every foreign blob they use exists and is not condemned. A build that passed that check writes its
//! tag within the grace period (the same rule as for its own young objects), so the gc that would delete
//! the blob sees it reachable and lifts the condemnation instead.

pub mod cache;
pub mod condemn;

use crate::digest::Digest;
use crate::model::BlobRef;
use crate::store::{Store, StoreError};
use crate::toc::{Toc, FOOTER_LEN};

/// Magic of a segment object.
const SEGMENT_MAGIC: &[u8; 8] = b"STRIDX01";
/// Magic, then the blob reference: digest, size, view size, TOC offset, TOC length, TOC digest, chunks.
const HEADER_LEN: usize = 8 + 32 + 8 * 4 + 32 + 8;
/// Largest TOC a segment may carry (a TOC of 16 M chunks is 768 MiB: no blob has that many).
const TOC_MAX: u64 = 1 << 30;

/// The key of the index segment of blob `d`.
pub fn segment_key(d: &Digest) -> String {
    format!("index/{}", d.hex())
}

/// Why a segment could not be read.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("index segment {key} is malformed: {why}")]
    Malformed { key: String, why: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("index cache {path}: {why}")]
    Cache {
        path: std::path::PathBuf,
        why: String,
    },
}

/// One blob's entry of the store-wide index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub blob: BlobRef,
    pub toc: Toc,
}

/// The blob reference as bytes (the segment header without its magic; also the cache's blob record).
pub(crate) fn encode_blob_ref(b: &BlobRef) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN - 8);
    out.extend_from_slice(&b.digest.0);
    for v in [b.size, b.view_size, b.toc_offset, b.toc_len] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&b.toc_digest.0);
    out.extend_from_slice(&b.chunks.to_le_bytes());
    out
}

/// The inverse of [`encode_blob_ref`]; `None` if `b` has the wrong length.
pub(crate) fn decode_blob_ref(b: &[u8]) -> Option<BlobRef> {
    if b.len() != HEADER_LEN - 8 {
        return None;
    }
    let digest = |at: usize| {
        let mut d = [0u8; 32];
        d.copy_from_slice(&b[at..at + 32]);
        Digest(d)
    };
    let u64_at = |at: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(a)
    };
    Some(BlobRef {
        digest: digest(0),
        size: u64_at(32),
        view_size: u64_at(40),
        toc_offset: u64_at(48),
        toc_len: u64_at(56),
        toc_digest: digest(64),
        chunks: u64_at(96),
    })
}

impl Segment {
    /// The segment object's bytes: magic, blob reference, the TOC as the blob holds it.
    pub fn encode(&self) -> Vec<u8> {
        let toc = self.toc.encode();
        let mut out = Vec::with_capacity(HEADER_LEN + toc.len());
        out.extend_from_slice(SEGMENT_MAGIC);
        out.extend_from_slice(&encode_blob_ref(&self.blob));
        out.extend_from_slice(&toc);
        out
    }

    /// Decodes and checks the segment stored under `key`: the header names the blob of the key, its TOC
    /// copy matches the TOC digest, and its sizes agree with the TOC (the TOC ends where the footer
    /// starts; view size and chunk count as the TOC says).
    pub fn decode(key: &str, b: &[u8]) -> Result<Segment, IndexError> {
        let bad = |why: &str| IndexError::Malformed {
            key: key.to_string(),
            why: why.to_string(),
        };
        if b.len() < HEADER_LEN || &b[..8] != SEGMENT_MAGIC {
            return Err(bad("no STRIDX01 header"));
        }
        let blob = decode_blob_ref(&b[8..HEADER_LEN]).ok_or_else(|| bad("short header"))?;
        if key.rsplit('/').next() != Some(blob.digest.hex().as_str()) {
            return Err(bad("names another blob than its key"));
        }
        let toc_bytes = &b[HEADER_LEN..];
        if blob.toc_len != toc_bytes.len() as u64 || blob.toc_len > TOC_MAX {
            return Err(bad("TOC length differs from the header's"));
        }
        if Digest::of(toc_bytes) != blob.toc_digest {
            return Err(bad("TOC does not match its digest"));
        }
        let toc = Toc::decode(toc_bytes).map_err(|e| bad(&e.to_string()))?;
        let consistent = blob
            .toc_offset
            .checked_add(blob.toc_len + FOOTER_LEN as u64)
            == Some(blob.size)
            && blob.view_size == toc.view_size()
            && blob.chunks == toc.chunks.len() as u64;
        if !consistent {
            return Err(bad("sizes disagree with the TOC"));
        }
        Ok(Segment { blob, toc })
    }
}

impl Store {
    /// Writes the index segment of a stored blob (after the blob, before any layer naming it).
    pub fn put_segment(&self, seg: &Segment) -> Result<(), StoreError> {
        self.put_bytes(&segment_key(&seg.blob.digest), seg.encode())
    }

    /// Reads and checks the index segment of blob `d`; `None` when it has none.
    pub fn get_segment(&self, d: &Digest) -> Result<Option<Segment>, IndexError> {
        let key = segment_key(d);
        match self.get_index(&key)? {
            Some(b) => Ok(Some(Segment::decode(&key, &b)?)),
            None => Ok(None),
        }
    }

    /// The blobs that have an index segment, unordered.
    pub fn list_segments(&self) -> Result<Vec<Digest>, StoreError> {
        Ok(self
            .list("index")?
            .iter()
            .filter_map(|k| Digest::from_hex(k.strip_prefix("index/")?).ok())
            .collect())
    }

    /// Writes the segment of a blob that has none (a store written before the index): reads the blob's
    /// footer and TOC. Returns whether it wrote one.
    pub fn backfill_segment(&self, d: &Digest) -> Result<bool, IndexError> {
        if self.exists(&segment_key(d))? {
            return Ok(false);
        }
        let size = self
            .backend()
            .head(&crate::store::key::blob(d))?
            .ok_or_else(|| StoreError::NotFound(crate::store::key::blob(d)))?
            .size;
        let footer = self.get_footer(d)?;
        let probe = BlobRef {
            digest: *d,
            size,
            view_size: 0,
            toc_offset: footer.toc_offset,
            toc_len: footer.toc_len,
            toc_digest: footer.toc_digest,
            chunks: 0,
        };
        let toc = self.get_toc(&probe)?;
        let blob = BlobRef {
            view_size: toc.view_size(),
            chunks: toc.chunks.len() as u64,
            ..probe
        };
        self.put_segment(&Segment { blob, toc })?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
