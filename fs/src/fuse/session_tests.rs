//! The request loop over a socket pair standing in for `/dev/fuse` (a `SOCK_SEQPACKET` pair keeps
//! message boundaries as the device does): no root, no kernel FUSE.

use std::sync::Mutex;

use zerocopy::FromBytes;

use super::*;
use crate::fuse::proto::{AttrOut, EntryOut, InitIn, InitOut};
use crate::testkit::{pair, read_arg, recv, send};

/// Answers lookups of "f" (node 5) and reads with the offset's low byte repeated; holds read replies
/// of node 6 for the test to answer later.
#[derive(Default)]
struct Fake {
    held: Mutex<Vec<Reply>>,
}

impl Filesystem for Fake {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno> {
        match (parent, name) {
            (1, b"f") => Ok(Attr {
                ino: 5,
                size: 100,
                mode: proto::S_IFREG | 0o400,
                ..Default::default()
            }),
            _ => Err(Errno::NOENT),
        }
    }
    fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        self.lookup(1, b"f")
            .ok()
            .filter(|a| a.ino == ino)
            .ok_or(Errno::NOENT)
    }
    fn open(&self, _ino: u64, _flags: u32) -> Result<u32, Errno> {
        Ok(proto::FOPEN_KEEP_CACHE)
    }
    fn read(&self, ino: u64, offset: u64, size: u32, reply: Reply) {
        match ino {
            6 => self.held.lock().expect("lock").push(reply),
            _ => reply.data(&[&vec![offset as u8; size as usize]]),
        }
    }
    fn readdir(&self, _ino: u64) -> Result<Arc<Entries>, Errno> {
        Ok(Arc::new(vec![(5, proto::DT_REG, b"f".to_vec())]))
    }
}

/// A one-worker session over a fresh pair serving [`Fake`], `immutable` or not: (the kernel's end, it).
fn started(immutable: bool) -> (std::os::fd::OwnedFd, Session) {
    let (kernel, server) = pair();
    let opts = Options {
        immutable,
        ..Options::default()
    };
    let chan = Arc::new(Channel::from_fd(server));
    let s = Session::start(chan, Arc::new(Fake::default()), 1, opts).expect("start");
    (kernel, s)
}

#[test]
fn init_lookup_getattr_read_readdir_and_unknown_ops() {
    let (kernel, server) = pair();
    let fs = Arc::new(Fake::default());
    let s = Session::start(
        Arc::new(Channel::from_fd(server)),
        fs,
        2,
        Options::default(),
    )
    .expect("start");
    let init = InitIn {
        major: 7,
        minor: 41,
        max_readahead: 1 << 17,
        flags: (init::ASYNC_DIO | init::MAX_PAGES | init::INIT_EXT) as u32,
        flags2: (init::HAS_RESEND >> 32) as u32,
        ..Default::default()
    };
    send(&kernel, op::INIT, 1, 0, init.as_bytes());
    let (h, body) = recv(&kernel);
    assert_eq!((h.unique, h.error), (1, 0));
    let out = InitOut::read_from_prefix(&body).expect("init out").0;
    assert_eq!((out.major, out.minor, out.max_pages), (7, 31, 256));
    // Only what the kernel offered, capped readahead.
    assert_eq!(
        u64::from(out.flags),
        init::ASYNC_DIO | init::MAX_PAGES | init::INIT_EXT
    );
    assert_eq!(out.max_readahead, 1 << 17);
    assert!(s.stats.kernel_resend.load(Ordering::Relaxed));

    send(&kernel, op::LOOKUP, 2, 1, b"f\0");
    let (h, body) = recv(&kernel);
    let e = EntryOut::read_from_prefix(&body).expect("entry").0;
    assert_eq!((h.unique, e.nodeid, e.attr.size), (2, 5, 100));
    send(&kernel, op::LOOKUP, 3, 1, b"nope\0");
    assert_eq!(recv(&kernel).0.error, -libc::ENOENT);
    send(&kernel, op::GETATTR, 4, 5, &[0; 16]);
    let (_, body) = recv(&kernel);
    assert_eq!(
        AttrOut::read_from_prefix(&body).expect("attr").0.attr.ino,
        5
    );
    send(&kernel, op::READ, 5, 5, &read_arg(7, 10));
    let (h, body) = recv(&kernel);
    assert_eq!((h.unique, body), (5, vec![7u8; 10]));
    send(&kernel, op::READDIR, 6, 1, &read_arg(0, 4096));
    let (_, body) = recv(&kernel);
    assert_eq!(
        body.len(),
        3 * proto::dirent_size(1).max(proto::dirent_size(2))
    );
    // FORGET gets no reply: the next reply is the unknown op's ENOSYS.
    send(&kernel, op::FORGET, 7, 5, &[1, 0, 0, 0, 0, 0, 0, 0]);
    send(&kernel, 999, 8, 1, &[]);
    let (h, _) = recv(&kernel);
    assert_eq!((h.unique, h.error), (8, -libc::ENOSYS));
    drop(kernel);
    s.join();
}

#[test]
fn replies_come_from_any_thread_later_and_a_dropped_reply_is_eio() {
    let (kernel, server) = pair();
    let fs = Arc::new(Fake::default());
    let s = Session::start(
        Arc::new(Channel::from_fd(server)),
        fs.clone(),
        1,
        Options::default(),
    )
    .expect("start");
    // Two reads held by the filesystem do not hold the only worker: a third is answered first.
    send(&kernel, op::READ, 10, 6, &read_arg(0, 4));
    send(&kernel, op::READ, 11, 6, &read_arg(0, 4));
    send(&kernel, op::READ, 12, 5, &read_arg(3, 4));
    assert_eq!(recv(&kernel).0.unique, 12);
    let (a, b) = {
        let mut held = fs.held.lock().expect("lock");
        assert_eq!(held.len(), 2);
        let b = held.pop().expect("held");
        (held.pop().expect("held"), b)
    };
    std::thread::spawn(move || a.data(&[b"late"]))
        .join()
        .expect("thread");
    let (h, body) = recv(&kernel);
    assert_eq!((h.unique, body.as_slice()), (10, &b"late"[..]));
    drop(b);
    let (h, _) = recv(&kernel);
    assert_eq!((h.unique, h.error), (11, -libc::EIO));
    drop(kernel);
    s.join();
}

#[test]
fn a_stopped_session_leaves_requests_unanswered_for_a_successor() {
    let (kernel, server) = pair();
    let chan = Arc::new(Channel::from_fd(server));
    let s = Session::start(
        chan.clone(),
        Arc::new(Fake::default()),
        1,
        Options::default(),
    )
    .expect("start");
    s.stop();
    send(&kernel, op::READ, 20, 5, &read_arg(0, 4));
    s.join();
    // The successor on the same channel answers the next request; the first was left alone.
    let s2 = Session::start(chan, Arc::new(Fake::default()), 1, Options::default()).expect("start");
    send(&kernel, op::READ, 21, 5, &read_arg(1, 4));
    let (h, body) = recv(&kernel);
    assert_eq!((h.unique, body), (21, vec![1u8; 4]));
    drop(kernel);
    s2.join();
}

#[test]
fn an_immutable_tree_caches_missing_names_and_opens_without_messages() {
    let (kernel, s) = started(true);
    // A missing name: node 0 with a timeout (a negative entry the kernel keeps), not ENOENT.
    send(&kernel, op::LOOKUP, 30, 1, b"nope\0");
    let (h, body) = recv(&kernel);
    let e = EntryOut::read_from_prefix(&body).expect("entry").0;
    assert_eq!((h.error, e.nodeid, e.entry_valid), (0, 0, 3600));
    // Opens are ENOSYS: the kernel then opens by itself, with KEEP_CACHE and CACHE_DIR.
    send(&kernel, op::OPEN, 31, 5, &[0; 8]);
    assert_eq!(recv(&kernel).0.error, -libc::ENOSYS);
    send(&kernel, op::OPENDIR, 32, 1, &[0; 8]);
    assert_eq!(recv(&kernel).0.error, -libc::ENOSYS);
    drop(kernel);
    s.join();
}

#[test]
fn a_close_never_waits_for_the_server() {
    let (kernel, s) = started(false);
    // Every open says: no FLUSH on close; a FLUSH is ENOSYS, after which the kernel sends none.
    send(&kernel, op::OPEN, 31, 5, &[0; 8]);
    let (_, body) = recv(&kernel);
    let o = proto::OpenOut::read_from_prefix(&body).expect("open").0;
    assert_eq!(o.open_flags, proto::FOPEN_KEEP_CACHE | proto::FOPEN_NOFLUSH);
    send(&kernel, op::FLUSH, 32, 5, &[0; 24]);
    assert_eq!(recv(&kernel).0.error, -libc::ENOSYS);
    // A missing name of a tree that may change is ENOENT, remembered nowhere.
    send(&kernel, op::LOOKUP, 33, 1, b"nope\0");
    assert_eq!(recv(&kernel).0.error, -libc::ENOENT);
    drop(kernel);
    s.join();
}

#[test]
fn an_immutable_tree_lists_with_attributes_and_lets_the_kernel_cache_links() {
    let (kernel, s) = started(true);
    let offered = init::MAX_PAGES | init::DO_READDIRPLUS | init::CACHE_SYMLINKS;
    let init = InitIn {
        major: 7,
        minor: 41,
        max_readahead: 1 << 17,
        flags: offered as u32,
        ..Default::default()
    };
    send(&kernel, op::INIT, 1, 0, init.as_bytes());
    let out = InitOut::read_from_prefix(&recv(&kernel).1).expect("init").0;
    assert_eq!(u64::from(out.flags), offered);
    // ".", ".." and "f", each with its place; only "f" carries a lookup answer (its dentry).
    send(&kernel, op::READDIRPLUS, 2, 1, &read_arg(0, 4096));
    let (h, body) = recv(&kernel);
    assert_eq!(h.error, 0);
    let mut rest = &body[..];
    let mut seen = Vec::new();
    while !rest.is_empty() {
        let (e, after) = EntryOut::read_from_prefix(rest).expect("entry");
        let (d, name) = proto::Dirent::read_from_prefix(after).expect("dirent");
        let name = name[..d.namelen as usize].to_vec();
        seen.push((e.nodeid, e.entry_valid, d.ino, d.off, name.clone()));
        rest = &rest[proto::direntplus_size(name.len())..];
    }
    assert_eq!(
        seen,
        vec![
            (0, 0, 1, 1, b".".to_vec()),
            (0, 0, 1, 2, b"..".to_vec()),
            (5, 3600, 5, 3, b"f".to_vec()),
        ]
    );
    // From an offset, and in a buffer too small for the next entry: nothing, not a cut entry.
    send(&kernel, op::READDIRPLUS, 3, 1, &read_arg(2, 4096));
    assert_eq!(recv(&kernel).1.len(), proto::direntplus_size(1));
    send(&kernel, op::READDIRPLUS, 4, 1, &read_arg(2, 100));
    assert!(recv(&kernel).1.is_empty());
    drop(kernel);
    s.join();
}

#[test]
fn a_tree_that_may_change_lists_without_attributes() {
    let (kernel, s) = started(false);
    let init = InitIn {
        major: 7,
        minor: 41,
        flags: (init::DO_READDIRPLUS | init::CACHE_SYMLINKS) as u32,
        ..Default::default()
    };
    send(&kernel, op::INIT, 1, 0, init.as_bytes());
    let out = InitOut::read_from_prefix(&recv(&kernel).1).expect("init").0;
    assert_eq!(out.flags, 0);
    drop(kernel);
    s.join();
}
