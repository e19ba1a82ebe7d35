//! A build: source → tree + chunks → blob, metadata, layer descriptor.
//!
//! [`LayerBuilder`] is the [`EntrySink`] every source feeds. It places entries in the [`Tree`] and turns
//! regular files into work for the chunk [`Pool`]: tiny files stay inline in the metadata, small files
//! are grouped into shared frames, larger files are cut into fixed-size chunks, in the order
//! [`crate::layout`] gives (files read at run time first). When the source is done the pool seals the
//! blob; chunk digests are resolved to `(device, block)` — the new blob is device 1, followed by the
//! parents' blobs that the layer still references, then the foreign blobs the store-wide index found
//! chunks in ([`crate::dedup`]) — and the EROFS writer lays out the metadata. Objects are stored in
//! dependency order: blob, its index segment, metadata, then the descriptor, so a failure at any point
//! leaves nothing referenced.
//!
//! The layer is named before anything is stored: its descriptor's identity covers the tree and its
//! chunks' digests ([`crate::identity`]), not where the chunks lie, so the same input gives the same
//! layer whatever the store held. When the store holds that layer already (and can rely on it), the
//! build stores nothing and returns the stored descriptor.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use strata_registry::blobread::BlobReader;
use strata_registry::digest::Digest;
use strata_registry::index::Segment;
use strata_registry::model::{
    BuiltOn, LayerConfig, LayerDescriptor, LayerKind, LayerStats, ObjectRef, SCHEMA,
};
use strata_registry::store::Store;

use crate::chunker::{ChunkData, Pool, PoolOptions, Unit};
use crate::compact::blob::for_each_live_chunk;
use crate::dedup::{DedupReport, Known};
use crate::devices::Devices;
use crate::elfdeps;
use crate::erofs;
use crate::error::{BuildError, TarError};
use crate::layout::{self, Class, Compiled, Layout};
use crate::source::exclude::Excludes;
use crate::source::{DataEntry, Entry, EntrySink, Existing, FileSource};
use crate::tree::{FileData, Meta, NodeId, NodeKind, Tree, OPAQUE_XATTR};

/// Largest stream-fed file whose chunks may be reordered ([`elfdeps::chunk_order`]): it is held in memory.
const STREAM_REORDER_MAX: u64 = 64 << 20;
/// Default chunk size: 1 MiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;
/// Files up to this size are stored inside the metadata, unless rarely read ([`inlined`]).
pub const DEFAULT_INLINE_MAX: u64 = 2048;
/// Files below this size are grouped with their neighbours into one compressed frame.
const GROUP_FILE_MAX: u64 = 64 << 10;
/// Uncompressed bytes of a group frame.
const GROUP_TARGET: usize = 128 << 10;

/// Whether a regular file of `size` bytes at `path` is stored inside the metadata: an empty one, and
/// one of at most `inline_max` bytes that programs read at run time. Small files rarely read — below
/// `tests`, documentation, translations, headers, type stubs ([`layout::classify`]'s cold class,
/// judged by the path alone, whatever `--layout`) — go to chunks in the blob instead, grouped with
/// their neighbours: every node fetches, decompresses, checks and writes a layer's whole metadata
/// before its first mount, and on the fat image such files were 10.8 of the 13.9 MB of inline data
/// (18.9 MB of metadata in all), read by almost no sandbox.
pub(crate) fn inlined(path: &[u8], size: u64, inline_max: u64) -> bool {
    size == 0 || (size <= inline_max && layout::classify(path) != Class::Cold)
}

/// How to build a layer.
#[derive(Clone)]
pub struct BuildOptions {
    pub kind: LayerKind,
    /// A power of two from 4 KiB to 16 MiB.
    pub chunk_size: u64,
    /// zstd level: 1 to 22, or one of zstd's fast levels, -1 to -7 ([`valid_level`]).
    pub level: i32,
    /// Chunks longer than this are stored as pieces, each its own frame, verified on its own (0: whole
    /// chunks; see [`strata_registry::pieces`]).
    pub piece_size: u32,
    pub inline_max: u64,
    pub threads: usize,
    /// Layers whose chunks are not stored again (e.g. the previous version, or an image's layers).
    pub parents: Vec<Digest>,
    pub labels: BTreeMap<String, String>,
    /// The config the layer declares (stored in its descriptor; empty: none).
    pub config: LayerConfig,
    /// What the layer is built on (recorded in its descriptor; compose checks it).
    pub built_on: Option<BuiltOn>,
    /// Bytes of file data processed so far (for progress displays).
    pub progress: Arc<AtomicU64>,
    /// Regular files added so far (for progress displays).
    pub files_done: Arc<AtomicU64>,
    /// The layer will be the bottom of an image: drop whiteouts and opaque markers even when it has
    /// parents (a flattened image). A base layer without parents is always a bottom layer.
    pub bottom: bool,
    /// Store the metadata as a patch against the first parent's when that is smaller (a rebuild). Off for
    /// layers whose metadata shares little with the parent's (a diff, a flattened layer): fetching and
    /// diffing the parent's metadata would cost time that grows with the image.
    pub patch_meta: bool,
    /// For a layer that is not the bottom: whether the whiteout at a path still hides something below
    /// (a flattened range keeps only those; see [`Tree::prune_whiteouts`]). `None` keeps them all.
    pub keep_whiteout: Option<WhiteoutFilter>,
    /// Store-wide dedup: the directory of the local index caches (`None`: only the parents' chunks are
    /// not stored again). See [`crate::dedup`].
    pub index: Option<PathBuf>,
    /// Cap on the foreign blobs (neither new nor a parent's) the layer references.
    pub max_foreign_blobs: usize,
    /// A foreign blob giving the layer fewer bytes than this is not referenced: its chunks are copied.
    pub min_foreign_bytes: u64,
    /// The order of file data in the blob (see [`crate::layout`]).
    pub layout: Layout,
    /// Paths a directory or tar source leaves out (`build --exclude`; see [`crate::source::exclude`]).
    pub excludes: Excludes,
}

/// See [`BuildOptions::keep_whiteout`].
pub type WhiteoutFilter = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

impl BuildOptions {
    /// Defaults for a layer of `kind`.
    pub fn new(kind: LayerKind) -> BuildOptions {
        BuildOptions {
            kind,
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: 3,
            piece_size: 0,
            inline_max: DEFAULT_INLINE_MAX,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            parents: Vec::new(),
            labels: BTreeMap::new(),
            config: LayerConfig::default(),
            built_on: None,
            progress: Arc::new(AtomicU64::new(0)),
            files_done: Arc::new(AtomicU64::new(0)),
            bottom: false,
            patch_meta: true,
            keep_whiteout: None,
            index: None,
            max_foreign_blobs: crate::dedup::MAX_FOREIGN_BLOBS,
            min_foreign_bytes: crate::dedup::MIN_FOREIGN_BYTES,
            layout: Layout::default(),
            excludes: Excludes::default(),
        }
    }

    fn check(&self) -> Result<(), BuildError> {
        let cs = self.chunk_size;
        if !cs.is_power_of_two() || !(4096..=16 << 20).contains(&cs) {
            return Err(BuildError::Option(format!(
                "chunk size {cs} must be a power of two from 4096 to 16777216"
            )));
        }
        let ps = self.piece_size;
        if ps != 0 && !strata_registry::pieces::valid_size(ps) {
            return Err(BuildError::Option(format!(
                "piece size {ps} must be 0 (whole chunks) or a power of two from 65536 to 16777216"
            )));
        }
        if !valid_level(self.level) {
            return Err(BuildError::Option(format!(
                "zstd level {} must be 1 to 22, or -1 to -7 (zstd's fast levels)",
                self.level
            )));
        }
        Ok(())
    }
}

/// Whether `level` is a zstd level a build takes: 1 to 22, or one of zstd's fast levels -1 to -7, which
/// decompress faster for more stored bytes (on the fat image, -3: 1.75× the decompression speed, 35 %
/// more bytes; BENCHMARKS.md, "Fourteenth session"). 0 would be zstd's default in disguise; below -7
/// the ratio falls towards no compression at all.
pub fn valid_level(level: i32) -> bool {
    (1..=22).contains(&level) || (-7..=-1).contains(&level)
}

/// A stored layer.
#[derive(Clone, Debug)]
pub struct BuiltLayer {
    pub digest: Digest,
    pub descriptor: LayerDescriptor,
    /// What store-wide dedup did (zeros without it).
    pub dedup: DedupReport,
    /// The store held the layer already (the same input built before): this build stored nothing, and
    /// `descriptor` is the stored one, with the placement and figures of the build that stored it.
    pub reused: bool,
}

/// The sink sources feed: builds the tree and feeds the chunk pool.
pub struct LayerBuilder {
    pub tree: Tree,
    pool: Pool,
    opts: BuildOptions,
    group: Vec<(NodeId, ChunkData)>,
    group_bytes: usize,
    stats: LayerStats,
    /// Compiled Python modules seen, for [`LayerBuilder::place_later`].
    compiled: Compiled,
    /// Files whose data the layout places after the run-time files, in source order.
    later: Vec<Later>,
    /// Bytes of stream-fed data held in `later`.
    later_stream: usize,
}

/// A file whose data is placed once the source is done.
struct Later {
    class: Class,
    path: Vec<u8>,
    node: NodeId,
    size: u64,
    data: Held,
}

/// Where a deferred file's data is: on disk, or read from the stream already.
enum Held {
    Path(PathBuf, bool),
    Bytes(Vec<u8>),
}

impl LayerBuilder {
    fn new(opts: BuildOptions, pool: Pool) -> LayerBuilder {
        LayerBuilder {
            tree: Tree::new(),
            pool,
            opts,
            group: Vec::new(),
            group_bytes: 0,
            stats: LayerStats::default(),
            compiled: Compiled::default(),
            later: Vec::new(),
            later_stream: 0,
        }
    }

    fn flush_group(&mut self) -> Result<(), BuildError> {
        if !self.group.is_empty() {
            let g = std::mem::take(&mut self.group);
            self.group_bytes = 0;
            self.pool.send(Unit::Group(g))?;
        }
        Ok(())
    }

    fn add_file(
        &mut self,
        path: &[u8],
        meta: Meta,
        size: u64,
        data: FileSource<'_>,
    ) -> Result<(), BuildError> {
        self.opts
            .files_done
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shown = || String::from_utf8_lossy(path).into_owned();
        if self.opts.layout == Layout::RunFirst {
            self.compiled.note(path);
        }
        if inlined(path, size, self.opts.inline_max) {
            let mut bytes = Vec::with_capacity(size as usize);
            match data {
                FileSource::Path { path: p, .. } => {
                    let mut f = std::fs::File::open(&p).map_err(|e| BuildError::io(&p, e))?;
                    f.read_to_end(&mut bytes)
                        .map_err(|e| BuildError::io(&p, e))?;
                }
                FileSource::Stream(r) => {
                    r.take(size)
                        .read_to_end(&mut bytes)
                        .map_err(|source| TarError::Data {
                            path: shown(),
                            source,
                        })?;
                }
            }
            if bytes.len() as u64 != size {
                return Err(TarError::Short {
                    path: shown(),
                    expected: size,
                    got: bytes.len() as u64,
                }
                .into());
            }
            self.tree.insert(
                path,
                meta,
                NodeKind::File {
                    size,
                    data: FileData::Inline(bytes),
                },
            )?;
            return Ok(());
        }
        let cs = self.opts.chunk_size;
        let n = size.div_ceil(cs);
        let node = self.tree.insert(
            path,
            meta,
            NodeKind::File {
                size,
                data: FileData::Chunks(vec![None; n as usize]),
            },
        )?;
        self.stats.chunks += n;
        let class = match self.opts.layout {
            Layout::RunFirst => layout::classify(path),
            Layout::Source => Class::Run,
        };
        // Run-time files from disk wait too, so that libraries can follow the programs that load
        // them ([`crate::elfdeps`]); a stream's are placed as they come.
        let deferred_run = class == Class::Run
            && self.opts.layout == Layout::RunFirst
            && matches!(data, FileSource::Path { .. });
        if class == Class::Run && !deferred_run {
            return self.place(path, node, size, data);
        }
        let data = match data {
            FileSource::Path { path: p, sparse } => Held::Path(p, sparse),
            FileSource::Stream(r)
                if size < GROUP_FILE_MAX
                    && self.later_stream + size as usize <= layout::STREAM_DEFER_MAX =>
            {
                self.later_stream += size as usize;
                Held::Bytes(read_exact_stream(r, size, path)?)
            }
            // A large stream-fed file, or too much held already: placed now.
            FileSource::Stream(r) => return self.place(path, node, size, FileSource::Stream(r)),
        };
        self.later.push(Later {
            class,
            path: path.to_vec(),
            node,
            size,
            data,
        });
        Ok(())
    }

    /// Sends a file's data to the pool: grouped with its neighbours if small, else cut into chunks.
    fn place(
        &mut self,
        path: &[u8],
        node: NodeId,
        size: u64,
        data: FileSource<'_>,
    ) -> Result<(), BuildError> {
        let cs = self.opts.chunk_size;
        let n = size.div_ceil(cs);
        if size < GROUP_FILE_MAX {
            let d = match data {
                FileSource::Path { path: p, sparse } => ChunkData::File {
                    path: Arc::new(p),
                    offset: 0,
                    len: size,
                    sparse,
                },
                FileSource::Stream(r) => ChunkData::Bytes(read_exact_stream(r, size, path)?),
            };
            self.group.push((node, d));
            self.group_bytes += size as usize;
            if self.group_bytes >= GROUP_TARGET {
                self.flush_group()?;
            }
            return Ok(());
        }
        match data {
            FileSource::Path { path: p, sparse } => {
                let order = match self.opts.layout {
                    Layout::RunFirst if n > 1 => elfdeps::head(&p)
                        .map(|h| elfdeps::chunk_order(&h, cs, n))
                        .unwrap_or_else(|| (0..n).collect()),
                    _ => (0..n).collect(),
                };
                let p = Arc::new(p);
                for i in order {
                    let offset = i * cs;
                    self.pool.send(Unit::Chunk {
                        node,
                        index: i as u32,
                        data: ChunkData::File {
                            path: p.clone(),
                            offset,
                            len: cs.min(size - offset),
                            sparse,
                        },
                    })?;
                }
            }
            FileSource::Stream(r) => {
                let first = read_exact_stream(r, cs.min(size), path)?;
                let order = match self.opts.layout {
                    // The loader's chunks of an ELF file go after its first: held in memory to get
                    // there, so only for files up to STREAM_REORDER_MAX.
                    Layout::RunFirst if n > 1 && size <= STREAM_REORDER_MAX => {
                        elfdeps::chunk_order(&first, cs, n)
                    }
                    _ => (0..n).collect(),
                };
                let mut held: Vec<Option<Vec<u8>>> = vec![None; n as usize];
                held[0] = Some(first);
                let mut read = 1u64;
                for i in order {
                    while read <= i {
                        let len = cs.min(size - read * cs);
                        held[read as usize] = Some(read_exact_stream(r, len, path)?);
                        read += 1;
                    }
                    let bytes = held[i as usize].take().unwrap_or_default();
                    self.pool.send(Unit::Chunk {
                        node,
                        index: i as u32,
                        data: ChunkData::Bytes(bytes),
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Places the deferred files once the source is done: run-time files read from disk in source order,
    /// each followed by the libraries it loads ([`crate::elfdeps`]); Python sources that no bytecode
    /// shadows; then the cold files, each in source order (see [`crate::layout`]).
    fn place_later(&mut self) -> Result<(), BuildError> {
        let later = std::mem::take(&mut self.later);
        let compiled = std::mem::take(&mut self.compiled);
        let (run, rest): (Vec<Later>, Vec<Later>) =
            later.into_iter().partition(|l| l.class == Class::Run);
        let (sources, cold): (Vec<Later>, Vec<Later>) = rest
            .into_iter()
            .partition(|l| l.class == Class::Source && !compiled.shadows(&l.path));
        let run = self.library_order(run);
        for part in [run, sources, cold] {
            self.flush_group()?;
            for l in part {
                match l.data {
                    Held::Path(p, sparse) => {
                        let src = FileSource::Path { path: p, sparse };
                        self.place(&l.path, l.node, l.size, src)?;
                    }
                    Held::Bytes(b) => {
                        let mut r: &[u8] = &b;
                        self.place(&l.path, l.node, l.size, FileSource::Stream(&mut r))?;
                    }
                }
            }
        }
        self.later_stream = 0;
        self.flush_group()
    }
}

impl LayerBuilder {
    /// `run` (in source order) reordered so that each library follows the first file that loads it.
    fn library_order(&self, run: Vec<Later>) -> Vec<Later> {
        let files: Vec<elfdeps::RunFile<'_>> = run
            .iter()
            .map(|l| elfdeps::RunFile {
                path: &l.path,
                perm: self.tree.nodes[l.node].meta.perm,
                disk: match &l.data {
                    Held::Path(p, _) => Some(p.as_path()),
                    Held::Bytes(_) => None,
                },
            })
            .collect();
        let kind = |p: &[u8]| {
            let id = self.tree.lookup(p)?;
            Some(match &self.tree.nodes[id].kind {
                NodeKind::Dir(_) => elfdeps::Kind::Dir,
                NodeKind::Symlink(t) => elfdeps::Kind::Link(t.clone()),
                _ => elfdeps::Kind::Other,
            })
        };
        let order = elfdeps::library_order(&files, kind);
        let mut run: Vec<Option<Later>> = run.into_iter().map(Some).collect();
        order.into_iter().filter_map(|i| run[i].take()).collect()
    }

    /// A file whose chunks are already stored (in a parent layer): no data moves, the digests are
    /// resolved to the parents' blobs when the layer is sealed.
    fn add_stored(
        &mut self,
        path: &[u8],
        meta: Meta,
        size: u64,
        chunks: Vec<Option<Digest>>,
    ) -> Result<(), BuildError> {
        let n = size.div_ceil(self.opts.chunk_size);
        if n != chunks.len() as u64 {
            return Err(BuildError::Unsupported {
                path: String::from_utf8_lossy(path).into_owned(),
                why: format!(
                    "{} chunks given for {size} bytes at chunk size {}",
                    chunks.len(),
                    self.opts.chunk_size
                ),
            });
        }
        self.stats.chunks += n;
        self.tree.insert(
            path,
            meta,
            NodeKind::File {
                size,
                data: FileData::Chunks(chunks),
            },
        )?;
        Ok(())
    }
}

fn read_exact_stream(r: &mut dyn Read, len: u64, path: &[u8]) -> Result<Vec<u8>, BuildError> {
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)
        .map_err(|source| TarError::Truncated {
            path: String::from_utf8_lossy(path).into_owned(),
            source,
        })?;
    Ok(buf)
}

impl EntrySink for LayerBuilder {
    fn existing(&self, path: &[u8]) -> Existing {
        match self.tree.lookup(path).map(|id| &self.tree.nodes[id]) {
            None => Existing::Absent,
            Some(n) if matches!(n.kind, NodeKind::Dir(_)) => Existing::Dir {
                opaque: n
                    .meta
                    .xattrs
                    .iter()
                    .any(|(k, v)| k == OPAQUE_XATTR && v == b"y"),
            },
            Some(_) => Existing::Other,
        }
    }

    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        match entry.place(&mut self.tree)? {
            None => Ok(()),
            Some(DataEntry::File { path, meta, size }) => {
                let data = data.ok_or_else(|| BuildError::Unsupported {
                    path: String::from_utf8_lossy(&path).into_owned(),
                    why: "regular file without data".into(),
                })?;
                self.add_file(&path, meta, size, data)
            }
            Some(DataEntry::Stored {
                path,
                meta,
                size,
                chunks,
            }) => self.add_stored(&path, meta, size, chunks),
        }
    }
}

/// Builds a layer from a directory, leaving out what `opts.excludes` matches.
pub fn build_dir(store: &Store, root: &Path, opts: BuildOptions) -> Result<BuiltLayer, BuildError> {
    let excludes = opts.excludes.clone();
    build_with(store, opts, |sink| {
        crate::source::dir::walk_dir(root, &mut excludes.sink(sink))
    })
}

/// Builds a layer from a tar stream (plain, gzip or zstd), leaving out what `opts.excludes` matches.
pub fn build_tar(
    store: &Store,
    reader: Box<dyn Read + Send>,
    opts: BuildOptions,
) -> Result<BuiltLayer, BuildError> {
    let stream = crate::source::tar::open_stream(reader)?;
    let excludes = opts.excludes.clone();
    build_with(store, opts, |sink| {
        crate::source::tar::read_tar(stream, &mut excludes.sink(sink))
    })
}

/// Builds a layer from any source.
pub fn build_with(
    store: &Store,
    opts: BuildOptions,
    source: impl FnOnce(&mut dyn EntrySink) -> Result<(), BuildError>,
) -> Result<BuiltLayer, BuildError> {
    opts.check()?;
    let known = Arc::new(Known::load(
        store,
        &opts.parents,
        opts.index.as_deref(),
        opts.max_foreign_blobs,
    )?);
    let pool = Pool::start(PoolOptions {
        threads: opts.threads,
        level: opts.level,
        piece_size: opts.piece_size,
        spool_dir: store.spool_dir()?,
        known: known.clone(),
        progress: opts.progress.clone(),
    })?;
    let mut b = LayerBuilder::new(opts, pool);
    source(&mut b)?;
    b.flush_group()?;
    b.place_later()?;
    // Foreign blobs that give the layer too little are given up: their chunks go into the new blob.
    b.pool.drain()?;
    for (blob, blocks) in known.prune(b.opts.min_foreign_bytes) {
        let reader = BlobReader::open(store, &blob)?;
        for_each_live_chunk(&reader, &blocks, |_, bytes| {
            b.pool.send(Unit::Forced(bytes.to_vec()))
        })?;
    }
    let LayerBuilder {
        mut tree,
        pool,
        opts,
        mut stats,
        ..
    } = b;
    let packed = pool.finish()?;
    let spool = packed.blob.as_ref().map(|b| b.spool.clone());
    let result = finish(store, &mut tree, packed, &known, &opts, &mut stats);
    if result.is_err() {
        if let Some(s) = spool {
            let _ = std::fs::remove_file(s);
        }
    }
    result
}

/// Fills the packed chunks' digests into the tree's files and counts the layer's figures; returns
/// which nodes are reachable from the root (a replaced file's chunks must not pull in a parent blob).
fn fill_and_count(
    tree: &mut Tree,
    packed: &crate::chunker::Packed,
    stats: &mut LayerStats,
) -> Vec<bool> {
    for (node, index, d) in &packed.refs {
        if let NodeKind::File {
            data: FileData::Chunks(c),
            ..
        } = &mut tree.nodes[*node].kind
        {
            if let Some(slot) = c.get_mut(*index as usize) {
                *slot = *d;
            }
        }
    }
    stats.entries = tree.entry_count();
    stats.new_chunks = packed.new_chunks;
    stats.new_bytes = packed.new_bytes;
    let mut seen = vec![false; tree.nodes.len()];
    let mut stack = vec![0usize];
    while let Some(id) = stack.pop() {
        if std::mem::replace(&mut seen[id], true) {
            continue;
        }
        match &tree.nodes[id].kind {
            NodeKind::Dir(c) => stack.extend(c.values().copied()),
            NodeKind::File { size, .. } => {
                stats.files += 1;
                stats.file_bytes += size;
            }
            k if k.is_whiteout() => stats.whiteouts += 1,
            _ => {}
        }
    }
    seen
}

fn finish(
    store: &Store,
    tree: &mut Tree,
    packed: crate::chunker::Packed,
    known: &Known,
    opts: &BuildOptions,
    stats: &mut LayerStats,
) -> Result<BuiltLayer, BuildError> {
    if opts.bottom || (opts.kind == LayerKind::Base && opts.parents.is_empty()) {
        tree.drop_whiteouts();
    } else if let Some(keep) = &opts.keep_whiteout {
        tree.prune_whiteouts(keep.as_ref());
    }
    let seen = fill_and_count(tree, &packed, stats);
    let chunk_bits = opts.chunk_size.trailing_zeros() as u8;
    let mut descriptor = LayerDescriptor {
        schema: SCHEMA,
        kind: opts.kind,
        content: Some(crate::identity::content_digest(tree, &seen, chunk_bits)?),
        meta: ObjectRef {
            digest: Digest([0; 32]),
            size: 0,
        },
        blobs: Vec::new(),
        chunk_size: opts.chunk_size,
        stats: stats.clone(),
        parent: opts.parents.first().copied(),
        labels: opts.labels.clone(),
        config: (!opts.config.is_empty()).then(|| Box::new(opts.config.clone())),
        built_on: opts.built_on.clone(),
    };
    let digest = descriptor.digest();
    let mut dedup = known.foreign().2;
    // The store holds this layer already (built before from the same input): nothing is stored again.
    if let Some(stored) = store.stored_layer(&digest)? {
        if let Some(b) = &packed.blob {
            let _ = std::fs::remove_file(&b.spool);
        }
        dedup.foreign_blobs = known.foreign().0.len() as u64;
        return Ok(BuiltLayer {
            digest,
            descriptor: stored,
            dedup,
            reused: true,
        });
    }

    let devices = Devices::assign(tree, &seen, &packed, known)?;
    let image = erofs::write_image(tree, &devices.slots(), chunk_bits, &|d: &Digest| {
        devices.resolve(d)
    })?;

    // Store in dependency order: blob, its index segment, metadata, descriptor.
    if let Some(b) = &packed.blob {
        store.put_blob_file(&b.digest, &b.spool)?;
        stats.stored_bytes += b.size;
        store.put_segment(&Segment {
            blob: devices.blobs[0].clone(),
            toc: b.toc.clone(),
        })?;
    }
    // A rebuild's metadata is stored as a patch against its (first) parent's.
    let base = match opts.parents.first().filter(|_| opts.patch_meta) {
        Some(p) => {
            let d = store.get_layer(p)?.meta.digest;
            Some((d, store.get_meta(&d)?))
        }
        None => None,
    };
    let (meta_digest, meta_stored) =
        store.put_meta(&image, base.as_ref().map(|(d, b)| (d, b.as_slice())))?;
    stats.stored_bytes += meta_stored;
    descriptor.meta = ObjectRef {
        digest: meta_digest,
        size: image.len() as u64,
    };
    descriptor.blobs = devices.blobs.clone();
    descriptor.stats = stats.clone();
    known.recheck(store, &devices.foreign)?;
    store.put_layer(&descriptor)?;
    dedup.foreign_blobs = devices.foreign.len() as u64;
    Ok(BuiltLayer {
        digest,
        descriptor,
        dedup,
        reused: false,
    })
}

#[cfg(test)]
#[path = "build_tests.rs"]
mod tests;
