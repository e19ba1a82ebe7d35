//! `strata import`: an OCI image layout, a `docker save` archive or an image in a registry
//! (`docker://`, pulled through the distribution API: [`strata_builder::oci::distribution`]) becomes a
//! tagged strata image.
//!
//! The source is parsed and its JSON blobs verified first ([`strata_builder::oci::open`]), so a bad
//! source fails before anything is stored. Then every layer is imported bottom first
//! ([`strata_builder::import`]: verified in the same pass, deduplicated against the layers below, reused
//! when an earlier import made it), the manifest is written with the image config, and the tag is set
//! last — a failure at any point leaves nothing a tag refers to. With `--flatten` the imported layers are
//! then collapsed into one ([`strata_builder::flatten`]: whiteouts applied, chunks referenced, no data
//! moved) and the image has that one layer; the per-layer imports stay reusable.

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;
use strata_builder::import::{import_layers, ImportedLayer};
use strata_builder::oci::distribution::{self, Reference, RegistryRef};
use strata_builder::oci::{self, Platform, Source};
use strata_builder::{BuildOptions, BuiltLayer};
use strata_registry::digest::Digest;
use strata_registry::model::{ImageConfig, LayerConfig, LayerKind, TagName};
use strata_registry::store::Store;

use crate::config::ConfigArgs;
use crate::exit::{NotFound, Usage};
use crate::images::{human, make_annotated_image};
use crate::layers::with_build_progress;

/// Arguments of `strata import`.
#[derive(clap::Args)]
pub struct ImportArgs {
    /// oci:DIR[:REF] (an OCI image layout), docker-archive:FILE[:REPO:TAG] (`docker save` output) or
    /// docker://HOST[:PORT]/REPO[:TAG|@sha256:DIGEST] (a registry).
    pub src: String,
    /// Tag for the imported image (default for docker://: the reference's REPO:TAG).
    #[arg(short = 't', long = "tag")]
    pub tag: Option<String>,
    /// Move the tag if it already names another image.
    #[arg(long)]
    pub force: bool,
    /// Platform to pick from a multi-platform index: os/arch[/variant] (default: linux/<this machine>).
    #[arg(long)]
    pub platform: Option<String>,
    /// Make one layer of the whole image instead of one per OCI layer.
    #[arg(long)]
    pub flatten: bool,
    #[command(flatten)]
    pub registry: crate::registry::RegistryArgs,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Changes to the imported image's config (or another image's with --config-from).
    #[command(flatten)]
    pub config: ConfigArgs,
    #[command(flatten)]
    pub dedup: crate::index::DedupArgs,
    #[arg(long)]
    pub json: bool,
}

/// The tag a registry image is imported as without `-t`: its repository and tag (`REPO:TAG`, as
/// `docker pull` names it; `REPO:latest` for a reference by digest).
fn default_tag(r: &RegistryRef) -> Result<TagName> {
    let tag = match &r.reference {
        Reference::Tag(t) => t.as_str(),
        Reference::Digest(_) => "latest",
    };
    let name = r
        .repository
        .strip_prefix("library/")
        .unwrap_or(&r.repository);
    TagName::parse(&format!("{name}:{tag}")).map_err(|e| {
        Usage(format!(
            "docker://{r}: cannot be a strata tag ({e}); give one with -t"
        ))
        .into()
    })
}

/// `strata import`.
pub fn import(store: &Store, a: ImportArgs) -> Result<()> {
    let source = Source::parse(&a.src)?;
    let tag = match (&a.tag, &source) {
        (Some(t), _) => TagName::parse(t)?,
        (None, Source::Registry(r)) => default_tag(r)?,
        (None, _) => {
            return Err(Usage(format!(
                "{}: give the tag to import as with -t NAME:TAG",
                a.src
            ))
            .into())
        }
    };
    let platform = match &a.platform {
        Some(p) => Platform::parse(p)?,
        None => Platform::host(),
    };
    let start = Instant::now();
    let image = match &source {
        Source::Registry(r) => distribution::open(r, &platform, &a.registry.options()?)?,
        _ => oci::open(&source, &platform)?,
    };
    let config = a.config.image_config(store, image.config.clone())?;
    check_platform(&a, &image, &platform)?;
    let mut opts = BuildOptions::new(LayerKind::Base);
    if let Some(t) = a.threads {
        opts.threads = t.max(1);
    }
    a.dedup.apply(&mut opts);
    let tty = std::io::stderr().is_terminal();
    let total = image.layers.len();
    let report = |l: &ImportedLayer| {
        if tty {
            let how = if l.reused { "reused" } else { "imported" };
            // Clears the progress line first.
            eprintln!(
                "\r\x1b[2Klayer {}/{total} {how}: {} ({}, {} stored)",
                l.number,
                l.digest,
                l.diff_id,
                human(l.stored_bytes())
            );
        }
    };
    let layers = with_build_progress("import", &opts.clone(), None, || {
        import_layers(store, &image, &opts, report)
    })?;
    let flattened = if a.flatten && layers.len() > 1 {
        Some(flatten(store, &layers, &config, opts.threads)?)
    } else {
        None
    };
    let parts = match &flattened {
        // The layers are imported (and reusable) as usual, then collapsed without moving data.
        Some(built) => vec![(built.digest, built.descriptor.clone())],
        None => layers
            .iter()
            .map(|l| (l.digest, l.descriptor.clone()))
            .collect(),
    };
    let annotations = oci::annotations(&image);
    let digest = make_annotated_image(store, parts, config, annotations, &tag, a.force)?;
    let done = Imported {
        digest,
        tag,
        image,
        layers,
        flattened,
        seconds: start.elapsed().as_secs_f64(),
    };
    done.print(a.json, tty);
    Ok(())
}

/// A single-platform image is taken as it is; it must be the platform asked for, if one was (else a
/// warning names the mismatch).
fn check_platform(a: &ImportArgs, image: &oci::OciImage, platform: &Platform) -> Result<()> {
    let found = Platform::parse(&image.platform).ok();
    let matches = found
        .as_ref()
        .is_some_and(|f| platform.matches(&f.os, &f.architecture, f.variant.as_deref()));
    if matches {
        return Ok(());
    }
    if a.platform.is_some() {
        return Err(NotFound(format!(
            "{}: the image is for {}, not {platform}",
            a.src, image.platform
        ))
        .into());
    }
    eprintln!(
        "strata: warning: {} is an image for {}, not for this machine ({platform})",
        a.src, image.platform
    );
    Ok(())
}

/// `--flatten`: the imported layers collapsed into one, without moving data.
fn flatten(
    store: &Store,
    layers: &[ImportedLayer],
    config: &ImageConfig,
    threads: usize,
) -> Result<BuiltLayer> {
    let digests: Vec<_> = layers.iter().map(|l| l.digest).collect();
    let mut fopts = BuildOptions::new(LayerKind::Base);
    fopts.threads = threads;
    fopts
        .labels
        .insert("strata.flatten.layers".into(), digests.len().to_string());
    fopts.config = LayerConfig::from_image(config);
    let built = with_build_progress("flatten", &fopts.clone(), None, || {
        strata_builder::flatten::flatten(store, &[], &digests, fopts)
    })?;
    Ok(built)
}

/// What an import made, for its report.
struct Imported {
    digest: Digest,
    tag: TagName,
    image: oci::OciImage,
    layers: Vec<ImportedLayer>,
    flattened: Option<BuiltLayer>,
    seconds: f64,
}

impl Imported {
    /// The image's digest on stdout (a JSON report with `--json`), a summary on a terminal.
    fn print(&self, json: bool, tty: bool) {
        let stored: u64 = self.layers.iter().map(|l| l.stored_bytes()).sum::<u64>()
            + self
                .flattened
                .as_ref()
                .map_or(0, |b| b.descriptor.stats.stored_bytes);
        if json {
            println!("{}", self.json(stored));
        } else {
            println!("{}", self.digest);
            if tty {
                eprintln!(
                    "{}: {} layers, {} stored ({} of OCI blobs), in {:.1}s",
                    self.tag,
                    self.layers.len(),
                    human(stored),
                    human(self.image.blob_bytes),
                    self.seconds
                );
            }
        }
    }

    fn json(&self, stored: u64) -> serde_json::Value {
        let layers: Vec<_> = self
            .layers
            .iter()
            .map(|l| {
                json!({
                    "digest": l.digest.to_string(),
                    "diff_id": l.diff_id.to_string(),
                    "chain_id": l.chain_id.to_string(),
                    "reused": l.reused,
                    "stored_bytes": l.stored_bytes(),
                    "whiteouts": l.descriptor.stats.whiteouts,
                    "entries": l.descriptor.stats.entries,
                })
            })
            .collect();
        json!({
            "digest": self.digest.to_string(),
            "tag": self.tag.to_string(),
            "oci_manifest": self.image.manifest_digest.map(|d| d.to_string()),
            "platform": self.image.platform,
            "layers": layers,
            "flattened": self.flattened.as_ref().map(|b| {
                let s = &b.descriptor.stats;
                json!({
                    "digest": b.digest.to_string(),
                    "stored_bytes": s.stored_bytes,
                    "whiteouts": s.whiteouts,
                    "entries": s.entries,
                })
            }),
            "stored_bytes": stored,
            "oci_blob_bytes": self.image.blob_bytes,
            "seconds": self.seconds,
        })
    }
}
