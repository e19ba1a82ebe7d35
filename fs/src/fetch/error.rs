//! Why a chunk could not be served: one error type for the fetcher, its readers and the metrics.

use std::sync::Arc;
use std::time::Duration;

use strata_registry::digest::Digest;
use strata_registry::store::StoreError;

use crate::cache::CacheError;

/// Why a chunk could not be served. Shared by every reader waiting on one fetch, hence `Clone` (the
/// store's and the cache's errors are kept whole, behind an `Arc`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    #[error("blob {blob}: no data within {after:?}")]
    Timeout { blob: Digest, after: Duration },
    #[error("blob {blob}: store failed: {source}")]
    Store {
        blob: Digest,
        #[source]
        source: Arc<StoreError>,
    },
    #[error("blob {blob}: chunk {chunk} failed verification twice")]
    Corrupt { blob: Digest, chunk: Digest },
    #[error("blob {blob}: chunk index {index} out of range")]
    NoChunk { blob: Digest, index: usize },
    #[error("blob {blob}: the store's answer for {range:?} ended early")]
    ShortAnswer {
        blob: Digest,
        range: std::ops::Range<u64>,
    },
    #[error("blob {blob}: nothing was fetched")]
    NothingFetched { blob: Digest },
    #[error("blob {blob} is not served on this node")]
    NotServed { blob: Digest },
    #[error(transparent)]
    Cache(Arc<CacheError>),
    #[error("chunk {index}: reading it from its blob's view file: {source}")]
    Home {
        index: usize,
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl FetchError {
    /// A short kind for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            FetchError::Timeout { .. } => "timeout",
            FetchError::Store { .. } => "store",
            FetchError::Corrupt { .. } => "corrupt",
            FetchError::NoChunk { .. }
            | FetchError::ShortAnswer { .. }
            | FetchError::NothingFetched { .. }
            | FetchError::NotServed { .. } => "invalid",
            FetchError::Cache(_) | FetchError::Home { .. } => "cache",
        }
    }
}
