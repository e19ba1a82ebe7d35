//! `fuse` mount mode's connections, kept across servers: each layer's tree is a FUSE connection of its
//! own ([`crate::treefs`]), and like the blob server's it must outlive the process that answers it.
//!
//! **Kept where the blob connection is.** When a server mounts a layer's tree it hands the connection's
//! `/dev/fuse` descriptor and its request journal to whatever keeps the node's descriptors, through a
//! [`Keeper`]: the same message systemd's file-descriptor store takes (`FDSTORE=1`, `FDNAME=tree-<layer
//! hex>`, the two descriptors attached with `SCM_RIGHTS`) — sent to systemd's notification socket, or
//! to the holder over a socket the holder gave the server (`stratad`'s `holder` module). Releasing the
//! layer sends `FDSTOREREMOVE=1` with the same name, and the keeper closes its copies. The name is the
//! record of which connection serves which layer: a successor receives the kept descriptors with their
//! names ([`Kept`]), tells the `/dev/fuse` one (a character device) from the journal (a memfd) by what
//! they are, and serves each layer it adopted on its own connection again ([`Daemon::adopt_trees`]).
//!
//! **Nothing lost in flight.** Each tree connection has its own journal
//! ([`crate::fuse::journal::TREE_SLOTS`] slots, 128 KiB): a successor's session on it takes the
//! connection's leftovers exactly as the blob server's does — the kernel resends them (Linux 6.9+) or
//! the successor answers them from the journal. One journal per connection rather than one shared with
//! a connection id: every session then owns its journal alone (no cross-connection slot accounting, no
//! ordering between sessions that start one after another), the journal is closed with its connection
//! when the layer is released, and a busy layer cannot fill the journal another layer needs. The cost
//! is bounded per layer (128 KiB of shared memory, touched only as slots are used).
//!
//! A kept connection no layer of the adopted node uses (released while the keeper's copy was in
//! flight) is closed and forgotten; a layer whose mount exists but whose connection was not kept (a
//! predecessor without this, a keeper that refused) cannot be served again and is reported.

use std::collections::HashMap;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use strata_registry::digest::Digest;

use crate::control::daemon::Daemon;
use crate::control::modes::MountMode;
use crate::fuse::journal::Journal;
use crate::fuse::session::Options;
use crate::fuse::Channel;
use crate::treefs::{TreeMount, TreeOptions};

/// Where a server parks descriptors that must outlive it (systemd's file-descriptor store, or the
/// holder), in the file-descriptor store's terms.
pub trait Keeper: Send + Sync {
    /// Keeps `fds` under `name` (`FDSTORE=1`).
    fn keep(&self, name: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()>;
    /// Closes what is kept under `name` (`FDSTOREREMOVE=1`).
    fn forget(&self, name: &str) -> io::Result<()>;
}

/// Descriptors kept by a predecessor, as the keeper handed them to this server, and where to keep new
/// ones.
#[derive(Default)]
pub struct Kept {
    /// `(name, descriptor)`: names from [`name`]; other names are ignored (and closed).
    pub fds: Vec<(String, OwnedFd)>,
    pub keeper: Option<Box<dyn Keeper>>,
}

/// Names of kept tree connections start with this.
pub const PREFIX: &str = "tree-";

/// The name layer `d`'s tree connection is kept under.
pub fn name(d: &Digest) -> String {
    format!("{PREFIX}{}", d.hex())
}

/// The layer a kept name is the tree connection of.
pub fn layer_of(name: &str) -> Option<Digest> {
    Digest::from_hex(name.strip_prefix(PREFIX)?).ok()
}

/// Assembles kept descriptors into connections, per layer: the `/dev/fuse` descriptor (a character
/// device) with its journal (anything else: a memfd). A name without a FUSE descriptor is dropped.
fn channels(fds: Vec<(String, OwnedFd)>) -> HashMap<Digest, Channel> {
    let mut parts: HashMap<Digest, (Option<OwnedFd>, Option<OwnedFd>)> = HashMap::new();
    for (n, fd) in fds {
        let Some(d) = layer_of(&n) else {
            continue;
        };
        let dev = rustix::fs::fstat(&fd)
            .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_char_device());
        let e = parts.entry(d).or_default();
        match dev {
            true => e.0 = Some(fd),
            false => e.1 = Some(fd),
        }
    }
    let mut out = HashMap::new();
    for (d, (fuse, journal)) in parts {
        let Some(fuse) = fuse else {
            tracing::warn!(layer = %d, "kept tree journal without its connection: dropped");
            continue;
        };
        let mut chan = Channel::from_fd(fuse);
        match journal.map(Journal::from_fd) {
            Some(Ok(j)) => chan = chan.with_journal(j),
            Some(Err(e)) => tracing::warn!(layer = %d, error = %e, "kept tree journal unusable"),
            None => {}
        }
        out.insert(d, chan);
    }
    out
}

/// The tree connections this server serves, and where they are kept.
pub struct Trees {
    mounts: Mutex<HashMap<Digest, TreeMount>>,
    keeper: Option<Box<dyn Keeper>>,
    /// Connections a predecessor left, until [`Daemon::adopt_trees`] takes them.
    inherited: Mutex<HashMap<Digest, Channel>>,
}

impl Trees {
    pub fn new(kept: Kept) -> Trees {
        Trees {
            mounts: Mutex::new(HashMap::new()),
            keeper: kept.keeper,
            inherited: Mutex::new(channels(kept.fds)),
        }
    }

    fn mounts(&self) -> MutexGuard<'_, HashMap<Digest, TreeMount>> {
        self.mounts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves layer `d`'s tree from now on; keeps its connection (`fresh`: a new one, not yet kept).
    pub(crate) fn add(&self, d: Digest, m: TreeMount, fresh: bool) {
        if let (true, Some(k)) = (fresh, &self.keeper) {
            let chan = m.channel();
            let fds: Vec<BorrowedFd<'_>> = std::iter::once(chan.fd())
                .chain(chan.journal().map(Journal::fd))
                .collect();
            if let Err(e) = k.keep(&name(&d), &fds) {
                tracing::error!(layer = %d, error = %e,
                    "cannot keep the layer's tree connection: its mount ends with this server");
            }
        }
        self.mounts().insert(d, m);
    }

    /// Stops serving layer `d`'s tree (unmounted by the caller) and has the keeper close its copy.
    pub(crate) fn remove(&self, d: &Digest) {
        if self.mounts().remove(d).is_some() {
            self.forget(d);
        }
    }

    fn forget(&self, d: &Digest) {
        if let Some(k) = &self.keeper {
            if let Err(e) = k.forget(&name(d)) {
                tracing::warn!(layer = %d, error = %e, "the keeper did not close a tree connection");
            }
        }
    }

    /// Stops answering on every tree connection (a handover: the successor gets what is read now).
    pub(crate) fn stop_all(&self) {
        self.mounts().values().for_each(TreeMount::stop);
    }

    /// Forgets every tree connection (the node is torn down; the trees were unmounted).
    pub(crate) fn clear(&self) {
        let all: Vec<Digest> = self.mounts().drain().map(|(d, _)| d).collect();
        all.iter().for_each(|d| self.forget(d));
    }

    /// Counters over every tree connection, for `GET /v1/status`.
    pub(crate) fn status(&self) -> serde_json::Value {
        let m = self.mounts();
        let sum = |f: fn(&crate::fuse::session::Stats) -> u64| -> u64 {
            m.values().map(|t| f(t.stats())).sum()
        };
        serde_json::json!({
            "connections": m.len(),
            "kept": self.keeper.is_some(),
            "journals": m.values().filter(|t| t.channel().journal().is_some()).count(),
            "requests": sum(|s| s.requests.load(Ordering::Relaxed)),
            "resent": sum(|s| s.resent.load(Ordering::Relaxed)),
            "replayed": sum(|s| s.replayed.load(Ordering::Relaxed)),
        })
    }
}

impl Daemon {
    /// How this node's trees are served.
    pub(crate) fn tree_options(&self) -> TreeOptions {
        TreeOptions {
            threads: self.config.fuse_threads.clamp(1, 4),
            allow_other: true,
        }
    }

    /// Serves again the tree of every layer this server adopted, on the connection a predecessor kept
    /// (after [`Daemon::restore`] registered the layers' blobs). Requests the predecessor left come back
    /// (resent by the kernel, or answered from the connection's journal).
    pub(crate) fn adopt_trees(&self) {
        let inherited = std::mem::take(
            &mut *self
                .trees
                .inherited
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let layers: Vec<Digest> = match self.mode {
            MountMode::Fuse => self.lock().layers.keys().copied().collect(),
            _ => Vec::new(),
        };
        let mut inherited = inherited;
        for d in layers {
            let Some(chan) = inherited.remove(&d) else {
                tracing::error!(layer = %d,
                    "a mounted layer's tree connection was not kept: its files cannot be read until it is released");
                continue;
            };
            let target = self.config.runtime_dir.join("layers").join(d.hex());
            let opts = Options {
                adopt: true,
                no_resend: std::env::var_os("STRATAD_NO_RESEND").is_some(),
                ..Options::default()
            };
            let served = crate::treefs::load(
                &self.meta_path(&d),
                self.table.clone(),
                self.fetcher.clone(),
                self.metrics.clone(),
            )
            .and_then(|fs| {
                crate::treefs::serve(Arc::new(chan), fs, &target, &self.tree_options(), opts)
            });
            match served {
                Ok(m) => self.trees.add(d, m, false),
                Err(e) => tracing::error!(layer = %d, error = %e, "cannot serve an adopted tree"),
            }
        }
        for (d, chan) in inherited {
            tracing::info!(layer = %d, "a kept tree connection no layer uses: closed");
            drop(chan);
            self.trees.forget(&d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn names_name_their_layer_and_nothing_else() {
        let d = Digest::of(b"layer");
        assert_eq!(layer_of(&name(&d)), Some(d));
        for other in ["fuse", "journal", "api", "tree-", "tree-xyz", &d.hex()] {
            assert_eq!(layer_of(other), None, "{other}");
        }
        // systemd's FDNAME: at most 255 characters, no ':'.
        assert!(name(&d).len() <= 255 && !name(&d).contains(':'));
    }

    #[test]
    fn kept_descriptors_become_connections_with_their_journals() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let dev = |_: ()| {
            rustix::fs::open(
                "/dev/null",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .expect("/dev/null")
        };
        let journal = || {
            Journal::create_with(crate::fuse::journal::TREE_SLOTS)
                .expect("journal")
                .fd()
                .try_clone_to_owned()
                .expect("dup")
        };
        let fds = vec![
            (name(&a), journal()),
            (name(&a), dev(())),
            (name(&b), journal()),
            ("fuse".to_string(), dev(())),
        ];
        let chans = channels(fds);
        assert_eq!(chans.len(), 1, "b has no connection, `fuse` is not a tree");
        let ca = &chans[&a];
        assert_eq!(ca.journal().map(Journal::slots), Some(128 * 1024 / 512));
        assert!(ca.fd().as_fd().try_clone_to_owned().is_ok());
    }
}
