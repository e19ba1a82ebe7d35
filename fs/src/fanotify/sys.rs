//! The fanotify calls `fanotify` mode needs, typed: a pre-content group, inode marks for
//! `FAN_PRE_ACCESS`, the events the kernel writes and the answers it takes.
//!
//! Neither rustix nor nix has pre-content events yet (Linux 6.14), so the two system calls go through
//! `libc` and the event records are parsed here, bounds-checked: a record's length comes from the
//! kernel, but a parser that trusts lengths is one kernel change away from reading past its buffer.
//!
//! **Layout facts** (`include/uapi/linux/fanotify.h`): an event is a 24-byte
//! `fanotify_event_metadata` (`event_len: u32, vers: u8, reserved: u8, metadata_len: u16, mask: u64,
//! fd: i32, pid: i32`) followed by info records, each a 4-byte header (`info_type: u8, pad: u8, len:
//! u16`); a pre-content event carries a range record (type 6: header, 4 bytes of padding, `offset:
//! u64, count: u64`). An answer is `fanotify_response { fd: i32, response: u32 }`; a denial may carry
//! an errno in the response's top byte (`FAN_DENY_ERRNO`, pre-content groups only).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `FAN_PRE_ACCESS`: before a read or write of a file's content, with the range (Linux 6.14).
pub const FAN_PRE_ACCESS: u64 = 0x0010_0000;
const FAN_CLASS_PRE_CONTENT: u32 = 0x08;
const FAN_CLOEXEC: u32 = 0x01;
const FAN_NONBLOCK: u32 = 0x02;
const FAN_MARK_ADD: u32 = 0x01;
const FAN_MARK_REMOVE: u32 = 0x02;
const FAN_ALLOW: u32 = 0x01;
const FAN_DENY: u32 = 0x02;
const FAN_EVENT_INFO_TYPE_RANGE: u8 = 6;
const METADATA_VERSION: u8 = 3;
/// Bytes of `fanotify_event_metadata`.
pub const METADATA_LEN: usize = 24;
/// Bytes of an event with its range record: what a read buffer is sized in.
pub const EVENT_WITH_RANGE: usize = METADATA_LEN + 24;

/// A pre-content fanotify group (its descriptor).
pub struct Group {
    fd: OwnedFd,
}

/// One event as read from the group.
#[derive(Debug, PartialEq, Eq)]
pub struct Event {
    pub mask: u64,
    /// The descriptor of the file accessed (opened for this process by the kernel, without events of
    /// its own); `None` when the kernel could not open one (`FAN_NOFD`, or an error it reports as a
    /// negative fd).
    pub fd: Option<RawFd>,
    pub pid: u32,
    /// The range accessed: `(offset, count)`.
    pub range: Option<(u64, u64)>,
}

/// What the kernel wrote that this parser cannot take.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("fanotify event at byte {at}: length {len} runs past the {buf} bytes read")]
    Truncated { at: usize, len: usize, buf: usize },
    #[error(
        "fanotify event at byte {at}: metadata version {version}, expected {METADATA_VERSION}"
    )]
    Version { at: usize, version: u8 },
}

/// How an event is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Allow,
    /// Refused; the access fails with this errno (the kernel takes EIO, EPERM, EBUSY, ETXTBSY,
    /// EAGAIN, ENOSPC, EDQUOT).
    Deny(i32),
}

impl Answer {
    fn bits(self) -> u32 {
        match self {
            Answer::Allow => FAN_ALLOW,
            Answer::Deny(errno) => FAN_DENY | ((errno as u32 & 0xff) << 24),
        }
    }
}

impl Group {
    /// A new pre-content group whose event descriptors are opened read-write (the daemon fills the
    /// file through them). Fails with `EINVAL` on kernels before pre-content events were added and
    /// `EPERM` without `CAP_SYS_ADMIN`.
    pub fn new() -> io::Result<Group> {
        let flags = FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK;
        let event_flags = (libc::O_RDWR | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32;
        // SAFETY: plain system call; the result is a new descriptor or -1.
        let fd = unsafe { libc::fanotify_init(flags, event_flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us alone.
        Ok(Group {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// A group kept by a predecessor (its descriptor, from the keeper).
    pub fn from_fd(fd: OwnedFd) -> Group {
        Group { fd }
    }

    /// Watches `path`'s inode for `FAN_PRE_ACCESS`. Adding a mark twice is one mark.
    pub fn mark(&self, path: &Path) -> io::Result<()> {
        self.mark_op(FAN_MARK_ADD, path)
    }

    /// Stops watching `path`'s inode.
    pub fn unmark(&self, path: &Path) -> io::Result<()> {
        self.mark_op(FAN_MARK_REMOVE, path)
    }

    fn mark_op(&self, op: u32, path: &Path) -> io::Result<()> {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let r = unsafe {
            libc::fanotify_mark(
                self.fd.as_raw_fd(),
                op,
                FAN_PRE_ACCESS,
                libc::AT_FDCWD,
                c.as_ptr(),
            )
        };
        match r {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// Reads whatever events are queued into `buf` (none: `WouldBlock`); returns the bytes read.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        rustix::io::read(&self.fd, buf).map_err(io::Error::from)
    }

    /// Waits up to `timeout_ms` for events to read.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut p = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let t = rustix::event::Timespec {
            tv_sec: i64::from(timeout_ms / 1000),
            tv_nsec: i64::from(timeout_ms % 1000) * 1_000_000,
        };
        match rustix::event::poll(&mut p, Some(&t)) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::INTR) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Answers the event that came with descriptor number `fd` (the number is what the kernel matches,
    /// so a successor can answer what a dead server read).
    pub fn answer(&self, fd: RawFd, answer: Answer) -> io::Result<()> {
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&fd.to_ne_bytes());
        b[4..].copy_from_slice(&answer.bits().to_ne_bytes());
        rustix::io::write(&self.fd, &b)
            .map(drop)
            .map_err(io::Error::from)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Parses the events in `buf` (as [`Group::read`] filled it).
pub fn parse(buf: &[u8]) -> Result<Vec<Event>, ParseError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let rest = &buf[at..];
        let truncated = |len| ParseError::Truncated {
            at,
            len,
            buf: buf.len(),
        };
        if rest.len() < METADATA_LEN {
            return Err(truncated(METADATA_LEN));
        }
        let u32_at =
            |o: usize| u32::from_ne_bytes([rest[o], rest[o + 1], rest[o + 2], rest[o + 3]]);
        let event_len = u32_at(0) as usize;
        if rest[4] != METADATA_VERSION {
            return Err(ParseError::Version {
                at,
                version: rest[4],
            });
        }
        let meta_len = usize::from(u16::from_ne_bytes([rest[6], rest[7]]));
        if event_len < METADATA_LEN || event_len > rest.len() || meta_len > event_len {
            return Err(truncated(event_len));
        }
        let mut mask = [0u8; 8];
        mask.copy_from_slice(&rest[8..16]);
        let fd = u32_at(16) as i32;
        let pid = u32_at(20);
        let range = parse_range(&rest[meta_len.max(METADATA_LEN)..event_len]);
        out.push(Event {
            mask: u64::from_ne_bytes(mask),
            fd: (fd >= 0).then_some(fd),
            pid,
            range,
        });
        at += event_len;
    }
    Ok(out)
}

/// The range record among an event's info records, if any (malformed records end the search).
fn parse_range(mut info: &[u8]) -> Option<(u64, u64)> {
    while info.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([info[2], info[3]]));
        if len < 4 || len > info.len() {
            return None;
        }
        if info[0] == FAN_EVENT_INFO_TYPE_RANGE && len >= 24 {
            let u64_at = |o: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&info[o..o + 8]);
                u64::from_ne_bytes(b)
            };
            return Some((u64_at(8), u64_at(16)));
        }
        info = &info[len..];
    }
    None
}

/// Whether this kernel has pre-content events, tried on `file` (a regular file the caller may
/// remove afterwards): `None` if so, else why not.
pub fn probe(file: &Path) -> Option<String> {
    let g = match Group::new() {
        Ok(g) => g,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return Some("no fanotify pre-content groups (Linux < 6.14 or CONFIG_FANOTIFY_ACCESS_PERMISSIONS off)".into())
        }
        Err(e) => return Some(format!("fanotify_init: {e}")),
    };
    match g.mark(file) {
        Ok(()) => None,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Some(format!(
            "fanotify refuses FAN_PRE_ACCESS marks (Linux < 6.14): {e}"
        )),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Some(format!(
            "{}'s filesystem has no pre-content events (ext4, xfs and btrfs have; tmpfs has not): {e}",
            file.parent().unwrap_or(file).display()
        )),
        Err(e) => Some(format!("fanotify_mark FAN_PRE_ACCESS: {e}")),
    }
}

/// Pages of `len` bytes at `offset` of `file` that are in the page cache (`len` 0: to the end of
/// the file), by `cachestat(2)` (Linux 6.5; `fanotify` mode needs 6.14). Not `mincore` over a
/// mapping: mapping a watched view file is a pre-content event for all of it, which fills it.
pub fn cached_pages(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<u64> {
    Ok(page_counts(file, offset, len)?.0)
}

/// Of the pages [`cached_pages`] counts, those dirty too: `(cached, dirty)`.
pub fn page_counts(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<(u64, u64)> {
    // `struct cachestat_range` and `struct cachestat` (include/uapi/linux/mman.h).
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    const _: () = assert!(std::mem::size_of::<Range>() == 16);
    const _: () = assert!(std::mem::size_of::<Stat>() == 40);
    // One number on every architecture (the common syscall table); libc names it for only some.
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off: offset, len };
    let mut st = Stat::default();
    // SAFETY: the kernel reads `range` and writes `st`, both live, of its layout (asserted above).
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.cache, st.dirty))
}

#[cfg(test)]
pub(crate) fn encode(e: &Event) -> Vec<u8> {
    let len = if e.range.is_some() {
        EVENT_WITH_RANGE
    } else {
        METADATA_LEN
    };
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&[METADATA_VERSION, 0]);
    b.extend_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
    b.extend_from_slice(&e.mask.to_ne_bytes());
    b.extend_from_slice(&e.fd.unwrap_or(-1).to_ne_bytes());
    b.extend_from_slice(&e.pid.to_ne_bytes());
    if let Some((o, c)) = e.range {
        b.extend_from_slice(&[FAN_EVENT_INFO_TYPE_RANGE, 0]);
        b.extend_from_slice(&24u16.to_ne_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&o.to_ne_bytes());
        b.extend_from_slice(&c.to_ne_bytes());
    }
    b
}
