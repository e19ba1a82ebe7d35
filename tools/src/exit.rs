//! Exit codes: the one place that maps errors to process exit status.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success |
//! | 1 | any other failure |
//! | 2 | bad usage (unknown flag, invalid reference or option), or credentials a registry refuses or wants |
//! | 3 | not found (image, tag, layer, path in an image, source) |
//! | 4 | conflict (a tag changed concurrently, or already names another image and --force was not given) |
//! | 5 | corrupt or malformed data (digest mismatch, bad metadata, bad tar, a broken OCI source, a tag that cannot be followed) |
//! | 6 | store unreachable or failing |
//! | 7 | sandbox state: leftovers of a stopped sandbox, a resume of another image, processes in a rootfs, a VM still running |
//!
//! Errors stratad reports through its control API carry a kind (`strata_api::ErrorKind`),
//! whose exit code (`ErrorKind::exit_code`, beside the HTTP status it derives too) is the code the same
//! failure gets locally.

use strata_builder::oci::export::ExportError;
use strata_builder::oci::OciError;
use strata_builder::BuildError;

use crate::catalog::BrokenTags;
use strata_registry::gc::GcError;
use strata_registry::index::IndexError;
use strata_registry::model::ModelError;
use strata_registry::store::StoreError;

/// A not-found condition outside the store (a path inside an image, say).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotFound(pub String);

pub use strata_cli::SandboxState;

/// A usage error found after argument parsing.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// A store error's code: its kind's, as the daemon's control API reports the same error.
fn store_code(e: &StoreError) -> i32 {
    e.kind().exit_code()
}

fn oci_code(e: &OciError) -> i32 {
    match e {
        OciError::Usage(_) | OciError::Auth { .. } => 2,
        OciError::NotFound(_) => 3,
        OciError::MissingBlob { .. }
        | OciError::DigestMismatch { .. }
        | OciError::SizeMismatch { .. }
        | OciError::Malformed(_) => 5,
        OciError::Http { status: 404, .. } => 3,
        OciError::Unsupported(_)
        | OciError::Timeout { .. }
        | OciError::Io { .. }
        | OciError::Http { .. }
        | OciError::Transport { .. } => 1,
    }
}

/// The exit status for an error.
pub fn code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        // A collection or listing stopped by a broken tag: the data is damaged, whatever the object.
        if matches!(
            cause.downcast_ref::<GcError>(),
            Some(GcError::Broken { .. })
        ) || cause.downcast_ref::<BrokenTags>().is_some()
        {
            return 5;
        }
        if let Some(s) = cause.downcast_ref::<StoreError>() {
            return store_code(s);
        }
        // Transparent: the store error is not a cause of its own in the chain.
        if let Some(GcError::Store(s)) = cause.downcast_ref::<GcError>() {
            return store_code(s);
        }
        if let Some(IndexError::Store(s)) = cause.downcast_ref::<IndexError>() {
            return store_code(s);
        }
        if let Some(b) = cause.downcast_ref::<BuildError>() {
            return match b {
                BuildError::Store(s) | BuildError::Index(IndexError::Store(s)) => store_code(s),
                BuildError::MissingSource { .. } => 3,
                BuildError::Option(_) => 2,
                // A tree error is a tar's: a member below a symlink or file, a hard link to nothing.
                BuildError::Tar(_) | BuildError::UnsafeEntry { .. } | BuildError::Tree(_) => 5,
                BuildError::Oci(o) => oci_code(o),
                _ => 1,
            };
        }
        if let Some(o) = cause.downcast_ref::<OciError>() {
            return oci_code(o);
        }
        if let Some(x) = cause.downcast_ref::<ExportError>() {
            return match x {
                ExportError::Store(s) => store_code(s),
                ExportError::Erofs(_) => 5,
                ExportError::Io { .. } | ExportError::Unsupported(_) => 1,
            };
        }
        // The per-sandbox commands' errors and the control API client's.
        if let Some(c) = strata_cli::code_of(cause) {
            return c;
        }
        if let Some(m) = cause.downcast_ref::<ModelError>() {
            return m.kind().exit_code();
        }
        if cause.downcast_ref::<Usage>().is_some() {
            return 2;
        }
        if cause.downcast_ref::<NotFound>().is_some() {
            return 3;
        }
    }
    1
}

/// An error as one line: its causes joined by ": ", each said once. A cause whose text an earlier
/// part already holds is left out — an error that writes its source into its own message (`{path}:
/// {source}`) would otherwise repeat it ("…: No such file or directory (os error 2): No such file or
/// directory (os error 2)").
pub fn message(e: &anyhow::Error) -> String {
    strata_cli::message(e.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let inner = anyhow::Error::new(io).context(format!(
            "cannot reach stratad at /x: {}",
            std::io::Error::from(std::io::ErrorKind::NotFound)
        ));
        let e = inner.context("mounting sb1");
        assert_eq!(
            message(&e),
            "mounting sb1: cannot reach stratad at /x: entity not found"
        );
    }

    #[test]
    fn store_failures_exit_with_their_kinds_code() {
        use strata_registry::model::{JsonObject, Manifest, TagName};
        let bad_tag = TagName::parse("Bad Tag").map(|_| ()).unwrap_err();
        assert_eq!(code(&anyhow::Error::new(bad_tag)), 2);
        let bad_json = Manifest::from_bytes(b"[").map(|_| ()).unwrap_err();
        let stored = StoreError::Model(bad_json);
        assert_eq!(stored.kind(), strata_api::ErrorKind::Corrupt);
        assert_eq!(code(&anyhow::Error::new(stored).context("reading x")), 5);
        let gone = GcError::Store(StoreError::NotFound("blobs/x".into()));
        assert_eq!(code(&anyhow::Error::new(gone)), 3);
    }
}
