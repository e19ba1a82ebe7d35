//! The builder's errors. Each names what was wrong and where; none leaves anything referenced in a store.

use std::path::PathBuf;

use strata_registry::store::StoreError;

use crate::tree::TreeError;

/// Everything that can stop a build.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("source {path} does not exist")]
    MissingSource { path: PathBuf },
    #[error("tar stream: {0}")]
    Tar(String),
    #[error("tar entry {path:?} is unsafe: {why}")]
    UnsafeEntry { path: String, why: &'static str },
    #[error("{0}")]
    Tree(#[from] TreeError),
    #[error("{path}: {why}")]
    Unsupported { path: String, why: String },
    #[error("EROFS writer: {0}")]
    Erofs(String),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("invalid option: {0}")]
    Option(String),
    #[error("layer {layer}: {why}")]
    Layer { layer: String, why: String },
    /// Transparent: the message is not repeated by the error's chain.
    #[error(transparent)]
    Oci(#[from] crate::oci::OciError),
    #[error("layer metadata: {0}")]
    Metadata(#[from] crate::erofs::ErofsError),
    #[error("store-wide index: {0}")]
    Index(#[from] strata_registry::index::IndexError),
    #[error("blob {blob}, which this build deduplicated against, was condemned or deleted by gc meanwhile; nothing was written: build again (the index cache now skips it)")]
    BlobGone {
        blob: strata_registry::digest::Digest,
    },
    #[error("{what} needs about {need} bytes in {dir}, which has {free} free: nothing was stored for it")]
    NoSpace {
        what: String,
        dir: PathBuf,
        need: u64,
        free: u64,
    },
}

impl BuildError {
    /// An I/O error at `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> BuildError {
        BuildError::Io {
            path: path.into(),
            source,
        }
    }
}
