//! Writing a strata image as an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/<hex>`),
//! which `umoci`, `skopeo` and other OCI tools read.
//!
//! Each strata layer becomes one layer tar ([`tar`]: overlay whiteouts translated to OCI `.wh.` files),
//! compressed as asked ([`Compression`]), streamed into a temporary file in `blobs/sha256/` through two
//! SHA-256 hashers — the compressed blob's digest names the file, the uncompressed tar's is the layer's
//! diff ID — and renamed into place. Then the config (platform from the image's
//! `org.strata.oci.platform` annotation, else this machine; `Env`, `Entrypoint`, `Cmd`, `WorkingDir`,
//! `User`, `Labels` from the strata image config; `rootfs.diff_ids`), the manifest, and last
//! `index.json`, rewritten atomically with the entry for `REF` replaced (other entries are kept: one
//! layout may hold several images). A failure leaves at worst unreferenced blobs in the layout.

pub mod tar;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest as _, Sha256};
use strata_registry::digest::Digest;
use strata_registry::model::{ImageConfig, Manifest};
use strata_registry::store::{Store, StoreError};

use super::spec::{OCI_CONFIG, OCI_MANIFEST, REF_NAME};
use super::{Platform, Sha256Digest};
use crate::erofs::reader::{ErofsError, ErofsImage};

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("layer metadata: {0}")]
    Erofs(#[from] ErofsError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// Something the destination cannot hold.
    #[error("{0}")]
    Unsupported(String),
}

impl ExportError {
    fn io(what: impl Into<String>, source: io::Error) -> ExportError {
        ExportError::Io {
            what: what.into(),
            source,
        }
    }
}

/// How layer tars are compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Compression {
    #[default]
    Gzip,
    Zstd,
    None,
}

impl Compression {
    fn media_type(self) -> &'static str {
        match self {
            Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
            Compression::None => "application/vnd.oci.image.layer.v1.tar",
        }
    }
}

/// A written layer.
#[derive(Clone, Debug)]
pub struct ExportedLayer {
    pub digest: Sha256Digest,
    pub size: u64,
    pub diff_id: Sha256Digest,
    pub stats: tar::TarStats,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    pub manifest: Sha256Digest,
    pub config: Sha256Digest,
    pub layers: Vec<ExportedLayer>,
}

/// A writer that hashes what passes through it.
struct HashWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W> HashWriter<W> {
    fn new(inner: W) -> HashWriter<W> {
        HashWriter {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }
    fn digest(&self) -> Sha256Digest {
        Sha256Digest(self.hasher.clone().finalize().into())
    }
}

fn blob_dir(dir: &Path) -> PathBuf {
    dir.join("blobs").join("sha256")
}

/// Writes `bytes` as a blob; returns its digest and size.
fn put_blob(dir: &Path, bytes: &[u8]) -> Result<(Sha256Digest, u64), ExportError> {
    let d = Sha256Digest::of(bytes);
    let path = blob_dir(dir).join(d.hex());
    write_atomic(&path, bytes)?;
    Ok((d, bytes.len() as u64))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ExportError> {
    let how = strata_registry::fsutil::Atomic {
        mode: 0o644,
        sync: false,
    };
    strata_registry::fsutil::write_atomic(path, bytes, how)
        .map_err(|e| ExportError::io(path.display().to_string(), e))
}

/// Streams one layer tar, compressed, into a blob of the layout.
fn layer_blob(
    dir: &Path,
    src: &tar::LayerSource<'_>,
    compression: Compression,
    n: usize,
) -> Result<ExportedLayer, ExportError> {
    let tmp = blob_dir(dir).join(format!(".strata-layer-{}-{n}", std::process::id()));
    let file = fs::File::create(&tmp).map_err(|e| ExportError::io(tmp.display().to_string(), e))?;
    let result = (|| {
        let outer = HashWriter::new(io::BufWriter::with_capacity(1 << 20, file));
        let io_err = |e| ExportError::io(tmp.display().to_string(), e);
        let (outer, diff_id, stats) = match compression {
            Compression::Gzip => {
                let gz = flate2::write::GzEncoder::new(outer, flate2::Compression::fast());
                let (inner, stats) = tar::write_layer(src, HashWriter::new(gz))?;
                let diff = inner.digest();
                (inner.inner.finish().map_err(io_err)?, diff, stats)
            }
            Compression::Zstd => {
                let z = zstd::Encoder::new(outer, 3).map_err(io_err)?;
                let (inner, stats) = tar::write_layer(src, HashWriter::new(z))?;
                let diff = inner.digest();
                (inner.inner.finish().map_err(io_err)?, diff, stats)
            }
            Compression::None => {
                let (inner, stats) = tar::write_layer(src, HashWriter::new(outer))?;
                let diff = inner.digest();
                (inner.inner, diff, stats)
            }
        };
        let digest = outer.digest();
        let size = outer.count;
        let file = outer
            .inner
            .into_inner()
            .map_err(|e| io_err(e.into_error()))?;
        file.sync_all().map_err(io_err)?;
        let path = blob_dir(dir).join(digest.hex());
        fs::rename(&tmp, &path).map_err(|e| ExportError::io(path.display().to_string(), e))?;
        Ok(ExportedLayer {
            digest,
            size,
            diff_id,
            stats,
        })
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The OCI config of a strata image.
fn config_json(m: &Manifest, diff_ids: &[Sha256Digest]) -> serde_json::Value {
    let platform = m
        .annotations
        .get("org.strata.oci.platform")
        .and_then(|p| Platform::parse(p).ok())
        .unwrap_or_else(Platform::host);
    let c: &ImageConfig = &m.config;
    let mut run = serde_json::Map::new();
    if !c.env.is_empty() {
        run.insert("Env".into(), json!(c.env));
    }
    if !c.entrypoint.is_empty() {
        run.insert("Entrypoint".into(), json!(c.entrypoint));
    }
    if !c.cmd.is_empty() {
        run.insert("Cmd".into(), json!(c.cmd));
    }
    if let Some(w) = &c.working_dir {
        run.insert("WorkingDir".into(), json!(w));
    }
    if let Some(u) = &c.user {
        run.insert("User".into(), json!(u));
    }
    if !c.labels.is_empty() {
        run.insert("Labels".into(), json!(c.labels));
    }
    let mut cfg = json!({
        "architecture": platform.architecture,
        "os": platform.os,
        "config": run,
        "rootfs": {
            "type": "layers",
            "diff_ids": diff_ids.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
        },
        "history": diff_ids.iter().map(|_| json!({"created_by": "strata export"})).collect::<Vec<_>>(),
    });
    if let Some(v) = &platform.variant {
        cfg["variant"] = json!(v);
    }
    cfg
}

/// Prepares `dir` as a layout: creates it, or checks an existing one is a layout (or empty).
fn open_layout(dir: &Path) -> Result<Vec<serde_json::Value>, ExportError> {
    let marker = dir.join("oci-layout");
    let index = dir.join("index.json");
    let existing = dir.is_dir()
        && fs::read_dir(dir)
            .map_err(|e| ExportError::io(dir.display().to_string(), e))?
            .next()
            .is_some();
    if existing && !marker.exists() {
        return Err(ExportError::Unsupported(format!(
            "{} is not empty and not an OCI image layout (no oci-layout file)",
            dir.display()
        )));
    }
    fs::create_dir_all(blob_dir(dir)).map_err(|e| ExportError::io(dir.display().to_string(), e))?;
    write_atomic(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    if !index.exists() {
        return Ok(Vec::new());
    }
    let bytes = fs::read(&index).map_err(|e| ExportError::io(index.display().to_string(), e))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        ExportError::Unsupported(format!("{}: not an image index: {e}", index.display()))
    })?;
    Ok(v["manifests"].as_array().cloned().unwrap_or_default())
}

/// How to export.
#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    pub compression: Compression,
    /// Bytes of file data written so far (for progress displays).
    pub progress: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The URL of the store the image lives in: when set, each layer descriptor carries strata's
    /// annotations ([`LAYER_ANNOTATION`], [`STORE_ANNOTATION`]) so that strata's containerd
    /// snapshotter mounts the layer from the store instead of unpacking its tar (which stays an
    /// ordinary OCI layer for every other runtime).
    pub strata_store: Option<String>,
}

/// The strata layer a descriptor's tar was exported from. Under `containerd.io/snapshot/`: the only
/// descriptor annotations containerd's unpacker passes to a snapshotter's `Prepare`.
pub const LAYER_ANNOTATION: &str = "containerd.io/snapshot/strata.layer";
/// The store holding that layer.
pub const STORE_ANNOTATION: &str = "containerd.io/snapshot/strata.store";

/// A layer descriptor of the exported manifest (`strata`: its strata layer and store, to annotate).
fn layer_descriptor(
    compression: Compression,
    l: &ExportedLayer,
    strata: Option<(&Digest, &str)>,
) -> serde_json::Value {
    let mut d = json!({
        "mediaType": compression.media_type(),
        "digest": l.digest.to_string(),
        "size": l.size,
    });
    if let Some((layer, store)) = strata {
        d["annotations"] = json!({LAYER_ANNOTATION: layer.to_string(), STORE_ANNOTATION: store});
    }
    d
}

/// Writes image `m` into the layout at `dir` under `reference`. `on_layer` is called after each layer.
pub fn export(
    store: &Store,
    m: &Manifest,
    dir: &Path,
    reference: &str,
    opts: &ExportOptions,
    mut on_layer: impl FnMut(usize, &ExportedLayer),
) -> Result<Exported, ExportError> {
    let compression = opts.compression;
    let entries = open_layout(dir)?;
    let mut layers = Vec::new();
    for (i, l) in m.layers.iter().enumerate() {
        let desc = store.get_layer(&l.digest)?;
        let image = ErofsImage::parse(store.get_meta(&desc.meta.digest)?)?;
        let src = tar::LayerSource {
            store,
            desc: &desc,
            image: &image,
            progress: &opts.progress,
        };
        let done = layer_blob(dir, &src, compression, i)?;
        on_layer(i + 1, &done);
        layers.push(done);
    }
    let diff_ids: Vec<_> = layers.iter().map(|l| l.diff_id).collect();
    let cfg = serde_json::to_vec(&config_json(m, &diff_ids)).unwrap_or_default();
    let (config, config_size) = put_blob(dir, &cfg)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config.to_string(), "size": config_size},
        "layers": layers.iter().zip(&m.layers).map(|(l, strata)| {
            let store = opts.strata_store.as_deref();
            layer_descriptor(compression, l, store.map(|s| (&strata.digest, s)))
        }).collect::<Vec<_>>(),
    });
    let (manifest_digest, manifest_size) =
        put_blob(dir, &serde_json::to_vec(&manifest).unwrap_or_default())?;
    let mut manifests: Vec<serde_json::Value> = entries
        .into_iter()
        .filter(|e| e["annotations"][REF_NAME].as_str() != Some(reference))
        .collect();
    let mut annotations = BTreeMap::new();
    annotations.insert(REF_NAME, reference);
    manifests.push(json!({
        "mediaType": OCI_MANIFEST,
        "digest": manifest_digest.to_string(),
        "size": manifest_size,
        "annotations": annotations,
    }));
    let index =
        json!({"schemaVersion": 2, "mediaType": super::spec::OCI_INDEX, "manifests": manifests});
    write_atomic(
        &dir.join("index.json"),
        &serde_json::to_vec(&index).unwrap_or_default(),
    )?;
    Ok(Exported {
        manifest: manifest_digest,
        config,
        layers,
    })
}
