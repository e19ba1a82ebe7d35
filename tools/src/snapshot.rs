//! Snapshots: `pack_diff` (a sandbox's writable delta as a new layer on its image) and `strata flatten`.
//!
//! **pack_diff** reads an overlay upper directory — a sandbox's, found through stratad, or one a launcher
//! owns (`--upper DIR --image REF`) — with the upper source of the builder
//! ([`strata_builder::source::upper`]), builds a `diff` layer deduplicated against every layer of the
//! image (its chunks are not stored again), and stores a manifest of the image's layers plus the diff,
//! with the image's config, then the tag. Cost follows the delta: the upper directory is walked, its new
//! chunks compressed; of the image only the layer descriptors and blob tables of contents are read (and
//! the layers' metadata if the upper holds whiteouts, to check each one hides an entry of the image: a
//! whiteout that hides nothing means the upper directory was made over another image, an error). An
//! existing tag is not moved unless `--force`; the tag is written last with compare-and-swap, so a failure
//! or a concurrent writer leaves the tag as it was and nothing new referenced.
//!
//! **flatten** collapses layers `--from N` to the top of an image into one
//! ([`strata_builder::flatten`]), reusing their chunks; the result replaces them in a new manifest.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use strata_api::Client;
use strata_builder::build::{build_with, BuildOptions};
use strata_builder::source::exclude::Excludes;
use strata_builder::source::upper::{walk_upper, UpperSummary};
use strata_builder::BuildError;
use strata_registry::digest::Digest;
use strata_registry::model::{
    BuiltOn, ImageConfig, LayerConfig, LayerKind, LayerStats, Manifest, ManifestLayer, TagName,
    SCHEMA,
};
use strata_registry::store::{Store, TagState};

use crate::config::ConfigArgs;
use crate::exit::{NotFound, Usage};
use crate::freeze::Frozen;
use crate::images::{claim_tag, human, resolve_image};
use crate::layers::with_build_progress;
use crate::view::View;

/// Arguments of `pack_diff` / `strata pack-diff`.
#[derive(clap::Args)]
pub struct PackDiffArgs {
    /// A sandbox of the running stratad (its upper directory and image).
    #[arg(long, required_unless_present_any = ["upper", "vm"], conflicts_with_all = ["upper", "image", "vm"])]
    pub sandbox: Option<String>,
    /// A stopped microVM sandbox of the running stratad (its scratch drive's upper directory and image).
    #[arg(long, conflicts_with_all = ["upper", "image", "freeze"])]
    pub vm: Option<String>,
    /// An overlay upper directory, for launchers that mount their own overlay (needs --image).
    #[arg(long, requires = "image")]
    pub upper: Option<PathBuf>,
    /// The image (tag or manifest digest) the upper directory's overlay was made over.
    #[arg(long, requires = "upper")]
    pub image: Option<String>,
    /// NAME:TAG for the new image.
    #[arg(short = 't', long = "tag")]
    pub tag: String,
    /// Leave out paths matching this pattern (repeatable; gitignore-like, see docs/CLI.md). The image's
    /// own version of an excluded path shows through.
    #[arg(long = "exclude", value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Pause the sandbox's processes (cgroup freezer, else SIGSTOP) while its upper directory is read.
    #[arg(long, requires = "sandbox")]
    pub freeze: bool,
    /// Move the tag if it already names another image.
    #[arg(long)]
    pub force: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Changes to the image's config (the new layer declares them).
    #[command(flatten)]
    pub config: ConfigArgs,
    #[arg(long)]
    pub json: bool,
}

/// What is being packed.
struct Target {
    upper: PathBuf,
    image_ref: String,
    manifest_digest: Digest,
    manifest: Manifest,
    rootfs: Option<PathBuf>,
    /// The image's layer mounts on this node (a sandbox's), top first: whiteouts are checked there.
    lowers: Vec<PathBuf>,
    /// A VM's scratch image, mounted while it is packed.
    _scratch: Option<crate::vm::ScratchUpper>,
}

fn target(store: &Store, socket: &Path, a: &PackDiffArgs) -> Result<Target> {
    if let Some(id) = a.sandbox.as_ref().or(a.vm.as_ref()) {
        let c = Client {
            socket: socket.to_path_buf(),
        };
        let v = c
            .call("GET", &format!("/v1/sandboxes/{id}"), None)
            .with_context(|| format!("asking stratad ({}) for sandbox {id}", socket.display()))?;
        let field = |k: &str| -> Result<String> {
            match v[k].as_str() {
                Some(s) => Ok(s.to_string()),
                None => bail!("stratad's answer for sandbox {id} has no {k:?}: {v}"),
            }
        };
        let manifest_digest: Digest = field("manifest")?
            .parse()
            .map_err(|e| anyhow::anyhow!("sandbox {id}: manifest digest: {e}"))?;
        let manifest = store
            .get_manifest(&manifest_digest)
            .with_context(|| format!("image of sandbox {id}"))?;
        let status = c.call("GET", "/v1/status", None)?;
        let mounted: Vec<(String, PathBuf)> = status["layers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| Some((l["digest"].as_str()?.into(), l["path"].as_str()?.into())))
            .collect();
        let lowers = manifest
            .layers
            .iter()
            .rev()
            .filter_map(|l| {
                let d = l.digest.to_string();
                mounted
                    .iter()
                    .find(|(m, _)| *m == d)
                    .map(|(_, p)| p.clone())
            })
            .collect::<Vec<_>>();
        let lowers = match lowers.len() == manifest.layers.len() {
            true => lowers,
            false => Vec::new(),
        };
        if a.vm.is_some() || v["vm"].is_object() {
            let scratch = crate::vm::ScratchUpper::mount(id, Path::new(&field("upper")?))?;
            return Ok(Target {
                lowers: Vec::new(),
                upper: scratch.upper(),
                image_ref: field("image")?,
                manifest_digest,
                manifest,
                rootfs: None,
                _scratch: Some(scratch),
            });
        }
        return Ok(Target {
            _scratch: None,
            lowers,
            upper: field("upper")?.into(),
            image_ref: field("image")?,
            manifest_digest,
            manifest,
            rootfs: Some(field("rootfs")?.into()),
        });
    }
    let (Some(upper), Some(image)) = (&a.upper, &a.image) else {
        bail!(Usage(
            "give --sandbox ID, or --upper DIR with --image REF".into()
        ));
    };
    if !upper.is_dir() {
        bail!(NotFound(format!(
            "upper directory {} does not exist or is not a directory",
            upper.display()
        )));
    }
    let (d, manifest) = resolve_image(store, image)?;
    let manifest_digest = match d {
        Some(d) => d,
        None => store.put_manifest(&manifest)?,
    };
    Ok(Target {
        _scratch: None,
        lowers: Vec::new(),
        upper: upper.clone(),
        image_ref: image.clone(),
        manifest_digest,
        manifest,
        rootfs: None,
    })
}

/// Whether a layer's mount holds an entry (not a whiteout) at `path`.
fn in_layer(layer: &Path, path: &[u8]) -> bool {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let p = layer.join(std::ffi::OsStr::from_bytes(path));
    match std::fs::symlink_metadata(p) {
        Ok(m) => !(m.file_type().is_char_device() && m.rdev() == 0),
        Err(_) => false,
    }
}

/// `pack_diff` / `strata pack-diff`.
pub fn pack_diff(store: &Store, socket: &Path, a: PackDiffArgs) -> Result<()> {
    let start = Instant::now();
    let tag = TagName::parse(&a.tag)?;
    let excludes = Excludes::new(&a.exclude).map_err(|e| Usage(e.to_string()))?;
    let t = target(store, socket, &a)?;
    let prev = claim_tag(store, &tag, a.force)?;
    let mut opts = BuildOptions::new(LayerKind::Diff);
    opts.parents = t.manifest.layers.iter().rev().map(|l| l.digest).collect();
    opts.patch_meta = false;
    if let Some(n) = a.threads {
        opts.threads = n.max(1);
    }
    opts.labels.insert(
        "strata.pack_diff.image".into(),
        t.manifest_digest.to_string(),
    );
    if let Some(id) = a.sandbox.as_ref().or(a.vm.as_ref()) {
        opts.labels
            .insert("strata.pack_diff.sandbox".into(), id.clone());
    }
    opts.config = a.config.layer_config(store, LayerConfig::default())?;
    opts.built_on = Some(BuiltOn {
        image: Some(t.manifest_digest),
        layers: t.manifest.layers.iter().map(|l| l.digest).collect(),
    });
    let config = a.config.image_config(store, t.manifest.config.clone())?;

    // Each whiteout must hide an entry of the image: looked up in the sandbox's layer mounts (metadata
    // already on this node), else in the image's layers' metadata, read at the first whiteout.
    let mut view: Option<View> = None;
    let manifest_ref = t.manifest_digest.to_string();
    let mut check = |path: &[u8]| -> Result<(), BuildError> {
        let why = |e: anyhow::Error| BuildError::Unsupported {
            path: String::from_utf8_lossy(path).into_owned(),
            why: format!("reading image {manifest_ref} to check a whiteout: {e:#}"),
        };
        let exists = if !t.lowers.is_empty() {
            t.lowers.iter().any(|l| in_layer(l, path))
        } else {
            if view.is_none() {
                view = Some(View::open(store, &manifest_ref).map_err(why)?);
            }
            match &view {
                Some(v) => v.exists(path).map_err(why)?,
                None => true,
            }
        };
        if !exists {
            return Err(BuildError::Unsupported {
                path: format!("/{}", String::from_utf8_lossy(path)),
                why: format!(
                    "the upper directory deletes this path, which image {manifest_ref} does not have: \
                     it was made over another image"
                ),
            });
        }
        Ok(())
    };
    let frozen = match (&t.rootfs, a.freeze) {
        (Some(r), true) => Some(Frozen::freeze(r)?),
        _ => None,
    };
    let frozen_json = frozen.as_ref().map(Frozen::describe);
    let mut summary = UpperSummary::default();
    let built = with_build_progress("pack_diff", &opts.clone(), None, || {
        build_with(store, opts, |sink| {
            summary = walk_upper(&t.upper, &excludes, &mut check, sink)?;
            Ok(())
        })
    })
    .with_context(|| format!("packing upper directory {}", t.upper.display()));
    drop(frozen);
    let built = built?;
    let top = (built.digest, LayerKind::Diff);
    let kept = (&t.manifest, t.manifest.layers.len());
    let digest = put_image(store, kept, top, config, &tag, prev)?;
    let s = &built.descriptor.stats;
    let out = json!({
        "tag": tag.to_string(),
        "manifest": digest.to_string(),
        "layer": built.digest.to_string(),
        "image": t.image_ref,
        "parent_manifest": t.manifest_digest.to_string(),
        "upper": t.upper,
        "stats": s,
        "excluded": summary.excluded,
        "opaque_dirs": summary.opaque_dirs,
        "frozen": frozen_json,
        "seconds": start.elapsed().as_secs_f64(),
    });
    report(a.json, &out, s, &format!("{tag} {digest}"));
    Ok(())
}

/// Stores an image made of `base`'s first `keep` layers and `top`, with `config`, and moves the tag
/// from `prev` to it (compare-and-swap).
fn put_image(
    store: &Store,
    (base, keep): (&Manifest, usize),
    top: (Digest, LayerKind),
    config: ImageConfig,
    tag: &TagName,
    prev: Option<TagState>,
) -> Result<Digest> {
    let mut layers = base.layers[..keep].to_vec();
    layers.push(ManifestLayer {
        digest: top.0,
        kind: top.1,
    });
    let m = Manifest {
        schema: SCHEMA,
        layers,
        config,
        annotations: base.annotations.clone(),
    };
    let digest = store.put_manifest(&m)?;
    store.tag_set(tag, prev.as_ref(), &digest)?;
    Ok(digest)
}

fn report(json_out: bool, out: &Value, s: &LayerStats, line: &str) {
    if json_out {
        println!("{out}");
        return;
    }
    println!("{line}");
    eprintln!(
        "{} entries ({} files, {} whiteouts), {} in files, {} new chunks ({}), {} stored, in {:.2}s",
        s.entries,
        s.files,
        s.whiteouts,
        human(s.file_bytes),
        s.new_chunks,
        human(s.new_bytes),
        human(s.stored_bytes),
        out["seconds"].as_f64().unwrap_or(0.0)
    );
}

/// Arguments of `strata flatten`.
#[derive(clap::Args)]
pub struct FlattenArgs {
    /// Image (tag or manifest digest).
    pub reference: String,
    /// NAME:TAG for the flattened image.
    #[arg(short = 't', long = "tag")]
    pub tag: String,
    /// First layer (0 = bottom) of the range collapsed; the layers below it are kept as they are.
    #[arg(long, default_value_t = 0)]
    pub from: usize,
    /// Move the tag if it already names another image (flattening an image in place).
    #[arg(long)]
    pub force: bool,
    /// Changes to the image's config.
    #[command(flatten)]
    pub config: ConfigArgs,
    #[arg(long)]
    pub json: bool,
}

/// `strata flatten`.
pub fn flatten(store: &Store, a: FlattenArgs) -> Result<()> {
    let start = Instant::now();
    let tag = TagName::parse(&a.tag)?;
    let (_, m) = resolve_image(store, &a.reference)?;
    let prev = claim_tag(store, &tag, a.force)?;
    let n = m.layers.len();
    if a.from >= n {
        bail!(Usage(format!(
            "--from {} is past the top of the image ({n} layers, numbered from 0)",
            a.from
        )));
    }
    let range: Vec<Digest> = m.layers[a.from..].iter().map(|l| l.digest).collect();
    let kind = match a.from {
        0 => LayerKind::Base,
        _ => m.layers[n - 1].kind,
    };
    let below: Vec<Digest> = m.layers[..a.from].iter().map(|l| l.digest).collect();
    let mut opts = BuildOptions::new(kind);
    opts.labels
        .insert("strata.flatten.layers".into(), range.len().to_string());
    // The new layer declares what the range did (from the bottom: the image's whole config), and
    // records the layers it sits on.
    let inherited = match a.from {
        0 => LayerConfig::from_image(&m.config),
        _ => {
            let mut c = LayerConfig::default();
            for d in &range {
                c = c.then(&store.get_layer(d)?.declared());
            }
            opts.built_on = Some(BuiltOn {
                image: None,
                layers: below.clone(),
            });
            c
        }
    };
    opts.config = a.config.layer_config(store, inherited)?;
    let config = a.config.image_config(store, m.config.clone())?;
    let built = with_build_progress("flatten", &opts.clone(), None, || {
        strata_builder::flatten::flatten(store, &below, &range, opts)
    })?;
    let digest = put_image(
        store,
        (&m, a.from),
        (built.digest, kind),
        config,
        &tag,
        prev,
    )?;
    let s = &built.descriptor.stats;
    let out = json!({
        "tag": tag.to_string(),
        "manifest": digest.to_string(),
        "layer": built.digest.to_string(),
        "flattened": range.len(),
        "layers": n - range.len() + 1,
        "stats": s,
        "seconds": start.elapsed().as_secs_f64(),
    });
    report(a.json, &out, s, &format!("{tag} {digest}"));
    Ok(())
}
