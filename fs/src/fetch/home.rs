//! A blob's *home*: where its verified chunks are kept instead of the chunk cache.
//!
//! The chunk cache is keyed by chunk digest and serves every mode. `fanotify` mode keeps each blob's
//! uncompressed view in a local file that EROFS reads directly, and that file is a cache of the
//! blob's chunks in its own right: filling it from the chunk cache meant every fetched chunk was
//! written to disk twice (the cache's buffered write, then the view file's direct one), read back and
//! hashed a second time, and held on disk twice. So a blob with a view file names it as its home
//! ([`BlobHandle::set_home`]): the fetcher hands each chunk it verifies straight to the home — the
//! reader's own chunk, its followers, read-behind and prefetch alike — and the chunk cache never sees
//! it. A chunk the home cannot take (a full disk, a view file being trimmed) goes to the chunk cache as
//! before, and a blob without a home (every other mode) is served as it always was.
//!
//! **Contract.** [`ChunkHome::take`] returns only once the chunk's bytes are durable in the home as far
//! as readers are concerned (written, not merely queued), and [`ChunkHome::has`] is true only after
//! such a `take` or an equivalent check of the bytes: a home is a cache of verified data, so the
//! fetcher treats `has` as `cache.contains`. The fetcher holds its home weakly: the home (the view
//! file) holds the blob, and a trimmed view file simply stops being one.

use std::io;
use std::sync::{Arc, Weak};

use super::BlobHandle;

/// Where a blob's verified chunks live instead of the chunk cache (see the module documentation).
pub trait ChunkHome: Send + Sync {
    /// Keeps verified chunk `j` (its `bytes`, exactly the chunk's length): `false` when it could not.
    fn take(&self, j: usize, bytes: &[u8]) -> bool;
    /// Whether chunk `j` is kept, verified.
    fn has(&self, j: usize) -> bool;
    /// Copies `buf.len()` bytes at `offset` of chunk `j` (kept) into `buf`.
    fn read_at(&self, j: usize, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl BlobHandle {
    /// Names `home` as where this blob's fetched chunks go from now on (replacing any earlier one).
    pub fn set_home(&self, home: Weak<dyn ChunkHome>) {
        *self.home.write().unwrap_or_else(|p| p.into_inner()) = Some(home);
    }

    /// The blob's home, while it has one.
    pub fn home(&self) -> Option<Arc<dyn ChunkHome>> {
        let h = self.home.read().unwrap_or_else(|p| p.into_inner());
        h.as_ref().and_then(Weak::upgrade)
    }
}
