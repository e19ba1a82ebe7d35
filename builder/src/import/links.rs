//! Hard links from a layer to a file of the layers below.
//!
//! An OCI layer may hold a hard link whose target is not in the layer but below it: extracted, the new
//! name links to the existing inode. Overlay cannot share an inode across layers, so the new name becomes
//! a copy of the file that references its stored data: a chunked file is emitted as
//! [`EntryKind::StoredFile`] with the chunk digests of the lower file (read from its EROFS chunk indexes
//! and its blobs' tables of contents; the build's parents are the lower layers, so no data moves), a file
//! inline in the metadata as its bytes, a symlink, device or fifo as itself. Further links to the same
//! target in the layer link to that copy. What differs from an extracted image: the copy and the lower
//! file are two inodes (`st_nlink` and inode numbers show it), as under any overlay-based runtime.

use std::collections::HashMap;

use strata_registry::store::Store;

use crate::chunkmap::{ChunkDigests, ChunkLookupError};
use crate::erofs::Layout;
use crate::error::{BuildError, TarError};
use crate::lower::{erofs, meta_of, LowerView};
use crate::source::{Entry, EntryKind};
use crate::tree::{S_IFBLK, S_IFCHR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG, S_IFSOCK};

/// Resolves links to lower files for one layer build.
pub(super) struct LinksBelow<'s> {
    chunks: ChunkDigests<'s>,
    /// Lower target → the path of this layer that holds its copy.
    copies: HashMap<Vec<u8>, Vec<u8>>,
}

fn show(p: &[u8]) -> String {
    String::from_utf8_lossy(p).into_owned()
}

impl<'s> LinksBelow<'s> {
    pub(super) fn new(store: &'s Store) -> LinksBelow<'s> {
        LinksBelow {
            chunks: ChunkDigests::new(store),
            copies: HashMap::new(),
        }
    }

    /// The entry (and, for a file inline in the metadata, its bytes) that stands for the hard link
    /// `path` → `target` when `target` is a file of the layers below.
    pub(super) fn entry(
        &mut self,
        lower: &LowerView,
        path: &[u8],
        target: &[u8],
    ) -> Result<(Entry, Option<Vec<u8>>), BuildError> {
        let fail = |why: &'static str| {
            BuildError::from(TarError::HardLink {
                path: show(path),
                target: show(target),
                why,
            })
        };
        if let Some(first) = self.copies.get(target) {
            let entry = Entry {
                path: path.to_vec(),
                meta: crate::tree::Meta::implied_dir(),
                kind: EntryKind::HardLink(first.clone()),
            };
            return Ok((entry, None));
        }
        let (li, inode) = lower.lookup_at(target)?.ok_or_else(|| {
            fail("which is neither an earlier entry nor a file of the layers below")
        })?;
        let layer = &lower.layers[li];
        let mut data = None;
        let kind = match inode.mode & S_IFMT {
            S_IFREG if inode.layout == Layout::ChunkBased => {
                let chunks = self
                    .chunks
                    .file_chunks(&layer.image, &layer.blobs, &inode)
                    .map_err(|e| match e {
                        ChunkLookupError::Store(s) => BuildError::Store(s),
                        source => BuildError::from(TarError::LinkedChunks {
                            path: show(path),
                            target: show(target),
                            source,
                        }),
                    })?;
                EntryKind::StoredFile {
                    size: inode.size,
                    chunks,
                }
            }
            S_IFREG => {
                data = Some(layer.image.data(&inode).map_err(erofs)?);
                EntryKind::File { size: inode.size }
            }
            S_IFLNK => EntryKind::Symlink(layer.image.data(&inode).map_err(erofs)?),
            S_IFCHR => EntryKind::CharDev { rdev: inode.rdev },
            S_IFBLK => EntryKind::BlockDev { rdev: inode.rdev },
            S_IFIFO => EntryKind::Fifo,
            S_IFSOCK => EntryKind::Socket,
            _ => return Err(fail("a directory of the layers below")),
        };
        self.copies.insert(target.to_vec(), path.to_vec());
        let entry = Entry {
            path: path.to_vec(),
            meta: meta_of(&inode),
            kind,
        };
        Ok((entry, data))
    }
}
