//! Layers acquired: each fetched once, different layers fetched at once, then mounted one at a time.
//!
//! A layer not yet on the node is *fetched* — its descriptor, its metadata written to
//! `<state>/layers/<hex>.erofs` and checked, the tables of contents of its blobs the blob server does
//! not serve yet — then *served* (its descriptor kept, its blobs registered with the blob server) and
//! *mounted* ([`Daemon::mount_layer`]). Fetching is most of the time (a round trip or more for each
//! object over a network, tens of ms of decompression for a large image's metadata) and independent
//! from layer to layer, so it runs under the layer's own [`Flight`](super::flights::Flight): sandboxes of one
//! new image fetch its layers once (later callers wait for the flight, then find the layer mounted),
//! while other layers — of other images in a burst, or the other layers of the same image, which
//! [`Daemon::acquire_layers`] fetches side by side — go on at once. A blob two layers share has its
//! table of contents fetched under the blob's flight, once. Serving and mounting stay under
//! `layer_lock`, one layer at a time, as before: they take about a millisecond, and the mount modes'
//! own state (loop devices, view files, FUSE trees) is kept by them alone. The last release of a
//! layer unmounts it under the layer's flight too ([`Daemon::release_layer`]), so that an acquirer
//! that finds it gone waits for the unmount instead of mounting at a path about to be detached.

use std::path::{Path, PathBuf};

use strata_registry::digest::Digest;
use strata_registry::model::{BlobRef, LayerDescriptor, ManifestLayer};

use crate::control::daemon::{io, Daemon, DaemonError, LayerMount};
use crate::fetch::BlobHandle;
use crate::metadir;

/// A layer fetched, to be served and mounted.
pub(crate) struct Fetched {
    pub(crate) desc: LayerDescriptor,
    /// Its metadata on this node, checked.
    pub(crate) meta: PathBuf,
    /// Its blobs the blob server did not serve when they were fetched.
    handles: Vec<BlobHandle>,
}

impl Daemon {
    /// Mounts (or takes another reference to) each of an image's layers, fetching those not on the
    /// node side by side: their mount points and digests, bottom first, and their stored bytes. On a
    /// failure none stays acquired.
    pub(crate) fn acquire_layers(
        &self,
        layers: &[ManifestLayer],
    ) -> Result<(Vec<PathBuf>, Vec<Digest>, u64), DaemonError> {
        // Layers mounted already are taken at once; the others are fetched side by side.
        let mut results: Vec<Option<Result<(PathBuf, u64), DaemonError>>> = layers
            .iter()
            .map(|l| self.take_layer(&l.digest).map(Ok))
            .collect();
        let missing: Vec<usize> = (0..layers.len())
            .filter(|&i| results[i].is_none())
            .collect();
        if let [i] = missing[..] {
            results[i] = Some(self.acquire_layer(&layers[i].digest));
        } else if !missing.is_empty() {
            std::thread::scope(|s| {
                let running: Vec<_> = missing
                    .iter()
                    .map(|&i| (i, s.spawn(move || self.acquire_layer(&layers[i].digest))))
                    .collect();
                for (i, h) in running {
                    let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                    results[i] = Some(r);
                }
            });
        }
        let (mut lowers, mut acquired, mut bytes, mut failed) = (Vec::new(), Vec::new(), 0, None);
        for (l, r) in layers.iter().zip(results.into_iter().flatten()) {
            match r {
                Ok((p, b)) => {
                    lowers.push(p);
                    acquired.push(l.digest);
                    bytes += b;
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            for d in &acquired {
                self.release_layer(d);
            }
            return Err(e);
        }
        Ok((lowers, acquired, bytes))
    }

    /// Takes another reference to layer `d` if it is mounted: its mount point and stored bytes.
    fn take_layer(&self, d: &Digest) -> Option<(PathBuf, u64)> {
        self.lock().layers.get_mut(d).map(|l| {
            l.refs += 1;
            (l.path.clone(), l.bytes)
        })
    }

    /// Mounts a layer if needed and takes a reference; returns its mount point and stored bytes.
    pub(crate) fn acquire_layer(&self, d: &Digest) -> Result<(PathBuf, u64), DaemonError> {
        if let Some(found) = self.take_layer(d) {
            return Ok(found);
        }
        let _flight = self.layer_flights.enter(d);
        if let Some(found) = self.take_layer(d) {
            return Ok(found);
        }
        let started = std::time::Instant::now();
        let fetched = self.fetch_layer(d)?;
        let fetched_in = started.elapsed();
        let _g = self.layer_lock.lock().unwrap_or_else(|p| p.into_inner());
        let (desc, meta_path) = self.serve_fetched(d, fetched)?;
        let bytes = desc.stored_bytes();
        let blobs: Vec<Digest> = desc.blobs.iter().map(|b| b.digest).collect();
        let target = self.config.runtime_dir.join("layers").join(d.hex());
        std::fs::create_dir_all(&target).map_err(|e| io(&target, e))?;
        self.mount_layer(d, &meta_path, &blobs, &target)?;
        tracing::debug!(layer = %d, fetched_ms = fetched_in.as_millis() as u64,
            mounted_ms = started.elapsed().as_millis() as u64, "layer mounted");
        self.lock().layers.insert(
            *d,
            LayerMount {
                refs: 1,
                path: target.clone(),
                bytes,
                blobs,
                views_watched: true,
            },
        );
        Ok((target, bytes))
    }

    /// Where layer `d`'s metadata is kept on this node.
    pub(crate) fn meta_path(&self, d: &Digest) -> PathBuf {
        self.config
            .state_dir
            .join("layers")
            .join(format!("{}.erofs", d.hex()))
    }

    /// The blob file of blob `d` on the blob server's mount.
    pub(crate) fn blob_path(&self, d: &Digest) -> PathBuf {
        self.config.runtime_dir.join("fuse/blobs").join(d.hex())
    }

    /// Fetches layer `d`: its descriptor, its metadata to local disk (verified), and the tables of
    /// contents of its blobs not served yet, the last two at once (over a slow link each is a round
    /// trip or more, and the mount needs them all). Callers hold the layer's flight.
    pub(crate) fn fetch_layer(&self, d: &Digest) -> Result<Fetched, DaemonError> {
        let started = std::time::Instant::now();
        let desc = self.store.get_layer(d)?;
        let meta = self.meta_path(d);
        let (fetched_meta, handles) = std::thread::scope(|s| {
            let tocs: Vec<_> = desc
                .blobs
                .iter()
                .filter(|b| !self.table.contains(&b.digest))
                .map(|b| s.spawn(move || self.blob_handle(b)))
                .collect();
            let fetched_meta = self.fetch_meta(&desc.meta.digest, &meta);
            let handles: Result<Vec<BlobHandle>, DaemonError> = tocs
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r,
                    Err(_) => Err(DaemonError::Metadata(
                        "table of contents fetch panicked".into(),
                    )),
                })
                .collect();
            (fetched_meta, handles)
        });
        fetched_meta?;
        let handles = handles?;
        self.metrics.layer_fetched(started.elapsed());
        Ok(Fetched {
            desc,
            meta,
            handles,
        })
    }

    /// Makes a fetched layer servable: its descriptor kept (before the mount: a successor must be
    /// able to serve every mounted layer's blobs), its blobs registered with the blob server. Callers
    /// hold `layer_lock`. Returns the descriptor and the metadata's path.
    pub(crate) fn serve_fetched(
        &self,
        d: &Digest,
        f: Fetched,
    ) -> Result<(LayerDescriptor, PathBuf), DaemonError> {
        self.node.save_layer(d, &f.desc)?;
        for h in f.handles {
            self.table.add(h)?;
        }
        Ok((f.desc, f.meta))
    }

    /// A blob's handle: its table of contents kept on this node, or fetched (verified) and kept —
    /// under the blob's flight, so that layers sharing it fetch it once.
    pub(crate) fn blob_handle(&self, b: &BlobRef) -> Result<BlobHandle, DaemonError> {
        let _flight = self.blob_flights.enter(&b.digest);
        if let Some(toc) = self.node.toc(b) {
            return Ok(BlobHandle::new(b, toc));
        }
        // Kept as stored (pieces and all): the handle holds it as units.
        let toc = self.store.get_toc(b)?;
        self.node.save_toc(b, &toc)?;
        Ok(BlobHandle::new(b, toc))
    }

    /// A layer's metadata image at `path`, verified: reused if already there and intact, else fetched.
    fn fetch_meta(&self, digest: &Digest, path: &Path) -> Result<(), DaemonError> {
        if std::fs::read(path).is_ok_and(|b| digest.matches(&b)) {
            metadir::touch(path);
            return Ok(());
        }
        let t = std::time::Instant::now();
        let tmp = path.with_extension("tmp");
        // Root's only: layer metadata names every file of the image.
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io(&tmp, e))?;
        // A temporary file a crash left keeps its mode: set it.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| io(&tmp, e))?;
        // Written and checked frame by frame; renamed into place only once checked whole.
        let len = self.store.get_meta_into(digest, &f, &tmp)?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
        tracing::debug!(meta = %digest, bytes = len, ms = t.elapsed().as_secs_f64() * 1e3,
            "layer metadata fetched");
        Ok(())
    }
}
