//! `fanotify` mode in the daemon: starting the pre-content server ([`crate::fanotify`]), keeping its
//! group for successors, and giving each layer mount its blobs' view files.
//!
//! The group and its event journal are kept by the node's keeper under [`fanotify::GROUP`] and
//! [`fanotify::JOURNAL`], as tree connections are ([`crate::control::trees`]): a successor gets both
//! back and adopts the group — its marks, the reads waiting on it and the ones its predecessor left
//! unanswered. Before it reads an event, every blob of the node's mounted layers has its view file
//! opened again ([`Daemon::serve_views`]), so no event finds a file the server does not know.
//!
//! View files live in `<state>/views/` (a local disk: they are the node's cache of uncompressed
//! views). Releasing a layer trims them to `cache_size`, never deleting a file a mounted layer uses
//! ([`Daemon::trim_views`]; `docs/DAEMON.md`); a fill that finds their disk full deletes every file
//! no mounted layer uses and tries once more ([`Daemon::serve_views`]).

use std::collections::HashSet;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use strata_registry::digest::Digest;

use crate::blobfs::BlobTable;
use crate::control::config::Config;
use crate::control::daemon::{Daemon, DaemonError};
use crate::control::trees::Keeper;
use crate::fanotify::room::Room;
use crate::fanotify::{self, Server};
use crate::fetch::Fetcher;
use crate::metrics::Metrics;

/// Named kept descriptors, as a keeper hands them over.
type Named = Vec<(String, OwnedFd)>;

/// Splits a predecessor's kept group and journal out of the kept descriptors (the rest is returned).
pub(crate) fn take_kept(fds: Named) -> (Option<(OwnedFd, OwnedFd)>, Named) {
    let (mut group, mut journal, mut rest) = (None, None, Vec::new());
    for (name, fd) in fds {
        match name.as_str() {
            fanotify::GROUP => group = Some(fd),
            fanotify::JOURNAL => journal = Some(fd),
            _ => rest.push((name, fd)),
        }
    }
    let kept = match (group, journal) {
        (Some(g), Some(j)) => Some((g, j)),
        (Some(_), None) => {
            tracing::error!("kept fanotify group without its journal: starting a new group");
            None
        }
        _ => None,
    };
    (kept, rest)
}

/// Starts the server for a node in `fanotify` mode (not reading events yet), keeping a new group.
pub(crate) fn start(
    config: &Config,
    kept: Option<(OwnedFd, OwnedFd)>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    table: Arc<BlobTable>,
    keeper: Option<&dyn Keeper>,
) -> Result<Arc<Server>, DaemonError> {
    let adopted = kept.is_some();
    let dir = config.state_dir.join("views");
    let room = Room::new(
        &dir,
        config.view_reserve_bytes,
        config.view_keep_free_percent,
    );
    let server = Server::new(&dir, kept, fetcher, metrics, table)
        .map_err(|e| DaemonError::Io {
            path: dir.clone(),
            source: std::io::Error::other(e),
        })?
        .with_room(room)
        .following_readers(config.fanotify_follow_readers);
    match (adopted, keeper) {
        (true, _) => {}
        (false, Some(k)) => {
            for (name, fd) in server.kept() {
                if let Err(e) = k.keep(name, &[fd]) {
                    tracing::error!(name, error = %e,
                        "cannot keep the fanotify group: reads waiting when this server dies fail");
                }
            }
        }
        (false, None) => tracing::warn!(
            "no descriptor keeper: the fanotify group and its waiting reads end with this server"
        ),
    }
    tracing::info!(
        group = server.kept()[0].1.as_raw_fd(),
        adopted,
        "fanotify pre-content server"
    );
    Ok(Arc::new(server))
}

/// View files handed to a mount about to open them ([`Daemon::view_paths`]): when dropped (the
/// mount made or failed), the complete ones are no longer watched ([`Server::mounted`]).
pub(crate) struct Opening {
    server: Option<Arc<Server>>,
    blobs: Vec<Digest>,
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(s) = &self.server {
            s.mounted(&self.blobs);
        }
    }
}

impl Daemon {
    /// The view files of `blobs`, watched (`fanotify` mode): what EROFS mounts as its devices.
    /// Keep the guard until the mount has opened them.
    pub(crate) fn view_paths(
        &self,
        blobs: &[Digest],
    ) -> Result<(Vec<PathBuf>, Opening), DaemonError> {
        let mut opening = Opening {
            server: self.views.clone(),
            blobs: Vec::with_capacity(blobs.len()),
        };
        let mut paths = Vec::with_capacity(blobs.len());
        for d in blobs {
            let (Some(server), Some(blob)) = (&self.views, self.table.handle(d)) else {
                return Err(DaemonError::Metadata(format!(
                    "blob {d} has no view file (not fanotify mode, or not served)"
                )));
            };
            paths.push(server.mounting(&blob).map_err(|e| DaemonError::Io {
                path: server.views.path(d),
                source: e,
            })?);
            opening.blobs.push(*d);
        }
        Ok((paths, opening))
    }

    /// Trims the view files to the cache's bound (`cache_size`), keeping those of every blob a
    /// mounted layer reads. Skipped while a layer is being mounted (the next release trims): a layer
    /// mounting now may be about to use a file this would delete.
    pub(crate) fn trim_views(&self) {
        let (files, bytes) = self.trim_views_to(self.config.cache_size);
        if files > 0 {
            tracing::info!(files, bytes, "view files trimmed to the cache's bound");
        }
    }

    /// Deletes view files no mounted layer reads until all take at most `bound` bytes: the files
    /// and bytes freed (none while a layer is being mounted).
    fn trim_views_to(&self, bound: u64) -> (u64, u64) {
        let Some(server) = &self.views else {
            return (0, 0);
        };
        let Ok(_mounting) = self.layer_lock.try_lock() else {
            return (0, 0);
        };
        let used: HashSet<Digest> = self
            .lock()
            .layers
            .values()
            .flat_map(|l| l.blobs.iter().copied())
            .collect();
        server.trim(&used, bound)
    }

    /// Opens every served blob's view file, then starts reading events (`fanotify` mode). A fill
    /// that finds the view files' disk full gets the files no mounted layer reads deleted, whatever
    /// `cache_size` allows them, or else the reserve given up, and tries once more (a read denied is
    /// worse than a refetch later; [`fanotify::room`]).
    pub(crate) fn serve_views(self: &Arc<Self>) {
        let Some(server) = &self.views else { return };
        self.restore_reserve();
        let node = Arc::downgrade(self);
        server.on_full(Box::new(move || match node.upgrade() {
            Some(d) => d.make_room(),
            None => false,
        }));
        for blob in self.table.all() {
            if let Err(e) = server.view(&blob) {
                tracing::error!(blob = %blob.blob.digest, error = %e,
                    "cannot open a blob's view file: its reads fail");
            }
        }
        server.run();
    }
}

impl Daemon {
    /// The view files' room (`fanotify` mode).
    fn room(&self) -> Option<&Room> {
        self.views.as_ref().and_then(|s| s.room.as_ref())
    }

    /// Frees room for a fill that found the view files' disk full: whether any was freed.
    fn make_room(&self) -> bool {
        let (files, bytes) = self.trim_views_to(0);
        if files > 0 {
            tracing::warn!(
                files,
                bytes,
                "the view files' disk is full: view files no mounted layer reads deleted"
            );
            return true;
        }
        let freed = self.room().map_or(0, |r| r.release());
        if freed > 0 {
            tracing::warn!(
                bytes = freed,
                "the view files' disk is full: their reserve given up to reads while eviction makes room"
            );
        } else {
            tracing::error!(
                "the view files' disk is full and nothing is left to free: reads of chunks not cached fail (EIO)"
            );
        }
        freed > 0
    }

    /// Allocates the view files' reserve again if the disk has room for it.
    fn restore_reserve(&self) {
        let Some(room) = self.room() else { return };
        let before = room.held();
        match room.restore() {
            Ok(held) if before == 0 && held > 0 => {
                tracing::info!(bytes = held, path = %room.path().display(), "view files' reserve allocated")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(path = %room.path().display(), error = %e, "view files' reserve not allocated")
            }
        }
    }

    /// Keeps the view files within `cache_size` while their layers stay mounted (`fanotify` mode),
    /// a pass every quarter of `view_evict_grace_secs` (250 ms to 5 s) while this process serves
    /// the node: over the bound, files no mounted layer reads are trimmed first, then chunks of
    /// mounted layers' files are evicted ([`fanotify::evict`]).
    pub(crate) fn start_evicting(self: &Arc<Self>) {
        if self.views.is_none() {
            return;
        }
        let grace = std::time::Duration::from_secs_f64(
            self.config.view_evict_grace_secs.clamp(0.0, 86_400.0),
        );
        let every = (grace / 4).clamp(
            std::time::Duration::from_millis(250),
            std::time::Duration::from_secs(5),
        );
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("strata-evict".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                match weak.upgrade() {
                    Some(d) if !d.metrics.attribution.is_retired() => d.bound_views(grace),
                    _ => return,
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to bound the view files: only released layers' files are trimmed");
        }
    }

    /// One pass of [`Daemon::start_evicting`]: the bound is `cache_size`, or less where the disk's
    /// free share must be kept ([`fanotify::room::Room::bound`]).
    fn bound_views(&self, grace: std::time::Duration) {
        let Some(server) = &self.views else { return };
        let mut disk = server.views.disk_bytes();
        let bound = match self.room() {
            Some(room) => room.bound(self.config.cache_size, disk),
            None => self.config.cache_size,
        };
        if disk > bound {
            let (files, bytes) = self.trim_views_to(bound);
            if files > 0 {
                tracing::info!(files, bytes, bound, "view files trimmed to their bound");
            }
            disk = disk.saturating_sub(bytes);
        }
        let allowed = {
            let st = self.lock();
            let layers = st.layers.values();
            fanotify::evict::allowed(layers.map(|l| (l.views_watched, &l.blobs[..])))
        };
        let p = server.evict(&allowed, bound, grace, disk);
        if p.punched.0 > 0 || p.marked > 0 {
            tracing::info!(
                punched_chunks = p.punched.0,
                punched_bytes = p.punched.1,
                marked_bytes = p.marked,
                bound,
                "view files kept to their bound: chunks of mounted layers evicted"
            );
        }
        self.restore_reserve();
    }

    /// Scrubs the node's cached data every `scrub_interval_secs` while this process serves the node
    /// (not after it handed the node to a successor, whose files they then are).
    pub(crate) fn start_scrubbing(self: &Arc<Self>) {
        let every = self.config.scrub_interval_secs;
        if !(every > 0.0 && every.is_finite()) {
            return;
        }
        let every = std::time::Duration::from_secs_f64(every);
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("strata-scrub".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                match weak.upgrade() {
                    Some(d) if !d.metrics.attribution.is_retired() => {
                        d.scrub();
                    }
                    _ => return,
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to scrub cached data: `strata daemon scrub` only");
        }
    }

    /// Checks the node's cached data at rest (`POST /v1/scrub`, `strata daemon scrub`): every chunk
    /// of the chunk cache and every filled chunk of every view file (`fanotify` mode) read back with
    /// direct I/O and hashed. A bad cached chunk is dropped, a bad view-file chunk made a hole
    /// ([`Server::scrub`]); either is fetched again on its next read. Reads check cached chunks too,
    /// but the kernel reads view files unchecked, and a scrub finds rot while the store is still there
    /// to mend it.
    pub(crate) fn scrub(&self) -> serde_json::Value {
        // One scrub at a time: one asked for while another runs (the daily one, another client's)
        // waits for it and answers its report instead of reading everything again.
        self.scrubs.run(|| self.scrub_now())
    }

    fn scrub_now(&self) -> serde_json::Value {
        let t = std::time::Instant::now();
        let cache = self.fetcher.cache().scrub();
        let (files, views) = match &self.views {
            Some(server) => server.scrub(),
            None => (0, fanotify::views::Scrubbed::default()),
        };
        let seconds = t.elapsed().as_secs_f64();
        let mut all = cache;
        all += views;
        tracing::info!(
            files,
            chunks = all.chunks,
            bytes = all.bytes,
            bad = all.bad,
            seconds,
            "scrubbed cached data"
        );
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        serde_json::json!({
            "mount_mode": self.mode,
            "files": files,
            "chunks": all.chunks,
            "bytes": all.bytes,
            "bad": all.bad,
            "cache": cache,
            "views": views,
            "seconds": seconds,
            "at": at,
        })
    }
}
