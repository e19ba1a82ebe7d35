//! Sources of layer content.
//!
//! A source walks its input once, in order, and hands each entry to an [`EntrySink`]. Regular files come
//! either with a path the builder's workers read in parallel ([`FileSource::Path`], a directory source) or
//! with their bytes as a stream the sink must consume before the source moves on ([`FileSource::Stream`],
//! a tar source). Paths are relative to the layer root, already checked: no `..`, no absolute paths, no NUL,
//! every component 1..=255 bytes. A hostile input is an error naming the entry, never a partial layer.

use std::io::Read;
use std::path::PathBuf;

use strata_registry::digest::Digest;

use crate::error::BuildError;
use crate::tree::{Meta, NodeKind, Tree, TreeError};

pub mod dir;
pub mod exclude;
pub mod tar;
pub mod upper;

/// One entry of a source.
#[derive(Debug)]
pub struct Entry {
    /// Relative path inside the layer, `/`-separated; empty for the root directory.
    pub path: Vec<u8>,
    pub meta: Meta,
    pub kind: EntryKind,
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    /// A regular file of `size` bytes; its data comes as the sink's `data` argument.
    File {
        size: u64,
    },
    Symlink(Vec<u8>),
    /// A hard link to an earlier entry of the same source (relative path); from an OCI layer
    /// ([`tar::read_tar_verified`]) possibly to a file of the layers below, which the sink resolves.
    HardLink(Vec<u8>),
    CharDev {
        rdev: u64,
    },
    BlockDev {
        rdev: u64,
    },
    Fifo,
    Socket,
    /// A regular file whose chunks are already stored in one of the build's parent layers (a layer being
    /// flattened); `None` is a hole. No data accompanies it.
    StoredFile {
        size: u64,
        chunks: Vec<Option<Digest>>,
    },
    /// An OCI whiteout (`.wh.NAME`): `path` names the hidden entry. Becomes an overlay whiteout.
    Whiteout,
    /// An OCI opaque marker (`.wh..wh..opq`): `path` names the directory made opaque.
    Opaque,
}

impl Entry {
    /// Puts into `tree` an entry that needs no data: a node by itself (a directory, symlink, device,
    /// FIFO, socket, or whiteout: a `0:0` character device) is inserted, a hard link linked, an opaque
    /// marker set on its directory. Regular files and stored files come back (`Some`): their data is the
    /// sink's care.
    pub fn place(self, tree: &mut Tree) -> Result<Option<DataEntry>, TreeError> {
        let Entry { path, meta, kind } = self;
        let node = match kind {
            EntryKind::Dir => NodeKind::Dir(std::collections::BTreeMap::new()),
            EntryKind::Symlink(t) => NodeKind::Symlink(t),
            EntryKind::CharDev { rdev } => NodeKind::CharDev { rdev },
            EntryKind::BlockDev { rdev } => NodeKind::BlockDev { rdev },
            EntryKind::Fifo => NodeKind::Fifo,
            EntryKind::Socket => NodeKind::Socket,
            EntryKind::Whiteout => NodeKind::CharDev { rdev: 0 },
            EntryKind::HardLink(target) => {
                tree.link(&path, &target)?;
                return Ok(None);
            }
            EntryKind::Opaque => {
                tree.set_opaque(&path)?;
                return Ok(None);
            }
            EntryKind::File { size } => return Ok(Some(DataEntry::File { path, meta, size })),
            EntryKind::StoredFile { size, chunks } => {
                return Ok(Some(DataEntry::Stored {
                    path,
                    meta,
                    size,
                    chunks,
                }))
            }
        };
        tree.insert(&path, meta, node)?;
        Ok(None)
    }
}

/// An entry [`Entry::place`] leaves to its sink: one whose data the sink brings.
pub enum DataEntry {
    /// A regular file of `size` bytes; its data comes as the sink's `data` argument.
    File {
        path: Vec<u8>,
        meta: Meta,
        size: u64,
    },
    /// A file whose chunks a parent layer stores (see [`EntryKind::StoredFile`]).
    Stored {
        path: Vec<u8>,
        meta: Meta,
        size: u64,
        chunks: Vec<Option<Digest>>,
    },
}

/// Where a regular file's bytes come from.
pub enum FileSource<'a> {
    /// A file on disk, read by the builder's workers (in parallel, by offset). `sparse` says the file has
    /// holes worth looking for (`SEEK_DATA`/`SEEK_HOLE`).
    Path { path: PathBuf, sparse: bool },
    /// Exactly `size` bytes to be read now, before the source goes on.
    Stream(&'a mut dyn Read),
}

/// Receives a source's entries.
pub trait EntrySink {
    /// One entry; `data` is `Some` exactly for [`EntryKind::File`].
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError>;

    /// What the entries given so far placed at `path`, for sources that apply layers onto one another
    /// (flattening). A sink that keeps no tree answers [`Existing::Absent`].
    fn existing(&self, _path: &[u8]) -> Existing {
        Existing::Absent
    }
}

/// What stands at a path of the tree a sink has built so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    Absent,
    Dir {
        opaque: bool,
    },
    /// Anything but a directory (a whiteout too).
    Other,
}

/// Joins a relative path and a name with `/`.
pub fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(dir.len() + 1 + name.len());
    p.extend_from_slice(dir);
    if !dir.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}
