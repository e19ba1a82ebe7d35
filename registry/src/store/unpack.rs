//! Layer metadata decompressed into a file while it is still being read.
//!
//! A layer's first mount waits for its metadata: the object read (4.2 MB for the fat image: 7.5–10 ms
//! from a local disk, tens of ms over a 1 Gbit link), then 18.9 MB decompressed, hashed and written.
//! Done one after the other, the read's whole time adds to the rest. Here the object arrives in pieces
//! ([`super::StoreBackend::get_streamed`]), each frame is handed to a worker as soon as its last byte is
//! in, and up to one worker per core decompresses, hashes and writes frames meanwhile, so that when the
//! read ends only its last frame's work remains.
//!
//! The layout taken this way: frames of `F` decompressed bytes each — `F` a power of two between
//! [`MIN_FRAME`] and [`MAX_FRAME`], the first frame's size — but the last, of 1 to `F` bytes, every frame
//! recording its size ([`super::frames::compress`] writes them). A frame of `F` bytes at a multiple of
//! `F` is a whole subtree of BLAKE3's tree, so each worker hashes its frames alone (their chaining
//! values) and the image's digest is their combination. Anything else — one frame, frames without sizes
//! or of other sizes, a patch, a damaged stream — is collected whole and handed back
//! ([`Unpacked::Whole`]) for the caller's ordinary path; the bytes written by then are the image's own
//! prefix, which that path overwrites.
//!
//! Invariants: a frame is handed to a worker only while every earlier one had `F` bytes; a result of
//! [`Unpacked::Written`] means every frame of the stream was decompressed, written and hashed, its
//! chaining value recorded, and no byte of the stream is left after its last frame.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard};

use blake3::hazmat::ChainingValue;

use super::frames::{bad, frame_into, over};
use crate::digest::Digest;

/// The smallest frame size taken as a layout.
pub const MIN_FRAME: usize = 64 << 10;

/// The largest frame size taken as a layout (a worker's buffer is one frame).
pub const MAX_FRAME: usize = 16 << 20;

/// The first bytes of a zstd frame.
const ZSTD_MAGIC: [u8; 4] = 0xFD2F_B528u32.to_le_bytes();

/// What [`unpack_into`] did with the stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Unpacked {
    /// Written to the file whole: the image's length and BLAKE3 digest.
    Written { len: u64, digest: Digest },
    /// Not laid out in sized frames: the whole stream, for the caller to decompress otherwise.
    Whole(Vec<u8>),
}

/// Why [`unpack_into`] failed: the stream, writing its bytes, or reading them (`E`, the reader's error).
#[derive(Debug, thiserror::Error)]
pub enum UnpackError<E> {
    #[error("{0}")]
    Stream(io::Error),
    #[error("writing: {0}")]
    Write(io::Error),
    #[error(transparent)]
    Read(E),
}

/// Decompresses the zstd stream `read` hands to its sink, piece by piece, into `out` from offset 0:
/// at most `limit` bytes, frames decompressed, hashed and written by up to one worker per core while
/// the stream is still being read (see the module documentation).
pub fn unpack_into<E>(
    limit: u64,
    out: &File,
    read: impl FnOnce(&mut dyn FnMut(&[u8])) -> Result<(), E>,
) -> Result<Unpacked, UnpackError<E>> {
    let (tx, rx) = mpsc::channel::<Job>();
    let workers = Workers {
        jobs: Mutex::new(rx),
        cvs: Mutex::default(),
        failed: Mutex::default(),
        stop: AtomicBool::new(false),
        out,
    };
    let mut split = Splitter::new(limit);
    let mut split_failed = None;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let read = std::thread::scope(|s| {
        // A worker starts with a frame to do, up to one per core: a stream that is not laid out in
        // frames (a small layer's single frame, a patch) starts none.
        let mut started = 0;
        let read = read(&mut |piece| {
            if split_failed.is_none() && !workers.stop.load(Ordering::Relaxed) {
                let dispatch = &mut |job| {
                    if started < cores {
                        s.spawn(|| workers.run());
                        started += 1;
                    }
                    // Only a worker that has stopped drops its receiver: the failure is recorded.
                    let _ = tx.send(job);
                };
                if let Err(e) = split.push(piece, dispatch) {
                    split_failed = Some(e);
                }
            }
        });
        drop(tx);
        read
    });
    read.map_err(UnpackError::Read)?;
    if let Some(e) = split_failed {
        return Err(UnpackError::Stream(e));
    }
    match workers
        .failed
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
    {
        Some(UnpackError::Stream(e)) => return Err(UnpackError::Stream(e)),
        Some(UnpackError::Write(e)) => return Err(UnpackError::Write(e)),
        Some(UnpackError::Read(never)) => match never {},
        None => {}
    }
    let Some(len) = split.end() else {
        return Ok(Unpacked::Whole(split.buf));
    };
    let cvs: Option<Vec<ChainingValue>> = workers
        .cvs
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .collect();
    match cvs {
        Some(cvs) if cvs.len() == split.frames => Ok(Unpacked::Written {
            len,
            digest: crate::pieces::combine(&cvs, len, split.size as u64),
        }),
        _ => Err(UnpackError::Stream(bad(
            "a frame was not decompressed".into()
        ))),
    }
}

/// One frame for a worker: its index, compressed bytes, decompressed size and place in the image.
struct Job {
    k: usize,
    frame: Vec<u8>,
    size: usize,
    at: u64,
}

/// Cuts the stream into frames as its pieces arrive, and decides whether it is laid out to be
/// unpacked frame by frame.
struct Splitter {
    /// Every byte of the stream so far.
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`.
    pos: usize,
    /// Frames handed out, and the last one's size.
    frames: usize,
    last: usize,
    /// `F`, once the first frame is in.
    size: usize,
    total: u64,
    limit: u64,
    /// Not laid out: only collected from here on.
    whole: bool,
}

impl Splitter {
    fn new(limit: u64) -> Splitter {
        Splitter {
            buf: Vec::new(),
            pos: 0,
            frames: 0,
            last: 0,
            size: 0,
            total: 0,
            limit,
            whole: false,
        }
    }

    /// Takes in `piece` and hands every frame it completes to `dispatch`. Fails when the frames'
    /// sizes pass the limit.
    fn push(&mut self, piece: &[u8], dispatch: &mut dyn FnMut(Job)) -> io::Result<()> {
        self.buf.extend_from_slice(piece);
        while !self.whole {
            let rest = &self.buf[self.pos..];
            if self.pos == 0 && rest.len() >= 4 && rest[..4] != ZSTD_MAGIC {
                self.whole = true;
                break;
            }
            // An error here is a frame not yet whole (or damaged: told by the ordinary path).
            let Ok(len) = zstd::zstd_safe::find_frame_compressed_size(rest) else {
                break;
            };
            let Ok(Some(size)) = zstd::zstd_safe::get_frame_content_size(&rest[..len]) else {
                self.whole = true;
                break;
            };
            self.total = self.total.saturating_add(size);
            if self.total > self.limit {
                return Err(over(self.limit));
            }
            let size = usize::try_from(size).map_err(|_| over(self.limit))?;
            if !self.fits(size) {
                self.whole = true;
                break;
            }
            dispatch(Job {
                k: self.frames,
                frame: self.buf[self.pos..self.pos + len].to_vec(),
                size,
                at: (self.frames * self.size) as u64,
            });
            self.pos += len;
            self.frames += 1;
            self.last = size;
        }
        Ok(())
    }

    /// Whether a frame of `size` bytes may come next in the layout (the first one sets `F`).
    fn fits(&mut self, size: usize) -> bool {
        if self.frames == 0 {
            let ok = size.is_power_of_two() && (MIN_FRAME..=MAX_FRAME).contains(&size);
            if ok {
                self.size = size;
            }
            return ok;
        }
        self.last == self.size && size <= self.size
    }

    /// After the last piece: the image's length, if the whole stream was frames of the layout.
    fn end(&self) -> Option<u64> {
        let laid_out =
            !self.whole && self.pos == self.buf.len() && self.frames >= 2 && self.last > 0;
        laid_out.then(|| ((self.frames - 1) * self.size + self.last) as u64)
    }
}

/// A worker's failure: never a read's.
type Failed = UnpackError<std::convert::Infallible>;

/// What the workers share: the frames to do, what they found, and where they write.
struct Workers<'a> {
    jobs: Mutex<mpsc::Receiver<Job>>,
    /// Each frame's chaining value, by index.
    cvs: Mutex<Vec<Option<ChainingValue>>>,
    failed: Mutex<Option<Failed>>,
    /// Set at the first failure: the rest of the frames are not done.
    stop: AtomicBool,
    out: &'a File,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Workers<'_> {
    /// One worker: takes frames until the stream ends.
    fn run(&self) {
        let mut d = match zstd::bulk::Decompressor::new() {
            Ok(d) => d,
            Err(e) => return self.fail(UnpackError::Stream(e)),
        };
        // Decompressed into spare capacity: no zeroing of a buffer about to be overwritten.
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let Ok(job) = locked(&self.jobs).recv() else {
                return;
            };
            if self.stop.load(Ordering::Relaxed) {
                continue;
            }
            buf.clear();
            buf.reserve(job.size);
            let done = frame_into(&mut d, &job.frame, &mut buf, job.size)
                .map_err(UnpackError::Stream)
                .and_then(|()| {
                    let cv = crate::pieces::chaining_value(&buf, job.at);
                    self.out
                        .write_all_at(&buf, job.at)
                        .map_err(UnpackError::Write)?;
                    Ok(cv)
                });
            match done {
                Ok(cv) => {
                    let mut cvs = locked(&self.cvs);
                    if cvs.len() <= job.k {
                        cvs.resize(job.k + 1, None);
                    }
                    cvs[job.k] = Some(cv);
                }
                Err(e) => self.fail(e),
            }
        }
    }

    fn fail(&self, e: Failed) {
        self.stop.store(true, Ordering::Relaxed);
        locked(&self.failed).get_or_insert(e);
    }
}

#[cfg(test)]
#[path = "unpack_tests.rs"]
mod tests;
