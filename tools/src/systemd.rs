//! The two parts of systemd's protocol stratad speaks, without libsystemd: notifications on
//! `$NOTIFY_SOCKET` (`READY=1` for `Type=notify`, and `FDSTORE=1` to park the FUSE connection's
//! descriptor in the service's file-descriptor store) and descriptors passed back at start
//! (`$LISTEN_FDS`, named by `$LISTEN_FDNAMES`). Both are a few lines of socket code; where no systemd
//! runs (as on the machines this is tested on) the test suite plays systemd's part.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use rustix::net::{
    sendmsg, sendmsg_addr, socket_with, AddressFamily, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// True when started by systemd with a notification socket (`Type=notify`).
pub fn notify_socket() -> Option<String> {
    std::env::var("NOTIFY_SOCKET")
        .ok()
        .filter(|s| !s.is_empty())
}

/// Sends `state` (e.g. `READY=1`) with `fds` attached; `Ok(false)` when there is no notification
/// socket.
pub fn notify(state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<bool> {
    let Some(path) = notify_socket() else {
        return Ok(false);
    };
    let addr = match path.strip_prefix('@') {
        Some(name) => SocketAddrUnix::new_abstract_name(name.as_bytes())?,
        None => SocketAddrUnix::new(path.as_str())?,
    };
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    send(sock.as_fd(), Some(&addr), state, fds)?;
    Ok(true)
}

/// Sends the message `state` with `fds` attached on `sock`, to `addr` (or its peer).
fn send(
    sock: BorrowedFd<'_>,
    addr: Option<&SocketAddrUnix>,
    state: &str,
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let mut space =
        vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(
            "too many descriptors for one notification",
        ));
    }
    let iov = [io::IoSlice::new(state.as_bytes())];
    match addr {
        Some(a) => sendmsg_addr(sock, a, &iov, &mut control, SendFlags::empty())?,
        None => sendmsg(sock, &iov, &mut control, SendFlags::empty())?,
    };
    Ok(())
}

/// A file-descriptor store message.
#[derive(Debug, PartialEq, Eq)]
pub enum StoreMessage {
    /// `FDSTORE=1`: keep the attached descriptors under this name.
    Keep(String),
    /// `FDSTOREREMOVE=1`: close what is kept under this name.
    Remove(String),
}

/// Reads a file-descriptor store message (`None`: another notification, or a name a list of kept
/// descriptors cannot carry: empty, longer than 255 bytes, or with `:`, `,` or a control character).
pub fn parse_store(text: &str) -> Option<StoreMessage> {
    let name = text.lines().find_map(|l| l.strip_prefix("FDNAME="))?;
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b',');
    if !ok {
        return None;
    }
    let has = |k: &str| text.lines().any(|l| l == k);
    match (has("FDSTORE=1"), has("FDSTOREREMOVE=1")) {
        (true, false) => Some(StoreMessage::Keep(name.to_string())),
        (false, true) => Some(StoreMessage::Remove(name.to_string())),
        _ => None,
    }
}

/// Where a server keeps descriptors that must outlive it: systemd's file-descriptor store, or its
/// holder's (a socket the holder gave it).
pub enum Keeper {
    Systemd,
    Holder(OwnedFd),
}

impl strata_fs::trees::Keeper for Keeper {
    fn keep(&self, name: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let msg = format!("FDSTORE=1\nFDNAME={name}");
        match self {
            Keeper::Systemd => notify(&msg, fds).map(|_| ()),
            Keeper::Holder(sock) => send(sock.as_fd(), None, &msg, fds),
        }
    }

    fn forget(&self, name: &str) -> io::Result<()> {
        let msg = format!("FDSTOREREMOVE=1\nFDNAME={name}");
        match self {
            Keeper::Systemd => notify(&msg, &[]).map(|_| ()),
            Keeper::Holder(sock) => send(sock.as_fd(), None, &msg, &[]),
        }
    }
}

/// Descriptors systemd passed to this process, with their names (`LISTEN_FDNAMES`). Taken once: the
/// variables are removed so that children do not see them.
pub fn take_listen_fds() -> Vec<(String, OwnedFd)> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let n = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(0);
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    if !pid_ok || n <= 0 {
        return Vec::new();
    }
    let mut names = names.split(':');
    (0..n.min(64))
        .map(|i| {
            let name = names.next().unwrap_or("unknown").to_string();
            // SAFETY: systemd passes LISTEN_FDS open descriptors from 3 on to the process named by
            // LISTEN_PID (checked above); they are taken here once and owned from now on.
            let fd = unsafe { OwnedFd::from_raw_fd(3 + i) };
            (name, fd)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_messages_parse_and_bad_names_are_refused() {
        let keep = parse_store("FDSTORE=1\nFDNAME=tree-ab12");
        assert_eq!(keep, Some(StoreMessage::Keep("tree-ab12".into())));
        let rm = parse_store("FDSTOREREMOVE=1\nFDNAME=tree-ab12");
        assert_eq!(rm, Some(StoreMessage::Remove("tree-ab12".into())));
        for bad in [
            "READY=1",
            "FDSTORE=1",
            "FDSTORE=1\nFDNAME=",
            "FDSTORE=1\nFDNAME=a:b",
            "FDSTORE=1\nFDNAME=a,b",
            "FDSTORE=1\nFDSTOREREMOVE=1\nFDNAME=a",
        ] {
            assert_eq!(parse_store(bad), None, "{bad:?}");
        }
        assert_eq!(
            parse_store(&format!("FDSTORE=1\nFDNAME={}", "x".repeat(256))),
            None
        );
    }
}
