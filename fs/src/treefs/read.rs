//! Reading a file of the tree: its bytes cut into pieces — zeros (holes), bytes of the image (inline
//! and flat files, device 0 chunks) and ranges of blob views — answered on the FUSE worker when every
//! blob range is cached, else on the slow-read scheduler (see [`crate::blobfs`] for the same split).
//! A slow read runs as its reader ([`with_reader`]): in `fuse` mode the request's pid is the process
//! in the sandbox, so its misses are charged to that sandbox as in `file` mode.

use std::sync::Arc;

use strata_erofs::{Inode, Layout};

use super::{TreeError, TreeFs};
use crate::attribution::with_reader;
use crate::blobfs::{tree_errno, View};
use crate::fetch::{BlobHandle, FetchError};
use crate::fuse::session::Reply;
use crate::metrics::Metrics;
use crate::slowread::SlowError;

/// A part of a read, in order.
enum Piece {
    /// Bytes already in the buffer (zeros of a hole, or copied from the image).
    Done(usize),
    /// `len` bytes of a blob's view at `offset`.
    Blob {
        blob: Arc<BlobHandle>,
        offset: u64,
        len: usize,
    },
}

impl TreeFs {
    /// Answers a read of `size` bytes at `offset` of the regular file `inode`.
    pub(super) fn read_file(&self, inode: &Inode, offset: u64, size: u32, reply: Reply) {
        if inode.is_dir() {
            return reply.error(rustix::io::Errno::ISDIR);
        }
        if offset >= inode.size {
            return reply.data(&[]);
        }
        let n = (u64::from(size)).min(inode.size - offset) as usize;
        let mut buf = vec![0u8; n];
        let pieces = match self.pieces(inode, offset, &mut buf) {
            Ok(p) => p,
            Err(e) => return reply.error(self.errno(e)),
        };
        // Cached blob ranges are read here; the first that is not goes, with the rest, to the slow
        // reads.
        let mut pos = 0;
        let mut stop = None;
        for (k, piece) in pieces.iter().enumerate() {
            match piece {
                Piece::Done(len) => pos += len,
                Piece::Blob { blob, offset, len } => {
                    match self
                        .view
                        .read(blob, *offset, &mut buf[pos..pos + len], true)
                    {
                        Ok(done) if done == *len => pos += len,
                        Ok(done) => {
                            stop = Some((k, done));
                            break;
                        }
                        Err(e) => return reply.error(self.errno(e.into())),
                    }
                }
            }
        }
        let Some((from, done)) = stop else {
            self.metrics.served(n);
            return reply.data(&[&buf]);
        };
        let rest = Rest {
            reader: reply.pid(),
            view: self.view.clone(),
            metrics: self.metrics.clone(),
            pieces,
            from,
            done,
            pos,
            buf,
        };
        self.slow_read(rest, reply);
    }

    fn slow_read(&self, rest: Rest, reply: Reply) {
        let Piece::Blob { blob, .. } = &rest.pieces[rest.from] else {
            return reply.error(rustix::io::Errno::IO);
        };
        let digest = blob.blob.digest;
        self.slow
            .submit(digest, reply, Box::new(move || rest.finish()));
    }

    /// Cuts the read of `buf.len()` bytes at `offset` into pieces, filling `buf` with what needs no
    /// blob (holes stay zero).
    fn pieces(&self, inode: &Inode, offset: u64, buf: &mut [u8]) -> Result<Vec<Piece>, TreeError> {
        match inode.layout {
            Layout::FlatPlain | Layout::FlatInline => {
                let data = self.image.data(inode)?;
                let start = (offset as usize).min(data.len());
                let end = (start + buf.len()).min(data.len());
                buf[..end - start].copy_from_slice(&data[start..end]);
                Ok(vec![Piece::Done(buf.len())])
            }
            Layout::ChunkBased => self.chunk_pieces(inode, offset, buf),
            layout => Err(TreeError::Layout {
                nid: inode.nid,
                layout,
            }),
        }
    }

    fn chunk_pieces(
        &self,
        inode: &Inode,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<Vec<Piece>, TreeError> {
        let bits = inode.chunk_bits;
        let chunk = 1u64 << bits;
        let end = offset + buf.len() as u64;
        let first = offset >> bits;
        let locs = self
            .image
            .chunk_range(inode, first..((end - 1) >> bits) + 1)?;
        let bsz = self.image.block_size();
        let mut pieces = Vec::with_capacity(locs.len());
        let mut at = offset;
        for loc in locs {
            let within = at & (chunk - 1);
            let len = (chunk - within).min(end - at) as usize;
            let pos = (at - offset) as usize;
            match loc {
                None => pieces.push(Piece::Done(len)),
                Some(l) if l.device == 0 => {
                    // Device 0 is the image itself (4-byte block maps of other writers).
                    let from = u64::from(l.block) * bsz + within;
                    let bytes = self
                        .image
                        .bytes()
                        .get(from as usize..from as usize + len)
                        .ok_or(TreeError::NoBlob { device: 0 })?;
                    buf[pos..pos + len].copy_from_slice(bytes);
                    pieces.push(Piece::Done(len));
                }
                Some(l) => pieces.push(Piece::Blob {
                    blob: self.blob(l.device)?,
                    offset: u64::from(l.block) * strata_registry::toc::BLOCK_SIZE + within,
                    len,
                }),
            }
            at += len as u64;
        }
        Ok(pieces)
    }
}

/// What a slow read goes on with: the pieces from `from` (of which `done` bytes are read), the
/// buffer and where piece `from` starts in it.
struct Rest {
    /// The process that read: its misses are charged to its sandbox ([`crate::attribution`]).
    reader: u32,
    view: Arc<View>,
    metrics: Arc<Metrics>,
    pieces: Vec<Piece>,
    from: usize,
    done: usize,
    pos: usize,
    buf: Vec<u8>,
}

impl Rest {
    fn finish(self) -> Result<Vec<u8>, SlowError> {
        let reader = self.reader;
        with_reader(reader, || self.read_rest())
    }

    fn read_rest(mut self) -> Result<Vec<u8>, SlowError> {
        let mut pos = self.pos;
        for (k, piece) in self.pieces.iter().enumerate().skip(self.from) {
            match piece {
                Piece::Done(len) => pos += len,
                Piece::Blob { blob, offset, len } => {
                    let skip = if k == self.from { self.done } else { 0 };
                    let part = &mut self.buf[pos + skip..pos + len];
                    if let Err(e) = self.view.read(blob, offset + skip as u64, part, false) {
                        return Err(SlowError {
                            unavailable: matches!(e, FetchError::Timeout { .. }),
                            errno: tree_errno(&e.into(), &self.metrics),
                        });
                    }
                    pos += len;
                }
            }
        }
        self.metrics.served(self.buf.len());
        Ok(self.buf)
    }
}
