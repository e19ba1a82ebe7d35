//! What the layers below show to a layer being built or collapsed: overlay's merged view of stored
//! layers, read from their metadata images alone.
//!
//! A path is looked up layer by layer, top first: an entry ends the search, a whiteout or a non-directory
//! on the way hides everything below, an opaque directory hides what lies below it in lower layers. The
//! layer being built may itself make directories opaque ([`LowerView::hide_below`]): nothing below them
//! shows. The OCI importer uses the view to fill in implied directories, resolve hard links to lower files
//! and drop whiteouts that hide nothing; `flatten` uses it to drop the same whiteouts.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use strata_registry::digest::Digest;
use strata_registry::model::BlobRef;
use strata_registry::store::Store;

use crate::erofs::{ErofsImage, Inode};
use crate::error::BuildError;
use crate::tree::{Meta, OPAQUE_XATTR, S_IFDIR, S_IFMT};

/// What the layers below show to the layer being built: their metadata images, top first (each loaded
/// once per import and shared), seen through the directories the layer being built makes opaque.
pub(crate) struct LowerView {
    pub(crate) layers: Vec<Arc<LowerLayer>>,
    /// Directories the layer being built makes opaque: nothing below them shows.
    opaque_here: Mutex<HashSet<Vec<u8>>>,
}

/// One lower layer: its metadata image and its blobs (device `i + 1` is `blobs[i]`).
pub(crate) struct LowerLayer {
    pub(crate) image: ErofsImage,
    pub(crate) blobs: Vec<BlobRef>,
}

pub(crate) fn erofs(e: crate::erofs::ErofsError) -> BuildError {
    BuildError::LowerMetadata(e)
}

/// What one layer says about a path.
enum Seen {
    /// An entry (not a whiteout).
    Found(Inode),
    /// Hidden here: a whiteout at the path or a non-directory on the way to it, or not in an opaque
    /// directory of this layer.
    Stop,
    /// Not in this layer: look below.
    Absent,
}

impl LowerView {
    /// The view of `layers` (top first).
    pub(crate) fn new(layers: Vec<Arc<LowerLayer>>) -> LowerView {
        LowerView {
            layers,
            opaque_here: Mutex::new(HashSet::new()),
        }
    }

    /// Notes that the layer being built makes `dir` opaque.
    pub(crate) fn hide_below(&self, dir: &[u8]) {
        let mut set = self
            .opaque_here
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        set.insert(dir.to_vec());
    }

    /// True if a proper ancestor of `path` is opaque in the layer being built.
    fn hidden(&self, path: &[u8]) -> bool {
        let set = self
            .opaque_here
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut ancestors = path.iter().enumerate().filter(|(_, &b)| b == b'/');
        !path.is_empty()
            && (set.contains(&path[..0]) || ancestors.any(|(i, _)| set.contains(&path[..i])))
    }

    /// Loads one layer's metadata image and blob list.
    pub(crate) fn load(store: &Store, layer: &Digest) -> Result<Arc<LowerLayer>, BuildError> {
        let desc = store.get_layer(layer)?;
        let image = ErofsImage::parse(store.get_meta(&desc.meta.digest)?).map_err(erofs)?;
        Ok(Arc::new(LowerLayer {
            image,
            blobs: desc.blobs,
        }))
    }

    /// What the merged lower layers show at `path`, if anything, and which layer (index) shows it.
    pub(crate) fn lookup_at(&self, path: &[u8]) -> Result<Option<(usize, Inode)>, BuildError> {
        if self.hidden(path) {
            return Ok(None);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            match seen(&layer.image, path).map_err(erofs)? {
                Seen::Found(inode) => return Ok(Some((i, inode))),
                Seen::Stop => return Ok(None),
                Seen::Absent => {}
            }
        }
        Ok(None)
    }

    fn lookup(&self, path: &[u8]) -> Result<Option<Inode>, BuildError> {
        Ok(self.lookup_at(path)?.map(|(_, i)| i))
    }

    /// True if the merged lower layers show an entry at `path` (a whiteout there hides something).
    /// An unreadable lower layer counts as showing it: the whiteout is kept.
    pub(crate) fn shows(&self, path: &[u8]) -> bool {
        self.lookup(path).map_or(true, |i| i.is_some())
    }

    /// The metadata of the directory at `path` in the merged lower layers, if it is a directory there.
    pub(crate) fn dir_meta(&self, path: &[u8]) -> Result<Option<Meta>, BuildError> {
        let dir = self.lookup(path)?.filter(|i| i.mode & S_IFMT == S_IFDIR);
        Ok(dir.as_ref().map(meta_of))
    }
}

/// An inode's metadata as a source entry carries it (overlay's opaque marker left out).
pub(crate) fn meta_of(i: &Inode) -> Meta {
    let mut meta = crate::erofs::meta_of(i);
    meta.xattrs.retain(|(k, _)| k != OPAQUE_XATTR);
    meta.xattrs.sort();
    meta
}

fn seen(image: &ErofsImage, path: &[u8]) -> Result<Seen, crate::erofs::ErofsError> {
    let mut cur = image.inode(image.root_nid())?;
    for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
        // A file or symlink on the way: nothing below shows anything here.
        if cur.mode & S_IFMT != S_IFDIR {
            return Ok(Seen::Stop);
        }
        let found = image.read_dir(&cur)?.into_iter().find(|e| e.name == comp);
        let Some(e) = found else {
            return Ok(if cur.is_opaque() {
                Seen::Stop
            } else {
                Seen::Absent
            });
        };
        cur = image.inode(e.nid)?;
        if cur.is_whiteout() {
            return Ok(Seen::Stop);
        }
    }
    Ok(Seen::Found(cur))
}
