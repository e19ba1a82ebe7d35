//! The tree server: one layer's whole tree over FUSE, from its local EROFS metadata — the `fuse` mount
//! mode, for kernels whose EROFS cannot mount strata's layers (no multi-device EROFS before 5.16, no
//! EROFS at all in some builds) and for containers given only `/dev/fuse`.
//!
//! Metadata never waits on the network: `lookup`, `getattr`, `readdir`, `readlink`, `getxattr` and
//! `listxattr` are answered from the layer's EROFS image, held in memory and read with `strata-erofs`'s
//! reader. File data takes the blob server's path ([`crate::blobfs`]): a chunk-based file's chunk index
//! gives `(device id, block)`; the device is a blob of the layer's device table, served by the same
//! [`BlobTable`], chunk cache and [`Fetcher`]; the block is an address in the blob's uncompressed view. A
//! read whose chunks are all cached is answered on the FUSE worker; otherwise it goes to the slow-read
//! scheduler ([`crate::slowread`]: on the worker while two workers stay free, else on the blob's
//! threads) and is answered by the fetcher's deadline. Inline and tail-packed
//! (FLAT_INLINE) files, symlinks and device 0 chunks are read from the image.
//!
//! **Overlay on top.** Each layer is its own FUSE mount; a sandbox's overlay stacks them as lower
//! directories, exactly as it stacks kernel EROFS mounts. What overlayfs needs to see is served as the
//! image holds it: a whiteout is a 0:0 character device (the rdev goes out in the kernel's
//! `new_encode_dev` form), an opaque directory carries `trusted.overlay.opaque=y` as an xattr, and
//! directory entries carry their types.
//!
//! **Node ids survive the server.** A node id is the EROFS nid plus one, with the root swapped to the
//! FUSE root id 1 ([`node_of`]): a successor serving the same connection from the same image answers the
//! same ids, and directory offsets are indexes into the image's sorted entries, equally stable. Nothing
//! is handed out in order, so nothing need be persisted beyond the image itself.
//!
//! **Why our FUSE code and not `fuse-backend-rs`.** Nydus's `fuse-backend-rs` has a complete
//! passthrough-style request set, `FUSE_DEV_IOC_CLONE` multi-queue, and an fd handover for failover; its
//! `PassthroughFs`, though, serves a host directory, not an image, so we would write this tree server's
//! `FileSystem` impl either way. What it would cost: a second FUSE stack beside the blob server's (whose
//! survival rules — one shared descriptor, never a cloned one, no new `INIT`, replies from any thread so
//! a read waiting on the network holds no worker — are ours and are what survival relies on), its own
//! threading model in the read path the slow-read scheduler owns, and `vm-memory`/`vmm-sys-util` for a
//! handful of opcodes. What the tree mode needed from ours was four requests (`READLINK`, `GETXATTR`,
//! `LISTXATTR`, and a mount without `noexec` with `default_permissions`), about a hundred lines. So the
//! tree server extends `crate::fuse`; revisit if the mode grows writes or `READDIRPLUS`-heavy workloads
//! that need its breadth.

mod read;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::io::Errno;
use strata_erofs::format::{self as ef, new_encode_dev};
use strata_erofs::{ErofsError, ErofsImage, Inode, Layout};
use strata_registry::digest::Digest;

use crate::blobfs::{tree_errno, BlobTable, View, READS_PER_BLOB};
use crate::fetch::{BlobHandle, FetchError, Fetcher};
use crate::fuse::proto::{self, Attr};
use crate::fuse::session::{Entries, Filesystem, Options, Reply, Session, Stats};
use crate::fuse::Channel;
use crate::metrics::Metrics;
use crate::mount::MountError;
use crate::slowread::SlowReads;

/// Why the tree server could not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("layer metadata: {0}")]
    Erofs(#[from] ErofsError),
    #[error("{0}")]
    Fetch(#[from] FetchError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("device {device} of the layer names no blob this node serves")]
    NoBlob { device: u16 },
    #[error("nid {nid}: {layout:?} data is not served by the tree server")]
    Layout { nid: u64, layout: Layout },
    #[error("{0}")]
    Mount(#[from] MountError),
}

/// How to mount a layer's tree.
#[derive(Clone, Debug)]
pub struct TreeOptions {
    /// FUSE worker threads.
    pub threads: usize,
    /// Let every user reach the tree (its modes and owners decide); else only root.
    pub allow_other: bool,
}

impl Default for TreeOptions {
    fn default() -> TreeOptions {
        TreeOptions {
            threads: 4,
            allow_other: true,
        }
    }
}

/// The FUSE node id of EROFS node `nid` in an image whose root is `root`: `nid + 1`, with the root and
/// nid 0 swapped so that the root is FUSE's node 1. A bijection, and a pure function of the image.
pub fn node_of(root: u64, nid: u64) -> u64 {
    match nid {
        n if n == root => proto::ROOT_ID,
        0 => root + 1,
        n => n + 1,
    }
}

/// The nid of FUSE node `node` (the inverse of [`node_of`]).
pub fn nid_of(root: u64, node: u64) -> Option<u64> {
    match node {
        0 => None,
        proto::ROOT_ID => Some(root),
        n if n == root + 1 => Some(0),
        n => Some(n - 1),
    }
}

/// One layer's tree, served over FUSE.
pub struct TreeFs {
    image: Arc<ErofsImage>,
    /// The blob digest of each device table slot (slot *i* is device *i + 1*).
    devices: Vec<Option<Digest>>,
    view: Arc<View>,
    metrics: Arc<Metrics>,
    slow: SlowReads,
    /// Set once a walk of the image found no xattr in it (see [`TreeFs::getxattr`]).
    xattr_free: Arc<AtomicBool>,
    /// Decoded directories by nid ([`TreeFs::entries`]).
    dirs: Mutex<HashMap<u64, Arc<Entries>>>,
}

/// Directories whose decoded entries are kept (all are forgotten when one more comes: a walk of a tree
/// decodes each directory once while it lists and looks up in it, whatever the order).
const DIRS_KEPT: usize = 1024;

impl TreeFs {
    /// A server for `image`, whose blobs are (or will be, before their data is read) registered in
    /// `table`; data is read through `fetcher`, within its deadline.
    pub fn new(
        image: ErofsImage,
        table: Arc<BlobTable>,
        fetcher: Arc<Fetcher>,
        metrics: Arc<Metrics>,
    ) -> Result<TreeFs, TreeError> {
        let devices = image
            .devices()
            .iter()
            .map(|s| s.tag_hex().and_then(|h| Digest::from_hex(h).ok()))
            .collect();
        let m = metrics.clone();
        let slow = SlowReads::new(
            fetcher.workers().clone(),
            READS_PER_BLOB,
            fetcher.deadline,
            Box::new(move || m.error("timeout")),
        )
        .map_err(|source| TreeError::Io {
            path: PathBuf::from("strata-deadline thread"),
            source,
        })?;
        let image = Arc::new(image);
        let xattr_free = Arc::new(AtomicBool::new(false));
        let (img, free) = (image.clone(), xattr_free.clone());
        // In the background: the walk reads every inode of the layer, and until it is done xattrs are
        // simply asked for.
        let walk = move || match img.any_xattrs() {
            Ok(any) => free.store(!any, Ordering::Release),
            Err(e) => tracing::warn!(error = %e, "walking the layer for xattrs"),
        };
        fetcher.workers().run_or_here(walk);
        Ok(TreeFs {
            image,
            devices,
            view: Arc::new(View::new(table, fetcher)),
            metrics,
            slow,
            xattr_free,
            dirs: Mutex::default(),
        })
    }

    /// The entries of directory `dir` (node id, `DT_*` kind, name; sorted by name, without `.` and
    /// `..`), decoded once and kept: `READDIRPLUS` comes once per buffer of a listing (a directory of
    /// thousands of entries is dozens of requests) and `LOOKUP` once per name, and each decoded the
    /// whole directory.
    fn entries(&self, dir: &Inode) -> Result<Arc<Entries>, Errno> {
        let kept = |d: &MutexGuard<'_, HashMap<u64, Arc<Entries>>>| d.get(&dir.nid).cloned();
        if let Some(e) = kept(&self.dirs.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(e);
        }
        if !dir.is_dir() {
            return Err(Errno::NOTDIR);
        }
        let root = self.image.root_nid();
        let decoded = self.image.read_dir(dir).map_err(|e| self.errno(e.into()))?;
        let e: Arc<Entries> = Arc::new(
            decoded
                .into_iter()
                .map(|e| (node_of(root, e.nid), dt_of(e.file_type), e.name))
                .collect(),
        );
        let mut dirs = self.dirs.lock().unwrap_or_else(|p| p.into_inner());
        if dirs.len() >= DIRS_KEPT {
            dirs.clear();
        }
        dirs.insert(dir.nid, e.clone());
        Ok(e)
    }

    /// The image served.
    pub fn image(&self) -> &ErofsImage {
        &self.image
    }

    fn inode(&self, node: u64) -> Result<Inode, Errno> {
        let root = self.image.root_nid();
        let nid = nid_of(root, node).ok_or(Errno::NOENT)?;
        self.image.inode(nid).map_err(|e| self.errno(e.into()))
    }

    fn errno(&self, e: TreeError) -> Errno {
        tree_errno(&e, &self.metrics)
    }

    /// The served blob behind device `device` (1-based).
    fn blob(&self, device: u16) -> Result<Arc<BlobHandle>, TreeError> {
        let slot = usize::from(device).checked_sub(1);
        slot.and_then(|s| self.devices.get(s).copied().flatten())
            .and_then(|d| self.view.table.handle(&d))
            .ok_or(TreeError::NoBlob { device })
    }

    fn attr(&self, inode: &Inode) -> Attr {
        let node = node_of(self.image.root_nid(), inode.nid);
        let (secs, nsec) = (inode.mtime as u64, inode.mtime_nsec);
        Attr {
            ino: node,
            size: inode.size,
            blocks: inode.size.div_ceil(512),
            atime: secs,
            mtime: secs,
            ctime: secs,
            atimensec: nsec,
            mtimensec: nsec,
            ctimensec: nsec,
            mode: inode.mode,
            nlink: inode.nlink,
            uid: inode.uid,
            gid: inode.gid,
            rdev: new_encode_dev(inode.rdev).unwrap_or(0),
            blksize: 4096,
            flags: 0,
        }
    }
}

/// The `DT_*` type of an EROFS `FT_*` dirent type.
fn dt_of(ft: u8) -> u32 {
    match ft {
        ef::FT_REG_FILE => 8,
        ef::FT_DIR => 4,
        ef::FT_CHRDEV => 2,
        ef::FT_BLKDEV => 6,
        ef::FT_FIFO => 1,
        ef::FT_SOCK => 12,
        ef::FT_SYMLINK => 10,
        _ => 0,
    }
}

const S_IFMT: u32 = 0o170000;
const S_IFLNK: u32 = 0o120000;

impl Filesystem for TreeFs {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno> {
        let entries = self.entries(&self.inode(parent)?)?;
        // Entries are sorted bytewise (the writer's order, which the kernel's lookup relies on too).
        let at = entries
            .binary_search_by(|e| e.2.as_slice().cmp(name))
            .map_err(|_| Errno::NOENT)?;
        Ok(self.attr(&self.inode(entries[at].0)?))
    }

    fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        Ok(self.attr(&self.inode(ino)?))
    }

    fn open(&self, ino: u64, flags: u32) -> Result<u32, Errno> {
        let inode = self.inode(ino)?;
        if inode.is_dir() {
            return Err(Errno::ISDIR);
        }
        if flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
            return Err(Errno::ROFS);
        }
        // A layer never changes: the kernel may keep the file's pages across opens.
        Ok(proto::FOPEN_KEEP_CACHE)
    }

    fn read(&self, ino: u64, offset: u64, size: u32, reply: Reply) {
        match self.inode(ino) {
            Ok(inode) => self.read_file(&inode, offset, size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, ino: u64) -> Result<Arc<Entries>, Errno> {
        self.entries(&self.inode(ino)?)
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        let inode = self.inode(ino)?;
        if inode.mode & S_IFMT != S_IFLNK {
            return Err(Errno::INVAL);
        }
        self.image.data(&inode).map_err(|e| self.errno(e.into()))
    }

    /// `ENOSYS` once the layer is known to hold no xattr at all: the kernel then asks no more on this
    /// connection and answers `EOPNOTSUPP` itself (overlayfs takes that as "no xattr", as it takes
    /// `ENODATA`). Overlay asks for its own xattrs on every directory it looks up, so a layer without
    /// any saves a round trip per directory (1,636 of the 5,678 requests of a cold `import numpy,
    /// pandas` on the fat image: `benches/fuseops.py`).
    fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>, Errno> {
        if self.xattr_free.load(Ordering::Acquire) {
            return Err(Errno::NOSYS);
        }
        let inode = self.inode(ino)?;
        inode
            .xattrs
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
            .ok_or(Errno::NODATA)
    }

    fn listxattr(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        let inode = self.inode(ino)?;
        let mut out = Vec::new();
        for (k, _) in &inode.xattrs {
            out.extend_from_slice(k);
            out.push(0);
        }
        Ok(out)
    }
}

/// A layer's tree mounted through the tree server.
pub struct TreeMount {
    session: Session,
    target: PathBuf,
}

impl TreeMount {
    /// Where the tree is mounted.
    pub fn path(&self) -> &Path {
        &self.target
    }

    /// The FUSE connection (for the descriptor holder, so a successor can serve it).
    pub fn channel(&self) -> &Arc<Channel> {
        self.session.channel()
    }

    /// The session's counters (requests, resent, replayed from the journal).
    pub fn stats(&self) -> &Arc<Stats> {
        &self.session.stats
    }

    /// Stops answering: requests read from now on stay for a successor (a handover).
    pub fn stop(&self) {
        self.session.stop();
    }

    /// Unmounts the tree (`lazy`: detach now, even if busy) and waits for the workers.
    pub fn unmount(self, lazy: bool) -> Result<(), TreeError> {
        crate::mount::unmount(&self.target, lazy)?;
        self.session.join();
        Ok(())
    }
}

/// The tree server of the layer whose EROFS metadata is the file `meta`, reading data from the blobs
/// in `table` through `fetcher`.
pub fn load(
    meta: &Path,
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
) -> Result<TreeFs, TreeError> {
    let bytes = std::fs::read(meta).map_err(|source| TreeError::Io {
        path: meta.to_path_buf(),
        source,
    })?;
    TreeFs::new(ErofsImage::parse(bytes)?, table, fetcher, metrics)
}

/// Mounts the tree of the layer whose EROFS metadata is the file `meta` at `target` (an existing
/// directory), serving its data from the blobs in `table` through `fetcher`. The layer's blobs must be
/// registered in `table` before their files are read (reads of a missing blob fail with `EIO`).
pub fn mount_layer(
    meta: &Path,
    target: &Path,
    table: Arc<BlobTable>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    opts: &TreeOptions,
) -> Result<TreeMount, TreeError> {
    let fs = load(meta, table, fetcher, metrics)?;
    let chan = Channel::mount_tree(target, opts.allow_other).map_err(|source| TreeError::Io {
        path: target.to_path_buf(),
        source,
    })?;
    serve(Arc::new(chan), fs, target, opts, Options::default())
}

/// Serves `fs` on an open connection mounted at `target`: a new mount, or one a holder kept across a
/// server's death (`session` with [`Options::adopt`]: what the dead server left unanswered is resent by
/// the kernel or answered from the connection's journal). Node ids and directory offsets are the
/// image's, so a successor answers alike.
pub fn serve(
    chan: Arc<Channel>,
    mut fs: TreeFs,
    target: &Path,
    opts: &TreeOptions,
    mut session: Options,
) -> Result<TreeMount, TreeError> {
    // A layer's tree never changes: missing names cached, opens without a message.
    session.immutable = true;
    // As the blob server: a read that fetches is served on the worker that read it while two stay free.
    fs.slow.set_workers(opts.threads);
    let session = Session::start(chan, Arc::new(fs), opts.threads, session).map_err(|source| {
        TreeError::Io {
            path: target.to_path_buf(),
            source,
        }
    })?;
    Ok(TreeMount {
        session,
        target: target.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_a_bijection() {
        for root in [0u64, 3, 100] {
            let mut seen = std::collections::HashSet::new();
            for nid in 0..200u64 {
                let node = node_of(root, nid);
                assert!(node >= 1);
                assert!(seen.insert(node), "root {root}: node {node} twice");
                assert_eq!(nid_of(root, node), Some(nid), "root {root}, nid {nid}");
            }
            assert_eq!(node_of(root, root), proto::ROOT_ID);
            assert_eq!(nid_of(root, 0), None);
        }
    }
}
