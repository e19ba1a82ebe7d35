//! `loop` mode's devices: one loop device per file a layer mount needs — each blob file on stratad's
//! FUSE mount, and each layer's local metadata file (before 6.12 the EROFS `source` must be a block
//! device too) — shared by every layer that names the file.
//!
//! **Counted by the kernel.** Devices are autoclear ([`crate::loopdev`]): each EROFS mount holds the
//! devices it was given open, and the kernel detaches a device when the last mount using it is gone.
//! So a blob's device is shared by every layer mount that names the blob, released when unused, and
//! never leaked — not by a stratad killed between configuring a device and mounting it (its descriptor
//! closes when it dies), not by a node whose daemon is gone. The daemon keeps only a map from backing
//! file to device number, to reuse a device rather than bind a second one, and checks every reuse on
//! the open device (still bound to the same file: device and inode). After a restart the map is empty
//! and devices are found again by their backing file (`/sys/block/loopN/loop/backing_file`), so a
//! successor shares the devices of the mounts it adopted instead of binding new ones.
//!
//! Direct I/O: see [`Loops::new`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use strata_registry::digest::Digest;

use crate::control::daemon::{Daemon, DaemonError};
use crate::control::modes::MountMode;
use crate::loopdev::{self, LoopDev};
use crate::mount;

/// The loop devices the daemon binds and reuses.
pub struct Loops {
    direct_io: bool,
    /// Backing file → the device last bound to it.
    known: Mutex<HashMap<PathBuf, u32>>,
}

impl Loops {
    /// `direct_io`: bind devices with `LO_FLAGS_DIRECT_IO`, so that the loop driver reads the blob
    /// files without a page cache of their own and a layer's data is cached once, by EROFS (the
    /// measurement is in docs/DAEMON.md).
    pub fn new(direct_io: bool) -> Loops {
        Loops {
            direct_io,
            known: Mutex::new(HashMap::new()),
        }
    }

    /// A device bound to `backing`, held open until the caller has mounted it: the known one, one found
    /// by its backing file, or a new one.
    pub fn device(&self, backing: &Path) -> std::io::Result<LoopDev> {
        // As the kernel names it in sysfs.
        let backing = &std::fs::canonicalize(backing)?;
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let again = known
            .get(backing)
            .and_then(|&n| loopdev::open_bound(n, backing))
            .or_else(|| loopdev::find(backing));
        let dev = match again {
            Some(d) => d,
            None => {
                let d = loopdev::attach(backing, self.direct_io)?;
                if self.direct_io && !loopdev::direct_io(d.number) {
                    tracing::warn!(device = %d.path().display(), backing = %backing.display(),
                        "the kernel refused direct I/O for this loop device: it reads buffered");
                }
                d
            }
        };
        known.insert(backing.to_path_buf(), dev.number);
        Ok(dev)
    }
}

/// A loop device bound to one of the node's files.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Bound {
    /// `/dev/loopN`.
    pub device: PathBuf,
    pub backing: PathBuf,
    /// Whether the kernel reads the backing file with direct I/O (`loop/dio` in sysfs).
    pub direct_io: bool,
}

/// The bound loop devices whose backing file lies under one of `dirs`.
pub fn devices_under(dirs: &[PathBuf]) -> Vec<Bound> {
    let mut out: Vec<_> = loopdev::bound()
        .into_iter()
        .filter(|(_, b)| dirs.iter().any(|d| b.starts_with(d)))
        .map(|(n, backing)| Bound {
            device: loopdev::dev_path(n),
            backing,
            direct_io: loopdev::direct_io(n),
        })
        .collect();
    out.sort();
    out
}

/// Read-ahead of a layer mount in `fanotify` mode: a chunk (see [`Daemon::mount_layer`]).
const VIEW_READ_AHEAD_KB: u32 = 1024;

/// Beside a `fanotify` layer mount at `target`: the mount opened its view files while they were
/// watched ([`crate::fanotify::Server::mounting`]), as stratad versions before eviction did not
/// make sure of; a server that finds the layer mounted evicts from its files only if this is there.
pub(crate) fn watched_marker(target: &Path) -> PathBuf {
    target.with_extension("watched")
}

impl Daemon {
    /// Mounts a layer's EROFS at `target` in this node's mode: its metadata file `meta` with the blob
    /// server's files of `blobs` as devices (`file`), or loop devices of them (`loop`), or the blobs'
    /// local view files (`fanotify`); or its tree served over FUSE (`fuse`), the connection kept for
    /// successors ([`crate::control::trees`]).
    pub(crate) fn mount_layer(
        &self,
        layer: &Digest,
        meta: &Path,
        blobs: &[Digest],
        target: &Path,
    ) -> Result<(), DaemonError> {
        if self.mode != MountMode::Fuse {
            crate::kernelcheck::check_layer(meta)?;
        }
        self.learn_groups(meta);
        // `_opening`: view files stay watched until the mount has opened them (`fanotify`).
        let (blobs, _opening) = match self.mode {
            MountMode::Fanotify => {
                let (paths, opening) = self.view_paths(blobs)?;
                (paths, Some(opening))
            }
            _ => (blobs.iter().map(|d| self.blob_path(d)).collect(), None),
        };
        let blobs = &blobs[..];
        match self.mode {
            MountMode::File => Ok(mount::mount_erofs_with(meta, blobs, target, true)?),
            MountMode::Fanotify => {
                // Without `directio`: a range just filled is read from memory (`fanotify::pages`
                // drops the view files' pages once read, so that EROFS's copy is the only one).
                mount::mount_erofs_with(meta, blobs, target, false)?;
                // Its view files were opened watched: a successor may evict from them too.
                if let Err(e) = std::fs::write(watched_marker(target), b"") {
                    tracing::warn!(layer = %layer, error = %e,
                        "a successor will not evict from this layer's view files");
                }
                // Each read of a view file that misses EROFS's page cache is an event and a wait:
                // reads the size of a chunk (not 128 KiB) are an eighth of the events (a 1 GiB
                // first read: 1,042 events instead of 8,186, 447 against 397 MB/s; 4 MiB: 212 MB/s).
                if let Err(e) = mount::set_read_ahead(target, VIEW_READ_AHEAD_KB) {
                    tracing::warn!(layer = %layer, error = %e, "read-ahead of a layer mount left as it is");
                }
                Ok(())
            }
            MountMode::Loop => {
                let dev = |p: &Path| {
                    self.loops.device(p).map_err(|e| DaemonError::Io {
                        path: p.to_path_buf(),
                        source: e,
                    })
                };
                let source = dev(meta)?;
                let devices = blobs
                    .iter()
                    .map(|b| dev(b))
                    .collect::<Result<Vec<_>, _>>()?;
                let paths: Vec<PathBuf> = devices.iter().map(LoopDev::path).collect();
                // EROFS's `directio` is for file-backed mounts; the devices do their own.
                mount::mount_erofs_with(&source.path(), &paths, target, false)?;
                // Dropping `source` and `devices` now leaves the mount as their only opener.
                Ok(())
            }
            // The layer's whole tree served from its metadata by a FUSE server of its own, reading
            // through the same cache and fetcher. Its workers end when the mount goes (release).
            MountMode::Fuse => {
                let m = crate::treefs::mount_layer(
                    meta,
                    target,
                    self.table.clone(),
                    self.fetcher.clone(),
                    self.metrics.clone(),
                    &self.tree_options(),
                )?;
                self.trees.add(*layer, m, true);
                Ok(())
            }
        }
    }

    /// Records a layer's directory groups ([`crate::groups`]) in the background, when misses fetch them
    /// (`max_fetch_group`). A layer whose metadata cannot be walked just has no groups.
    fn learn_groups(&self, meta: &Path) {
        if self.fetcher.max_group == 0 {
            return;
        }
        let (meta, fetcher, table) = (meta.to_path_buf(), self.fetcher.clone(), self.table.clone());
        self.fetcher.workers().run_or_here(move || {
            let image = match std::fs::read(&meta) {
                Ok(b) => strata_erofs::ErofsImage::parse(b),
                Err(e) => {
                    return tracing::warn!(meta = %meta.display(), error = %e, "no directory groups")
                }
            };
            let walked = image.and_then(|image| {
                let devices: Vec<Option<Digest>> = image
                    .devices()
                    .iter()
                    .map(|s| s.tag_hex().and_then(|h| Digest::from_hex(h).ok()))
                    .collect();
                let named: Vec<Digest> = devices.iter().flatten().copied().collect();
                // Mounted again, or naming only blobs walked layers named: nothing new to learn.
                if fetcher.groups().all_walked(&named) {
                    return Ok(());
                }
                let blob_of = |dev: u16| {
                    let slot = usize::from(dev).checked_sub(1)?;
                    table.handle(&devices.get(slot).copied().flatten()?)
                };
                fetcher.groups().add_layer(&image, blob_of)?;
                fetcher.groups().mark_walked(&named);
                Ok(())
            });
            if let Err(e) = walked {
                tracing::warn!(meta = %meta.display(), error = %e, "no directory groups");
            }
        });
    }

    /// The loop devices bound to this node's files (blob files, layer metadata).
    pub(crate) fn loop_devices(&self) -> Vec<Bound> {
        devices_under(&[
            self.config.runtime_dir.join("fuse"),
            self.config.state_dir.join("layers"),
        ])
    }
}
