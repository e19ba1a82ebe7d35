//! `strata export IMAGE oci:DIR[:REF]`: a strata image as an OCI image layout
//! ([`strata_builder::oci::export`]: one tar layer per strata layer, whiteouts in the OCI form, the image
//! config), which `umoci unpack` and `skopeo copy oci:DIR:REF …` read. `REF` defaults to `latest`.
//! Each layer descriptor names its strata layer and this store in annotations for strata's
//! containerd snapshotter (`docs/CONTAINERD.md`), unless `--no-strata-annotations`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;
use strata_builder::oci::export::{
    export as write_layout, Compression, ExportOptions, ExportedLayer,
};
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
    /// oci:DIR[:REF] (REF defaults to latest; an existing layout keeps its other images).
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
}

fn parse_compression(s: &str) -> Result<Compression, String> {
    match s {
        "gzip" => Ok(Compression::Gzip),
        "zstd" => Ok(Compression::Zstd),
        "none" => Ok(Compression::None),
        other => Err(format!("{other:?}: expected gzip, zstd or none")),
    }
}

/// `oci:DIR[:REF]` → (DIR, REF).
fn parse_dest(s: &str) -> Result<(PathBuf, String), Usage> {
    let rest = s
        .strip_prefix("oci:")
        .ok_or_else(|| Usage(format!("destination {s:?}: expected oci:DIR[:REF]")))?;
    let (dir, reference) = match rest.split_once(':') {
        Some((d, r)) => (d, r),
        None => (rest, "latest"),
    };
    if dir.is_empty() || reference.is_empty() {
        return Err(Usage(format!(
            "destination {s:?}: empty directory or reference"
        )));
    }
    Ok((PathBuf::from(dir), reference.to_string()))
}

/// `strata export`.
pub fn export(store: &Store, a: ExportArgs) -> Result<()> {
    let (dir, reference) = parse_dest(&a.dest)?;
    let start = Instant::now();
    let (digest, manifest) = resolve_image(store, &a.image)?;
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
    let out = crate::progress::watch(
        "export",
        crate::progress::Counters {
            bytes: opts.progress.clone(),
            ..Default::default()
        },
        || write_layout(store, &manifest, &dir, &reference, &opts, report),
    )?;
    let written: u64 = out.layers.iter().map(|l| l.size).sum();
    if a.json {
        println!(
            "{}",
            json!({
                "image": digest.map(|d| d.to_string()),
                "layout": dir.display().to_string(),
                "reference": reference,
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
                "seconds": start.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!("{}", out.manifest);
        progress_line(&format!(
            "oci:{}:{reference}: {total} layers, {} in {:.1}s",
            dir.display(),
            human(written),
            start.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}
