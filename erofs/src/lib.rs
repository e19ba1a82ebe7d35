//! strata's EROFS on-disk format and reader, shared by the builder (which writes images) and the node
//! daemon (which mounts them, or serves their trees itself).
//!
//! A layer's metadata is a real EROFS image that Linux mounts with one `device=` per blob; file data never
//! lives in it (except the bytes of tiny files). No Rust crate writes or reads chunk indexes with a device
//! table, so the format is ours:
//!
//! * [`format`] — the on-disk constants and fixed-layout structures (kernel names, compile-time size
//!   checks), device-number and checksum helpers;
//! * [`reader`] — a defensive reader ([`ErofsImage`]) of what strata writes plus compact inodes, plain and
//!   inline flat layouts, 4-byte chunk maps and shared xattrs: every offset is bounds-checked, malformed
//!   input is an [`ErofsError`], never a panic;
//! * [`device`] — device table entries ([`DeviceSlot`]), chunk locations ([`ChunkLoc`]) and sealing a
//!   superblock (content-derived uuid, checksum);
//! * [`repoint`] — rewriting an image's device slots and chunk indexes (compaction);
//! * [`features`] — the oldest kernel an image needs, so a node refuses a layer its kernel cannot mount.
//!
//! The writer stays in `strata-builder` (`strata_builder::erofs::write_image`): it lays out the builder's
//! own tree type. This crate depends on nothing of strata's; the dependency direction is
//! `builder → erofs` and `fs → erofs`. The image layout the writer produces is described in
//! `docs/FORMAT.md` and the writer's module documentation.

pub mod device;
pub mod features;
pub mod format;
pub mod fuzzing;
pub mod reader;
pub mod repoint;

pub use device::{ChunkLoc, DeviceSlot};
pub use features::{check_kernel, required_kernel, FeatureError, KernelVersion};
pub use reader::{enter_dir, DirEntry, ErofsError, ErofsImage, Inode, Layout};
