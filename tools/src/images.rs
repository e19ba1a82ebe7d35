//! Images: references, compose, tag, images, inspect.

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata_registry::digest::Digest;
use strata_registry::model::{
    ImageConfig, LayerDescriptor, Manifest, ManifestLayer, Reference, TagName, SCHEMA,
};
use strata_registry::store::{Store, StoreError, TagState};

pub use strata_cli::ps::human;

use crate::exit::{NotFound, Usage};

/// What a reference named.
pub enum Resolved {
    Image(Digest, Manifest),
    Layer(Digest, LayerDescriptor),
}

/// Resolves a tag or digest to an image or a layer.
pub fn resolve(store: &Store, r: &str) -> Result<Resolved> {
    match Reference::parse(r)? {
        Reference::Tag(t) => {
            let s = store
                .tag_get(&t)?
                .ok_or_else(|| NotFound(format!("no image tagged {t} in {}", store.url())))?;
            Ok(Resolved::Image(s.digest, store.get_manifest(&s.digest)?))
        }
        Reference::Digest(d) => {
            if store.has_manifest(&d)? {
                return Ok(Resolved::Image(d, store.get_manifest(&d)?));
            }
            match store.get_layer(&d) {
                Ok(l) => Ok(Resolved::Layer(d, l)),
                Err(StoreError::NotFound(_)) => Err(NotFound(format!(
                    "{d} is neither an image nor a layer in {}",
                    store.url()
                ))
                .into()),
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// Resolves to an image (a bare layer becomes a one-layer image).
pub fn resolve_image(store: &Store, r: &str) -> Result<(Option<Digest>, Manifest)> {
    Ok(match resolve(store, r)? {
        Resolved::Image(d, m) => (Some(d), m),
        Resolved::Layer(d, l) => (
            None,
            Manifest {
                schema: SCHEMA,
                layers: vec![ManifestLayer {
                    digest: d,
                    kind: l.kind,
                }],
                config: l.declared().apply(&ImageConfig::default()),
                annotations: Default::default(),
            },
        ),
    })
}

/// Resolves to layer digests: a layer, or every layer of an image (bottom first).
pub fn resolve_layers(store: &Store, r: &str) -> Result<Vec<Digest>> {
    Ok(match resolve(store, r)? {
        Resolved::Image(_, m) => m.layers.iter().map(|l| l.digest).collect(),
        Resolved::Layer(d, _) => vec![d],
    })
}

/// Resolves to exactly one layer.
pub fn resolve_layer(store: &Store, r: &str) -> Result<(Digest, LayerDescriptor)> {
    match resolve(store, r)? {
        Resolved::Layer(d, l) => Ok((d, l)),
        Resolved::Image(_, m) if m.layers.len() == 1 => {
            let d = m.layers[0].digest;
            Ok((d, store.get_layer(&d)?))
        }
        Resolved::Image(_, m) => Err(Usage(format!(
            "{r} is an image of {} layers; name one layer by digest (see strata inspect {r})",
            m.layers.len()
        ))
        .into()),
    }
}

/// Arguments of `strata compose` (the layers above the base are ordered by [`crate::compose::Compose`]).
#[derive(clap::Args)]
pub struct ComposeArgs {
    /// The bottom: an image (all its layers, and its config) or a layer; it must hold no whiteouts.
    #[arg(long)]
    pub base: String,
    /// A workspace layer (or image) above the base (repeatable). --workspace and --toolkit layers stack
    /// in the order given, the first lowest.
    #[arg(long)]
    pub workspace: Vec<String>,
    /// A toolkit layer (or image) above the base (repeatable), in the same order as --workspace.
    #[arg(long)]
    pub toolkit: Vec<String>,
    /// Tag for the new image.
    #[arg(short = 't', long = "tag")]
    pub tag: String,
    /// Move the tag if it already names another image.
    #[arg(long)]
    pub force: bool,
    /// Compose layers on a base other than the one they were built on (their files, e.g. a toolkit's
    /// /var/lib/dpkg/status, then hide the base's).
    #[arg(long)]
    pub rebase: bool,
    #[command(flatten)]
    pub config: crate::config::ConfigArgs,
    #[arg(long)]
    pub json: bool,
}

/// Makes and tags a manifest from layers; an existing tag naming another image moves only if `force`.
pub fn make_image(
    store: &Store,
    layers: Vec<(Digest, LayerDescriptor)>,
    config: ImageConfig,
    tag: &TagName,
    force: bool,
) -> Result<Digest> {
    make_annotated_image(store, layers, config, Default::default(), tag, force)
}

/// Makes and tags a manifest from layers, with annotations.
pub fn make_annotated_image(
    store: &Store,
    layers: Vec<(Digest, LayerDescriptor)>,
    config: ImageConfig,
    annotations: std::collections::BTreeMap<String, String>,
    tag: &TagName,
    force: bool,
) -> Result<Digest> {
    if let Some((d, bottom)) = layers.first() {
        if bottom.stats.whiteouts > 0 {
            bail!(Usage(format!(
                "layer {d} holds {} whiteouts and cannot be the bottom layer of an image",
                bottom.stats.whiteouts
            )));
        }
    }
    let m = Manifest {
        schema: SCHEMA,
        layers: layers
            .iter()
            .map(|(d, l)| ManifestLayer {
                digest: *d,
                kind: l.kind,
            })
            .collect(),
        config,
        annotations,
    };
    let digest = store.put_manifest(&m)?;
    set_tag(store, tag, &digest, force)?;
    Ok(digest)
}

/// The state of `tag` to compare-and-swap against, refusing a tag that exists unless `force`: the
/// check a command makes before it starts work that ends in moving the tag.
pub fn claim_tag(store: &Store, tag: &TagName, force: bool) -> Result<Option<TagState>> {
    let prev = store.tag_get(tag)?;
    if let (Some(p), false) = (&prev, force) {
        return Err(moving_refused(tag, &p.digest).into());
    }
    Ok(prev)
}

/// The refusal to move a tag that names another image without `--force` (not a race: the tag was there
/// before the command started).
fn moving_refused(tag: &TagName, found: &Digest) -> StoreError {
    StoreError::TagTaken {
        tag: tag.to_string(),
        found: found.to_string(),
    }
}

/// The state of `tag` if it may be pointed at `digest`: absent, naming `digest` already, or naming another
/// image and `force`. Otherwise the refusal [`set_tag`] gives. For callers that check before long work
/// and set (by compare-and-swap against this state) after it.
pub fn check_tag(
    store: &Store,
    tag: &TagName,
    digest: &Digest,
    force: bool,
) -> Result<Option<TagState>> {
    let prev = store.tag_get(tag)?;
    match &prev {
        Some(p) if p.digest != *digest && !force => Err(moving_refused(tag, &p.digest).into()),
        _ => Ok(prev),
    }
}

/// Points `tag` at `digest` by compare-and-swap. A tag that already names `digest`, or the same image
/// compacted by `gc --compact` (unless `force`), is left as it is; one naming another image is moved only
/// if `force`.
pub fn set_tag(store: &Store, tag: &TagName, digest: &Digest, force: bool) -> Result<()> {
    let prev = store.tag_get(tag)?;
    if let Some(p) = &prev {
        let compacted = || strata_builder::compact::is_compacted_form(store, &p.digest, digest);
        if p.digest == *digest || (!force && compacted()?) {
            return Ok(());
        }
        if !force {
            return Err(moving_refused(tag, &p.digest).into());
        }
    }
    store.tag_set(tag, prev.as_ref(), digest)?;
    Ok(())
}

/// Arguments of `strata tag`.
#[derive(clap::Args)]
pub struct TagArgs {
    /// Image (tag or manifest digest) or layer to tag.
    pub reference: String,
    /// NAME:TAG to set.
    pub tag: String,
    /// Only move the tag if it currently names this digest ("absent": only create it).
    #[arg(long)]
    pub expect: Option<String>,
}

/// `strata tag`.
pub fn tag(store: &Store, a: TagArgs) -> Result<()> {
    let t = TagName::parse(&a.tag)?;
    let digest = match resolve(store, &a.reference)? {
        Resolved::Image(d, _) => d,
        Resolved::Layer(d, _) => {
            let (_, m) = resolve_image(store, &d.to_string())?;
            store.put_manifest(&m)?
        }
    };
    let prev = store.tag_get(&t)?;
    if let Some(e) = &a.expect {
        let wanted = if e == "absent" {
            None
        } else {
            Some(e.parse::<Digest>().map_err(|e| Usage(e.to_string()))?)
        };
        if prev.as_ref().map(|p| p.digest) != wanted {
            return Err(StoreError::TagConflict {
                tag: t.to_string(),
                expected: e.clone(),
                found: prev.map_or("absent".into(), |p| p.digest.to_string()),
            }
            .into());
        }
    }
    store.tag_set(&t, prev.as_ref(), &digest)?;
    println!("{t} {digest}");
    Ok(())
}

fn layer_json(d: &Digest, l: &LayerDescriptor) -> serde_json::Value {
    json!({
        "digest": d.to_string(), "kind": l.kind, "content": l.content, "meta": l.meta, "blobs": l.blobs,
        "chunk_size": l.chunk_size, "stats": l.stats, "parent": l.parent, "labels": l.labels,
        "config": l.config, "built_on": l.built_on,
    })
}

/// `strata inspect`.
pub fn inspect(store: &Store, r: &str, json_out: bool) -> Result<()> {
    match resolve(store, r)? {
        Resolved::Layer(d, l) => {
            if json_out {
                println!("{}", serde_json::to_string_pretty(&layer_json(&d, &l))?);
            } else {
                print_layer(&d, &l);
            }
        }
        Resolved::Image(d, m) => {
            let mut layers = Vec::new();
            for l in &m.layers {
                let desc = store
                    .get_layer(&l.digest)
                    .with_context(|| format!("reading layer {}", l.digest))?;
                layers.push((l.digest, desc));
            }
            let (stored, logical) = store.image_size(&m)?;
            if json_out {
                let v = json!({
                    "digest": d.to_string(), "manifest": m, "stored_bytes": stored, "file_bytes": logical,
                    "layers": layers.iter().map(|(d, l)| layer_json(d, l)).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("image    {d}");
                println!("stored   {}  (files {})", human(stored), human(logical));
                for line in crate::config::describe(&m.config) {
                    println!("config   {line}");
                }
                for (d, l) in &layers {
                    print_layer(d, l);
                }
            }
        }
    }
    Ok(())
}

fn print_layer(d: &Digest, l: &LayerDescriptor) {
    let s = &l.stats;
    println!("layer    {d}  {}", l.kind);
    println!(
        "  entries {}  files {}  file bytes {}  whiteouts {}",
        s.entries,
        s.files,
        human(s.file_bytes),
        s.whiteouts
    );
    println!(
        "  metadata {} ({})  chunks {} (new {}, {})  stored {}",
        l.meta.digest,
        human(l.meta.size),
        s.chunks,
        s.new_chunks,
        human(s.new_bytes),
        human(s.stored_bytes)
    );
    if let Some(on) = &l.built_on {
        match &on.image {
            Some(m) => println!("  built on image {m}"),
            None => println!("  built on"),
        }
        for d in &on.layers {
            println!("    {d}");
        }
    }
    for line in l
        .config
        .as_deref()
        .map(crate::config::describe_declared)
        .into_iter()
        .flatten()
    {
        println!("  declares {line}");
    }
    for (i, b) in l.blobs.iter().enumerate() {
        println!(
            "  device {}: blob {}  {}  view {}  {} chunks",
            i + 1,
            b.digest,
            human(b.size),
            human(b.view_size),
            b.chunks
        );
    }
}
