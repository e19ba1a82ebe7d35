//! Why a tree cannot be written as an EROFS image.
//!
//! Two kinds of refusal, kept apart so that callers can tell them by type rather than by message: a
//! limit of the format the whole image meets ([`WriteError`]'s own variants: chunk size, devices,
//! blocks, inodes), and a fault of one node ([`WriteError::Node`]: the node's path in the tree, then
//! [`NodeFault`] — a name, an xattr, a size or a chunk location the format cannot hold, or a tree the
//! writer was handed inconsistent). The messages are what `strata build` prints after "EROFS writer:".

use strata_registry::digest::Digest;

/// The tree does not fit the EROFS format, or is not a tree the writer can lay out.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("chunk size bits {0} outside 12..=24")]
    ChunkBits(u8),
    #[error("{0} devices: at most 65535")]
    Devices(usize),
    #[error("image needs {0} blocks: more than 2^32")]
    Blocks(u64),
    #[error("image does not fit in memory")]
    Memory,
    #[error("the root (node 0) is not a directory")]
    RootNotDir,
    #[error("more than 2^32 inodes")]
    Inodes,
    #[error("{path}: {fault}")]
    Node { path: String, fault: NodeFault },
}

/// What is wrong with one node of the tree.
#[derive(Debug, thiserror::Error)]
pub enum NodeFault {
    #[error("invalid entry name {0:?}")]
    Name(String),
    #[error("refers to node {0}, which does not exist")]
    Dangling(usize),
    #[error("directory (node {0}) is reachable by more than one name")]
    DirTwice(usize),
    #[error("xattr {0:?} appears twice")]
    XattrTwice(String),
    #[error(
        "xattr {0:?}: unsupported name prefix (EROFS stores user., trusted., security., \
         system.posix_acl_access and system.posix_acl_default)"
    )]
    XattrPrefix(String),
    #[error("xattr {0:?}: name longer than 255 bytes after its prefix")]
    XattrName(String),
    #[error("xattr {name:?}: value of {len} bytes exceeds 65535")]
    XattrValue { name: String, len: usize },
    #[error("xattrs take {0} bytes: too many for one inode")]
    Xattrs(usize),
    #[error("mtime nanoseconds {0} out of range")]
    Mtime(u32),
    #[error("size {size} but {inline} inline bytes")]
    Inline { size: u64, inline: usize },
    #[error("size {size} needs {want} chunks of 2^{bits} bytes but the tree holds {held}")]
    ChunkCount {
        size: u64,
        want: u64,
        bits: u8,
        held: usize,
    },
    #[error("device number {major}:{minor} does not fit 12:20 bits")]
    DeviceNumber { major: u64, minor: u64 },
    #[error("chunk {k} ({digest}) has no location")]
    NoLocation { k: u64, digest: Digest },
    #[error("chunk {k} resolved to device {device}, but the table has devices 1..={devices}")]
    NoDevice { k: u64, device: u16, devices: usize },
    #[error(
        "chunk {k} at device {device} block {block} ({len} bytes) lies outside the device's \
         {blocks} blocks"
    )]
    OutsideDevice {
        k: u64,
        device: u16,
        block: u32,
        len: u64,
        blocks: u32,
    },
    #[error("directory data is {got} bytes, planned {planned}")]
    DirSize { got: usize, planned: u64 },
}

impl NodeFault {
    /// This fault at `path`.
    pub fn at(self, path: String) -> WriteError {
        WriteError::Node { path, fault: self }
    }
}
