//! The store seam: [`StoreBackend`], the few blocking object operations a [`super::Store`] is built on.
//!
//! A [`super::Store`] knows the layout (blobs, metadata, descriptors, tags), verifies what it reads and
//! orders its writes; a backend only moves bytes under keys, in the spirit of `object_store`: whole and
//! ranged reads, metadata, writes (unconditional, create-only, or if-match on a version), listing and
//! deletion. Implementations:
//!
//! - [`super::backend::ObjectStoreBackend`] — `file://` directories and `s3://` buckets through the
//!   `object_store` crate (the only module that speaks it);
//! - [`super::memory::MemoryStore`] — objects in memory, with versions and compare-and-swap, for unit tests;
//! - [`super::fault::FaultyStore`] — wraps any backend and injects delays, hangs, errors and corruption
//!   per key and byte range, and counts calls.
//!
//! The contract every implementation keeps (checked by [`super::conformance`] over all of them):
//!
//! - Keys are `/`-separated relative paths. Listing a prefix lists the objects *below* it as a directory
//!   (`tags` lists `tags/a/b`, never `tagsx/c`), recursively, sorted by key; the empty prefix lists all.
//! - A missing object is [`StoreError::NotFound`] for reads; [`StoreBackend::head`] says `None` and
//!   [`StoreBackend::delete`] succeeds.
//! - [`StoreBackend::get_range`] returns exactly the bytes asked for, or an error: a range past the end of
//!   the object is [`StoreError::Malformed`] (a table of contents that points past its blob is a corrupt
//!   store), an empty range of an existing object is empty. It returns within `deadline` — connecting,
//!   waiting for the first byte, reading the body and any retries included — or fails with
//!   [`StoreError::Timeout`]; whatever the server does, the caller gets control back at the deadline.
//! - A conditional put ([`PutMode::Create`], [`PutMode::IfMatch`]) that loses its race is
//!   [`StoreError::Precondition`] and changes nothing; if-match on an absent object is a lost race too.
//! - Calls block; a backend must not be called from inside an async runtime.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;

use super::StoreError;

/// A version of an object, for compare-and-swap (an S3 `ETag` or version id; the memory store's counter).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Version {
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// What a listing or [`StoreBackend::head`] says about an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
    /// Last modified, Unix seconds.
    pub modified: i64,
    pub version: Version,
}

/// How a put treats an object already at the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutMode {
    /// Replace whatever is there.
    Overwrite,
    /// Write only if nothing is there, else [`StoreError::Precondition`].
    Create,
    /// Write only if the object is still at this version, else [`StoreError::Precondition`].
    IfMatch(Version),
}

/// Blocking access to one bucket or directory. See the module documentation for the contract.
pub trait StoreBackend: Send + Sync {
    /// The URL shown in errors.
    fn url(&self) -> &str;

    /// A whole object and its version.
    fn get(&self, key: &str) -> Result<(Bytes, Version), StoreError>;

    /// `range` of an object, within `deadline` (total: connect, first byte, body, retries).
    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
    ) -> Result<Bytes, StoreError>;

    /// `range` of an object handed to `sink` in order, in pieces as it arrives, within `deadline` (the
    /// whole read, as [`StoreBackend::get_range`]). Pieces handed over before an error stay handed over:
    /// a caller that acts on a prefix must check it itself. The default reads the whole range, then hands
    /// it over at once.
    fn get_range_streamed(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), StoreError> {
        let b = self.get_range(key, range, deadline)?;
        sink(&b);
        Ok(())
    }

    /// A whole object handed to `sink` in order, in pieces as it arrives, within the backend's deadline
    /// (as [`StoreBackend::get`]). Pieces handed over before an error stay handed over: a caller that
    /// acts on a prefix must check it itself. The default reads the whole object, then hands it over.
    fn get_streamed(&self, key: &str, sink: &mut dyn FnMut(&[u8])) -> Result<(), StoreError> {
        sink(&self.get(key)?.0);
        Ok(())
    }

    /// An object's metadata, or `None` if it does not exist.
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError>;

    /// Writes an object; returns its new version.
    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<Version, StoreError>;

    /// Uploads a local file to `key` (overwriting). Backends that can stream override this.
    fn put_file(&self, key: &str, file: &Path) -> Result<(), StoreError> {
        let data = std::fs::read(file).map_err(|e| StoreError::io(file, e))?;
        self.put(key, Bytes::from(data), PutMode::Overwrite)
            .map(|_| ())
    }

    /// The objects below `prefix` (recursive), sorted by key.
    fn list_info(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError>;

    /// The keys below `prefix` (recursive), sorted.
    fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        Ok(self.list_info(prefix)?.into_iter().map(|m| m.key).collect())
    }

    /// Deletes an object; deleting an absent one succeeds.
    fn delete(&self, key: &str) -> Result<(), StoreError>;
}

/// True when `key` is below `prefix` in the sense of [`StoreBackend::list_info`].
pub(crate) fn below(prefix: &str, key: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || key
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Checks `range` against an object of `size` bytes.
pub(crate) fn check_range(key: &str, range: &Range<u64>, size: u64) -> Result<(), StoreError> {
    if range.start > range.end || range.end > size {
        return Err(StoreError::Malformed {
            key: key.to_string(),
            why: format!(
                "byte range {}..{} is outside the object ({size} bytes)",
                range.start, range.end
            ),
        });
    }
    Ok(())
}

/// The error of a read that missed its deadline.
pub(crate) fn timeout(url: &str, key: &str, after: Duration) -> StoreError {
    StoreError::Timeout {
        url: url.to_string(),
        key: key.to_string(),
        after,
    }
}
