//! What kind of failure an error is: the one classification that both the control API's HTTP status
//! and `strata`'s exit code are derived from.
//!
//! The node's core (`strata_fs::control::daemon::DaemonError::kind`) says what kind each of its errors
//! is; the HTTP adapter (`strata_fs::control::api`) answers with [`ErrorKind::status`] and the kind itself
//! (`"kind"` in the JSON body), and the CLI exits with [`ErrorKind::exit_code`] — so a failure inside
//! stratad gets the same exit code as the same failure found by the CLI locally, and a status can never
//! disagree with its kind. The core depends on this crate, never on the HTTP adapter.

use serde::{Deserialize, Serialize};

/// What kind of failure an error reply reports (its `"kind"`): what a client decides on without parsing
/// the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// A bad request: an invalid sandbox id, image reference or body.
    Invalid,
    /// No such sandbox, image, tag or route.
    NotFound,
    /// The request collides with the node's state: a sandbox id in use, a trace already running.
    Conflict,
    /// The store holds data that fails its digest or does not parse.
    Corrupt,
    /// The store is unreachable or failing.
    Store,
    /// The sandbox's state forbids it: an id with a stopped sandbox's leftovers (resume or discard
    /// them), a resume of another image, processes still in a rootfs, a sandbox not running.
    Sandbox,
    /// Anything else (a mount the kernel refused, a local disk error).
    Internal,
}

impl ErrorKind {
    /// Every kind (for tables and tests).
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Invalid,
        ErrorKind::NotFound,
        ErrorKind::Conflict,
        ErrorKind::Corrupt,
        ErrorKind::Store,
        ErrorKind::Sandbox,
        ErrorKind::Internal,
    ];

    /// The HTTP status the control API answers a failure of this kind with.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::Invalid => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict | ErrorKind::Sandbox => 409,
            // The store (the daemon's upstream) failed or answered with bad bytes.
            ErrorKind::Corrupt | ErrorKind::Store => 502,
            ErrorKind::Internal => 500,
        }
    }

    /// `strata`'s exit code for a failure of this kind (the table in `docs/CLI.md`).
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorKind::Invalid => 2,
            ErrorKind::NotFound => 3,
            ErrorKind::Conflict => 4,
            ErrorKind::Corrupt => 5,
            ErrorKind::Store => 6,
            ErrorKind::Sandbox => 7,
            ErrorKind::Internal => 1,
        }
    }

    /// The kind of an error reply without one (from a daemon older than `kind`): from its status.
    pub fn from_status(status: u16) -> ErrorKind {
        match status {
            400 => ErrorKind::Invalid,
            404 => ErrorKind::NotFound,
            409 => ErrorKind::Conflict,
            502 => ErrorKind::Store,
            _ => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_exit_codes_come_from_the_kind_and_read_back() {
        let mut codes: Vec<i32> = ErrorKind::ALL.iter().map(|k| k.exit_code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), ErrorKind::ALL.len(), "one exit code per kind");
        for k in ErrorKind::ALL {
            let back = ErrorKind::from_status(k.status());
            // A status shared by two kinds reads back as one of them, with the same status.
            assert_eq!(back.status(), k.status(), "{k:?}");
            let json = serde_json::to_value(k).expect("serialize");
            assert_eq!(serde_json::from_value::<ErrorKind>(json).expect("parse"), k);
        }
    }
}
