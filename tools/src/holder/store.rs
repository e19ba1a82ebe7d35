//! The holder's file-descriptor store: descriptors a server asks it to keep for its successors — in
//! `fuse` mount mode, each layer's tree connection and its journal (`strata_fs::trees`).
//!
//! It is systemd's store, played by the holder, with systemd's messages ([`crate::systemd::Keeper`]
//! sends them, [`crate::systemd::parse_store`] reads them): `FDSTORE=1` with `FDNAME=` and the
//! descriptors in `SCM_RIGHTS` keeps them, `FDSTOREREMOVE=1` closes them. Each server gets its own end
//! of a new `SOCK_SEQPACKET` socket pair (named `store=N` in [`super::ENV`]); a thread of the holder
//! reads the other end until the server is gone (end of file: every copy of the server's end closed).
//! Before the holder starts a successor it waits for that end of file ([`FdStore::settle`], bounded),
//! so a descriptor a server kept just before it died is handed on too. What is kept is passed to every
//! server at start as inherited descriptors named in [`KEPT_ENV`] (`fd:name,...`), as systemd names
//! them in `LISTEN_FDNAMES`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::io::{fcntl_setfd, FdFlags};
use rustix::net::{
    recvmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SocketFlags, SocketType,
};

use crate::systemd::{parse_store, StoreMessage};

/// The environment variable naming the kept descriptors a server inherits: `fd:name,fd:name,...`.
pub const KEPT_ENV: &str = "STRATAD_KEPT";

/// How long the holder waits for a dead server's last messages before starting its successor.
const SETTLE: Duration = Duration::from_secs(2);

/// Descriptors kept for the node's servers, in the order they were kept.
#[derive(Default)]
pub struct FdStore {
    kept: Arc<Mutex<Vec<(String, OwnedFd)>>>,
    /// Ends (sends `()`) when the current server's socket reaches end of file.
    reader: Option<Receiver<()>>,
}

impl FdStore {
    fn kept(&self) -> MutexGuard<'_, Vec<(String, OwnedFd)>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many descriptors are kept.
    pub fn len(&self) -> usize {
        self.kept().len()
    }

    /// Waits (up to [`SETTLE`]) until the previous server's messages are all read.
    pub fn settle(&mut self) {
        if let Some(r) = self.reader.take() {
            if r.recv_timeout(SETTLE).is_err() {
                tracing::warn!("the previous server's descriptor store socket is still open: starting its successor anyway");
            }
        }
    }

    /// A new socket for the next server: its end is returned (inheritable), the holder's end is read
    /// by a thread from now on. Call [`FdStore::settle`] first.
    pub fn connect(&mut self) -> io::Result<OwnedFd> {
        let (mine, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        fcntl_setfd(&theirs, FdFlags::empty())?;
        let (tx, rx) = mpsc::channel();
        let kept = self.kept.clone();
        std::thread::Builder::new()
            .name("strata-fdstore".into())
            .spawn(move || {
                read_messages(&mine, &kept);
                let _ = tx.send(());
            })?;
        self.reader = Some(rx);
        Ok(theirs)
    }

    /// The value of [`KEPT_ENV`] for a server started now.
    pub fn env(&self) -> String {
        let kept = self.kept();
        let names: Vec<String> = kept
            .iter()
            .map(|(n, fd)| format!("{}:{n}", fd.as_raw_fd()))
            .collect();
        names.join(",")
    }
}

/// Applies the messages on `sock` to `kept` until end of file.
fn read_messages(sock: &OwnedFd, kept: &Mutex<Vec<(String, OwnedFd)>>) {
    loop {
        let mut buf = [0u8; 512];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let r = match recvmsg(
            sock.as_fd(),
            &mut iov,
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "reading the descriptor store socket");
                return;
            }
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(f) = m {
                fds.extend(f);
            }
        }
        if r.bytes == 0 && fds.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&buf[..r.bytes]);
        let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        match parse_store(&text) {
            Some(StoreMessage::Keep(name)) => {
                for fd in fds {
                    // Inherited by the next server (and closed by the holder when forgotten).
                    match fcntl_setfd(&fd, FdFlags::empty()) {
                        Ok(()) => kept.push((name.clone(), fd)),
                        Err(e) => tracing::error!(error = %e, name, "cannot keep a descriptor"),
                    }
                }
            }
            Some(StoreMessage::Remove(name)) => kept.retain(|(n, _)| *n != name),
            None => tracing::warn!(message = %text, "not a descriptor store message: ignored"),
        }
    }
}

/// The kept descriptors a server inherited (named by [`KEPT_ENV`], removed from the environment),
/// close-on-exec from now on.
pub fn take_kept() -> io::Result<Vec<(String, OwnedFd)>> {
    let Ok(spec) = std::env::var(KEPT_ENV) else {
        return Ok(Vec::new());
    };
    std::env::remove_var(KEPT_ENV);
    let mut out = Vec::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let parsed = item
            .split_once(':')
            .and_then(|(fd, name)| Some((fd.parse::<i32>().ok()?, name)));
        let Some((fd, name)) = parsed.filter(|(fd, _)| *fd > 2) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{KEPT_ENV}: {item:?} is not fd:name"),
            ));
        };
        // SAFETY: the holder left this descriptor open across exec for this process and named it in
        // KEPT_ENV (removed above, so it is taken once); nothing else in this process owns it.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        fcntl_setfd(&fd, FdFlags::CLOEXEC)?;
        out.push((name.to_string(), fd));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::systemd::Keeper;
    use strata_fs::trees::Keeper as _;

    #[test]
    fn kept_descriptors_outlive_the_server_socket_and_forgotten_ones_go() {
        let mut store = FdStore::default();
        let theirs = store.connect().expect("socket pair");
        let server = Keeper::Holder(theirs);
        let f = std::fs::File::open("/dev/null").expect("open");
        server
            .keep("tree-a", &[f.as_fd(), f.as_fd()])
            .expect("keep");
        server.keep("tree-b", &[f.as_fd()]).expect("keep");
        server.forget("tree-a").expect("forget");
        drop(server);
        store.settle();
        assert_eq!(store.len(), 1, "tree-b kept, tree-a closed");
        let env = store.env();
        assert!(env.ends_with(":tree-b") && !env.contains(','), "{env}");
        // A second server starts with a new socket; the first one's messages are all applied.
        let theirs = store.connect().expect("socket pair");
        drop(theirs);
        store.settle();
        assert_eq!(store.len(), 1);
    }
}
