//! A blob the node serves, as units: [`BlobHandle`].

use std::sync::atomic::AtomicUsize;

use strata_registry::model::BlobRef;
use strata_registry::pieces::{self, PieceCheck};
use strata_registry::store::{key, Store, StoreError};
use strata_registry::toc::Toc;

use super::ChunkHome;

/// A blob the node serves: its descriptor entry and verified table of contents, as *units*.
pub struct BlobHandle {
    pub blob: BlobRef,
    /// The blob's table of contents as units ([`pieces::units`]): its chunks stored whole and the
    /// pieces of its pieced chunks, each named by its key. Everything the node does by chunk — fetch,
    /// cache, fill a view file, record a plan — it does by unit, so that a miss in a pieced chunk
    /// fetches, decompresses and verifies one piece. A blob without pieces has its chunks as units.
    pub toc: Toc,
    /// Each unit's piece check (empty: the blob has no pieces).
    checks: Vec<Option<PieceCheck>>,
    pub(super) key: String,
    /// The chunk the last read entered (`usize::MAX`: none yet), for [`Fetcher::read_ahead`].
    pub(super) last: AtomicUsize,
    /// The first chunk not yet read ahead.
    pub(super) ahead: AtomicUsize,
    /// Where fetched chunks go instead of the chunk cache ([`home`]).
    pub(super) home: std::sync::RwLock<Option<std::sync::Weak<dyn ChunkHome>>>,
}

impl BlobHandle {
    /// Fetches and verifies the blob's table of contents.
    pub fn open(store: &Store, blob: &BlobRef) -> Result<BlobHandle, StoreError> {
        Ok(BlobHandle::new(blob, store.get_toc(blob)?))
    }

    /// A blob whose table of contents the caller has verified (e.g. kept in the node's state).
    pub fn new(blob: &BlobRef, toc: Toc) -> BlobHandle {
        let (toc, checks) = pieces::units(toc);
        BlobHandle {
            toc,
            checks,
            blob: blob.clone(),
            key: key::blob(&blob.digest),
            last: AtomicUsize::new(usize::MAX),
            ahead: AtomicUsize::new(0),
            home: std::sync::RwLock::new(None),
        }
    }

    /// Whether `bytes`, which match unit `j`'s key, are also the piece of its chunk the unit names
    /// (a whole chunk's key is its digest: nothing more to check).
    pub fn piece_ok(&self, j: usize, bytes: &[u8]) -> bool {
        match self.checks.get(j) {
            Some(Some(check)) => check.matches(bytes),
            _ => true,
        }
    }

    /// The first unit of the chunk unit `i` is in: `i` itself unless it is a piece past its chunk's first.
    pub fn chunk_start(&self, i: usize) -> usize {
        let back = self
            .checks
            .get(..=i)
            .unwrap_or(&[])
            .iter()
            .rev()
            .take_while(|c| c.is_some_and(|c| c.offset > 0))
            .count();
        i - back
    }

    /// The units of the chunk whose first unit is `i`: `i` alone, or all of its chunk's pieces.
    pub fn chunk_units(&self, i: usize) -> std::ops::Range<usize> {
        let more = self
            .checks
            .get(i + 1..)
            .unwrap_or(&[])
            .iter()
            .take_while(|c| c.is_some_and(|c| c.offset > 0))
            .count();
        i..i + 1 + more
    }
}
