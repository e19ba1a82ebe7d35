//! `strata build` and `strata materialize`.

use std::io::{ErrorKind, IsTerminal};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use strata_builder::source::exclude::{Excludes, PatternError};
use strata_builder::{build_dir, build_tar, BuildOptions};
use strata_registry::blobread::BlobReader;
use strata_registry::model::{ImageConfig, LayerConfig, LayerKind, TagName};
use strata_registry::store::Store;

use crate::compose::built_on;
use crate::config::ConfigArgs;
use crate::exit::{NotFound, Usage};
use crate::images::{human, make_image, resolve_layer, resolve_layers};

/// Arguments of `strata build`.
#[derive(clap::Args)]
pub struct BuildArgs {
    /// A directory, or with --tar a tar file ('-' for standard input; plain, gzip or zstd).
    pub src: PathBuf,
    /// Read SRC as a tar stream.
    #[arg(long)]
    pub tar: bool,
    /// What the layer is for: base, workspace, toolkit or diff.
    #[arg(long, default_value = "base")]
    pub kind: LayerKind,
    /// Also make a one-layer image and tag it NAME:TAG.
    #[arg(short = 't', long = "tag")]
    pub tag: Option<String>,
    /// With -t: move the tag if it already names another image.
    #[arg(long, requires = "tag")]
    pub force: bool,
    /// Deduplicate against this layer, or every layer of this image.
    #[arg(long)]
    pub parent: Vec<String>,
    /// Chunk size in bytes (a power of two, 4096 to 16777216).
    #[arg(long, default_value_t = strata_builder::build::DEFAULT_CHUNK_SIZE)]
    pub chunk_size: u64,
    /// zstd level: 1 to 22, or -1 to -7 (zstd's fast levels: faster to decompress, more bytes stored).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true)]
    pub level: i32,
    /// Store chunks longer than this as pieces of this size, each compressed and verified on its own,
    /// so that a read of a few pages fetches one piece: for images read in scattered pages (large data
    /// files, libraries read in part) from a local or shared-filesystem store; costs ~6 % of stored
    /// bytes at 65536 (0: whole chunks; else a power of two, 65536 to 16777216; BENCHMARKS.md).
    #[arg(long, default_value_t = 0)]
    pub piece_size: u32,
    /// Order of file data in the blob: run-first (files programs read at run time first; Python
    /// sources shadowed by bytecode, tests, docs, translations, stubs, headers and static libraries
    /// last) or source (walk/tar order).
    #[arg(long, default_value = "run-first")]
    pub layout: strata_builder::layout::Layout,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// What a workspace, toolkit or diff layer is built on (an image or a layer): recorded in the
    /// layer, so that compose refuses to put it on another base (unless --rebase).
    #[arg(long, value_name = "IMAGE|LAYER")]
    pub on: Option<String>,
    /// The config the layer declares (the image's, with -t).
    #[command(flatten)]
    pub config: ConfigArgs,
    #[command(flatten)]
    pub dedup: crate::index::DedupArgs,
    /// Leave out paths matching PATTERN (.dockerignore/gitignore syntax: '!' re-includes, '**', a
    /// pattern without '/' matches a name at any depth); repeatable, after --exclude-from's.
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub exclude: Vec<String>,
    /// Read exclude patterns from FILE, one a line ('#' comments), e.g. a .dockerignore; repeatable.
    #[arg(long = "exclude-from", value_name = "FILE")]
    pub exclude_from: Vec<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// Shows a build's progress (bytes and files, of `total` once known) while `f` runs, as `--progress`
/// says.
pub(crate) fn with_build_progress<T, E>(
    what: &str,
    opts: &strata_builder::BuildOptions,
    total: Option<Arc<AtomicU64>>,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let c = crate::progress::Counters {
        bytes: opts.progress.clone(),
        files: Some(opts.files_done.clone()),
        total: total.unwrap_or_default(),
    };
    crate::progress::watch(what, c, f)
}

/// `strata build`.
pub fn build(store: &Store, a: BuildArgs) -> Result<()> {
    let tag = a.tag.as_deref().map(TagName::parse).transpose()?;
    let mut opts = BuildOptions::new(a.kind);
    opts.chunk_size = a.chunk_size;
    opts.level = a.level;
    opts.piece_size = a.piece_size;
    opts.layout = a.layout;
    opts.excludes = excludes(&a.exclude_from, &a.exclude)?;
    if let Some(t) = a.threads {
        opts.threads = t.max(1);
    }
    opts.config = a.config.layer_config(store, LayerConfig::default())?;
    if let Some(on) = &a.on {
        if a.kind == LayerKind::Base {
            return Err(Usage(
                "--on is for workspace, toolkit and diff layers: a base layer is the bottom of an image".into(),
            )
            .into());
        }
        opts.built_on = Some(built_on(store, on).with_context(|| format!("--on {on}"))?);
    }
    let config = opts.config.apply(&ImageConfig::default());
    a.dedup.apply(&mut opts);
    for p in &a.parent {
        opts.parents
            .extend(resolve_layers(store, p).with_context(|| format!("parent {p}"))?);
    }
    let start = Instant::now();
    // A directory's size is summed beside the build; a tar stream's is unknown.
    let total = (!a.tar).then(|| crate::progress::total_of_dir(&a.src));
    let built = with_build_progress("build", &opts.clone(), total, || {
        if a.tar {
            let reader: Box<dyn std::io::Read + Send> = if a.src == Path::new("-") {
                Box::new(std::io::stdin())
            } else {
                Box::new(
                    std::fs::File::open(&a.src)
                        .with_context(|| format!("opening tar {}", a.src.display()))?,
                )
            };
            Ok::<_, anyhow::Error>(build_tar(store, reader, opts)?)
        } else {
            Ok(build_dir(store, &a.src, opts)?)
        }
    })?;
    let image = match &tag {
        Some(t) => Some(make_image(
            store,
            vec![(built.digest, built.descriptor.clone())],
            config,
            t,
            a.force,
        )?),
        None => None,
    };
    // What this build stored: nothing when the store held the layer already.
    let mut s = built.descriptor.stats.clone();
    if built.reused {
        (s.new_chunks, s.new_bytes, s.stored_bytes) = (0, 0, 0);
    }
    let s = &s;
    if a.json {
        println!(
            "{}",
            json!({
                "digest": built.digest.to_string(),
                "image": image.map(|d| d.to_string()),
                "tag": tag.map(|t| t.to_string()),
                "stats": s,
                "reused": built.reused,
                "index": built.dedup,
                "seconds": start.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!("{}", built.digest);
        if std::io::stderr().is_terminal() && built.reused {
            eprintln!(
                "{} entries, {} in files: the store holds this layer already, nothing stored, in {:.1}s",
                s.entries,
                human(s.file_bytes),
                start.elapsed().as_secs_f64()
            );
        } else if std::io::stderr().is_terminal() {
            eprintln!(
                "{} entries, {} in files, {} new chunks ({}), {} stored, in {:.1}s",
                s.entries,
                human(s.file_bytes),
                s.new_chunks,
                human(s.new_bytes),
                human(s.stored_bytes),
                start.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// The exclude patterns of `--exclude-from` files then `--exclude`: a bad pattern is a usage error
/// (exit 2), a missing file not found (exit 3).
fn excludes(files: &[PathBuf], patterns: &[String]) -> Result<Excludes> {
    match Excludes::with_files(files, patterns) {
        Ok(e) => Ok(e),
        Err(e @ PatternError::Bad { .. }) => Err(Usage(e.to_string()).into()),
        Err(PatternError::File { path, source }) if source.kind() == ErrorKind::NotFound => {
            Err(NotFound(format!("exclude file {}: no such file", path.display())).into())
        }
        Err(e) => Err(e.into()),
    }
}

/// `strata materialize`: DIR/meta.erofs and DIR/devices/N, each view verified chunk by chunk.
pub fn materialize(store: &Store, layer: &str, dir: &Path) -> Result<()> {
    let (_, desc) = resolve_layer(store, layer)?;
    let devices = dir.join("devices");
    std::fs::create_dir_all(&devices).with_context(|| format!("creating {}", devices.display()))?;
    let meta = store.get_meta(&desc.meta.digest)?;
    let meta_path = dir.join("meta.erofs");
    std::fs::write(&meta_path, &meta)
        .with_context(|| format!("writing {}", meta_path.display()))?;
    for (i, b) in desc.blobs.iter().enumerate() {
        let path = devices.join((i + 1).to_string());
        let f =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        f.set_len(b.view_size)?;
        let r = BlobReader::open(store, b)?;
        r.for_each_chunk(0..r.toc.chunks.len(), |c, bytes| {
            f.write_all_at(bytes, c.block as u64 * 4096)
                .map_err(|source| strata_registry::store::StoreError::Io {
                    path: path.clone(),
                    source,
                })
        })?;
        f.sync_all()?;
    }
    println!("{}", meta_path.display());
    Ok(())
}
