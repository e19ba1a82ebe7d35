//! strata's own FUSE server: a connection that outlives the process serving it.
//!
//! The blob server's FUSE connection is a kernel object behind a `/dev/fuse` descriptor. Kernel EROFS
//! mounts and every sandbox's overlay sit on it, and they live exactly as long as *some* process holds
//! that descriptor open — not as long as the process that answers requests. So the descriptor is held by
//! a process that does nothing else (stratad's holder, or systemd's file-descriptor store), and the server
//! that answers it can die or be replaced:
//!
//! - **No new `INIT`.** A successor serves the same connection as it finds it. The kernel sends `INIT`
//!   once, to whichever server reads it first; every server answers it the same way ([`session`]).
//! - **Stable node ids.** A node id means the same file to every server: blob files get ids derived from
//!   their digests (see `blobfs`), so the kernel's cached lookups and open files stay valid.
//! - **Nothing lost in flight.** Requests a dead server had read but not answered stay in the
//!   connection's processing queue (the descriptor never closed, so the kernel did not end them). A
//!   successor writes `FUSE_NOTIFY_RESEND` (Linux 6.9+) and the kernel queues them again. Older kernels
//!   cannot: every server records what it reads in the connection's [`journal`] (shared memory kept by
//!   the holder with the descriptor), and a successor answers what its predecessor left there.
//! - **One descriptor, no clones.** Every worker thread reads the one shared descriptor. A cloned
//!   descriptor (`FUSE_DEV_IOC_CLONE`, as fuser uses) has its own processing queue, and closing it — as
//!   a dying server does — ends its requests with an error: a failed read in some sandbox.
//!
//! Replies can be written from any thread, at any time after the request was read ([`session::Reply`]):
//! a read waiting on the network holds no worker thread. This module owns the wire format ([`proto`]),
//! the descriptor and the mount ([`Channel`]), and the request loop ([`session`]); what the files are is
//! the [`session::Filesystem`] implementation's business (`crate::blobfs`, and in `fuse` mount mode
//! `crate::treefs`, whose per-layer connections survive the same way: `crate::control::trees`).

pub mod journal;
pub mod proto;
pub mod session;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags};
use rustix::mount::MountFlags;
use zerocopy::IntoBytes;

/// An open FUSE connection (`/dev/fuse` descriptor), mounted somewhere, with its request journal.
pub struct Channel {
    fd: OwnedFd,
    journal: Option<journal::Journal>,
}

/// How a read of the device ended.
pub enum Received {
    /// A request of this many bytes.
    Request(usize),
    /// Nothing this time (a request was interrupted before we read it, or a signal): read again.
    Retry,
    /// The filesystem was unmounted or the connection aborted: serving is over.
    Gone,
}

impl Channel {
    /// Wraps a descriptor of an existing connection (inherited from the holder or systemd).
    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel { fd, journal: None }
    }

    /// The same connection with its request journal (inherited with it).
    pub fn with_journal(mut self, j: journal::Journal) -> Channel {
        self.journal = Some(j);
        self
    }

    /// The request journal, if the connection has one (a holder's connection always has).
    pub fn journal(&self) -> Option<&journal::Journal> {
        self.journal.as_ref()
    }

    /// Opens a new connection and mounts it read-only (`nodev`, `nosuid`, `noexec`) at `target`. Without
    /// `allow_other` only root reaches the files; with it, the files' modes decide (`default_permissions`).
    pub fn mount(target: &Path, allow_other: bool) -> io::Result<Channel> {
        let flags =
            MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID | MountFlags::NOEXEC;
        let chan = Self::mount_with(target, flags, allow_other, allow_other)?;
        Ok(chan.with_new_journal(journal::SLOTS))
    }

    /// The connection with a new request journal of `slots` slots; without one (logged) if the memfd
    /// cannot be made.
    fn with_new_journal(self, slots: usize) -> Channel {
        match journal::Journal::create_with(slots) {
            Ok(j) => self.with_journal(j),
            Err(e) => {
                tracing::warn!(error = %e, "no FUSE request journal: a dead server's reads are lost on kernels without FUSE_NOTIFY_RESEND");
                self
            }
        }
    }

    /// Opens a new connection for a layer's whole tree (`crate::treefs`) and mounts it read-only at
    /// `target`: `nodev` and `nosuid` like every image mount (`crate::mount`), but programs may run, and
    /// the kernel checks the served modes and owners (`default_permissions`) for every caller. Like
    /// the blob server's, the connection outlives its server (its descriptor and journal are kept by
    /// the holder: `crate::control::trees`), with a smaller journal ([`journal::TREE_SLOTS`]): one per layer.
    pub fn mount_tree(target: &Path, allow_other: bool) -> io::Result<Channel> {
        let flags = MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID;
        let chan = Self::mount_with(target, flags, allow_other, true)?;
        Ok(chan.with_new_journal(journal::TREE_SLOTS))
    }

    fn mount_with(
        target: &Path,
        flags: MountFlags,
        allow_other: bool,
        default_permissions: bool,
    ) -> io::Result<Channel> {
        let fd = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())?;
        let mut data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        );
        if allow_other {
            data.push_str(",allow_other");
        }
        if default_permissions {
            data.push_str(",default_permissions");
        }
        let data =
            CString::new(data).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        rustix::mount::mount("strata", target, "fuse.strata", flags, data.as_c_str())?;
        Ok(Channel { fd, journal: None })
    }

    /// The descriptor (to hand to a successor or systemd's store).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Reads one request into `buf` (at least [`proto::MIN_READ_BUFFER`] bytes).
    pub fn receive(&self, buf: &mut [u8]) -> io::Result<Received> {
        use rustix::io::Errno;
        match rustix::io::read(&self.fd, buf) {
            Ok(n) => Ok(Received::Request(n)),
            Err(Errno::NOENT | Errno::INTR | Errno::AGAIN) => Ok(Received::Retry),
            Err(Errno::NODEV) => Ok(Received::Gone),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes one message (header and body parts) to the kernel. A reply to a request that no longer
    /// exists (interrupted, or already answered after a resend) is not an error.
    pub fn send(&self, parts: &[&[u8]]) -> io::Result<()> {
        use rustix::io::Errno;
        let iov: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
        match rustix::io::writev(&self.fd, &iov) {
            Ok(_) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks the kernel to queue again every request that was read but not answered (by a server that
    /// died). Linux 6.9 and later; older kernels refuse (the caller logs it: in-flight reads of a dead
    /// server then wait until their deadline).
    pub fn notify_resend(&self) -> io::Result<()> {
        let h = proto::out_header(0, proto::NOTIFY_RESEND, 0);
        rustix::io::write(&self.fd, h.as_bytes())?;
        Ok(())
    }
}
