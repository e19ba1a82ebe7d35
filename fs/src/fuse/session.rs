//! The request loop: worker threads read requests from the one shared descriptor and dispatch them to a
//! [`Filesystem`], which answers through plain values or, for reads, a [`Reply`] it may send later from
//! any thread.
//!
//! `INIT` is answered whenever it comes, always the same way, so a server that starts on a connection
//! another server initialized simply never sees one. Every request is recorded in the connection's
//! journal (`super::journal`) as it is read and cleared when answered. A worker that reads a request after
//! [`Session::stop`] leaves it unanswered and recorded. A session that *adopts* a connection
//! ([`Options::adopt`]) asks the kernel to resend what its predecessor left (Linux 6.9+) and frees those
//! records, or, where the kernel cannot, answers them itself from the records.
//!
//! Both filesystems served here are read-only, so a `close(2)` must never wait for a server: every
//! open is answered with `FOPEN_NOFLUSH` and a `FLUSH` (kernels before 5.16, and zero-message opens:
//! [`Options::immutable`]) with `ENOSYS`, after which the kernel sends none on that connection. Without this a process closing a file of a `fuse`
//! mode tree (or running `execve`, which closes inherited descriptors) while the server restarts would
//! wait for the successor — found when a restarting server's own fork child waited on a dead one.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::io::Errno;
use zerocopy::IntoBytes;

use super::journal::{Journal, Leftover};
use super::proto::{self, init, op, Attr, Request};
use super::{Channel, Received};

/// A directory's entries as [`Filesystem::readdir`] gives them: node id, `DT_*` kind, name.
pub type Entries = Vec<(u64, u32, Vec<u8>)>;

/// What a filesystem answers. Node ids are the caller's (`attr.ino` of a lookup is the new node's id).
pub trait Filesystem: Send + Sync + 'static {
    /// The entry `name` in directory `parent`.
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno>;
    /// The attributes of node `ino`.
    fn getattr(&self, ino: u64) -> Result<Attr, Errno>;
    /// Opens node `ino` with open(2) `flags`; returns `FOPEN_*` flags.
    fn open(&self, ino: u64, flags: u32) -> Result<u32, Errno>;
    /// Reads `size` bytes at `offset` of node `ino`; answers through `reply`, now or later.
    fn read(&self, ino: u64, offset: u64, size: u32, reply: Reply);
    /// The entries of directory `ino` (without `.` and `..`): node id, `DT_*` kind, name. The order
    /// must be stable (a directory offset is an index into it, also for a successor server). Shared,
    /// so that a server may keep a directory's entries for the many requests that list it.
    fn readdir(&self, ino: u64) -> Result<Arc<Entries>, Errno>;
    /// The target of symlink `ino`.
    fn readlink(&self, _ino: u64) -> Result<Vec<u8>, Errno> {
        Err(Errno::NOSYS)
    }
    /// The value of extended attribute `name` of `ino` (`ENODATA` when it has none).
    fn getxattr(&self, _ino: u64, _name: &[u8]) -> Result<Vec<u8>, Errno> {
        Err(Errno::NOSYS)
    }
    /// The names of `ino`'s extended attributes, each followed by a NUL.
    fn listxattr(&self, _ino: u64) -> Result<Vec<u8>, Errno> {
        Err(Errno::NOSYS)
    }
}

/// Negotiated once per connection; every server proposes the same.
#[derive(Clone, Debug)]
pub struct Options {
    /// Largest readahead the kernel may use.
    pub max_readahead: u32,
    /// Largest request in pages (256: 1 MiB reads).
    pub max_pages: u16,
    /// Asynchronous requests (reads) the kernel keeps in flight.
    pub max_background: u16,
    /// How long the kernel may cache lookups and attributes.
    pub ttl: Duration,
    /// The tree never changes (a layer's; not the blob server's directory, which gains files as layers
    /// are mounted). Then the kernel may remember missing names as long as present ones (a lookup of a
    /// name that is not there is answered as a negative entry, node 0 with [`Options::ttl`], not
    /// `ENOENT`), and opens cost no message: `OPEN` and `OPENDIR` are answered `ENOSYS`, after which the
    /// kernel opens files with `FOPEN_KEEP_CACHE` and directories with `FOPEN_CACHE_DIR` by itself (its
    /// zero-message opens, FUSE 7.23 and 7.29; we need 7.31) and sends no `RELEASE` either. Directories
    /// are listed with `READDIRPLUS` (every entry with its attributes: no lookup of a listed name), and
    /// the kernel keeps symlink targets in its page cache (`FUSE_CACHE_SYMLINKS`).
    pub immutable: bool,
    /// This session takes over a connection another server served: get back what that one left.
    pub adopt: bool,
    /// Never ask the kernel to resend (answer a predecessor's requests from the journal, as on a
    /// kernel older than 6.9): for tests of that path on newer kernels.
    pub no_resend: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            max_readahead: 1 << 20,
            max_pages: 256,
            // Reads are asynchronous requests: past this many in flight the kernel queues the rest,
            // of every file, behind them. Reads of one hung blob must not hold a healthy blob's
            // reads there (they wait in the server's per-blob queues instead, holding only memory).
            max_background: 1024,
            ttl: Duration::from_secs(3600),
            immutable: false,
            adopt: false,
            no_resend: false,
        }
    }
}

/// The answer to one request; sent at most once, from any thread. Dropping it unsent answers `EIO`,
/// so no request is ever left waiting by a bug; [`Reply::abandon`] leaves it for a successor instead.
pub struct Reply {
    chan: Arc<Channel>,
    unique: u64,
    /// The request's record in the journal, cleared once answered.
    slot: Option<usize>,
    sent: bool,
    /// The process that made the request (in the pid namespace of whoever mounted the connection).
    pid: u32,
}

impl Reply {
    fn new(chan: &Arc<Channel>, unique: u64, slot: Option<usize>, pid: u32) -> Reply {
        Reply {
            chan: chan.clone(),
            unique,
            slot,
            sent: false,
            pid,
        }
    }

    /// The process that made the request (0 when the kernel made it on no process's behalf).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Writes `parts` as the answer and frees the request's record.
    fn send(&mut self, parts: &[&[u8]]) {
        self.sent = true;
        if let Err(e) = self.chan.send(parts) {
            tracing::warn!(error = %e, "FUSE reply failed");
        }
        if let (Some(j), Some(slot)) = (self.chan.journal(), self.slot.take()) {
            j.clear(slot);
        }
    }

    /// Answers with the concatenation of `parts`.
    pub fn data(mut self, parts: &[&[u8]]) {
        let body: usize = parts.iter().map(|p| p.len()).sum();
        let h = proto::out_header(self.unique, 0, body);
        let mut all = Vec::with_capacity(parts.len() + 1);
        all.push(h.as_bytes());
        all.extend_from_slice(parts);
        self.send(&all);
    }

    /// Answers with an error.
    pub fn error(mut self, e: Errno) {
        let h = proto::out_header(self.unique, -e.raw_os_error(), 0);
        self.send(&[h.as_bytes()]);
    }

    /// Does not answer: the request stays with the kernel (and in the journal, if recorded), for a
    /// successor.
    pub fn abandon(mut self) {
        self.sent = true;
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.sent {
            let h = proto::out_header(self.unique, -Errno::IO.raw_os_error(), 0);
            self.send(&[h.as_bytes()]);
        }
    }
}

/// Counters of the loop.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    /// Requests that came back after a resend (`unique` has [`proto::UNIQUE_RESEND`]).
    pub resent: AtomicU64,
    /// Whether this server answered `INIT` (false for a successor on an initialized connection).
    pub initialized_here: AtomicBool,
    /// The kernel said it supports `FUSE_NOTIFY_RESEND` (known only to the server that saw `INIT`).
    pub kernel_resend: AtomicBool,
    /// Requests a predecessor left that this server answered from the journal (no kernel resend).
    pub replayed: AtomicU64,
}

/// Worker threads serving one connection.
pub struct Session {
    chan: Arc<Channel>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pub stats: Arc<Stats>,
}

/// Size of each worker's request buffer: requests to a read-only server are small (no writes).
const REQUEST_BUFFER: usize = 64 << 10;

impl Session {
    /// Starts `threads` workers serving `chan` with `fs`; with [`Options::adopt`], first gets back what
    /// a predecessor left unanswered (see the module documentation).
    pub fn start<F: Filesystem>(
        chan: Arc<Channel>,
        fs: Arc<F>,
        threads: usize,
        opts: Options,
    ) -> io::Result<Session> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        // Taken before any worker records a request of its own.
        let leftovers = chan.journal().map(Journal::leftovers).unwrap_or_default();
        let worker = Worker {
            chan: chan.clone(),
            fs,
            stop: stop.clone(),
            stats: stats.clone(),
            opts,
        };
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let w = worker.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("strata-fuse-{i}"))
                    .spawn(move || w.run(i))?,
            );
        }
        if worker.opts.adopt {
            worker.take_over(leftovers)?;
        }
        Ok(Session {
            chan,
            stop,
            threads: handles,
            stats,
        })
    }

    /// The connection served.
    pub fn channel(&self) -> &Arc<Channel> {
        &self.chan
    }

    /// Stops answering: requests read from now on are left for a successor.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Waits for the workers (they end when the connection goes away).
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

struct Worker<F> {
    chan: Arc<Channel>,
    fs: Arc<F>,
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    opts: Options,
}

impl<F> Clone for Worker<F> {
    fn clone(&self) -> Self {
        Worker {
            chan: self.chan.clone(),
            fs: self.fs.clone(),
            stop: self.stop.clone(),
            stats: self.stats.clone(),
            opts: self.opts.clone(),
        }
    }
}

/// Requests that get no answer, so are never recorded.
fn unanswered(opcode: u32) -> bool {
    matches!(opcode, op::FORGET | op::BATCH_FORGET | op::INTERRUPT)
}

impl<F: Filesystem> Worker<F> {
    /// Worker `index`'s loop: reads into its area of the journal where there is one (see
    /// [`crate::fuse::journal`]: a request read is then in the journal even if this process dies
    /// before recording it), else into a buffer of its own.
    fn run(self, index: usize) {
        let area = self.chan.journal().and_then(|j| j.area(index));
        let mut own = Vec::new();
        loop {
            let buf: &mut [u8] = match &area {
                Some(a) => a.arm(),
                None => {
                    own.resize(REQUEST_BUFFER, 0);
                    &mut own
                }
            };
            let n = match self.chan.receive(buf) {
                Ok(Received::Request(0)) | Ok(Received::Gone) => return,
                Ok(Received::Request(n)) => n,
                Ok(Received::Retry) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "reading FUSE requests failed");
                    return;
                }
            };
            let req = Request::parse(&buf[..n]);
            let slot = match (&req, self.chan.journal()) {
                (Ok(r), Some(j)) if !unanswered(r.header.opcode) => {
                    j.record(r.header.unique, &buf[..n])
                }
                _ => None,
            };
            if self.stop.load(Ordering::SeqCst) {
                // Left unanswered (and recorded): the successor gets it back.
                return;
            }
            match req {
                Ok(req) => self.dispatch(&req, slot),
                Err(e) => tracing::warn!(error = %e, "bad FUSE request"),
            }
        }
    }

    /// Gets back what a predecessor left: the kernel resends it (the records are dropped), or, where it
    /// cannot, this server answers the recorded requests (on a thread of their own).
    fn take_over(&self, leftovers: Vec<Leftover>) -> io::Result<()> {
        let resent = !self.opts.no_resend && self.chan.notify_resend().is_ok();
        if resent {
            if let Some(j) = self.chan.journal() {
                leftovers.iter().for_each(|l| j.clear(l.slot));
            }
            return Ok(());
        }
        tracing::info!(
            requests = leftovers.len(),
            "no FUSE_NOTIFY_RESEND (Linux < 6.9): answering the previous server's requests from its journal"
        );
        let w = self.clone();
        std::thread::Builder::new()
            .name("strata-fuse-replay".into())
            .spawn(move || {
                for l in leftovers {
                    match Request::parse(&l.bytes) {
                        Ok(req) if req.header.unique == l.unique => {
                            w.stats.replayed.fetch_add(1, Ordering::Relaxed);
                            w.dispatch(&req, Some(l.slot));
                            if unanswered(req.header.opcode) {
                                // Found in a read area: nothing answers it, nothing clears its slot.
                                if let Some(j) = w.chan.journal() {
                                    j.clear(l.slot);
                                }
                            }
                        }
                        _ => {
                            tracing::warn!(unique = l.unique, "damaged journal record: dropped");
                            if let Some(j) = w.chan.journal() {
                                j.clear(l.slot);
                            }
                        }
                    }
                }
            })?;
        Ok(())
    }

    fn dispatch(&self, req: &Request<'_>, slot: Option<usize>) {
        let h = &req.header;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if h.unique & proto::UNIQUE_RESEND != 0 {
            self.stats.resent.fetch_add(1, Ordering::Relaxed);
        }
        let reply = Reply::new(&self.chan, h.unique, slot, h.pid);
        let ino = h.nodeid;
        match h.opcode {
            op::INIT => self.init(req, reply),
            op::FORGET | op::BATCH_FORGET | op::INTERRUPT => reply.abandon(),
            op::LOOKUP => match self.fs.lookup(ino, req.name()) {
                Ok(attr) => reply.data(&[self.entry(attr).as_bytes()]),
                // A negative entry the kernel keeps: programs probe many names that are not there
                // (an interpreter's module search), each a round trip otherwise.
                Err(Errno::NOENT) if self.opts.immutable => {
                    let (s, ns) = ttl(self.opts.ttl);
                    let e = proto::EntryOut {
                        nodeid: 0,
                        entry_valid: s,
                        entry_valid_nsec: ns,
                        ..Default::default()
                    };
                    reply.data(&[e.as_bytes()]);
                }
                Err(e) => reply.error(e),
            },
            op::GETATTR => match self.fs.getattr(ino) {
                Ok(attr) => {
                    let (s, ns) = ttl(self.opts.ttl);
                    let a = proto::AttrOut {
                        attr_valid: s,
                        attr_valid_nsec: ns,
                        dummy: 0,
                        attr,
                    };
                    reply.data(&[a.as_bytes()]);
                }
                Err(e) => reply.error(e),
            },
            op::OPEN | op::OPENDIR if self.opts.immutable => reply.error(Errno::NOSYS),
            op::OPEN | op::OPENDIR => {
                let flags = req.arg::<proto::OpenIn>().map_or(0, |o| o.flags);
                let r = match h.opcode {
                    op::OPEN => self.fs.open(ino, flags),
                    _ => self.fs.getattr(ino).map(|_| 0),
                };
                match r {
                    Ok(open_flags) => {
                        let o = proto::OpenOut {
                            fh: 0,
                            open_flags: open_flags | proto::FOPEN_NOFLUSH,
                            backing_id: 0,
                        };
                        reply.data(&[o.as_bytes()]);
                    }
                    Err(e) => reply.error(e),
                }
            }
            op::READ => match req.arg::<proto::ReadIn>() {
                Ok(r) => self.fs.read(ino, r.offset, r.size, reply),
                Err(_) => reply.error(Errno::INVAL),
            },
            op::READDIR => self.readdir(req, reply, false),
            op::READDIRPLUS => self.readdir(req, reply, true),
            op::READLINK => match self.fs.readlink(ino) {
                Ok(target) => reply.data(&[&target]),
                Err(e) => reply.error(e),
            },
            op::GETXATTR | op::LISTXATTR => self.xattr(req, reply),
            // Nothing is ever written: no `close` needs the server. `ENOSYS` to a `FLUSH` (kernels
            // before `FOPEN_NOFLUSH`) makes the kernel send no more on this connection.
            op::FLUSH => reply.error(Errno::NOSYS),
            op::RELEASE | op::RELEASEDIR | op::ACCESS | op::DESTROY => reply.data(&[]),
            op::STATFS => {
                let s = proto::StatfsOut {
                    bsize: 4096,
                    frsize: 4096,
                    namelen: 255,
                    ..Default::default()
                };
                reply.data(&[s.as_bytes()]);
            }
            _ => reply.error(Errno::NOSYS),
        }
    }

    fn init(&self, req: &Request<'_>, reply: Reply) {
        let Ok(i) = req.arg::<proto::InitIn>() else {
            return reply.error(Errno::PROTO);
        };
        if i.major != proto::KERNEL_VERSION || i.minor < proto::KERNEL_MINOR_VERSION {
            tracing::error!(
                major = i.major,
                minor = i.minor,
                "kernel FUSE protocol too old (need 7.31)"
            );
            return reply.error(Errno::PROTO);
        }
        let kernel = u64::from(i.flags) | (u64::from(i.flags2) << 32);
        let wanted = init::ASYNC_READ
            | init::BIG_WRITES
            | init::ASYNC_DIO
            | init::PARALLEL_DIROPS
            | init::MAX_PAGES
            | init::INIT_EXT;
        // A tree that never changes also lists with attributes and lets the kernel cache link targets.
        let wanted = match self.opts.immutable {
            true => wanted | init::DO_READDIRPLUS | init::CACHE_SYMLINKS,
            false => wanted,
        };
        let flags = wanted & kernel;
        self.stats
            .kernel_resend
            .store(kernel & init::HAS_RESEND != 0, Ordering::Relaxed);
        self.stats.initialized_here.store(true, Ordering::Relaxed);
        let out = proto::InitOut {
            major: proto::KERNEL_VERSION,
            minor: proto::KERNEL_MINOR_VERSION,
            max_readahead: self.opts.max_readahead.min(i.max_readahead),
            flags: flags as u32,
            max_background: self.opts.max_background,
            congestion_threshold: self.opts.max_background / 4 * 3,
            max_write: 4096,
            time_gran: 1,
            max_pages: self.opts.max_pages,
            flags2: (flags >> 32) as u32,
            ..Default::default()
        };
        reply.data(&[out.as_bytes()]);
    }

    /// `GETXATTR` and `LISTXATTR`: a size of 0 asks how large the value (or name list) is.
    fn xattr(&self, req: &Request<'_>, reply: Reply) {
        let Ok(arg) = req.arg::<proto::GetxattrIn>() else {
            return reply.error(Errno::INVAL);
        };
        let ino = req.header.nodeid;
        let value = match req.header.opcode {
            op::GETXATTR => self.fs.getxattr(ino, req.name_after::<proto::GetxattrIn>()),
            _ => self.fs.listxattr(ino),
        };
        match value {
            Ok(v) if arg.size == 0 => {
                let out = proto::GetxattrOut {
                    size: v.len() as u32,
                    padding: 0,
                };
                reply.data(&[out.as_bytes()]);
            }
            Ok(v) if v.len() > arg.size as usize => reply.error(Errno::RANGE),
            Ok(v) => reply.data(&[&v]),
            Err(e) => reply.error(e),
        }
    }

    /// The answer to a lookup that found `attr`, kept by the kernel for the session's TTL.
    fn entry(&self, attr: Attr) -> proto::EntryOut {
        let (s, ns) = ttl(self.opts.ttl);
        proto::EntryOut {
            nodeid: attr.ino,
            entry_valid: s,
            attr_valid: s,
            entry_valid_nsec: ns,
            attr_valid_nsec: ns,
            attr,
            ..Default::default()
        }
    }

    /// `READDIR`, or with `plus` `READDIRPLUS`: each entry then carries its lookup answer, so that the
    /// kernel makes its dentry and inode at once and a later lookup of the name costs no round trip
    /// (an interpreter lists a directory, then opens what it found there).
    fn readdir(&self, req: &Request<'_>, reply: Reply, plus: bool) {
        let Ok(r) = req.arg::<proto::ReadIn>() else {
            return reply.error(Errno::INVAL);
        };
        let ino = req.header.nodeid;
        let entries = match self.fs.readdir(ino) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        let dots = [
            (ino, proto::DT_DIR, b".".to_vec()),
            (proto::ROOT_ID, proto::DT_DIR, b"..".to_vec()),
        ];
        let mut out = Vec::new();
        for (k, &(child, kind, ref name)) in dots.iter().chain(entries.iter()).enumerate() {
            if (k as u64) < r.offset {
                continue;
            }
            let off = k as u64 + 1;
            if !plus {
                if out.len() + proto::dirent_size(name.len()) > r.size as usize {
                    break;
                }
                proto::push_dirent(&mut out, child, off, kind, name);
                continue;
            }
            if out.len() + proto::direntplus_size(name.len()) > r.size as usize {
                break;
            }
            // `.` and `..` (the first two) get no dentry; an entry whose attributes cannot be read
            // is listed without, and its lookup reports the error.
            let entry = match k {
                0 | 1 => proto::EntryOut::default(),
                _ => self
                    .fs
                    .getattr(child)
                    .map_or_else(|_| proto::EntryOut::default(), |a| self.entry(a)),
            };
            proto::push_direntplus(&mut out, &entry, child, off, kind, name);
        }
        reply.data(&[&out]);
    }
}

fn ttl(d: Duration) -> (u64, u32) {
    (d.as_secs(), d.subsec_nanos())
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
