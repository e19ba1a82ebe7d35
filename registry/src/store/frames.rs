//! Layer metadata images compressed as a sequence of independent zstd frames.
//!
//! A metadata image (tens of MB for a large tree) is fetched, decompressed and verified before its layer
//! can be mounted, so its decompression is on the path of every cold mount. One zstd frame decompresses
//! on one core only; the image is therefore stored as frames of [`FRAME`] bytes of input, each recording
//! its decompressed size, and decompressed on every core into one preallocated buffer. The result is
//! still a plain zstd stream (frames may be concatenated), and a stream of frames without sizes — older
//! stores — decompresses the ordinary way. Compression at build time uses every core the same way.
//!
//! A node writes the image to a file before it mounts it, and checks it against its BLAKE3 digest:
//! [`super::unpack`] does that frame by frame while the object is still being read. Frames were 4 MiB
//! of input; they are 1 MiB now (+1.0 % stored on the fat image's 18.9 MB of metadata, 4.25 → 4.29 MB):
//! a frame can start as soon as 1/19 of the object is in rather than 1/5, and 19 frames share two cores
//! evenly where 5 did not. Both sizes, and any other power of two in the unpacker's bounds, are read.

use std::io;

/// Input bytes per frame.
pub const FRAME: usize = 1 << 20;

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

pub(super) fn bad(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

pub(super) fn over(limit: u64) -> io::Error {
    bad(format!("decompresses to more than {limit} bytes"))
}

/// Decompresses `frame` into `dst` (a slice it must fill, or a `Vec`'s spare capacity), checking that it
/// gave the `want` bytes its header says.
pub(super) fn frame_into<B: zstd::zstd_safe::WriteBuf + ?Sized>(
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
}
