//! Test support: blobs made in memory and a fetcher over the fault-injecting store, so the data path is
//! tested without root, a kernel mount or a network.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use zerocopy::{FromBytes, IntoBytes};

use strata_registry::digest::Digest;
use strata_registry::model::BlobRef;
use strata_registry::pieces;
use strata_registry::store::{key, FaultyStore, MemoryStore, PutMode, Store, StoreBackend};
use strata_registry::toc::{compress, ChunkEntry, Frame, Toc, BLOCK_SIZE};

use crate::cache::ChunkCache;
use crate::fetch::{BlobHandle, Fetcher};
use crate::fuse::proto::{InHeader, OutHeader, ReadIn};
use crate::metrics::Metrics;

/// A fetcher over a faulty in-memory store holding blobs made by [`Kit::blob`].
pub struct Kit {
    pub mem: Arc<MemoryStore>,
    pub faults: Arc<FaultyStore>,
    pub store: Arc<Store>,
    pub fetcher: Arc<Fetcher>,
    pub metrics: Arc<Metrics>,
    _cache_dir: tempfile::TempDir,
}

impl Kit {
    /// A kit whose reads wait at most `deadline`.
    pub fn new(deadline: Duration) -> Kit {
        let mem = Arc::new(MemoryStore::new());
        let faults = Arc::new(FaultyStore::new(mem.clone()));
        faults.set_hang_limit(Duration::from_secs(20));
        let mut store = Store::with_backend(faults.clone());
        store.range_deadline = deadline;
        let store = Arc::new(store);
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ChunkCache::open(dir.path(), 1 << 30).expect("cache");
        let metrics = Arc::new(Metrics::default());
        // Fetching only the chunk asked for keeps request counts exact.
        let fetcher = Arc::new(Fetcher::new(
            store.clone(),
            cache,
            metrics.clone(),
            1,
            deadline,
        ));
        Kit {
            mem,
            faults,
            store,
            fetcher,
            metrics,
            _cache_dir: dir,
        }
    }

    /// Stores a blob of `chunks` (each compressed on its own) and opens it; returns it and its key.
    pub fn blob(&self, chunks: &[Vec<u8>]) -> (BlobHandle, String) {
        self.pieced_blob(chunks, 0, None)
    }

    /// Stores a blob of `chunks` compressed together in one frame (a group frame, as builds store small
    /// files) and opens it.
    pub fn group_blob(&self, chunks: &[Vec<u8>]) -> (BlobHandle, String) {
        let all = chunks.concat();
        let z = compress(&all, 3);
        let mut toc = Toc {
            frames: vec![Frame {
                offset: 0,
                compressed: z.len() as u32,
                uncompressed: all.len() as u32,
            }],
            ..Toc::default()
        };
        let (mut block, mut at) = (0u64, 0u32);
        for c in chunks {
            toc.chunks.push(ChunkEntry {
                block: block as u32,
                len: c.len() as u32,
                frame: 0,
                frame_offset: at,
                digest: Digest::of(c),
            });
            block += (c.len() as u64).div_ceil(BLOCK_SIZE);
            at += c.len() as u32;
        }
        toc.view_blocks = block;
        self.store_blob(z, &toc, chunks.len())
    }

    /// Stores a blob of `chunks`, those longer than `piece_size` in pieces (0: none), and opens it.
    /// `forged`: (chunk, piece, bytes) stores those bytes as that piece, named by their own key in the
    /// table of contents but keeping the true piece's chaining value — a blob whose keys lie.
    pub fn pieced_blob(
        &self,
        chunks: &[Vec<u8>],
        piece_size: u32,
        forged: Option<(usize, usize, Vec<u8>)>,
    ) -> (BlobHandle, String) {
        let mut obj = Vec::new();
        let mut toc = Toc {
            piece_size,
            ..Toc::default()
        };
        let mut block = 0u64;
        for (i, c) in chunks.iter().enumerate() {
            let mut parts = vec![c.clone()];
            let first = toc.frames.len() as u32;
            if pieces::count(c.len() as u32, piece_size) > 0 {
                parts.clear();
                for (k, (r, mut p)) in pieces::cut(c, piece_size).into_iter().enumerate() {
                    let mut bytes = c[r].to_vec();
                    if let Some((_, _, b)) = forged.as_ref().filter(|f| (f.0, f.1) == (i, k)) {
                        bytes = b.clone();
                        p.key = Digest::of(&bytes);
                    }
                    toc.pieces.push((i as u32, p));
                    parts.push(bytes);
                }
            }
            for part in &parts {
                let z = compress(part, 3);
                toc.frames.push(Frame {
                    offset: obj.len() as u64,
                    compressed: z.len() as u32,
                    uncompressed: part.len() as u32,
                });
                obj.extend_from_slice(&z);
            }
            toc.chunks.push(ChunkEntry {
                block: block as u32,
                len: c.len() as u32,
                frame: first,
                frame_offset: 0,
                digest: Digest::of(c),
            });
            block += (c.len() as u64).div_ceil(BLOCK_SIZE);
        }
        toc.view_blocks = block;
        self.store_blob(obj, &toc, chunks.len())
    }

    /// Stores `obj` (the frames) with `toc` appended as a blob and opens it.
    fn store_blob(&self, mut obj: Vec<u8>, toc: &Toc, chunks: usize) -> (BlobHandle, String) {
        let t = toc.encode();
        let toc_offset = obj.len() as u64;
        obj.extend_from_slice(&t);
        let r = BlobRef {
            digest: Digest::of(&obj),
            size: obj.len() as u64,
            view_size: toc.view_blocks * BLOCK_SIZE,
            toc_offset,
            toc_len: t.len() as u64,
            toc_digest: Digest::of(&t),
            chunks: chunks as u64,
        };
        let k = key::blob(&r.digest);
        self.mem
            .put(&k, obj.into(), PutMode::Overwrite)
            .expect("put blob");
        let h = BlobHandle::open(&self.store, &r).expect("open blob");
        (h, k)
    }
}

/// Waits (up to 10 s, else fails the test) until `ok`: for what background work does, such as the
/// fetcher keeping a leader's frame after the leader answered.
pub fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `n` bytes of a repeatable pattern that compresses poorly.
pub fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A `SOCK_SEQPACKET` pair standing in for `/dev/fuse` (it keeps message boundaries as the device does):
/// (the kernel's end, the server's end).
pub fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair")
}

/// Sends a request as the kernel would.
pub fn send(kernel: &OwnedFd, opcode: u32, unique: u64, nodeid: u64, arg: &[u8]) {
    let h = InHeader {
        len: (40 + arg.len()) as u32,
        opcode,
        unique,
        nodeid,
        ..Default::default()
    };
    let mut m = h.as_bytes().to_vec();
    m.extend_from_slice(arg);
    rustix::io::write(kernel, &m).expect("write request");
}

/// Receives one reply as the kernel would.
pub fn recv(kernel: &OwnedFd) -> (OutHeader, Vec<u8>) {
    let mut b = vec![0u8; 1 << 20];
    let n = rustix::io::read(kernel, &mut b).expect("read reply");
    let (h, rest) = OutHeader::read_from_prefix(&b[..n]).expect("header");
    assert_eq!(h.len as usize, n, "reply length");
    (h, rest.to_vec())
}

/// A `READ` argument.
pub fn read_arg(offset: u64, size: u32) -> Vec<u8> {
    ReadIn {
        offset,
        size,
        ..Default::default()
    }
    .as_bytes()
    .to_vec()
}
