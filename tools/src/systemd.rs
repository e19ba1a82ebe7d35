//! The two parts of systemd's protocol stratad speaks, without libsystemd: notifications on
//! `$NOTIFY_SOCKET` (`READY=1` for `Type=notify`, and `FDSTORE=1` to park the FUSE connection's
//! descriptor in the service's file-descriptor store) and descriptors passed back at start
//! (`$LISTEN_FDS`, named by `$LISTEN_FDNAMES`). Both are a few lines of socket code; where no systemd
//! runs (as on the machines this is tested on) the test suite plays systemd's part.

use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use rustix::net::{
    sendmsg_addr, socket_with, AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
    SocketAddrUnix, SocketFlags, SocketType,
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
    let mut space =
        vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(
            "too many descriptors for one notification",
        ));
    }
    sendmsg_addr(
        &sock,
        &addr,
        &[io::IoSlice::new(state.as_bytes())],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(true)
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
