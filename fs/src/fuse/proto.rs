//! The FUSE wire protocol: the few messages the blob server speaks, as fixed-layout structures.
//!
//! Every structure is `#[repr(C)]`, native endian (the kernel's own layout, `include/uapi/linux/fuse.h`),
//! converted to and from bytes by `zerocopy` (no `unsafe`), and has its size asserted at compile time so
//! that a mistyped field cannot shift the layout silently. Names follow the kernel's header.
//!
//! Only what a read-only server of regular files needs is here: `INIT`, `LOOKUP`, `FORGET`,
//! `GETATTR`, `OPEN`/`OPENDIR`, `READ`, `READDIR`, `RELEASE`/`RELEASEDIR`, `FLUSH`, `STATFS`,
//! `INTERRUPT`, `DESTROY`; everything else is answered `ENOSYS`.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Protocol major version.
pub const KERNEL_VERSION: u32 = 7;
/// The minor version this server speaks (the kernel uses the smaller of its own and this).
pub const KERNEL_MINOR_VERSION: u32 = 31;
/// The root directory's node id.
pub const ROOT_ID: u64 = 1;
/// Smallest buffer the kernel accepts for a read of `/dev/fuse`.
pub const MIN_READ_BUFFER: usize = 8192;
/// Set in `unique` of a request the kernel resends after `FUSE_NOTIFY_RESEND`.
pub const UNIQUE_RESEND: u64 = 1 << 63;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const READLINK: u32 = 5;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const READDIRPLUS: u32 = 44;
}

/// `INIT` flags (`flags` low 32 bits, `flags2` high 32 bits when `INIT_EXT` is set).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    /// The kernel may list directories with `READDIRPLUS` (entries with their attributes).
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const MAX_PAGES: u64 = 1 << 22;
    /// The kernel keeps symlink targets in the page cache (one `READLINK` per link, not per walk).
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const INIT_EXT: u64 = 1 << 30;
    /// The kernel resends requests on `FUSE_NOTIFY_RESEND` (Linux 6.9+).
    pub const HAS_RESEND: u64 = 1 << 39;
}

/// `FOPEN_KEEP_CACHE`: the kernel may keep the file's pages across opens.
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
/// `FOPEN_NOFLUSH` (Linux 5.16+): a `close` of the file sends no `FLUSH`.
pub const FOPEN_NOFLUSH: u32 = 1 << 5;
/// `FUSE_NOTIFY_RESEND`: the kernel moves every request a server read but did not answer back to its
/// pending queue, to be read again.
pub const NOTIFY_RESEND: i32 = 7;

/// `S_IFDIR` and `S_IFREG` for `fuse_attr.mode`; `DT_DIR`, `DT_REG` for directory entries.
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const DT_DIR: u32 = 4;
pub const DT_REG: u32 = 8;

macro_rules! wire {
    ($(#[$m:meta])* $name:ident = $size:literal { $($f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
        pub struct $name { $(pub $f: $t,)* }
        const _: () = assert!(std::mem::size_of::<$name>() == $size);
    };
}

wire!(
    /// `struct fuse_in_header`: starts every request.
    InHeader = 40 {
        len: u32, opcode: u32, unique: u64, nodeid: u64, uid: u32, gid: u32, pid: u32,
        total_extlen: u16, padding: u16,
    }
);
wire!(
    /// `struct fuse_out_header`: starts every reply (`unique` 0 and `error` a notify code: a
    /// notification).
    OutHeader = 16 { len: u32, error: i32, unique: u64 }
);
wire!(
    /// `struct fuse_init_in` (7.36+: with `flags2`).
    InitIn = 64 {
        major: u32, minor: u32, max_readahead: u32, flags: u32, flags2: u32, unused: [u32; 11],
    }
);
wire!(
    /// `struct fuse_init_out`.
    InitOut = 64 {
        major: u32, minor: u32, max_readahead: u32, flags: u32, max_background: u16,
        congestion_threshold: u16, max_write: u32, time_gran: u32, max_pages: u16,
        map_alignment: u16, flags2: u32, max_stack_depth: u32, unused: [u32; 6],
    }
);
wire!(
    /// `struct fuse_attr`.
    Attr = 88 {
        ino: u64, size: u64, blocks: u64, atime: u64, mtime: u64, ctime: u64, atimensec: u32,
        mtimensec: u32, ctimensec: u32, mode: u32, nlink: u32, uid: u32, gid: u32, rdev: u32,
        blksize: u32, flags: u32,
    }
);
wire!(
    /// `struct fuse_entry_out`: the answer to `LOOKUP`.
    EntryOut = 128 {
        nodeid: u64, generation: u64, entry_valid: u64, attr_valid: u64, entry_valid_nsec: u32,
        attr_valid_nsec: u32, attr: Attr,
    }
);
wire!(
    /// `struct fuse_attr_out`: the answer to `GETATTR`.
    AttrOut = 104 { attr_valid: u64, attr_valid_nsec: u32, dummy: u32, attr: Attr }
);
wire!(
    /// `struct fuse_open_in`.
    OpenIn = 8 { flags: u32, open_flags: u32 }
);
wire!(
    /// `struct fuse_open_out`.
    OpenOut = 16 { fh: u64, open_flags: u32, backing_id: i32 }
);
wire!(
    /// `struct fuse_read_in` (also `READDIR`'s argument).
    ReadIn = 40 {
        fh: u64, offset: u64, size: u32, read_flags: u32, lock_owner: u64, flags: u32, padding: u32,
    }
);
wire!(
    /// `struct fuse_getxattr_in` (also `LISTXATTR`'s argument; the name follows for `GETXATTR`).
    GetxattrIn = 8 { size: u32, padding: u32 }
);
wire!(
    /// `struct fuse_getxattr_out`: the size of a value (or name list) asked for with size 0.
    GetxattrOut = 8 { size: u32, padding: u32 }
);
wire!(
    /// `struct fuse_kstatfs` (`fuse_statfs_out`).
    StatfsOut = 80 {
        blocks: u64, bfree: u64, bavail: u64, files: u64, ffree: u64, bsize: u32, namelen: u32,
        frsize: u32, padding: u32, spare: [u32; 6],
    }
);
wire!(
    /// `struct fuse_dirent` without its name (the name follows, padded to 8 bytes).
    Dirent = 24 { ino: u64, off: u64, namelen: u32, kind: u32 }
);

/// A request read from the device: its header and the argument bytes after it.
pub struct Request<'a> {
    pub header: InHeader,
    pub arg: &'a [u8],
}

/// Why a request could not be parsed.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("FUSE request of {got} bytes is shorter than its header or its stated length")]
    Short { got: usize },
    #[error("FUSE opcode {opcode}: argument of {got} bytes, need {need}")]
    Arg {
        opcode: u32,
        got: usize,
        need: usize,
    },
}

impl<'a> Request<'a> {
    /// Parses the `n` bytes read from the device.
    pub fn parse(buf: &'a [u8]) -> Result<Request<'a>, ProtoError> {
        let short = ProtoError::Short { got: buf.len() };
        let (header, _) = InHeader::read_from_prefix(buf).map_err(|_| short.clone())?;
        let end = header.len as usize;
        let arg = buf.get(std::mem::size_of::<InHeader>()..end).ok_or(short)?;
        Ok(Request { header, arg })
    }

    /// The argument as a `T` (a prefix of the argument bytes; newer kernels may send longer ones).
    pub fn arg<T: FromBytes>(&self) -> Result<T, ProtoError> {
        T::read_from_prefix(self.arg)
            .map(|(t, _)| t)
            .map_err(|_| ProtoError::Arg {
                opcode: self.header.opcode,
                got: self.arg.len(),
                need: std::mem::size_of::<T>(),
            })
    }

    /// The argument as a NUL-terminated name (`LOOKUP`).
    pub fn name(&self) -> &'a [u8] {
        nul_terminated(self.arg)
    }

    /// The NUL-terminated name after a fixed argument of type `T` (`GETXATTR`).
    pub fn name_after<T>(&self) -> &'a [u8] {
        nul_terminated(self.arg.get(std::mem::size_of::<T>()..).unwrap_or(&[]))
    }
}

fn nul_terminated(b: &[u8]) -> &[u8] {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    &b[..end]
}

/// The header of a reply carrying `body` bytes (or an error: negative errno and no body).
pub fn out_header(unique: u64, error: i32, body: usize) -> OutHeader {
    OutHeader {
        len: (std::mem::size_of::<OutHeader>() + body) as u32,
        error,
        unique,
    }
}

/// Appends one directory entry to `out` (name padded to 8 bytes).
pub fn push_dirent(out: &mut Vec<u8>, ino: u64, off: u64, kind: u32, name: &[u8]) {
    let d = Dirent {
        ino,
        off,
        namelen: name.len() as u32,
        kind,
    };
    out.extend_from_slice(d.as_bytes());
    out.extend_from_slice(name);
    let padded = (std::mem::size_of::<Dirent>() + name.len()).div_ceil(8) * 8;
    out.resize(
        out.len() + padded - std::mem::size_of::<Dirent>() - name.len(),
        0,
    );
}

/// The size of a directory entry with a name of `len` bytes.
pub fn dirent_size(len: usize) -> usize {
    (std::mem::size_of::<Dirent>() + len).div_ceil(8) * 8
}

/// Appends one `READDIRPLUS` entry (`struct fuse_direntplus`: the entry's lookup answer, then its
/// directory entry). A `nodeid` of 0 in `entry` tells the kernel to make no dentry of it (`.`, `..`).
pub fn push_direntplus(
    out: &mut Vec<u8>,
    entry: &EntryOut,
    ino: u64,
    off: u64,
    kind: u32,
    name: &[u8],
) {
    out.extend_from_slice(entry.as_bytes());
    push_dirent(out, ino, off, kind, name);
}

/// The size of a `READDIRPLUS` entry with a name of `len` bytes.
pub fn direntplus_size(len: usize) -> usize {
    std::mem::size_of::<EntryOut>() + dirent_size(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(opcode: u32, arg: &[u8]) -> Vec<u8> {
        let h = InHeader {
            len: (40 + arg.len()) as u32,
            opcode,
            unique: 42,
            nodeid: 7,
            ..Default::default()
        };
        let mut v = h.as_bytes().to_vec();
        v.extend_from_slice(arg);
        v
    }

    #[test]
    fn requests_round_trip_and_short_ones_are_errors() {
        let read = ReadIn {
            offset: 4096,
            size: 131072,
            ..Default::default()
        };
        let buf = request(op::READ, read.as_bytes());
        let r = Request::parse(&buf).expect("parse");
        assert_eq!(
            (r.header.opcode, r.header.unique, r.header.nodeid),
            (15, 42, 7)
        );
        let got: ReadIn = r.arg().expect("arg");
        assert_eq!((got.offset, got.size), (4096, 131072));
        // A header that claims more bytes than were read, a truncated header, a short argument.
        assert!(Request::parse(&buf[..60]).is_err());
        assert!(Request::parse(&buf[..20]).is_err());
        let short = request(op::READ, &[0; 8]);
        let r = Request::parse(&short).expect("parse");
        assert!(matches!(
            r.arg::<ReadIn>(),
            Err(ProtoError::Arg { need: 40, .. })
        ));
    }

    #[test]
    fn any_bytes_parse_or_fail_without_panicking() {
        let good = request(op::READ, ReadIn::default().as_bytes());
        for n in 0..=good.len() {
            if let Ok(r) = Request::parse(&good[..n]) {
                let _ = r.arg::<ReadIn>();
                let _ = r.name();
            }
        }
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..2000 {
            let len = (x % 200) as usize;
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            if let Ok(r) = Request::parse(&junk) {
                assert!(r.arg.len() + 40 <= junk.len());
                let _ = (r.arg::<InitIn>(), r.arg::<ReadIn>(), r.name());
            }
        }
    }

    #[test]
    fn names_stop_at_nul_and_dirents_are_padded() {
        let buf = request(op::LOOKUP, b"blobs\0");
        assert_eq!(Request::parse(&buf).expect("parse").name(), b"blobs");
        let mut out = Vec::new();
        push_dirent(&mut out, 3, 1, DT_REG, b"abc");
        assert_eq!(out.len(), dirent_size(3));
        assert_eq!(out.len() % 8, 0);
        let (d, rest) = Dirent::read_from_prefix(&out).expect("dirent");
        assert_eq!((d.ino, d.namelen, &rest[..3]), (3, 3, &b"abc"[..]));
    }
}
