//! `strata copy IMAGE --to STORE_URL`: an image from one store into another (`file://` ↔ `s3://`),
//! sending only the objects the destination lacks.
//!
//! **What an image is, in write order.** For each layer, bottom first: its blobs, the metadata its
//! metadata is a patch against (if it is one), its metadata, its layer descriptor, and the OCI import
//! record that names it (when the layer came from `strata import` and the source still has the record:
//! a later import into the destination then reuses it); then the manifest; then its prefetch plan and the
//! plan's pointer; the tag last. That is the order every writer of a store follows (an object before
//! what names it), so a copy that stops half-way leaves only unreferenced objects, which the next copy
//! completes and `strata gc` would reclaim.
//!
//! **Only what is missing.** Content-addressed objects already in the destination are skipped (they
//! are the same bytes by their name). Everything sent is verified first: blobs while they stream
//! through a spool file (BLAKE3 of the object, read in ranges, never whole in memory), metadata by
//! decoding it, JSON objects against their digest. Index objects (the import record, the plan pointer)
//! are hints and are rewritten.
//!
//! **The chunk index.** Each blob's index segment (`index/<blob>`, see `strata_registry::index`) goes
//! with it, right after the blob and before the metadata (the store's write order), so that the next
//! build into the destination deduplicates against the copied chunks. A source without a segment for
//! a blob (written before the index) gets one derived from the blob in the destination.
//!
//! **The tag** moves by compare-and-swap on the destination. An existing tag naming another image is
//! refused unless `--force`; one already naming this image is left alone.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use strata_registry::digest::{Digest, Hasher};
use strata_registry::index::{segment_key, Segment};
use strata_registry::model::{LayerDescriptor, TagName};
use strata_registry::store::{key, Store, StoreError};

use crate::images::{human, resolve, Resolved};

/// Bytes read from the source per range request while spooling a blob.
const RANGE: u64 = 8 << 20;

/// Arguments of `strata copy`.
#[derive(clap::Args)]
pub struct CopyArgs {
    /// Image tag or manifest digest in the source store (--store).
    pub image: String,
    /// Destination store URL: file:///path or s3://bucket/prefix.
    #[arg(long)]
    pub to: String,
    /// Tag in the destination (default: IMAGE, when it is a tag).
    #[arg(short = 't', long = "tag")]
    pub tag: Option<String>,
    /// Move the destination tag even if it names another image.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

/// What was sent and skipped.
#[derive(Default)]
struct Tally {
    sent: u64,
    sent_bytes: u64,
    skipped: u64,
    skipped_bytes: u64,
    /// Index segments written.
    segments: u64,
}

struct Copier<'a> {
    src: &'a Store,
    dst: &'a Store,
    tally: Tally,
    /// Bytes sent so far, for the progress display.
    progress: Arc<AtomicU64>,
}

impl Copier<'_> {
    /// The size of `key` in the source.
    fn size(&self, key: &str) -> Result<u64, StoreError> {
        match self.src.backend().head(key)? {
            Some(m) => Ok(m.size),
            None => Err(StoreError::NotFound(key.to_string())),
        }
    }

    /// True (and counted as skipped) when the destination has `key` already.
    fn skip(&mut self, key: &str, size: u64) -> Result<bool, StoreError> {
        if self.dst.exists(key)? {
            self.tally.skipped += 1;
            self.tally.skipped_bytes += size;
            return Ok(true);
        }
        Ok(false)
    }

    fn sent(&mut self, n: u64) {
        self.tally.sent += 1;
        self.tally.sent_bytes += n;
        self.progress.fetch_add(n, Ordering::Relaxed);
    }

    /// A blob, spooled through a local file in ranges and verified before it is stored.
    fn blob(&mut self, d: &Digest) -> Result<()> {
        let k = key::blob(d);
        let size = self.size(&k)?;
        if self.skip(&k, size)? {
            return Ok(());
        }
        let spool = self
            .dst
            .spool_dir()?
            .join(format!("copy-{}-{}", d.hex(), std::process::id()));
        let result = self.spool(&k, d, size, &spool);
        if result.is_err() {
            let _ = std::fs::remove_file(&spool);
        }
        result?;
        self.dst.put_blob_file(d, &spool)?;
        self.sent(size);
        Ok(())
    }

    /// The index segment of a blob the destination has (so that builds into the destination
    /// deduplicate against its chunks): the source's, checked, or — a source written before the index
    /// — derived from the blob in the destination.
    fn segment(&mut self, d: &Digest) -> Result<()> {
        let k = segment_key(d);
        let Some(size) = self.src.backend().head(&k)?.map(|m| m.size) else {
            if self.dst.backfill_segment(d)? {
                self.tally.segments += 1;
            }
            return Ok(());
        };
        if self.skip(&k, size)? {
            return Ok(());
        }
        let Some(b) = self.src.get_index(&k)? else {
            return Ok(());
        };
        Segment::decode(&k, &b)?;
        self.dst.put_index(&k, b.to_vec())?;
        self.sent(size);
        self.tally.segments += 1;
        Ok(())
    }

    fn spool(&self, k: &str, d: &Digest, size: u64, spool: &PathBuf) -> Result<()> {
        let mut f = std::fs::File::create(spool)
            .with_context(|| format!("creating {}", spool.display()))?;
        let mut h = Hasher::new();
        let mut at = 0;
        while at < size {
            let end = (at + RANGE).min(size);
            let b = self.src.get_range(k, at..end)?;
            h.update(&b);
            f.write_all(&b)
                .with_context(|| format!("writing {}", spool.display()))?;
            at = end;
        }
        f.sync_all()
            .with_context(|| format!("writing {}", spool.display()))?;
        let actual = h.finish();
        if actual != *d {
            return Err(StoreError::Corrupt {
                key: format!("{} in {}", k, self.src.url()),
                expected: *d,
                actual,
            }
            .into());
        }
        Ok(())
    }

    /// A metadata object, as it is stored (whole or a patch), after decoding it checks out.
    fn meta(&mut self, d: &Digest) -> Result<()> {
        let k = key::meta(d);
        // The base of a patch first (and whether or not the patch is there: a destination that has a
        // patch without its base gets the base).
        if let Some(base) = self.src.meta_base(d)? {
            self.meta(&base)?;
        }
        let size = self.size(&k)?;
        if self.skip(&k, size)? {
            return Ok(());
        }
        self.src.get_meta(d)?;
        let raw = self.src.backend().get(&k)?.0;
        let n = raw.len() as u64;
        self.dst.put_bytes(&k, raw.to_vec())?;
        self.sent(n);
        Ok(())
    }

    /// A JSON object named by the digest of its bytes (layer, manifest, plan).
    fn json(&mut self, k: &str, d: &Digest) -> Result<()> {
        let size = self.size(k)?;
        if self.skip(k, size)? {
            return Ok(());
        }
        let b = self.src.get_verified(k, d)?;
        self.dst.put_bytes(k, b.to_vec())?;
        self.sent(size);
        Ok(())
    }

    /// An index object (a hint): copied when the source has it.
    fn index(&mut self, k: &str) -> Result<()> {
        let Some(b) = self.src.get_index(k)? else {
            return Ok(());
        };
        if self.dst.get_index(k)?.as_deref() == Some(&b[..]) {
            self.tally.skipped += 1;
            self.tally.skipped_bytes += b.len() as u64;
            return Ok(());
        }
        self.dst.put_index(k, b.to_vec())?;
        self.sent(b.len() as u64);
        Ok(())
    }

    /// Counts as skipped the objects of a layer the destination holds (in its own placement).
    fn held(&mut self, d: &Digest, held: &LayerDescriptor) -> Result<()> {
        let mut keys = vec![key::layer(d), key::meta(&held.meta.digest)];
        keys.extend(
            self.dst
                .meta_base(&held.meta.digest)?
                .map(|b| key::meta(&b)),
        );
        keys.extend(held.blobs.iter().map(|b| key::blob(&b.digest)));
        for k in keys {
            let size = self.dst.backend().head(&k)?.map_or(0, |m| m.size);
            self.tally.skipped += 1;
            self.tally.skipped_bytes += size;
        }
        Ok(())
    }

    /// One layer: blobs, metadata, descriptor, import record. A destination that holds the layer
    /// already, in a placement it can rely on, keeps it (a reproducible layer's placement may differ
    /// between stores: see [`Store::put_layer`]).
    fn layer(&mut self, d: &Digest) -> Result<()> {
        let desc = self.src.get_layer(d)?;
        if let Some(held) = self.dst.stored_layer(d)? {
            self.held(d, &held)?;
            // Its blobs' index segments too: sent if the destination lacks them, else skipped.
            for b in &held.blobs {
                self.segment(&b.digest)?;
            }
        } else {
            for b in &desc.blobs {
                self.blob(&b.digest)?;
                self.segment(&b.digest)?;
            }
            self.meta(&desc.meta.digest)?;
            let k = key::layer(d);
            if desc.content.is_none() {
                // An older layer is named by its bytes: copied as they are.
                self.json(&k, d)?;
            } else {
                let size = self.size(&k)?;
                self.dst.put_layer(&desc)?;
                self.sent(size);
            }
        }
        let chain = desc
            .labels
            .get(strata_builder::import::CHAIN_ID_LABEL)
            .and_then(|c| c.strip_prefix("sha256:"));
        if let Some(hex) = chain {
            let record = key::oci_import(hex);
            let names_it = self
                .src
                .get_index(&record)?
                .is_some_and(|b| String::from_utf8_lossy(&b).trim() == d.to_string());
            if names_it {
                self.index(&record)?;
            }
        }
        Ok(())
    }
}

/// `strata copy`.
/// `timeout`: the deadline of the destination store's operations (`--store-timeout`).
pub fn copy(src: &Store, a: CopyArgs, timeout: std::time::Duration) -> Result<()> {
    let start = Instant::now();
    let (manifest_digest, manifest) = match resolve(src, &a.image)? {
        Resolved::Image(d, m) => (d, m),
        Resolved::Layer(d, _) => {
            return Err(crate::exit::Usage(format!(
                "{d} is a layer; copy an image (a tag or a manifest digest)"
            ))
            .into())
        }
    };
    let tag = match (&a.tag, TagName::parse(&a.image)) {
        (Some(t), _) => Some(TagName::parse(t)?),
        (None, Ok(t)) if !a.image.starts_with("blake3:") => Some(t),
        _ => None,
    };
    let mut dst = Store::open_with(&a.to, &crate::cli::store_options(timeout)).context("--to")?;
    dst.range_deadline = timeout;
    let mut c = Copier {
        src,
        dst: &dst,
        tally: Tally::default(),
        progress: Arc::new(AtomicU64::new(0)),
    };
    // The tag is checked first, so a refused copy sends nothing.
    let prev = match &tag {
        Some(t) => crate::images::check_tag(&dst, t, &manifest_digest, a.force)
            .with_context(|| format!("destination store {}", dst.url()))?,
        None => None,
    };
    crate::progress::watch(
        "copy",
        crate::progress::Counters {
            bytes: c.progress.clone(),
            ..Default::default()
        },
        || -> Result<()> {
            for l in &manifest.layers {
                c.layer(&l.digest)?;
            }
            c.json(&key::manifest(&manifest_digest), &manifest_digest)?;
            let pointer = key::plan_of(&manifest_digest);
            if let Some(p) = src.get_index(&pointer)? {
                if let Some(plan) = std::str::from_utf8(&p)
                    .ok()
                    .and_then(|s| s.trim().parse::<Digest>().ok())
                {
                    c.json(&key::plan(&plan), &plan)?;
                    c.index(&pointer)?;
                }
            }
            Ok(())
        },
    )?;
    let tagged = match &tag {
        Some(t) if prev.as_ref().map(|p| p.digest) != Some(manifest_digest) => {
            dst.tag_set(t, prev.as_ref(), &manifest_digest)?;
            true
        }
        _ => false,
    };
    let t = &c.tally;
    if a.json {
        println!(
            "{}",
            json!({
                "digest": manifest_digest.to_string(),
                "to": dst.url(),
                "tag": tag.as_ref().map(|t| t.to_string()),
                "tag_moved": tagged,
                "sent_objects": t.sent,
                "sent_bytes": t.sent_bytes,
                "skipped_objects": t.skipped,
                "skipped_bytes": t.skipped_bytes,
                "index_segments": t.segments,
                "seconds": start.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!("{manifest_digest}");
        eprintln!(
            "{}: sent {} objects ({}), skipped {} already there ({}), in {:.1}s{}",
            dst.url(),
            t.sent,
            human(t.sent_bytes),
            t.skipped,
            human(t.skipped_bytes),
            start.elapsed().as_secs_f64(),
            match (&tag, tagged) {
                (Some(tag), true) => format!("; tagged {tag}"),
                (Some(tag), false) => format!("; {tag} already names it"),
                (None, _) => "; not tagged (give -t NAME:TAG)".into(),
            }
        );
    }
    Ok(())
}
