//! stratad's control API as its clients see it: what kind of failure an error reply reports
//! ([`ErrorKind`], from which the daemon's HTTP status and `strata`'s exit code both derive) and the
//! small client that speaks the protocol ([`Client`]), and the shapes clients read from its replies
//! ([`Process`]).
//!
//! This crate is the contract between the daemon and everything that calls it — the CLI, the
//! containerd snapshotter, tests — and depends on nothing of the daemon: the lean `strata` binary
//! (`strata_cli`) links it without the node daemon's library, the store clients or the builder, so a
//! node agent's `strata mount` starts as a small program does. The protocol itself (HTTP/1.1 and
//! JSON on a Unix socket, one request per connection) is documented in `docs/API.md`; the server is
//! `strata_fs::control::api`.

mod client;
mod kind;
mod process;

pub use client::{Client, ClientError};
pub use kind::ErrorKind;
pub use process::{Process, User};
