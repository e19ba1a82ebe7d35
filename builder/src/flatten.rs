//! Flattening: consecutive stored layers collapsed into one, with no file data read or written.
//!
//! An image that grew through many snapshots (`pack_diff`) stacks many thin layers; each costs a mount and
//! an overlay lookup step. [`flatten`] reads the layers' metadata (bottom first), applies each onto the
//! tree the previous ones built with overlay's rules, and seals the result as one layer:
//!
//! - a whiteout (0:0 character device) replaces whatever the layers below placed at its path;
//! - an opaque directory (`trusted.overlay.opaque=y`) drops what the layers below placed inside it;
//! - a directory over a directory merges (the upper metadata wins), anything else replaces.
//!
//! When the result is the bottom of its image whiteouts and opaque markers are dropped once applied:
//! nothing lies beneath them. Otherwise they stay where they still hide an entry of the layers below the
//! flattened range (a whiteout that hides nothing there is dropped: overlay lists it as a broken entry
//! when its directory exists in the new layer only); for the same reason a directory that replaces a
//! non-directory of the range (or merges into an opaque one) is itself marked opaque.
//!
//! Files keep their chunks: each chunk index of a layer's EROFS metadata names a device (a blob) and a
//! block, which the blob's table of contents turns into the chunk digest; the file enters the new tree as
//! [`EntryKind::StoredFile`] and the builder resolves the digests to the flattened layers' blobs (they are
//! the build's parents). Files inline in the metadata are copied as bytes. The layers must share one chunk
//! size. Cost: the layers' metadata and tables of contents, never their data.

use std::collections::HashMap;
use std::sync::Arc;

use strata_registry::digest::Digest;
use strata_registry::model::{BlobRef, LayerDescriptor};
use strata_registry::store::Store;

use crate::build::{build_with, BuildOptions, BuiltLayer};
use crate::chunkmap::{ChunkDigests, ChunkLookupError};
use crate::erofs::{ErofsImage, Layout};
use crate::error::BuildError;
use crate::lower::LowerView;
use crate::source::{join, Entry, EntryKind, EntrySink, Existing, FileSource};
use crate::tree::{set_xattr, Meta, OPAQUE_XATTR, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK};
use crate::tree::{S_IFMT, S_IFREG, S_IFSOCK};

/// One layer being applied: its metadata and its blobs (device `i + 1` is `blobs[i]`).
struct Source {
    digest: Digest,
    image: ErofsImage,
    blobs: Vec<BlobRef>,
}

impl Source {
    fn fail(&self, why: impl Into<String>) -> BuildError {
        BuildError::Layer {
            layer: self.digest.to_string(),
            why: why.into(),
        }
    }
}

/// Collapses `layers` (bottom first) into one new layer that will sit on `below` (the image's layers
/// under the range, bottom first; empty when the result is the image's bottom layer, which then holds
/// no whiteouts). `opts.parents` is replaced by the layers (top first). A whiteout of the range that
/// hides nothing in `below` is dropped once applied: overlay would show it as a broken entry in a
/// directory that only the new layer has.
pub fn flatten(
    store: &Store,
    below: &[Digest],
    layers: &[Digest],
    mut opts: BuildOptions,
) -> Result<BuiltLayer, BuildError> {
    if layers.is_empty() {
        return Err(BuildError::Option("no layers to flatten".into()));
    }
    let mut descs: Vec<(Digest, LayerDescriptor)> = Vec::new();
    for d in layers {
        descs.push((*d, store.get_layer(d)?));
    }
    let chunk_size = descs[0].1.chunk_size;
    if let Some((d, l)) = descs.iter().find(|(_, l)| l.chunk_size != chunk_size) {
        return Err(BuildError::Layer {
            layer: d.to_string(),
            why: format!(
                "chunk size {} differs from {chunk_size} of the layers below: such layers cannot be \
                 flattened without re-chunking their data",
                l.chunk_size
            ),
        });
    }
    opts.chunk_size = chunk_size;
    opts.parents = layers.iter().rev().copied().collect();
    opts.patch_meta = false;
    opts.bottom = below.is_empty();
    if !opts.bottom {
        let layers = below
            .iter()
            .rev()
            .map(|d| LowerView::load(store, d))
            .collect::<Result<Vec<_>, _>>()?;
        let lower = LowerView::new(layers);
        opts.keep_whiteout = Some(Arc::new(move |path: &[u8]| lower.shows(path)));
    }
    let mut sources = Vec::new();
    for (digest, desc) in descs {
        let meta = store.get_meta(&desc.meta.digest)?;
        let image = ErofsImage::parse(meta).map_err(|e| BuildError::Layer {
            layer: digest.to_string(),
            why: format!("metadata: {e}"),
        })?;
        sources.push(Source {
            digest,
            image,
            blobs: desc.blobs,
        });
    }
    let mut chunks = ChunkDigests::new(store);
    let bottom = opts.bottom;
    build_with(store, opts, |sink| {
        for (i, s) in sources.iter().enumerate() {
            apply(s, &sources[..i], bottom, &mut chunks, sink)?;
        }
        Ok(())
    })
}

/// Applies one layer onto what `sink` holds (see the module documentation). `below` are the layers of
/// the range already applied (for an opaque root, whose lower names must be hidden one by one).
fn apply(
    s: &Source,
    below: &[Source],
    bottom: bool,
    chunks: &mut ChunkDigests,
    sink: &mut dyn EntrySink,
) -> Result<(), BuildError> {
    let err = |e: crate::erofs::ErofsError| s.fail(e.to_string());
    let root = s.image.root_nid();
    let mut stack: Vec<(Vec<u8>, u64)> = vec![(Vec::new(), root)];
    let mut links: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut dirs = std::collections::HashSet::new();
    while let Some((path, nid)) = stack.pop() {
        let inode = s.image.inode(nid).map_err(err)?;
        let mut meta = crate::erofs::meta_of(&inode);
        let kind = match inode.mode & S_IFMT {
            S_IFDIR => {
                strata_erofs::enter_dir(&mut dirs, nid).map_err(err)?;
                let opaque = inode.is_opaque();
                match sink.existing(&path) {
                    Existing::Dir { .. } if opaque => {
                        if path.is_empty() {
                            hide_root_names(below, &meta, sink)?;
                        } else {
                            let e = entry(path.clone(), meta.clone(), EntryKind::Whiteout);
                            sink.add(e, None)?;
                        }
                    }
                    Existing::Dir { opaque: true } => {
                        set_xattr(&mut meta.xattrs, OPAQUE_XATTR, b"y")
                    }
                    Existing::Other if !bottom => set_xattr(&mut meta.xattrs, OPAQUE_XATTR, b"y"),
                    _ => {}
                }
                sink.add(entry(path.clone(), meta, EntryKind::Dir), None)?;
                let mut children = s.image.read_dir(&inode).map_err(err)?;
                children.sort_by(|a, b| b.name.cmp(&a.name));
                for c in children {
                    stack.push((join(&path, &c.name), c.nid));
                }
                continue;
            }
            _ if inode.nlink > 1 && links.contains_key(&nid) => {
                let target = links.get(&nid).cloned().unwrap_or_default();
                sink.add(entry(path, meta, EntryKind::HardLink(target)), None)?;
                continue;
            }
            S_IFREG => {
                if inode.nlink > 1 {
                    links.insert(nid, path.clone());
                }
                if inode.layout == Layout::ChunkBased {
                    let chunks =
                        chunks
                            .file_chunks(&s.image, &s.blobs, &inode)
                            .map_err(|e| match e {
                                ChunkLookupError::Store(e) => BuildError::Store(e),
                                e => s.fail(format!("inode {}: {e}", inode.nid)),
                            })?;
                    let k = EntryKind::StoredFile {
                        size: inode.size,
                        chunks,
                    };
                    sink.add(entry(path, meta, k), None)?;
                } else {
                    let bytes = s.image.data(&inode).map_err(err)?;
                    let k = EntryKind::File { size: inode.size };
                    let mut r: &[u8] = &bytes;
                    sink.add(entry(path, meta, k), Some(FileSource::Stream(&mut r)))?;
                }
                continue;
            }
            S_IFLNK => EntryKind::Symlink(s.image.data(&inode).map_err(err)?),
            S_IFCHR if inode.rdev == 0 => EntryKind::Whiteout,
            S_IFCHR => EntryKind::CharDev { rdev: inode.rdev },
            S_IFBLK => EntryKind::BlockDev { rdev: inode.rdev },
            S_IFIFO => EntryKind::Fifo,
            S_IFSOCK => EntryKind::Socket,
            other => {
                return Err(s.fail(format!(
                    "inode {nid} at {:?} has unknown type {other:o}",
                    String::from_utf8_lossy(&path)
                )))
            }
        };
        if inode.nlink > 1 {
            links.insert(nid, path.clone());
        }
        sink.add(entry(path, meta, kind), None)?;
    }
    Ok(())
}

fn entry(path: Vec<u8>, meta: Meta, kind: EntryKind) -> Entry {
    Entry { path, meta, kind }
}

/// An opaque root: every name the layers below placed at the root is whited out (whiteouts of names
/// that only lie beneath the range are harmless: the root stays opaque there).
fn hide_root_names(
    below: &[Source],
    meta: &Meta,
    sink: &mut dyn EntrySink,
) -> Result<(), BuildError> {
    let mut names = std::collections::BTreeSet::new();
    for b in below {
        let root = b
            .image
            .inode(b.image.root_nid())
            .map_err(|e| b.fail(e.to_string()))?;
        for e in b.image.read_dir(&root).map_err(|e| b.fail(e.to_string()))? {
            names.insert(e.name);
        }
    }
    for n in names {
        sink.add(entry(n, meta.clone(), EntryKind::Whiteout), None)?;
    }
    Ok(())
}
