//! `strata export IMAGE oci:DIR[:REF]`: a strata image as an OCI image layout
//! ([`strata_builder::oci::export`]: one tar layer per strata layer, whiteouts in the OCI form, the image
//! config), which `umoci unpack` and `skopeo copy oci:DIR:REF …` read. `REF` defaults to `latest`.
//! Each layer descriptor names its strata layer and this store in annotations for strata's
//! containerd snapshotter (`docs/CONTAINERD.md`), unless `--no-strata-annotations`.
//!
//! `strata export IMAGE docker://HOST[:PORT]/REPO[:TAG]` (also `strata push`) publishes to a registry:
//! the same layout is written into a temporary directory (under `$TMPDIR`: it needs the image's
//! compressed size there for the time of the push), then its blobs and manifest are pushed through
//! the distribution API ([`strata_builder::oci::distribution::push`]: blobs the repository has are
//! skipped), with the registry flags and credentials of `strata import`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use strata_builder::oci::distribution::client::Client;
use strata_builder::oci::distribution::push::{self, Pushed};
use strata_builder::oci::distribution::RegistryRef;
use strata_builder::oci::export::{
    export as write_layout, Compression, ExportOptions, Exported, ExportedLayer,
};
use strata_builder::oci::spec::OCI_MANIFEST;
use strata_builder::oci::Sha256Digest;
use strata_registry::model::Manifest;
use strata_registry::store::Store;

use crate::exit::Usage;
use crate::images::{human, resolve_image};

/// A progress line on standard error, when it is a terminal (clearing the spinner's line first).
fn progress_line(msg: &str) {
    if std::io::stderr().is_terminal() {
        eprintln!("\r\x1b[2K{msg}");
    }
}

/// Arguments of `strata export`.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// Image tag, manifest digest or layer digest.
    pub image: String,
    /// oci:DIR[:REF] (REF defaults to latest; an existing layout keeps its other images) or
    /// docker://HOST[:PORT]/REPO[:TAG] (a registry; TAG defaults to latest).
    pub dest: String,
    /// Layer compression: gzip, zstd or none.
    #[arg(long, default_value = "gzip", value_parser = parse_compression)]
    pub compress: Compression,
    #[arg(long)]
    pub json: bool,
    /// Leave out strata's layer annotations (`containerd.io/snapshot/strata.layer` and `.store`,
    /// which let strata's containerd snapshotter mount the layers lazily).
    #[arg(long)]
    pub no_strata_annotations: bool,
    #[command(flatten)]
    pub registry: crate::registry::RegistryArgs,
}

/// Where an export goes.
enum Dest {
    Layout(PathBuf, String),
    Registry(RegistryRef),
}

fn parse_compression(s: &str) -> Result<Compression, String> {
    match s {
        "gzip" => Ok(Compression::Gzip),
        "zstd" => Ok(Compression::Zstd),
        "none" => Ok(Compression::None),
        other => Err(format!("{other:?}: expected gzip, zstd or none")),
    }
}

/// `oci:DIR[:REF]` → (DIR, REF); `docker://…` → the registry reference.
fn parse_dest(s: &str) -> Result<Dest, Usage> {
    if let Some(r) = s.strip_prefix("docker://") {
        return RegistryRef::parse(r)
            .map(Dest::Registry)
            .map_err(|e| Usage(e.to_string()));
    }
    let rest = s.strip_prefix("oci:").ok_or_else(|| {
        Usage(format!(
            "destination {s:?}: expected oci:DIR[:REF] or docker://HOST[:PORT]/REPO[:TAG]"
        ))
    })?;
    let (dir, reference) = match rest.split_once(':') {
        Some((d, r)) => (d, r),
        None => (rest, "latest"),
    };
    if dir.is_empty() || reference.is_empty() {
        return Err(Usage(format!(
            "destination {s:?}: empty directory or reference"
        )));
    }
    Ok(Dest::Layout(PathBuf::from(dir), reference.to_string()))
}

/// `strata export`.
pub fn export(store: &Store, a: ExportArgs) -> Result<()> {
    let dest = parse_dest(&a.dest)?;
    let start = Instant::now();
    let (digest, manifest) = resolve_image(store, &a.image)?;
    // A push stages the layout in a temporary directory; the registry is reached first.
    let (dir, reference, staging, client) = match &dest {
        Dest::Layout(dir, reference) => (dir.clone(), reference.clone(), None, None),
        Dest::Registry(r) => {
            let client = push::connect(r, &a.registry.options()?)?;
            let t = tempfile::Builder::new()
                .prefix("strata-push-")
                .tempdir()
                .context("creating the staging directory of the push (in $TMPDIR)")?;
            (
                t.path().to_path_buf(),
                "latest".to_string(),
                Some(t),
                Some(client),
            )
        }
    };
    let out = write_image(store, &a, &manifest, &dir, &reference)?;
    let written: u64 = out.layers.iter().map(|l| l.size).sum();
    let mut doc = json!({
        "image": digest.map(|d| d.to_string()),
        "manifest": out.manifest.to_string(),
        "config": out.config.to_string(),
        "layers": out.layers.iter().map(|l| json!({
            "digest": l.digest.to_string(),
            "diff_id": l.diff_id.to_string(),
            "size": l.size,
            "entries": l.stats.entries,
            "whiteouts": l.stats.whiteouts,
            "file_bytes": l.stats.file_bytes,
            "skipped_sockets": l.stats.skipped_sockets,
        })).collect::<Vec<_>>(),
        "bytes": written,
    });
    let shown = match (&dest, client) {
        (Dest::Registry(r), Some(client)) => {
            let p = push_layout(&client, r, &dir, &out)?;
            doc["registry"] = json!(format!("docker://{r}"));
            doc["uploaded_blobs"] = json!(p.uploaded);
            doc["uploaded_bytes"] = json!(p.uploaded_bytes);
            doc["skipped_blobs"] = json!(p.skipped);
            doc["skipped_bytes"] = json!(p.skipped_bytes);
            format!(
                "docker://{r}: {} blobs uploaded ({}), {} already there ({})",
                p.uploaded,
                human(p.uploaded_bytes),
                p.skipped,
                human(p.skipped_bytes)
            )
        }
        _ => {
            doc["layout"] = json!(dir.display().to_string());
            doc["reference"] = json!(reference);
            format!("oci:{}:{reference}", dir.display())
        }
    };
    drop(staging);
    doc["seconds"] = json!(start.elapsed().as_secs_f64());
    if a.json {
        println!("{doc}");
    } else {
        println!("{}", out.manifest);
        progress_line(&format!(
            "{shown}: {} layers, {} in {:.1}s",
            out.layers.len(),
            human(written),
            start.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// Writes the image as an OCI layout at `dir`, with progress.
fn write_image(
    store: &Store,
    a: &ExportArgs,
    manifest: &Manifest,
    dir: &Path,
    reference: &str,
) -> Result<Exported> {
    let total = manifest.layers.len();
    let report = |n: usize, l: &ExportedLayer| {
        progress_line(&format!(
            "layer {n}/{total}: {} ({} entries, {} of files, {} written)",
            l.digest,
            l.stats.entries,
            human(l.stats.file_bytes),
            human(l.size)
        ));
    };
    let opts = ExportOptions {
        compression: a.compress,
        strata_store: (!a.no_strata_annotations).then(|| store.url().to_string()),
        ..Default::default()
    };
    Ok(crate::progress::watch(
        "export",
        crate::progress::Counters {
            bytes: opts.progress.clone(),
            ..Default::default()
        },
        || write_layout(store, manifest, dir, reference, &opts, report),
    )?)
}

/// Pushes the layout `export` wrote at `dir`: layer blobs, config, manifest.
fn push_layout(client: &Client, r: &RegistryRef, dir: &Path, out: &Exported) -> Result<Pushed> {
    let blob = |digest: Sha256Digest| -> Result<push::Blob> {
        let path = dir.join("blobs/sha256").join(digest.hex());
        let size = std::fs::metadata(&path)
            .with_context(|| format!("staged blob {}", path.display()))?
            .len();
        Ok(push::Blob { digest, size, path })
    };
    let mut blobs = Vec::new();
    for l in &out.layers {
        blobs.push(blob(l.digest)?);
    }
    blobs.push(blob(out.config)?);
    let manifest_path = dir.join("blobs/sha256").join(out.manifest.hex());
    let manifest = std::fs::read(&manifest_path)
        .with_context(|| format!("staged manifest {}", manifest_path.display()))?;
    let progress = Arc::new(AtomicU64::new(0));
    let pushed = crate::progress::watch(
        "push",
        crate::progress::Counters {
            bytes: progress.clone(),
            ..Default::default()
        },
        || push::push(client, r, &blobs, &manifest, OCI_MANIFEST, &progress),
    )?;
    Ok(pushed)
}
