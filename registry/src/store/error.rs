//! A store's errors, and the one mapping from each to its kind.
//!
//! [`StoreError::kind`] is where a store failure gets its [`ErrorKind`]: `strata` exits with the
//! kind's code (`ErrorKind::exit_code`) and stratad answers with the kind and its HTTP status
//! (`ErrorKind::status`), so the same failure reads the same from the CLI and from the control API.
//! The match names every variant: a new one cannot be added without deciding its kind.

use std::path::{Path, PathBuf};
use std::time::Duration;

use strata_api::ErrorKind;

use crate::digest::Digest;
use crate::model::ModelError;

/// Errors of a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found in store: {0}")]
    NotFound(String),
    /// The backend failed: its client's error (object_store's, kept as the source without naming
    /// its type here) or what was wrong with its answer.
    #[error("{url}: {key}: {source}")]
    Backend {
        url: String,
        key: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{url}: {key}: no answer within {after:?}")]
    Timeout {
        url: String,
        key: String,
        after: Duration,
    },
    #[error("precondition failed writing {0}")]
    Precondition(String),
    #[error("{key} is corrupt in the store: expected {expected}, found {actual}")]
    Corrupt {
        key: String,
        expected: Digest,
        actual: Digest,
    },
    #[error("{key} is corrupt in the store: {why}")]
    Malformed { key: String, why: String },
    #[error("tag {tag} already names another image ({found}); pass --force to move it")]
    TagTaken { tag: String, found: String },
    #[error("tag {tag} was changed concurrently (expected {expected}, found {found}); nothing was changed")]
    TagConflict {
        tag: String,
        expected: String,
        found: String,
    },
    /// A tag write refused: an object its image reaches is gone (deleted by gc under a build or copy
    /// slower than gc's grace period, or an image untagged long ago).
    #[error("tag {tag} not set: {key}, which its image needs, was deleted by gc meanwhile; nothing was written: build or copy the image again")]
    Unreachable { tag: String, key: String },
    #[error(
        "store {url} does not exist (no directory {path}); the first build or import creates it"
    )]
    NoStore { url: String, path: PathBuf },
    /// An `s3://` store whose bucket does not exist (every request answers `NoSuchBucket`).
    #[error("store {url} does not exist (no bucket {bucket}); create the bucket first")]
    NoBucket { url: String, bucket: String },
    /// An S3 server that ignores a conditional-write header (found by [`conditional`]'s probe):
    /// nothing was written, since the write could not be made safely.
    #[error(
        "{url} ignores {feature}: tags cannot move safely there; nothing was written \
         (set STRATA_TAG_LOCK to a lock file all tag writers share: docs/STORES.md)"
    )]
    NoConditionalWrites { url: String, feature: &'static str },
    #[error("invalid store URL {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Model(#[from] ModelError),
}

impl StoreError {
    pub(crate) fn io(path: impl AsRef<Path>, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }

    /// What kind of failure this is: the one mapping behind `strata`'s exit code and the control
    /// API's kind and HTTP status (`ErrorKind::exit_code`, `ErrorKind::status`). Every variant is
    /// named, so a new one must be given its kind here.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::NotFound(_) | StoreError::NoStore { .. } | StoreError::NoBucket { .. } => {
                ErrorKind::NotFound
            }
            StoreError::Precondition(_)
            | StoreError::TagTaken { .. }
            | StoreError::TagConflict { .. }
            | StoreError::Unreachable { .. } => ErrorKind::Conflict,
            StoreError::Corrupt { .. } | StoreError::Malformed { .. } => ErrorKind::Corrupt,
            StoreError::Backend { .. }
            | StoreError::Timeout { .. }
            | StoreError::NoConditionalWrites { .. } => ErrorKind::Store,
            StoreError::BadUrl { .. } => ErrorKind::Invalid,
            // A local store's file system failed (a full disk, a permission): not the store's data.
            StoreError::Io { .. } => ErrorKind::Internal,
            StoreError::Model(m) => m.kind(),
        }
    }

    /// True when the object simply does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound(_))
    }

    /// True when the object is missing or damaged (absent, corrupt, malformed), as opposed to a store
    /// that failed or did not answer — or a reference a user wrote that does not parse.
    pub fn is_damaged(&self) -> bool {
        match self {
            StoreError::NotFound(_) | StoreError::Corrupt { .. } | StoreError::Malformed { .. } => {
                true
            }
            StoreError::Model(m) => m.kind() == ErrorKind::Corrupt,
            _ => false,
        }
    }

    /// True when the store did not answer in time.
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{JsonObject, Manifest, Reference};

    fn code(e: StoreError) -> (i32, u16) {
        let k = e.kind();
        (k.exit_code(), k.status())
    }

    #[test]
    fn user_input_is_invalid_and_stored_data_corrupt() {
        let bad_ref = Reference::parse("UPPER:case").map(|_| ()).unwrap_err();
        assert_eq!(code(StoreError::Model(bad_ref)), (2, 400));
        let bad_json = Manifest::from_bytes(b"{").map(|_| ()).unwrap_err();
        assert!(
            !StoreError::Model(Reference::parse("UPPER:case").map(|_| ()).unwrap_err())
                .is_damaged()
        );
        assert!(
            StoreError::Model(Manifest::from_bytes(b"{").map(|_| ()).unwrap_err()).is_damaged()
        );
        assert_eq!(code(StoreError::Model(bad_json)), (5, 502));
        let bad_url = StoreError::BadUrl {
            url: "x".into(),
            why: "no scheme".into(),
        };
        assert_eq!(code(bad_url), (2, 400));
    }

    #[test]
    fn each_failure_has_its_documented_code() {
        let d = Digest::of(b"x");
        let cases = [
            (StoreError::NotFound("k".into()), (3, 404)),
            (
                StoreError::NoBucket {
                    url: "s3://b".into(),
                    bucket: "b".into(),
                },
                (3, 404),
            ),
            (
                StoreError::Unreachable {
                    tag: "a:b".into(),
                    key: "blobs/x".into(),
                },
                (4, 409),
            ),
            (StoreError::Precondition("tags/a/b".into()), (4, 409)),
            (
                StoreError::Corrupt {
                    key: "k".into(),
                    expected: d,
                    actual: d,
                },
                (5, 502),
            ),
            (
                StoreError::Timeout {
                    url: "s3://b".into(),
                    key: "k".into(),
                    after: Duration::from_secs(1),
                },
                (6, 502),
            ),
            (
                StoreError::NoConditionalWrites {
                    url: "s3://b".into(),
                    feature: "If-Match",
                },
                (6, 502),
            ),
            (
                StoreError::io("/x", std::io::Error::from(std::io::ErrorKind::StorageFull)),
                (1, 500),
            ),
        ];
        for (e, want) in cases {
            let what = e.to_string();
            assert_eq!(code(e), want, "{what}");
        }
    }
}
