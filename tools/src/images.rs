//! Images: references, compose, tag, images, inspect.

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata_registry::digest::Digest;
use strata_registry::model::{
    ImageConfig, LayerDescriptor, LayerKind, Manifest, ManifestLayer, Reference, TagName, SCHEMA,
};
use strata_registry::store::{Store, StoreError};

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
                config: ImageConfig::default(),
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

/// Arguments of `strata compose`.
#[derive(clap::Args)]
pub struct ComposeArgs {
    /// The bottom layer (it must hold no whiteouts).
    #[arg(long)]
    pub base: String,
    /// Workspace layers, bottom to top.
    #[arg(long)]
    pub workspace: Vec<String>,
    /// Toolkit layers, bottom to top (above the workspaces).
    #[arg(long)]
    pub toolkit: Vec<String>,
    /// Tag for the new image.
    #[arg(short = 't', long = "tag")]
    pub tag: String,
    #[arg(long)]
    pub json: bool,
}

/// Makes and tags a manifest from layers.
pub fn make_image(
    store: &Store,
    layers: Vec<(Digest, LayerDescriptor)>,
    config: ImageConfig,
    tag: &TagName,
) -> Result<Digest> {
    make_annotated_image(store, layers, config, Default::default(), tag)
}

/// Makes and tags a manifest from layers, with annotations.
pub fn make_annotated_image(
    store: &Store,
    layers: Vec<(Digest, LayerDescriptor)>,
    config: ImageConfig,
    annotations: std::collections::BTreeMap<String, String>,
    tag: &TagName,
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
    let prev = store.tag_get(tag)?;
    store.tag_set(tag, prev.as_ref(), &digest)?;
    Ok(digest)
}

/// `strata compose`.
pub fn compose(store: &Store, a: ComposeArgs) -> Result<()> {
    let tag = TagName::parse(&a.tag)?;
    let mut layers = Vec::new();
    let mut config = ImageConfig::default();
    let groups = [
        (vec![a.base.clone()], LayerKind::Base),
        (a.workspace.clone(), LayerKind::Workspace),
        (a.toolkit.clone(), LayerKind::Toolkit),
    ];
    for (refs, _) in groups.iter() {
        for r in refs {
            match resolve(store, r)? {
                Resolved::Layer(d, l) => layers.push((d, l)),
                Resolved::Image(_, m) => {
                    config = m.config.clone();
                    for l in &m.layers {
                        layers.push((l.digest, store.get_layer(&l.digest)?));
                    }
                }
            }
        }
    }
    let digest = make_image(store, layers, config, &tag)?;
    if a.json {
        println!(
            "{}",
            json!({"tag": tag.to_string(), "digest": digest.to_string()})
        );
    } else {
        println!("{digest}");
    }
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

/// Stored bytes of an image: its layers' metadata and the distinct blobs they reference.
fn image_size(store: &Store, m: &Manifest) -> Result<(u64, u64)> {
    let mut blobs = std::collections::BTreeMap::new();
    let mut meta = 0;
    let mut logical = 0;
    for l in &m.layers {
        let d = store.get_layer(&l.digest)?;
        meta += d.meta.size;
        logical += d.stats.file_bytes;
        for b in &d.blobs {
            blobs.insert(b.digest, b.size);
        }
    }
    Ok((meta + blobs.values().sum::<u64>(), logical))
}

/// `strata images`.
pub fn list(store: &Store, json_out: bool) -> Result<()> {
    let tags = store.tags()?;
    let mut rows = Vec::new();
    for (t, d) in tags {
        let m = store.get_manifest(&d)?;
        let (stored, logical) = image_size(store, &m)?;
        rows.push((t, d, m.layers.len(), stored, logical));
    }
    if json_out {
        let v: Vec<_> = rows
            .iter()
            .map(|(t, d, n, s, l)| {
                json!({"name": t.name, "tag": t.tag, "digest": d.to_string(), "layers": n,
                       "stored_bytes": s, "file_bytes": l})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<40} {:<20} {:>6} {:>12} {:>12}",
        "NAME:TAG", "DIGEST", "LAYERS", "STORED", "FILES"
    );
    for (t, d, n, s, l) in rows {
        println!(
            "{:<40} {:<20} {:>6} {:>12} {:>12}",
            t.to_string(),
            format!("blake3:{}", d.short()),
            n,
            human(s),
            human(l)
        );
    }
    Ok(())
}

/// Bytes for humans.
pub fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn layer_json(d: &Digest, l: &LayerDescriptor) -> serde_json::Value {
    json!({
        "digest": d.to_string(), "kind": l.kind, "meta": l.meta, "blobs": l.blobs,
        "chunk_size": l.chunk_size, "stats": l.stats, "parent": l.parent, "labels": l.labels,
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
            let (stored, logical) = image_size(store, &m)?;
            if json_out {
                let v = json!({
                    "digest": d.to_string(), "manifest": m, "stored_bytes": stored, "file_bytes": logical,
                    "layers": layers.iter().map(|(d, l)| layer_json(d, l)).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("image    {d}");
                println!("stored   {}  (files {})", human(stored), human(logical));
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

/// Arguments of `strata gc`.
#[derive(clap::Args)]
pub struct GcArgs {
    /// Keep unreferenced objects younger than this (builds in flight): e.g. 24h, 30m, 7d, 0s.
    #[arg(long, default_value = "24h")]
    pub grace: String,
    /// Report what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub compact: crate::compact::CompactArgs,
    #[arg(long)]
    pub json: bool,
}

/// Parses `90s`, `30m`, `24h`, `7d`.
fn parse_duration(s: &str) -> Result<std::time::Duration> {
    let s = s.trim();
    let bad = || {
        Usage(format!(
            "duration {s:?}: use a number and s, m, h or d, e.g. 24h"
        ))
    };
    let unit = s.chars().last().ok_or_else(bad)?;
    let mult = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86400,
        _ => return Err(bad().into()),
    };
    let n: u64 = s[..s.len() - 1].parse().map_err(|_| bad())?;
    Ok(std::time::Duration::from_secs(n.saturating_mul(mult)))
}

/// `strata gc`.
pub fn gc(store: &Store, a: GcArgs) -> Result<()> {
    let grace = parse_duration(&a.grace)?;
    let compacted = a.compact.run(store, a.dry_run)?;
    let r = strata_registry::gc::collect(store, grace, a.dry_run, std::time::SystemTime::now())?;
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        if let Some(c) = &compacted {
            v["compact"] = serde_json::to_value(c)?;
        }
        println!("{v}");
        return Ok(());
    }
    if let Some(c) = &compacted {
        println!("{}", crate::compact::summary(c));
    }
    let verb = if a.dry_run { "would delete" } else { "deleted" };
    println!(
        "{} tags, {} live objects; {verb} {} objects ({}); kept {} unreferenced objects younger than {}",
        r.tags,
        r.live,
        r.deleted,
        human(r.deleted_bytes),
        r.young,
        a.grace
    );
    if r.condemned > 0 {
        println!(
            "{} unreferenced blobs condemned: a gc at least {} from now deletes them if still unreferenced",
            r.condemned, a.grace
        );
    }
    Ok(())
}
