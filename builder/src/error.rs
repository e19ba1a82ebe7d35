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
    Tar(#[source] Box<TarError>),
    #[error("tar entry {path:?} is unsafe: {why}")]
    UnsafeEntry { path: String, why: &'static str },
    #[error("{0}")]
    Tree(#[from] TreeError),
    #[error("{path}: {why}")]
    Unsupported { path: String, why: String },
    /// The tree does not fit the EROFS format (a limit it has), or is inconsistent.
    #[error("EROFS writer: {0}")]
    Erofs(#[from] crate::erofs::WriteError),
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
    #[error("reading a lower layer's metadata: {0}")]
    LowerMetadata(#[source] crate::erofs::ErofsError),
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

impl From<TarError> for BuildError {
    fn from(e: TarError) -> BuildError {
        BuildError::Tar(Box::new(e))
    }
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

/// Where in a tar stream something was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TarPlace {
    /// Before the first member's header was read, at this byte.
    Start { at: u64 },
    /// After the member `last`, at this byte.
    After { last: String, at: u64 },
    /// In the member `path`, whose header starts at this byte.
    Entry { path: String, at: u64 },
}

impl std::fmt::Display for TarPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TarPlace::Start { at } => write!(f, "before the first entry, at byte {at}"),
            TarPlace::After { last, at } => write!(f, "after entry {last:?}, at byte {at}"),
            TarPlace::Entry { path, at } => write!(f, "entry {path:?} (at byte {at})"),
        }
    }
}

/// What was wrong with a tar stream (a layer's source, an imported layer), and where. A failure to
/// read keeps its `io::Error` as its source; the message also says it, so that the error reads whole
/// on its own.
#[derive(Debug, thiserror::Error)]
pub enum TarError {
    /// The stream's first bytes (its compression's magic) could not be read.
    #[error("reading the stream: {0}")]
    Read(#[source] std::io::Error),
    #[error("starting zstd: {0}")]
    Zstd(#[source] std::io::Error),
    /// A header, an extension or a member's data could not be read where the stream says it is.
    #[error("{place}: {source}")]
    Stream {
        place: TarPlace,
        #[source]
        source: std::io::Error,
    },
    /// The bytes read are not a valid tar there: a bad extension record, a missing end.
    #[error("{place}: {why}")]
    Malformed { place: TarPlace, why: String },
    /// Bytes after the end-of-archive block could not be read.
    #[error("after the end-of-archive block at byte {at}: {source}")]
    Trailing {
        at: u64,
        #[source]
        source: std::io::Error,
    },
    /// A member's data stopped before its size.
    #[error("{path}: file data ends early ({source}): truncated stream?")]
    Truncated {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A member's data was shorter than its header says.
    #[error("{path}: expected {expected} bytes, got {got} (truncated input or file changed while building)")]
    Short {
        path: String,
        expected: u64,
        got: u64,
    },
    /// A member's data could not be read while it was stored.
    #[error("{path}: {source}")]
    Data {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A hard link an imported layer cannot have.
    #[error("entry {path:?}: hard link to {target:?}, {why}")]
    HardLink {
        path: String,
        target: String,
        why: &'static str,
    },
    /// A hard link to a file of the layers below whose chunks could not be looked up.
    #[error("entry {path:?}: hard link to {target:?}, whose chunks: {source}")]
    LinkedChunks {
        path: String,
        target: String,
        #[source]
        source: crate::chunkmap::ChunkLookupError,
    },
    /// An imported layer's uncompressed content could not be read to its end.
    #[error("{layer}: {source}")]
    Layer {
        layer: String,
        #[source]
        source: std::io::Error,
    },
}
