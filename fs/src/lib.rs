//! strata's node daemon library, in two planes.
//!
//! **The data plane** serves bytes: the daemon's own FUSE request loop ([`fuse`]); the blob server
//! ([`blobfs`]) whose files are kernel EROFS's devices, and the tree server ([`treefs`]) that serves a
//! layer's whole tree from its metadata (the `fuse` mount mode, for kernels whose EROFS cannot mount
//! it); a read is served from the chunk [`cache`] on a FUSE worker or, when it must fetch, by the
//! [`fetch`]er on the blob's own threads ([`slowread`]) under a deadline — verified either way, its
//! pages kept out of the page cache where the kernel keeps its own ([`pagecache`]). In `fanotify` mode
//! ([`fanotify`]) EROFS reads local view files instead and the kernel asks before reading a range the
//! daemon may not have filled yet. Misses are charged
//! to the sandbox whose process read ([`attribution`]); [`metrics`] counts; [`warming`] fetches an
//! image's prefetch plan in the background. [`mount`] and [`loopdev`] are the kernel calls that
//! mount EROFS and bind loop devices; [`metadir`], [`metafile`], [`size`], [`process`] and
//! [`kernelcheck`] are small helpers.
//!
//! **The control plane** ([`control`]) decides what is mounted where: the node's sandboxes and their
//! overlays, layer holds, mount modes, microVM drives, the node's state on disk and the control socket
//! — see its documentation. It calls down into the data plane; nothing in the data plane calls up
//! (`control::tests::the_data_plane_never_calls_up` checks the sources). Failures are classified
//! once (`strata_api::ErrorKind`): the API's HTTP status and `strata`'s exit code both derive from the kind.
//!
//! `docs/DESIGN.md` describes the whole; the control plane's modules are also re-exported here, where
//! the crates that use this one have always found them.

pub mod attribution;
pub mod blobfs;
pub mod cache;
pub mod control;
pub mod deadline;
pub mod fanotify;
pub mod fetch;
pub mod fuse;
pub mod groups;
pub mod kernelcheck;
pub mod loopdev;
pub mod metadir;
pub mod metafile;
pub mod metrics;
pub mod mount;
pub mod pagecache;
pub mod process;
pub mod residentcode;
pub mod size;
pub mod slowread;
#[cfg(test)]
mod testkit;
pub mod treefs;
pub mod warming;
pub mod workers;

// The control plane's modules, where the crates above this one have always found them.
pub use control::{
    api, daemon, layers, loops, modes, perms, sandboxes, state, teardown, trees, vm,
};
