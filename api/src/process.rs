//! The process a sandbox's image starts, as stratad reports it (`"process"` in a sandbox's JSON):
//! arguments, environment, working directory and the user as numbers — what an OCI runtime config's
//! `process` holds. stratad resolves it (`strata_fs::process::image_process`); clients start it.

use serde::{Deserialize, Serialize};

/// Numeric user and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

/// What to start: as in an OCI runtime config's `process`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub user: User,
}
