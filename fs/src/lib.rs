//! strata's node daemon library.
//!
//! Kernel mode, as `docs/DESIGN.md` describes it: the [`daemon`] fetches each layer's metadata to
//! local disk and mounts it as kernel EROFS ([`mount`]) whose devices are files of the daemon's own FUSE
//! blob server ([`blobfs`], over strata's own FUSE request loop, [`fuse`]) — on kernels before 6.12 through
//! loop devices of those files ([`loops`], [`loopdev`]; [`modes`] probes the kernel and picks how); a
//! read of a blob file is
//! served from the chunk [`cache`] on a FUSE worker, or, when it must fetch, by the [`fetch`]er on the
//! blob's own threads ([`slowread`]) under a deadline — verified either way. Each sandbox gets an overlay
//! of its image's layers ([`sandboxes`]); [`layers`] hands out the layer mounts alone, under named holds
//! (what a containerd snapshotter uses). The node's state ([`state`]) is on disk, so a successor
//! serving the same FUSE connection — or a daemon restarted after the node died — knows every sandbox.
//! [`warming`] fetches an image's prefetch plan in the background when it is mounted. [`api`] is the
//! control socket, [`metrics`] what it exports (with [`attribution`]: bytes fetched per sandbox,
//! charged to the sandbox whose process read); [`teardown`] stops and removes many sandboxes in one
//! request; [`process`] is what an image's config starts in a sandbox, as the API reports it. [`vm`]
//! serves the same layers to microVMs as drive files (metadata through [`metafile`]) with a scratch
//! drive for their changes. [`treefs`] serves a layer's whole tree
//! over FUSE from its metadata (the `fuse` mount mode), for kernels whose EROFS cannot mount it.

pub mod api;
pub mod attribution;
pub mod blobfs;
pub mod cache;
pub mod daemon;
pub mod fetch;
pub mod fuse;
pub mod kernelcheck;
pub mod layers;
pub mod loopdev;
pub mod loops;
pub mod metadir;
pub mod metafile;
pub mod metrics;
pub mod modes;
pub mod mount;
pub mod pagecache;
pub mod perms;
pub mod process;
pub mod sandboxes;
pub mod size;
pub mod slowread;
pub mod state;
pub mod teardown;
#[cfg(test)]
mod testkit;
pub mod treefs;
pub mod trees;
pub mod vm;
pub mod warming;
