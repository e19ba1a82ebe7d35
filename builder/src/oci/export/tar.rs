//! One strata layer as an OCI layer tar.
//!
//! The layer's EROFS metadata is walked depth first, each directory before its entries, entries in name
//! order (as EROFS stores them). Every entry becomes a tar entry with its mode, owner, times (a PAX
//! `mtime` record keeps nanoseconds), extended attributes (PAX `SCHILY.xattr.*`) and, for a device, its
//! numbers; names and link targets of any length or encoding go through GNU long-name records. A file's
//! bytes are read chunk by chunk from its blobs ([`BlobReader`]: each chunk verified), so a file is never
//! in memory whole. Inodes a layer shares between names (hard links) are written once, then as links to
//! the first name.
//!
//! **Whiteouts**, overlay's way, become the OCI way: a whiteout (a 0:0 character device) `D/NAME` is the
//! empty file `D/.wh.NAME`; an opaque directory (`trusted.overlay.opaque=y`) is the directory, without
//! that attribute, followed by the empty file `D/.wh..wh..opq`. Other `trusted.overlay.*` attributes are
//! overlay's own and are dropped. Sockets have no tar form and are left out (with a warning), as GNU
//! tar does. The root directory itself is not an entry (a layer tar names paths
//! below it).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use strata_registry::blobread::BlobReader;
use strata_registry::model::LayerDescriptor;
use strata_registry::store::{Store, StoreError};
use tar::{EntryType, Header};

use super::ExportError;
use crate::erofs::format::{dev_major, dev_minor};
use crate::erofs::reader::{ErofsImage, Inode};
use crate::erofs::ChunkLoc;

const S_IFMT: u32 = 0o170000;

/// Where a layer's bytes come from.
pub struct LayerSource<'s> {
    pub store: &'s Store,
    pub desc: &'s LayerDescriptor,
    pub image: &'s ErofsImage,
    /// Bytes of file data written so far (for progress displays).
    pub progress: &'s AtomicU64,
}

/// Counts of what a layer tar holds.
#[derive(Clone, Copy, Debug, Default)]
pub struct TarStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub file_bytes: u64,
    /// Sockets left out (tar has no form of them).
    pub skipped_sockets: u64,
}

/// What file readers share: the layer and its open blobs.
struct Ctx<'s> {
    src: &'s LayerSource<'s>,
    readers: RefCell<HashMap<u16, BlobReader<'s>>>,
    /// A store error met while tar was pulling file bytes (tar only passes `io::Error` on).
    failed: RefCell<Option<StoreError>>,
}

struct Walker<'s, W: Write> {
    ctx: Ctx<'s>,
    tar: tar::Builder<W>,
    /// The first name written of each inode with more than one name.
    links: HashMap<u64, PathBuf>,
    stats: TarStats,
}

/// Writes the layer as a tar stream into `out` (which is returned, finished).
pub fn write_layer<W: Write>(src: &LayerSource<'_>, out: W) -> Result<(W, TarStats), ExportError> {
    let mut w = Walker {
        ctx: Ctx {
            src,
            readers: RefCell::new(HashMap::new()),
            failed: RefCell::new(None),
        },
        tar: tar::Builder::new(out),
        links: HashMap::new(),
        stats: TarStats::default(),
    };
    let root = src.image.inode(src.image.root_nid())?;
    w.children(&root, Path::new(""))?;
    w.tar
        .finish()
        .map_err(|e| ExportError::io("layer tar", e))?;
    let stats = w.stats;
    let out = w
        .tar
        .into_inner()
        .map_err(|e| ExportError::io("layer tar", e))?;
    Ok((out, stats))
}

impl<'s, W: Write> Walker<'s, W> {
    fn children(&mut self, dir: &Inode, path: &Path) -> Result<(), ExportError> {
        if dir.is_opaque() {
            self.marker(dir, &path.join(".wh..wh..opq"))?;
        }
        let image = self.ctx.src.image;
        for e in image.read_dir(dir)? {
            let inode = image.inode(e.nid)?;
            let p = path.join(std::ffi::OsStr::from_bytes(&e.name));
            self.entry(&inode, &p)?;
            if inode.is_dir() {
                self.children(&inode, &p)?;
            }
        }
        Ok(())
    }

    /// An empty regular file with `like`'s owner and time: a whiteout or an opaque marker.
    fn marker(&mut self, like: &Inode, path: &Path) -> Result<(), ExportError> {
        let mut h = self.header(like, EntryType::Regular, 0o644)?;
        h.set_size(0);
        self.stats.whiteouts += 1;
        self.append(&mut h, path, io::empty())
    }

    fn header(&mut self, inode: &Inode, kind: EntryType, perm: u32) -> Result<Header, ExportError> {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(perm);
        h.set_uid(u64::from(inode.uid));
        h.set_gid(u64::from(inode.gid));
        h.set_mtime(inode.mtime.max(0) as u64);
        let mut pax: Vec<(String, Vec<u8>)> = Vec::new();
        if inode.mtime_nsec != 0 || inode.mtime < 0 {
            pax.push((
                "mtime".into(),
                format!("{}.{:09}", inode.mtime, inode.mtime_nsec).into_bytes(),
            ));
        }
        for (k, v) in &inode.xattrs {
            if k.starts_with(b"trusted.overlay.") {
                continue;
            }
            pax.push((
                format!("SCHILY.xattr.{}", String::from_utf8_lossy(k)),
                v.clone(),
            ));
        }
        if !pax.is_empty() {
            self.tar
                .append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .map_err(|e| ExportError::io("layer tar", e))?;
        }
        Ok(h)
    }

    fn append(&mut self, h: &mut Header, path: &Path, data: impl Read) -> Result<(), ExportError> {
        self.stats.entries += 1;
        let r = self.tar.append_data(h, path, data);
        if let Some(e) = self.ctx.failed.borrow_mut().take() {
            return Err(e.into());
        }
        r.map_err(|e| ExportError::io(format!("layer tar entry {}", path.display()), e))
    }

    fn entry(&mut self, inode: &Inode, path: &Path) -> Result<(), ExportError> {
        if inode.is_whiteout() {
            let name = path.file_name().map(|n| n.as_bytes()).unwrap_or_default();
            let mut wh = b".wh.".to_vec();
            wh.extend_from_slice(name);
            let p = path.with_file_name(std::ffi::OsStr::from_bytes(&wh));
            return self.marker(inode, &p);
        }
        let perm = inode.mode & 0o7777;
        let fmt = inode.mode & S_IFMT;
        if fmt != 0o040000 && inode.nlink > 1 {
            if let Some(first) = self.links.get(&inode.nid).cloned() {
                let mut h = self.header(inode, EntryType::Link, perm)?;
                h.set_size(0);
                self.stats.entries += 1;
                return self
                    .tar
                    .append_link(&mut h, path, &first)
                    .map_err(|e| ExportError::io(format!("layer tar link {}", path.display()), e));
            }
            self.links.insert(inode.nid, path.to_path_buf());
        }
        match fmt {
            0o040000 => {
                let mut h = self.header(inode, EntryType::Directory, perm)?;
                h.set_size(0);
                self.append(&mut h, path, io::empty())
            }
            0o100000 => {
                let mut h = self.header(inode, EntryType::Regular, perm)?;
                h.set_size(inode.size);
                self.stats.file_bytes += inode.size;
                self.stats.entries += 1;
                let data = file_data(&self.ctx, inode)?;
                let r = self.tar.append_data(&mut h, path, data);
                if let Some(e) = self.ctx.failed.borrow_mut().take() {
                    return Err(e.into());
                }
                r.map_err(|e| ExportError::io(format!("layer tar entry {}", path.display()), e))
            }
            0o120000 => {
                let target = self.ctx.src.image.data(inode)?;
                let mut h = self.header(inode, EntryType::Symlink, perm)?;
                h.set_size(0);
                self.stats.entries += 1;
                self.tar
                    .append_link(&mut h, path, std::ffi::OsStr::from_bytes(&target))
                    .map_err(|e| {
                        ExportError::io(format!("layer tar symlink {}", path.display()), e)
                    })
            }
            0o020000 | 0o060000 | 0o010000 => {
                let kind = match fmt {
                    0o020000 => EntryType::Char,
                    0o060000 => EntryType::Block,
                    _ => EntryType::Fifo,
                };
                let mut h = self.header(inode, kind, perm)?;
                h.set_size(0);
                let dev = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
                h.set_device_major(dev(dev_major(inode.rdev)))
                    .and_then(|_| h.set_device_minor(dev(dev_minor(inode.rdev))))
                    .map_err(|e| ExportError::io(format!("device {}", path.display()), e))?;
                self.append(&mut h, path, io::empty())
            }
            0o140000 => {
                // As GNU tar does: a socket is something a running program made; tar has no form of it.
                tracing::warn!(path = %path.display(), "a socket has no tar form: left out");
                self.stats.skipped_sockets += 1;
                Ok(())
            }
            other => Err(ExportError::Unsupported(format!(
                "{}: file type {other:o} has no tar form",
                path.display()
            ))),
        }
    }
}

/// A regular file's bytes as a reader.
fn file_data<'a, 's>(ctx: &'a Ctx<'s>, inode: &Inode) -> Result<FileData<'a, 's>, ExportError> {
    let (locs, flat) = match ctx.src.image.chunks(inode) {
        Ok(locs) => (locs, Vec::new()),
        Err(_) => (Vec::new(), ctx.src.image.data(inode)?),
    };
    Ok(FileData {
        ctx,
        locs: locs.into_iter(),
        chunk: 1u64 << inode.chunk_bits,
        left: inode.size,
        buf: flat,
        pos: 0,
    })
}

impl Ctx<'_> {
    fn chunk(&self, loc: ChunkLoc) -> Result<Vec<u8>, StoreError> {
        let mut readers = self.readers.borrow_mut();
        let reader = match readers.entry(loc.device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let blob = (loc.device as usize)
                    .checked_sub(1)
                    .and_then(|i| self.src.desc.blobs.get(i))
                    .ok_or_else(|| StoreError::Malformed {
                        key: format!("layer metadata {}", self.src.desc.meta.digest),
                        why: format!("a chunk on unknown device {}", loc.device),
                    })?;
                e.insert(BlobReader::open(self.src.store, blob)?)
            }
        };
        reader.chunk_at_block(u64::from(loc.block))
    }
}

/// A file's bytes, one chunk at a time (holes as zeros).
struct FileData<'a, 's> {
    ctx: &'a Ctx<'s>,
    locs: std::vec::IntoIter<Option<ChunkLoc>>,
    chunk: u64,
    left: u64,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for FileData<'_, '_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.buf.len() {
            let Some(loc) = self.locs.next() else {
                return Ok(0);
            };
            let n = self.chunk.min(self.left) as usize;
            self.left -= n as u64;
            self.buf = match loc {
                None => vec![0; n],
                Some(loc) => match self.ctx.chunk(loc) {
                    Ok(mut b) => {
                        b.resize(n, 0);
                        b
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        *self.ctx.failed.borrow_mut() = Some(e);
                        return Err(io::Error::other(msg));
                    }
                },
            };
            self.pos = 0;
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        self.ctx.src.progress.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}
