//! The directory source: walks a directory tree on a local filesystem and emits one [`Entry`] per name.
//!
//! **Order.** The root first (empty path, its own metadata), then every entry depth first, each
//! directory's children sorted bytewise by name, a directory before its children: the same tree always
//! yields the same sequence, whatever order `readdir` returns.
//!
//! **Walking.** Nothing recurses on the call stack and nothing is looked up by a long path. The walker
//! keeps an explicit stack of frames (a directory's device and inode and its child names still to visit)
//! and one open directory, the one whose children are being visited; children are examined relative to it
//! (`statx` with `AT_SYMLINK_NOFOLLOW`, `readlinkat`, `openat` with `O_NOFOLLOW`), so symlinks are never
//! followed and depth is limited by memory only (the current relative path is one shared buffer). Going
//! down opens the child; going back up opens `..` and checks it is the directory the frame recorded, so a
//! tree rearranged during the walk is an error, never a walk of something else. Only the root path itself
//! is resolved normally: a root that is a symlink to a directory works.
//!
//! **Metadata.** Permission bits (`& 0o7777`), uid, gid, mtime with nanoseconds, and every extended
//! attribute (`trusted.*`, `security.*` too, as far as the caller may read them) sorted by name, values as
//! raw bytes. Extended attributes are read with `llistxattr`/`lgetxattr` on
//! `/proc/self/fd/<dir fd>/<name>`: the entry itself (never a symlink's target) by a short path at any
//! depth; without a usable `/proc` the full path is used (entries deeper than `PATH_MAX` then fail, named).
//! Symlink targets are raw bytes; devices carry `st_rdev` as the kernel encodes it (`makedev`); fifos and
//! sockets are kept. Names are any byte string; `.wh.` names mean nothing here (an overlay upper directory
//! has its own reader).
//!
//! **Files and hard links.** A regular file is [`EntryKind::File`] with [`FileSource::Path`] (its full
//! path, for the builder's workers), `sparse` when `st_blocks * 512 < st_size`; it is checked for
//! readability (`faccessat`) when met, so an unreadable file fails here, named. A file whose full path is
//! `PATH_MAX` bytes or longer cannot be opened by path at all: it is opened here, relative to its
//! directory, and handed over as a [`FileSource::Stream`] of exactly its size. A non-directory with
//! `st_nlink > 1` whose `(st_dev, st_ino)` was seen before becomes [`EntryKind::HardLink`] to the path it
//! was first seen at.
//!
//! **Mount points.** The walk never crosses into another filesystem. A mount point below the root is found
//! by `STATX_ATTR_MOUNT_ROOT` (bind mounts of the same filesystem too) or, on kernels before 5.8, by a
//! directory's `st_dev` differing from its parent's (then a btrfs subvolume counts as one). A directory
//! mount point is emitted as an empty directory with the metadata seen at that path (the mounted root's),
//! keeping `/proc`, `/sys` or a volume's mount point in the image as `rsync -x` and
//! `tar --one-file-system` do; a non-directory mount point (a bind-mounted file such as a container's
//! `/etc/resolv.conf`) is skipped, its content belonging to another filesystem. Both are logged with
//! `tracing::warn!`. The root itself may be a mount point.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use libc::c_char;

use super::{Entry, EntryKind, EntrySink, FileSource};
use crate::error::BuildError;
use crate::tree::{Meta, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG, S_IFSOCK};

/// Longest path (with its NUL) the kernel accepts in one system call.
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// Walks the directory `root` and hands every entry to `sink` (see the module documentation).
pub fn walk_dir(root: &Path, sink: &mut dyn EntrySink) -> Result<(), BuildError> {
    walk_impl(root, sink, true)
}

/// [`walk_dir`]; `use_proc: false` reads xattrs by full paths, as where `/proc` is unusable.
fn walk_impl(root: &Path, sink: &mut dyn EntrySink, use_proc: bool) -> Result<(), BuildError> {
    let not_a_dir = || {
        let e = io::Error::new(
            io::ErrorKind::NotADirectory,
            "the source root is not a directory",
        );
        BuildError::io(root, e)
    };
    match std::fs::metadata(root) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let path = root.to_path_buf();
            return Err(BuildError::MissingSource { path });
        }
        Err(e) => return Err(BuildError::io(root, e)),
        Ok(m) if !m.is_dir() => return Err(not_a_dir()),
        Ok(_) => {}
    }
    let err = |e| BuildError::io(root, e);
    let croot = cstring(root.as_os_str().as_bytes()).map_err(err)?;
    let dir = Dir::open(libc::AT_FDCWD, &croot, false).map_err(err)?;
    let st = stat_at(dir.fd(), c"", libc::AT_EMPTY_PATH).map_err(err)?;
    if st.mode & S_IFMT != S_IFDIR {
        return Err(not_a_dir());
    }
    let proc_path = format!("/proc/self/fd/{}/.", dir.fd());
    let proc_st = stat_at(
        libc::AT_FDCWD,
        &cstring(proc_path.as_bytes()).map_err(err)?,
        0,
    );
    let proc_fd = use_proc && proc_st.is_ok_and(|s| (s.dev, s.ino) == (st.dev, st.ino));
    let xattr_path = match proc_fd {
        true => proc_path.into_bytes(),
        false => root.join(".").into_os_string().into_encoded_bytes(),
    };
    let xattrs = read_xattrs(&cstring(&xattr_path).map_err(err)?).map_err(err)?;
    let meta = st.meta(xattrs);
    sink.add(
        Entry {
            path: Vec::new(),
            meta,
            kind: EntryKind::Dir,
        },
        None,
    )?;
    let mut walker = Walker {
        root,
        sink,
        links: HashMap::new(),
        proc_fd,
    };
    walker.run(dir, &st)
}

/// The full path of a relative path, for errors and for workers.
fn abs(root: &Path, rel: &[u8]) -> PathBuf {
    match rel.is_empty() {
        true => root.to_path_buf(),
        false => root.join(OsStr::from_bytes(rel)),
    }
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL"))
}

fn moved() -> io::Error {
    io::Error::other("the directory tree changed while it was being walked")
}

/// A directory being visited.
struct Frame {
    /// Length of this directory's relative path in the shared path buffer.
    len: usize,
    dev: u64,
    ino: u64,
    /// Child names still to visit, sorted descending so that `pop` yields them in ascending order.
    pending: Vec<Vec<u8>>,
}

struct Walker<'a> {
    root: &'a Path,
    sink: &'a mut dyn EntrySink,
    /// First path of every multiply linked non-directory seen so far.
    links: HashMap<(u64, u64), Vec<u8>>,
    /// Entries can be addressed as `/proc/self/fd/<dir fd>/<name>`.
    proc_fd: bool,
}

impl Walker<'_> {
    fn run(&mut self, root: Dir, st: &Stat) -> Result<(), BuildError> {
        let (mut path, mut cur, mut cur_depth) = (Vec::new(), root, 0);
        let pending = self.child_names(&mut cur, &path)?;
        let mut stack = vec![Frame {
            len: 0,
            dev: st.dev,
            ino: st.ino,
            pending,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.pending.pop() else {
                stack.pop();
                continue;
            };
            let (len, parent_dev, depth) = (top.len, top.dev, stack.len() - 1);
            if cur_depth > depth {
                // Back up to this frame's directory, and make sure it is still the same one.
                let frame = &stack[depth];
                for _ in depth..cur_depth {
                    cur =
                        Dir::open(cur.fd(), c"..", true).map_err(|e| self.err(&path[..len], e))?;
                }
                let st = stat_at(cur.fd(), c"", libc::AT_EMPTY_PATH);
                let st = st.map_err(|e| self.err(&path[..len], e))?;
                if (st.dev, st.ino) != (frame.dev, frame.ino) {
                    return Err(self.err(&path[..len], moved()));
                }
                cur_depth = depth;
            }
            path.truncate(len);
            if len > 0 {
                path.push(b'/');
            }
            path.extend_from_slice(&name);
            if let Some((mut child, cst)) = self.visit(&cur, &name, &path, parent_dev)? {
                let pending = self.child_names(&mut child, &path)?;
                stack.push(Frame {
                    len: path.len(),
                    dev: cst.dev,
                    ino: cst.ino,
                    pending,
                });
                (cur, cur_depth) = (child, depth + 1);
            }
        }
        Ok(())
    }

    fn abs(&self, rel: &[u8]) -> PathBuf {
        abs(self.root, rel)
    }

    fn err(&self, rel: &[u8], e: io::Error) -> BuildError {
        BuildError::io(self.abs(rel), e)
    }

    fn child_names(&self, dir: &mut Dir, rel: &[u8]) -> Result<Vec<Vec<u8>>, BuildError> {
        let mut names = dir.names().map_err(|e| self.err(rel, e))?;
        names.sort_unstable_by(|a, b| b.cmp(a));
        Ok(names)
    }

    /// Emits the entry `name` of `dir` (relative path `rel`); returns the directory to descend into.
    fn visit(
        &mut self,
        dir: &Dir,
        name: &[u8],
        rel: &[u8],
        parent_dev: u64,
    ) -> Result<Option<(Dir, Stat)>, BuildError> {
        let root = self.root;
        let unsupported = |why: String| {
            let path = abs(root, rel).display().to_string();
            Err(BuildError::Unsupported { path, why })
        };
        if name.len() > 255 {
            return unsupported("a name longer than 255 bytes".into());
        }
        let err = |e| BuildError::io(abs(root, rel), e);
        let cname = cstring(name).map_err(err)?;
        let st = stat_at(dir.fd(), &cname, 0).map_err(err)?;
        let ft = st.mode & S_IFMT;
        let mount = st
            .mount_root
            .unwrap_or(ft == S_IFDIR && st.dev != parent_dev);
        if mount && ft != S_IFDIR {
            let path = self.abs(rel);
            tracing::warn!(path = %path.display(), "skipping a file mounted from another filesystem");
            return Ok(None);
        }
        let xattr_path = match self.proc_fd {
            true => [format!("/proc/self/fd/{}/", dir.fd()).as_bytes(), name].concat(),
            false => abs(root, rel).into_os_string().into_encoded_bytes(),
        };
        let xattrs = read_xattrs(&cstring(&xattr_path).map_err(err)?).map_err(err)?;
        let entry = |kind| Entry {
            path: rel.to_vec(),
            meta: st.meta(xattrs),
            kind,
        };
        if ft != S_IFDIR && st.nlink > 1 {
            match self.links.entry((st.dev, st.ino)) {
                MapEntry::Occupied(first) => {
                    let kind = EntryKind::HardLink(first.get().clone());
                    self.sink.add(entry(kind), None)?;
                    return Ok(None);
                }
                MapEntry::Vacant(v) => _ = v.insert(rel.to_vec()),
            }
        }
        let kind = match ft {
            S_IFDIR => {
                self.sink.add(entry(EntryKind::Dir), None)?;
                if mount {
                    let path = self.abs(rel);
                    tracing::warn!(path = %path.display(),
                        "not crossing into another filesystem: the mount point stays an empty directory");
                    return Ok(None);
                }
                let child = Dir::open(dir.fd(), &cname, true).map_err(err)?;
                let cst = stat_at(child.fd(), c"", libc::AT_EMPTY_PATH).map_err(err)?;
                if (cst.dev, cst.ino) != (st.dev, st.ino) {
                    return Err(err(moved()));
                }
                return Ok(Some((child, cst)));
            }
            S_IFREG => {
                self.file(
                    dir,
                    &cname,
                    rel,
                    &st,
                    entry(EntryKind::File { size: st.size }),
                )?;
                return Ok(None);
            }
            S_IFLNK => EntryKind::Symlink(read_link(dir.fd(), &cname, st.size).map_err(err)?),
            S_IFCHR => EntryKind::CharDev { rdev: st.rdev },
            S_IFBLK => EntryKind::BlockDev { rdev: st.rdev },
            S_IFIFO => EntryKind::Fifo,
            S_IFSOCK => EntryKind::Socket,
            other => return unsupported(format!("unknown file type {other:#o}")),
        };
        self.sink.add(entry(kind), None)?;
        Ok(None)
    }

    /// Emits a regular file: by path, or (when its path is too long to open) as a stream of its bytes.
    fn file(
        &mut self,
        dir: &Dir,
        cname: &CStr,
        rel: &[u8],
        st: &Stat,
        entry: Entry,
    ) -> Result<(), BuildError> {
        let abs = self.abs(rel);
        if abs.as_os_str().len() < PATH_MAX {
            // SAFETY: `cname` is NUL-terminated and `dir` is an open directory.
            let rc =
                unsafe { libc::faccessat(dir.fd(), cname.as_ptr(), libc::R_OK, libc::AT_EACCESS) };
            if rc != 0 {
                return Err(BuildError::io(abs, io::Error::last_os_error()));
            }
            let sparse = st.blocks.saturating_mul(512) < st.size;
            return self
                .sink
                .add(entry, Some(FileSource::Path { path: abs, sparse }));
        }
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY;
        let fd = open_at(dir.fd(), cname, flags).map_err(|e| BuildError::io(&abs, e))?;
        let fst = stat_at(fd.as_raw_fd(), c"", libc::AT_EMPTY_PATH);
        if fst.map_or(true, |f| (f.dev, f.ino) != (st.dev, st.ino)) {
            return Err(BuildError::io(abs, moved()));
        }
        let mut data = ExactFile {
            file: File::from(fd),
            left: st.size,
        };
        self.sink.add(entry, Some(FileSource::Stream(&mut data)))
    }
}

/// A regular file handed over as a stream: exactly `left` bytes, an error if the file shrank.
struct ExactFile {
    file: File,
    left: u64,
}

impl Read for ExactFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read(&mut buf[..want])?;
        if n == 0 {
            let why = "the file shrank while it was being read";
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, why));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// What `statx` says about one entry.
#[derive(Clone, Copy, Debug)]
struct Stat {
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u32,
    size: u64,
    blocks: u64,
    dev: u64,
    ino: u64,
    rdev: u64,
    mtime: i64,
    mtime_nsec: u32,
    /// Whether this is the root of a mount, when the kernel can tell (Linux 5.8 and later).
    mount_root: Option<bool>,
}

impl Stat {
    fn meta(&self, xattrs: Vec<(Vec<u8>, Vec<u8>)>) -> Meta {
        let (perm, uid, gid) = (self.mode & 0o7777, self.uid, self.gid);
        Meta {
            perm,
            uid,
            gid,
            mtime: self.mtime,
            mtime_nsec: self.mtime_nsec,
            xattrs,
        }
    }
}

/// `statx(dirfd, name, AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | flags)` (Linux 4.11).
fn stat_at(dirfd: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<Stat> {
    let flags = flags | libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT;
    let mut sx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `name` is NUL-terminated and `sx` is writable memory of the type statx fills in.
    if unsafe {
        libc::statx(
            dirfd,
            name.as_ptr(),
            flags,
            libc::STATX_BASIC_STATS,
            sx.as_mut_ptr(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statx succeeded (and the buffer was zeroed to begin with).
    let sx = unsafe { sx.assume_init() };
    let mount = libc::STATX_ATTR_MOUNT_ROOT as u64;
    Ok(Stat {
        mode: u32::from(sx.stx_mode),
        uid: sx.stx_uid,
        gid: sx.stx_gid,
        nlink: sx.stx_nlink,
        size: sx.stx_size,
        blocks: sx.stx_blocks,
        dev: libc::makedev(sx.stx_dev_major, sx.stx_dev_minor),
        ino: sx.stx_ino,
        rdev: libc::makedev(sx.stx_rdev_major, sx.stx_rdev_minor),
        mtime: sx.stx_mtime.tv_sec,
        mtime_nsec: sx.stx_mtime.tv_nsec,
        mount_root: (sx.stx_attributes_mask & mount != 0).then_some(sx.stx_attributes & mount != 0),
    })
}

fn open_at(dirfd: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; a non-negative result is a new descriptor nobody else owns.
    match unsafe { libc::openat(dirfd, name.as_ptr(), flags) } {
        fd if fd < 0 => Err(io::Error::last_os_error()),
        fd => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
    }
}

/// An open directory stream (it owns its descriptor).
struct Dir(NonNull<libc::DIR>);

impl Dir {
    /// Opens `name` relative to `dirfd` as a directory; `nofollow` refuses a symlink.
    fn open(dirfd: RawFd, name: &CStr, nofollow: bool) -> io::Result<Dir> {
        let nofollow = if nofollow { libc::O_NOFOLLOW } else { 0 };
        let fd = open_at(
            dirfd,
            name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | nofollow,
        )?;
        // SAFETY: `fd` is an open directory; on success the stream owns it.
        let dirp = NonNull::new(unsafe { libc::fdopendir(fd.as_raw_fd()) });
        let dirp = dirp.ok_or_else(io::Error::last_os_error)?;
        std::mem::forget(fd);
        Ok(Dir(dirp))
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the stream is open for as long as `self` lives.
        unsafe { libc::dirfd(self.0.as_ptr()) }
    }

    /// Every name in the directory except `.` and `..`, in `readdir` order.
    fn names(&mut self) -> io::Result<Vec<Vec<u8>>> {
        let mut names = Vec::new();
        loop {
            // SAFETY: errno is thread-local, and readdir reports errors only through it; the stream is
            // open and used by this thread only.
            let ent = unsafe {
                *libc::__errno_location() = 0;
                libc::readdir(self.0.as_ptr())
            };
            if ent.is_null() {
                let err = io::Error::last_os_error();
                return if err.raw_os_error() == Some(0) {
                    Ok(names)
                } else {
                    Err(err)
                };
            }
            // SAFETY: `ent` is a valid dirent with a NUL-terminated name until the next readdir.
            let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        // SAFETY: the stream is open and is closed exactly once, here.
        unsafe { libc::closedir(self.0.as_ptr()) };
    }
}

fn read_link(dirfd: RawFd, name: &CStr, size_hint: u64) -> io::Result<Vec<u8>> {
    let mut cap = usize::try_from(size_hint).unwrap_or(0).clamp(255, 1 << 16) + 1;
    loop {
        let mut buf = vec![0u8; cap];
        // SAFETY: `buf` has `cap` writable bytes.
        let n = unsafe { libc::readlinkat(dirfd, name.as_ptr(), buf.as_mut_ptr().cast(), cap) };
        match usize::try_from(n) {
            Err(_) => return Err(io::Error::last_os_error()),
            Ok(n) if n < cap => return Ok(buf[..n].to_vec()),
            Ok(_) if cap > 1 << 20 => return Err(io::Error::other("symlink target over 1 MiB")),
            Ok(_) => cap *= 2,
        }
    }
}

/// Calls `f(buf, len)` with no buffer to learn the length, then with a buffer of that length; again when
/// the value grew in between (`ERANGE`).
fn read_sized(mut f: impl FnMut(*mut c_char, usize) -> isize) -> io::Result<Vec<u8>> {
    for _ in 0..16 {
        let n =
            usize::try_from(f(std::ptr::null_mut(), 0)).map_err(|_| io::Error::last_os_error())?;
        let mut buf = vec![0u8; n];
        if n == 0 {
            return Ok(buf);
        }
        match usize::try_from(f(buf.as_mut_ptr().cast(), n)) {
            Ok(m) => return Ok(buf[..m].to_vec()),
            Err(_) if io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE) => {}
            Err(_) => return Err(io::Error::last_os_error()),
        }
    }
    Err(io::Error::other(
        "extended attributes kept changing while being read",
    ))
}

/// Every extended attribute of `path` (its last component not followed), sorted by name. A filesystem
/// without xattr support has none.
fn read_xattrs(path: &CStr) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    // SAFETY: the buffer is null with length 0 or `len` writable bytes, and the path is NUL-terminated.
    let list = match read_sized(|buf, len| unsafe { libc::llistxattr(path.as_ptr(), buf, len) }) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(Vec::new()),
        list => list?,
    };
    let mut out = Vec::new();
    for name in list.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cname = cstring(name)?;
        // SAFETY: as above.
        match read_sized(|buf, len| unsafe {
            libc::lgetxattr(path.as_ptr(), cname.as_ptr(), buf.cast(), len)
        }) {
            Ok(v) => out.push((name.to_vec(), v)),
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {} // removed since it was listed
            Err(e) => return Err(e),
        }
    }
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    Ok(out)
}

#[cfg(test)]
#[path = "dir_tests.rs"]
mod tests;
