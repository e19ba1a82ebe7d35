//! strata's node daemon library.
//!
//! Kernel mode, as `../shared/DESIGN.md` describes it: the [`daemon`] fetches each layer's metadata to
//! local disk and mounts it as kernel EROFS ([`mount`]) whose devices are files of the daemon's own FUSE
//! blob server ([`blobfs`]); a read of a blob file is served from the chunk [`cache`] or by the
//! [`fetch`]er, verified. Each sandbox gets an overlay of its image's layers. [`warming`] fetches an
//! image's prefetch plan in the background when it is mounted. [`api`] is the control socket, [`metrics`]
//! what it exports.

pub mod api;
pub mod blobfs;
pub mod cache;
pub mod daemon;
pub mod fetch;
pub mod metadir;
pub mod metrics;
pub mod mount;
pub mod perms;
pub mod size;
pub mod warming;
