//! Direct I/O reads (`O_DIRECT`): bytes of a local file read without passing through the page cache.
//!
//! A node keeps each byte in memory once (`strata_fs::pagecache`): the kernel's copy of what a sandbox
//! reads. The files a node reads *from* to produce those bytes — a `file://` store's blobs, the chunk
//! cache's segments — must then leave nothing behind. Reading them through the page cache and dropping
//! the range afterwards (`POSIX_FADV_DONTNEED`) also drops the pages the kernel has just read ahead for
//! the next read, so every read becomes a synchronous one; a direct read touches no page at all.
//!
//! Direct I/O wants offsets, lengths and buffer addresses aligned to the disk's logical block size:
//! a read of any range reads the [`ALIGN`]-aligned range around it into an aligned buffer and returns
//! where the wanted bytes start. A filesystem that refuses `O_DIRECT` (some FUSE and network ones) makes
//! [`open`] fail; callers then read the ordinary way.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The alignment used for offsets, lengths and buffers: the largest logical block size of the disks a
/// store or cache lives on.
pub const ALIGN: u64 = 4096;

/// `path` opened read-only for direct I/O.
pub fn open(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

/// Reads `len` bytes at `offset` of `file` (opened with [`open`]): returns a buffer and where the bytes
/// start in it. Fails with `UnexpectedEof` when the file ends before `offset + len`.
pub fn read(file: &File, offset: u64, len: usize) -> io::Result<(Vec<u8>, usize)> {
    let align = ALIGN as usize;
    let base = offset / ALIGN * ALIGN;
    let skip = (offset - base) as usize;
    let want = skip + len;
    let whole = want.div_ceil(align) * align;
    let mut buf = vec![0u8; whole + align];
    let start = buf.as_ptr().align_offset(align);
    let area = &mut buf[start..start + whole];
    let mut done = 0;
    while done < want {
        match file.read_at(&mut area[done..], base + done as u64) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // A short read that is not block-aligned is the end of the file.
        if done % align != 0 && done < want {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
    }
    Ok((buf, start + skip))
}

/// The step [`drop_pages`] widens ranges to: the kernel drops only whole folios inside a range, and a
/// file read or written in pieces is cached in large folios (up to 2 MiB) that straddle the pieces'
/// edges. Dropping a neighbour's pages too costs nothing where every page of the file is cold.
pub const DROP_STEP: u64 = 2 << 20;

/// `len` bytes at `offset` widened to whole [`DROP_STEP`]s, as `(start, len)`.
pub fn widened(offset: u64, len: u64) -> (u64, u64) {
    let start = offset / DROP_STEP * DROP_STEP;
    let end = offset
        .saturating_add(len)
        .div_ceil(DROP_STEP)
        .saturating_mul(DROP_STEP);
    (start, end.saturating_sub(start))
}

/// Drops `len` bytes at `offset` of `file` (widened to whole [`DROP_STEP`]s) from the page cache
/// (`POSIX_FADV_DONTNEED`: clean pages go at once). Best effort: a failure only leaves them cached.
pub fn drop_pages(file: &File, offset: u64, len: u64) {
    let (start, len) = widened(offset, len);
    if let Some(len) = std::num::NonZeroU64::new(len) {
        let _ = rustix::fs::fadvise(file, start, Some(len), rustix::fs::Advice::DontNeed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_range_reads_back_exactly_or_not_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("blob");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 31 % 253) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let Ok(f) = open(&path) else {
            eprintln!("the test directory's filesystem refuses O_DIRECT: nothing to test");
            return;
        };
        for (offset, len) in [
            (0, 1),
            (0, 4096),
            (1, 4095),
            (4095, 2),
            (12_345, 20_000),
            (0, 50_000),
        ] {
            let (buf, at) = read(&f, offset, len).expect("read");
            assert_eq!(
                &buf[at..at + len],
                &data[offset as usize..offset as usize + len]
            );
        }
        for (offset, len) in [(49_999, 2), (50_000, 1), (60_000, 10)] {
            let e = read(&f, offset, len).expect_err("past the end");
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{offset}+{len}");
        }
    }
}
