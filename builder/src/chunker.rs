//! Chunking, digesting, compressing and packing on all cores.
//!
//! The source thread cuts file data into [`Unit`]s, in source order, and sends them to a pool of workers
//! through a bounded channel (so memory stays bounded whatever the layer's size). A unit is one chunk of a
//! large file, or a *group* of small files that will share one zstd frame. Workers read the bytes (from
//! disk, in parallel, by offset — or from memory for tar streams), digest each chunk, turn all-zero chunks
//! into holes, skip chunks stored already (the parents', or any blob's: [`crate::dedup`]), and compress.
//! A single collector thread receives the results, puts them back in source order, drops chunks already placed in this blob, and appends frames
//! to the blob spool while it builds the table of contents. Source order and collector-side dedup make
//! the blob, and so every digest, reproducible.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};
use strata_registry::digest::{Digest, Hasher};
use strata_registry::pieces::{self, Piece};
use strata_registry::toc::{self, ChunkEntry, Footer, Frame, Toc, BLOCK_SIZE};

use crate::error::BuildError;
use crate::tree::NodeId;

/// Bytes of a chunk: in memory, or a range of a file read by the worker.
pub enum ChunkData {
    Bytes(Vec<u8>),
    File {
        path: Arc<PathBuf>,
        offset: u64,
        len: u64,
        sparse: bool,
    },
}

/// A piece of work for the pool.
pub enum Unit {
    /// Chunk `index` of the file at `node`.
    Chunk {
        node: NodeId,
        index: u32,
        data: ChunkData,
    },
    /// Small files (each a single chunk) compressed together in one frame.
    Group(Vec<(NodeId, ChunkData)>),
    /// A chunk to store in the new blob whatever holds it already (its files' references were recorded
    /// when they were met): a chunk of a foreign blob the layer will not reference ([`crate::dedup`]).
    Forced(Vec<u8>),
}

/// Where each file's chunk lies, by digest (`None`: a hole).
pub type ChunkRef = (NodeId, u32, Option<Digest>);

/// What a worker hands the collector: one frame holding chunks, or a pieced chunk's frames.
struct FrameOut {
    /// Each frame's compressed bytes and uncompressed length: one, or one per piece of a pieced chunk.
    frames: Vec<(Vec<u8>, u32)>,
    /// Digest, length and offset in the decompressed frame of each chunk (a pieced chunk: it alone).
    chunks: Vec<(Digest, u32, u32)>,
    /// A pieced chunk's pieces (empty otherwise).
    pieces: Vec<Piece>,
}

impl FrameOut {
    /// Chunk `d` (`data`) compressed on its own: in pieces when longer than `piece_size`.
    fn chunk(d: Digest, data: &[u8], level: i32, piece_size: u32) -> FrameOut {
        let (frames, pieces) = compress_chunk(data, level, piece_size);
        FrameOut {
            frames,
            chunks: vec![(d, data.len() as u32, 0)],
            pieces,
        }
    }
}

/// Compresses a chunk for a blob of piece size `piece_size` (0: none): one frame, or one per piece
/// with the pieces' records. Returns each frame's compressed bytes and uncompressed length.
pub(crate) fn compress_chunk(
    data: &[u8],
    level: i32,
    piece_size: u32,
) -> (Vec<(Vec<u8>, u32)>, Vec<Piece>) {
    if pieces::count(data.len() as u32, piece_size) == 0 {
        return (
            vec![(toc::compress(data, level), data.len() as u32)],
            Vec::new(),
        );
    }
    pieces::cut(data, piece_size)
        .into_iter()
        .map(|(r, p)| {
            let part = &data[r];
            ((toc::compress(part, level), part.len() as u32), p)
        })
        .unzip()
}

/// Appends `frames` to `out` and records them in `toc`; returns the first one's index.
pub(crate) fn append_frames(
    out: &mut BlobSpool,
    toc: &mut Toc,
    frames: &[(Vec<u8>, u32)],
) -> Result<u32, BuildError> {
    let first = toc.frames.len() as u32;
    for (z, uncompressed) in frames {
        toc.frames.push(Frame {
            offset: out.offset,
            compressed: z.len() as u32,
            uncompressed: *uncompressed,
        });
        out.write(z)?;
    }
    Ok(first)
}

struct Done {
    seq: u64,
    frames: Vec<FrameOut>,
    refs: Vec<ChunkRef>,
}

/// The blob a build produced.
pub struct BlobOut {
    pub spool: PathBuf,
    pub digest: Digest,
    pub size: u64,
    pub toc: Toc,
    pub footer: Footer,
}

/// What the collector hands back.
pub struct Packed {
    /// `None` when no chunk was new.
    pub blob: Option<BlobOut>,
    /// Chunk digest → view block in the new blob.
    pub placed: HashMap<Digest, u32>,
    pub refs: Vec<ChunkRef>,
    pub new_chunks: u64,
    pub new_bytes: u64,
}

/// Settings of the pool.
#[derive(Clone)]
pub struct PoolOptions {
    pub threads: usize,
    pub level: i32,
    /// Chunks longer than this are stored in pieces (0: none; see [`strata_registry::pieces`]).
    pub piece_size: u32,
    pub spool_dir: PathBuf,
    /// Chunks stored already (never compressed or stored again).
    pub known: Arc<crate::dedup::Known>,
    /// Counts bytes of file data processed, for progress.
    pub progress: Arc<AtomicU64>,
}

/// A running pool: send units with [`Pool::send`], then [`Pool::finish`].
pub struct Pool {
    tx: Option<Sender<(u64, Unit)>>,
    seq: u64,
    /// Units the workers have finished with.
    worked: Arc<AtomicU64>,
    workers: Vec<JoinHandle<()>>,
    collector: Option<JoinHandle<Result<Packed, BuildError>>>,
    error: Receiver<BuildError>,
}

fn read_data(data: &ChunkData) -> Result<Option<Vec<u8>>, BuildError> {
    match data {
        ChunkData::Bytes(b) => Ok(Some(b.clone())),
        ChunkData::File {
            path,
            offset,
            len,
            sparse,
        } => {
            let f = File::open(path.as_path()).map_err(|e| BuildError::io(path.as_path(), e))?;
            if *sparse && !has_data(&f, *offset, *len) {
                return Ok(None);
            }
            let mut buf = vec![0u8; *len as usize];
            f.read_exact_at(&mut buf, *offset).map_err(|e| {
                BuildError::io(
                    path.as_path(),
                    std::io::Error::new(e.kind(), format!("{e} (file changed while building?)")),
                )
            })?;
            Ok(Some(buf))
        }
    }
}

/// False if `[offset, offset+len)` of `f` is entirely a hole.
fn has_data(f: &File, offset: u64, len: u64) -> bool {
    // SAFETY: lseek on a valid descriptor has no memory-safety preconditions.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
    if r < 0 {
        // ENXIO: no data after offset. Anything else: assume data.
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    (r as u64) < offset + len
}

fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Digests a chunk's bytes and records its reference; returns the bytes if they must be stored.
fn classify(
    done: &mut Done,
    opts: &PoolOptions,
    node: NodeId,
    index: u32,
    data: Option<Vec<u8>>,
) -> Option<(Digest, Vec<u8>)> {
    let Some(data) = data else {
        done.refs.push((node, index, None));
        return None;
    };
    opts.progress
        .fetch_add(data.len() as u64, Ordering::Relaxed);
    if is_zero(&data) {
        done.refs.push((node, index, None));
        return None;
    }
    let d = Digest::of(&data);
    done.refs.push((node, index, Some(d)));
    if opts.known.known(&d, data.len() as u64) {
        return None;
    }
    Some((d, data))
}

fn work(unit: Unit, seq: u64, opts: &PoolOptions) -> Result<Done, BuildError> {
    let mut done = Done {
        seq,
        frames: Vec::new(),
        refs: Vec::new(),
    };
    match unit {
        Unit::Chunk { node, index, data } => {
            let bytes = read_data(&data)?;
            if let Some((d, data)) = classify(&mut done, opts, node, index, bytes) {
                let out = FrameOut::chunk(d, &data, opts.level, opts.piece_size);
                done.frames.push(out);
            }
        }
        Unit::Forced(data) => {
            let d = Digest::of(&data);
            let out = FrameOut::chunk(d, &data, opts.level, opts.piece_size);
            done.frames.push(out);
        }
        Unit::Group(members) => {
            let mut buf = Vec::new();
            let mut chunks = Vec::new();
            for (node, data) in members {
                let bytes = read_data(&data)?;
                if let Some((d, data)) = classify(&mut done, opts, node, 0, bytes) {
                    chunks.push((d, data.len() as u32, buf.len() as u32));
                    buf.extend_from_slice(&data);
                }
            }
            if !chunks.is_empty() {
                // Grouped chunks are shorter than any piece size: a group is never pieced.
                done.frames.push(FrameOut {
                    frames: vec![(toc::compress(&buf, opts.level), buf.len() as u32)],
                    chunks,
                    pieces: Vec::new(),
                });
            }
        }
    }
    Ok(done)
}

/// A blob being written to a spool file, digested as it goes: frames, then [`BlobSpool::seal`] appends the
/// table of contents and the footer. Builds and compaction write blobs through it.
pub struct BlobSpool {
    pub path: PathBuf,
    file: std::io::BufWriter<File>,
    hasher: Hasher,
    /// Bytes written so far (the offset of the next frame).
    pub offset: u64,
}

impl BlobSpool {
    /// A new spool file in `dir`, named after `label`, the process and the time.
    pub fn create(dir: &Path, label: &str) -> Result<BlobSpool, BuildError> {
        let name = format!(
            "{label}-{}-{}.tmp",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        let path = dir.join(name);
        let f = File::create(&path).map_err(|e| BuildError::io(&path, e))?;
        Ok(BlobSpool {
            path,
            file: std::io::BufWriter::with_capacity(1 << 20, f),
            hasher: Hasher::new(),
            offset: 0,
        })
    }

    /// Appends bytes.
    pub fn write(&mut self, b: &[u8]) -> Result<(), BuildError> {
        self.file
            .write_all(b)
            .map_err(|e| BuildError::io(&self.path, e))?;
        self.hasher.update(b);
        self.offset += b.len() as u64;
        Ok(())
    }

    /// Appends `toc` and the footer and syncs the file; returns the blob's digest, size and footer.
    pub fn seal(mut self, toc: &Toc) -> Result<(Digest, u64, Footer), BuildError> {
        let toc_bytes = toc.encode();
        let footer = Footer {
            toc_offset: self.offset,
            toc_len: toc_bytes.len() as u64,
            toc_digest: Digest::of(&toc_bytes),
        };
        self.write(&toc_bytes)?;
        self.write(&footer.encode())?;
        self.file
            .flush()
            .map_err(|e| BuildError::io(&self.path, e))?;
        let file = self
            .file
            .into_inner()
            .map_err(|e| BuildError::io(&self.path, e.into_error()))?;
        file.sync_all().map_err(|e| BuildError::io(&self.path, e))?;
        Ok((self.hasher.finish(), self.offset, footer))
    }

    /// Deletes the spool file (a failed or empty blob).
    pub fn discard(self) {
        drop(self.file);
        let _ = std::fs::remove_file(&self.path);
    }
}

struct Collector {
    out: BlobSpool,
    toc: Toc,
    placed: HashMap<Digest, u32>,
    next_block: u64,
    refs: Vec<ChunkRef>,
    new_bytes: u64,
}

impl Collector {
    fn take(&mut self, done: Done) -> Result<(), BuildError> {
        self.refs.extend(done.refs);
        for f in done.frames {
            if f.chunks.iter().all(|(d, _, _)| self.placed.contains_key(d)) {
                continue;
            }
            let index = append_frames(&mut self.out, &mut self.toc, &f.frames)?;
            if !f.pieces.is_empty() {
                let chunk = self.toc.chunks.len() as u32;
                self.toc.pieces.extend(f.pieces.iter().map(|p| (chunk, *p)));
            }
            for (d, len, frame_offset) in f.chunks {
                if self.placed.contains_key(&d) {
                    continue;
                }
                let block = u32::try_from(self.next_block)
                    .map_err(|_| BuildError::Option("blob view larger than 16 TiB".into()))?;
                self.placed.insert(d, block);
                self.new_bytes += len as u64;
                self.toc.chunks.push(ChunkEntry {
                    block,
                    len,
                    frame: index,
                    frame_offset,
                    digest: d,
                });
                self.next_block += (len as u64).div_ceil(BLOCK_SIZE);
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Packed, BuildError> {
        let new_chunks = self.toc.chunks.len() as u64;
        if new_chunks == 0 {
            self.out.discard();
            return Ok(Packed {
                blob: None,
                placed: self.placed,
                refs: self.refs,
                new_chunks: 0,
                new_bytes: 0,
            });
        }
        self.toc.view_blocks = self.next_block;
        let spool = self.out.path.clone();
        let (digest, size, footer) = self.out.seal(&self.toc)?;
        Ok(Packed {
            blob: Some(BlobOut {
                spool,
                digest,
                size,
                toc: self.toc,
                footer,
            }),
            placed: self.placed,
            refs: self.refs,
            new_chunks,
            new_bytes: self.new_bytes,
        })
    }
}

impl Pool {
    /// Starts the workers and the collector.
    pub fn start(opts: PoolOptions) -> Result<Pool, BuildError> {
        let threads = opts.threads.max(1);
        let (tx, rx) = bounded::<(u64, Unit)>(threads * 4);
        let (done_tx, done_rx) = bounded::<Done>(threads * 4);
        let (err_tx, err_rx) = bounded::<BuildError>(threads + 1);
        let mut workers = Vec::new();
        let worked = Arc::new(AtomicU64::new(0));
        for i in 0..threads {
            let worked = worked.clone();
            let rx = rx.clone();
            let done_tx = done_tx.clone();
            let err_tx = err_tx.clone();
            let opts = opts.clone();
            let h = std::thread::Builder::new()
                .name(format!("strata-chunk-{i}"))
                .spawn(move || {
                    for (seq, unit) in rx {
                        let result = work(unit, seq, &opts);
                        worked.fetch_add(1, Ordering::Release);
                        match result {
                            Ok(d) => {
                                if done_tx.send(d).is_err() {
                                    return;
                                }
                            }
                            Err(e) => {
                                let _ = err_tx.try_send(e);
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| BuildError::io("worker thread", e))?;
            workers.push(h);
        }
        drop(done_tx);
        let out = BlobSpool::create(&opts.spool_dir, "blob")?;
        let collector = std::thread::Builder::new()
            .name("strata-collect".into())
            .spawn(move || {
                let mut c = Collector {
                    out,
                    toc: Toc {
                        piece_size: opts.piece_size,
                        ..Toc::default()
                    },
                    placed: HashMap::new(),
                    next_block: 0,
                    refs: Vec::new(),
                    new_bytes: 0,
                };
                let mut pending = BTreeMap::new();
                let mut next = 0u64;
                let result = (|| {
                    for d in done_rx {
                        pending.insert(d.seq, d);
                        while let Some(d) = pending.remove(&next) {
                            c.take(d)?;
                            next += 1;
                        }
                    }
                    Ok(())
                })();
                match result {
                    Ok(()) => c.finish(),
                    Err(e) => {
                        c.out.discard();
                        Err(e)
                    }
                }
            })
            .map_err(|e| BuildError::io("collector thread", e))?;
        Ok(Pool {
            tx: Some(tx),
            seq: 0,
            worked,
            workers,
            collector: Some(collector),
            error: err_rx,
        })
    }

    /// Queues a unit (blocks while the pool is busy). Fails early if a worker has failed.
    pub fn send(&mut self, unit: Unit) -> Result<(), BuildError> {
        if let Ok(e) = self.error.try_recv() {
            return Err(e);
        }
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| BuildError::Option("pool already finished".into()))?;
        if tx.send((self.seq, unit)).is_err() {
            return Err(self.fail());
        }
        self.seq += 1;
        Ok(())
    }

    /// Waits until the workers have classified every unit sent so far (so that what they found stored
    /// already is final); fails early if one has failed.
    pub fn drain(&mut self) -> Result<(), BuildError> {
        while self.worked.load(Ordering::Acquire) < self.seq {
            if let Ok(e) = self.error.try_recv() {
                return Err(e);
            }
            if self.workers.iter().all(|w| w.is_finished()) {
                return Err(self.fail());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    /// Stops everything after a failure and returns the first error a thread reported.
    fn fail(&mut self) -> BuildError {
        drop(self.tx.take());
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if let Ok(e) = self.error.try_recv() {
            return e;
        }
        match self.collector.take().map(|c| c.join()) {
            Some(Ok(Err(e))) => e,
            Some(Ok(Ok(p))) => {
                if let Some(b) = p.blob {
                    let _ = std::fs::remove_file(&b.spool);
                }
                BuildError::Option("chunk workers stopped".into())
            }
            _ => BuildError::Option("chunk collector panicked".into()),
        }
    }

    /// Waits for every unit, then seals the blob.
    pub fn finish(mut self) -> Result<Packed, BuildError> {
        drop(self.tx.take());
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        let packed = match self.collector.take().map(|c| c.join()) {
            Some(Ok(r)) => r,
            _ => Err(BuildError::Option("collector thread panicked".into())),
        };
        if let Ok(e) = self.error.try_recv() {
            if let Ok(p) = &packed {
                if let Some(b) = &p.blob {
                    let _ = std::fs::remove_file(&b.spool);
                }
            }
            return Err(e);
        }
        packed
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        drop(self.tx.take());
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if let Some(c) = self.collector.take() {
            if let Ok(Ok(p)) = c.join() {
                if let Some(b) = p.blob {
                    let _ = std::fs::remove_file(&b.spool);
                }
            }
        }
    }
}
