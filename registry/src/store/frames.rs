//! Layer metadata images compressed as a sequence of independent zstd frames.
//!
//! A metadata image (tens of MB for a large tree) is fetched, decompressed and verified before its layer
//! can be mounted, so its decompression is on the path of every cold mount. One zstd frame decompresses
//! on one core only; the image is therefore stored as frames of [`FRAME`] bytes of input, each recording
//! its decompressed size, and decompressed on every core into one preallocated buffer. The result is
//! still a plain zstd stream (frames may be concatenated), and a stream of frames without sizes — older
//! stores — decompresses the ordinary way. Compression at build time uses every core the same way.
//!
//! A node writes the image to a file before it mounts it, and checks it against its BLAKE3 digest.
//! [`decompress_to`] does all three per frame on the thread that decompressed it, while the frame is
//! in that core's cache: a frame of [`FRAME`] bytes at a multiple of [`FRAME`] is a whole subtree of
//! BLAKE3's tree, so each thread hashes its frames alone (their chaining values,
//! [`crate::pieces::chaining_value`]) and the digest is their combination. On the fat image's
//! 18.9 MB of metadata that replaced decompress, then hash, then write, one after the other.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use blake3::hazmat::ChainingValue;

use crate::digest::Digest;

/// Input bytes per frame.
pub const FRAME: usize = 4 << 20;

fn threads(jobs: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs)
        .max(1)
}

/// Runs `f` over `items` on up to one thread per core, in contiguous runs of items.
fn in_parallel<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let n = threads(items.len());
    let per = items.len().div_ceil(n).max(1);
    let mut groups: Vec<Vec<T>> = Vec::new();
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        groups.push(items.by_ref().take(per).collect());
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || g.into_iter().map(f).collect::<Vec<R>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h.join() {
                Ok(r) => r,
                Err(p) => std::panic::resume_unwind(p),
            })
            .collect()
    })
}

/// Compresses `data` at `level` as frames of [`FRAME`] input bytes.
pub fn compress(data: &[u8], level: i32) -> Vec<u8> {
    let pieces: Vec<&[u8]> = data.chunks(FRAME).collect();
    if pieces.len() <= 1 {
        return crate::toc::compress(data, level);
    }
    in_parallel(pieces, |p| crate::toc::compress(p, level)).concat()
}

/// A zstd frame and its decompressed size.
type SizedFrame<'a> = (&'a [u8], usize);

/// The frames of `z` with their decompressed sizes (`None`: a frame records no size — an older
/// stream, to decompress the ordinary way), refused past `limit` bytes in all.
fn frame_list(z: &[u8], limit: u64) -> io::Result<Option<Vec<SizedFrame<'_>>>> {
    let mut frames = Vec::new();
    let (mut pos, mut total) = (0usize, 0u64);
    while pos < z.len() {
        let rest = &z[pos..];
        let len = zstd::zstd_safe::find_frame_compressed_size(rest).map_err(|c| {
            bad(format!(
                "zstd frame at {pos}: {}",
                zstd::zstd_safe::get_error_name(c)
            ))
        })?;
        let Ok(Some(size)) = zstd::zstd_safe::get_frame_content_size(&rest[..len]) else {
            return Ok(None);
        };
        total += size;
        if total > limit {
            return Err(over(limit));
        }
        frames.push((&rest[..len], size as usize));
        pos += len;
    }
    Ok(Some(frames))
}

fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

fn over(limit: u64) -> io::Error {
    bad(format!("decompresses to more than {limit} bytes"))
}

/// Decompresses `frame` into `dst` (a slice it must fill, or a `Vec`'s spare capacity), checking that it
/// gave the `want` bytes its header says.
fn frame_into<B: zstd::zstd_safe::WriteBuf + ?Sized>(
    d: &mut zstd::bulk::Decompressor,
    frame: &[u8],
    dst: &mut B,
    want: usize,
) -> io::Result<()> {
    match d.decompress_to_buffer(frame, dst)? {
        n if n == want => Ok(()),
        n => Err(bad(format!(
            "frame decompressed to {n} bytes, its header says {want}"
        ))),
    }
}

/// Decompresses a zstd stream of at most `limit` bytes; frames that record their size are decompressed in
/// parallel.
pub fn decompress(z: &[u8], limit: u64) -> io::Result<Vec<u8>> {
    let Some(frames) = frame_list(z, limit)? else {
        return sequential(z, limit);
    };
    let total = frames.iter().map(|f| f.1).sum();
    let mut out = vec![0u8; total];
    let mut jobs = Vec::with_capacity(frames.len());
    let mut rest = &mut out[..];
    for (frame, size) in frames {
        let (dst, tail) = rest.split_at_mut(size);
        jobs.push((frame, dst));
        rest = tail;
    }
    for r in in_parallel(jobs, |(frame, dst)| {
        let want = dst.len();
        frame_into(&mut zstd::bulk::Decompressor::new()?, frame, dst, want)
    }) {
        r?;
    }
    Ok(out)
}

/// Why [`decompress_to`] failed: the stream, or writing its bytes.
#[derive(Debug, thiserror::Error)]
pub enum ToFileError {
    #[error("{0}")]
    Stream(io::Error),
    #[error("writing: {0}")]
    Write(io::Error),
}

/// What [`decompress_to`] wrote: the image's length and digest (`None`: not laid out for it).
pub type Written = Option<(u64, Digest)>;

/// Decompresses `z` (at most `limit` bytes) into `out` from offset 0, each frame decompressed, hashed
/// and written by one of up to one thread per core (see the module documentation). Returns the image's
/// length and BLAKE3 digest; `None` when the stream is not laid out in [`FRAME`]-byte frames recording
/// their sizes (an older store's, or a single frame), for the caller to use [`decompress`].
pub fn decompress_to(z: &[u8], limit: u64, out: &std::fs::File) -> Result<Written, ToFileError> {
    let Some(frames) = frame_list(z, limit).map_err(ToFileError::Stream)? else {
        return Ok(None);
    };
    let Some(((_, last), whole)) = frames.split_last() else {
        return Ok(None);
    };
    if whole.is_empty() || *last == 0 || *last > FRAME || whole.iter().any(|f| f.1 != FRAME) {
        return Ok(None);
    }
    let next = AtomicUsize::new(0);
    let cvs: Mutex<Vec<Option<ChainingValue>>> = Mutex::new(vec![None; frames.len()]);
    let failed: Mutex<Option<ToFileError>> = Mutex::new(None);
    let work = || {
        let mut d = zstd::bulk::Decompressor::new().map_err(ToFileError::Stream)?;
        // Decompressed into spare capacity: no zeroing of a buffer about to be overwritten.
        let mut buf: Vec<u8> = Vec::with_capacity(FRAME);
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(frame, size)) = frames.get(k) else {
                return Ok(());
            };
            let at = (k * FRAME) as u64;
            buf.clear();
            frame_into(&mut d, frame, &mut buf, size).map_err(ToFileError::Stream)?;
            let cv = crate::pieces::chaining_value(&buf, at);
            out.write_all_at(&buf, at).map_err(ToFileError::Write)?;
            cvs.lock().unwrap_or_else(|p| p.into_inner())[k] = Some(cv);
        }
    };
    std::thread::scope(|s| {
        for _ in 0..threads(frames.len()) {
            s.spawn(|| {
                if let Err(e) = work() {
                    // Every thread stops at its next frame.
                    next.store(usize::MAX / 2, Ordering::Relaxed);
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let cvs: Option<Vec<ChainingValue>> = cvs
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .collect();
    let cvs = cvs.ok_or_else(|| ToFileError::Stream(bad("a frame was not decompressed".into())))?;
    let len = (whole.len() * FRAME + last) as u64;
    Ok(Some((len, crate::pieces::combine(&cvs, len, FRAME as u64))))
}

fn sequential(z: &[u8], limit: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    zstd::stream::read::Decoder::new(z)?
        .take(limit + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(over(limit));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i / 7) % 251) as u8 ^ (i % 13) as u8)
            .collect()
    }

    #[test]
    fn round_trips_in_frames_and_reads_older_streams() {
        for n in [0, 100, FRAME, FRAME + 1, 3 * FRAME + 12345] {
            let d = data(n);
            let z = compress(&d, 3);
            assert_eq!(decompress(&z, 1 << 30).unwrap(), d, "{n} bytes");
            // One frame without a recorded size, as a streaming encoder writes it.
            let old = zstd::stream::encode_all(&d[..], 3).unwrap();
            assert_eq!(decompress(&old, 1 << 30).unwrap(), d, "{n} bytes, old");
        }
    }

    #[test]
    fn refuses_garbage_truncation_and_bombs() {
        let d = data(2 * FRAME + 5);
        let z = compress(&d, 3);
        assert!(decompress(&z[..z.len() - 3], 1 << 30).is_err(), "truncated");
        assert!(decompress(b"not zstd at all", 1 << 30).is_err());
        assert!(decompress(&z, FRAME as u64).is_err(), "over the limit");
        let old = zstd::stream::encode_all(&d[..], 3).unwrap();
        assert!(
            decompress(&old, FRAME as u64).is_err(),
            "over the limit, old"
        );
        let mut bad = z.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        assert!(decompress(&bad, 1 << 30).map_or(true, |o| o != d));
    }

    /// `decompress_to` into a new temporary file: its result and the file's bytes.
    fn to_file(z: &[u8], limit: u64) -> (Result<Written, ToFileError>, Vec<u8>) {
        let f = tempfile::tempfile().unwrap();
        let r = decompress_to(z, limit, &f);
        let mut back = Vec::new();
        use std::io::{Read, Seek};
        let mut f = f;
        f.rewind().unwrap();
        f.read_to_end(&mut back).unwrap();
        (r, back)
    }

    #[test]
    fn frames_go_to_a_file_with_the_digest_of_the_whole() {
        for n in [FRAME + 1, 2 * FRAME, 3 * FRAME + 12345, 5 * FRAME - 1] {
            let d = data(n);
            let (r, back) = to_file(&compress(&d, 3), 1 << 30);
            assert_eq!(r.unwrap(), Some((n as u64, Digest::of(&d))), "{n} bytes");
            assert!(back == d, "{n} bytes written");
        }
    }

    #[test]
    fn other_layouts_are_left_to_decompress() {
        // One frame, and frames of another size: the caller decompresses them the ordinary way.
        let d = data(FRAME / 2);
        assert!(to_file(&compress(&d, 3), 1 << 30).0.unwrap().is_none());
        let d = data(3 * FRAME);
        let halves: Vec<u8> = d
            .chunks(FRAME / 2)
            .flat_map(|c| crate::toc::compress(c, 3))
            .collect();
        assert!(to_file(&halves, 1 << 30).0.unwrap().is_none());
        let old = zstd::stream::encode_all(&d[..], 3).unwrap();
        assert!(to_file(&old, 1 << 30).0.unwrap().is_none());
        assert_eq!(decompress(&halves, 1 << 30).unwrap(), d);
    }

    #[test]
    fn a_bad_frame_or_a_bomb_is_refused_on_the_way_to_a_file() {
        let d = data(3 * FRAME + 7);
        let z = compress(&d, 3);
        assert!(matches!(
            to_file(&z[..z.len() - 3], 1 << 30).0,
            Err(ToFileError::Stream(_))
        ));
        assert!(matches!(
            to_file(&z, 2 * FRAME as u64).0,
            Err(ToFileError::Stream(_))
        ));
        // A frame whose bytes are damaged but still decode: the digest tells.
        let mut bad = z.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        match to_file(&bad, 1 << 30).0 {
            Ok(Some((_, digest))) => assert_ne!(digest, Digest::of(&d)),
            Ok(None) => panic!("damaged stream not taken"),
            Err(_) => {}
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Damaged streams (bytes flipped or cut anywhere) never panic, and what `decompress_to` says it
        /// wrote is what the file holds: its digest is the bytes' own (so a caller comparing it with the
        /// name never keeps wrong bytes).
        #[test]
        fn damaged_streams_never_pass_as_the_image(flips in proptest::collection::vec((0usize..1 << 20, 1u8..), 0..4),
                                                   cut in proptest::option::of(0usize..1 << 20)) {
            let d = data(2 * FRAME + 4321);
            let mut z = compress(&d, 1);
            for (at, x) in flips {
                let at = at % z.len();
                z[at] ^= x;
            }
            if let Some(c) = cut {
                z.truncate(c % (z.len() + 1));
            }
            if let (Ok(Some((len, digest))), back) = to_file(&z, 1 << 30) {
                proptest::prop_assert_eq!(len, back.len() as u64);
                proptest::prop_assert_eq!(digest, Digest::of(&back));
            }
        }
    }
}
