//! The store's catalog as a pipeline manages it: `strata images`, `strata rmi`, `strata gc`.
//!
//! These commands never hide a broken object. `strata images` lists every good tag and then reports each
//! tag it cannot follow (a value that is not a digest, a missing manifest, a layer that does not parse),
//! naming it, and exits non-zero; `strata gc` refuses to delete anything while a tag is broken unless told
//! to `--skip-broken` (see `strata_registry::gc`). `strata rmi` deletes tags by compare-and-swap — with
//! `--expect DIGEST` only if the tag still names that image — and leaves the objects to `strata gc`.

use anyhow::Result;
use serde_json::json;
use strata_registry::digest::Digest;
use strata_registry::gc::GcOptions;
use strata_registry::model::TagName;
use strata_registry::store::{Store, StoreError};

use crate::exit::{NotFound, Usage};
use crate::images::human;

/// Tags that could not be followed; the error of a command that still printed what it could.
#[derive(Debug, thiserror::Error)]
#[error("{} broken tag(s): {}", .0.len(), .0.join("; "))]
pub struct BrokenTags(pub Vec<String>);

/// One row of `strata images`.
struct Row {
    tag: TagName,
    digest: Digest,
    layers: usize,
    stored: u64,
    logical: u64,
}

/// `strata images`.
pub fn list(store: &Store, json_out: bool) -> Result<()> {
    let tags = store.tags()?;
    let mut rows = Vec::new();
    let mut broken: Vec<(String, String)> = tags
        .broken
        .iter()
        .map(|b| {
            let name = b.tag.clone().unwrap_or_else(|| b.key.clone());
            (name, format!("{}: {}", b.key, b.why))
        })
        .collect();
    for (tag, digest) in tags.good {
        let sized = store
            .get_manifest(&digest)
            .map_err(anyhow::Error::from)
            .and_then(|m| Ok((m.layers.len(), store.image_size(&m)?)));
        match sized {
            Ok((layers, (stored, logical))) => rows.push(Row {
                tag,
                digest,
                layers,
                stored,
                logical,
            }),
            Err(e) if is_broken(&e) => broken.push((tag.to_string(), format!("{e:#}"))),
            Err(e) => return Err(e),
        }
    }
    broken.sort();
    if json_out {
        let mut v: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({"name": r.tag.name, "tag": r.tag.tag, "digest": r.digest.to_string(),
                       "layers": r.layers, "stored_bytes": r.stored, "file_bytes": r.logical})
            })
            .collect();
        v.extend(
            broken
                .iter()
                .map(|(t, why)| json!({"tag": t, "broken": why})),
        );
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{:<40} {:<20} {:>6} {:>12} {:>12}",
            "NAME:TAG", "DIGEST", "LAYERS", "STORED", "FILES"
        );
        for r in rows {
            println!(
                "{:<40} {:<20} {:>6} {:>12} {:>12}",
                r.tag.to_string(),
                format!("blake3:{}", r.digest.short()),
                r.layers,
                human(r.stored),
                human(r.logical)
            );
        }
    }
    if broken.is_empty() {
        return Ok(());
    }
    Err(BrokenTags(
        broken
            .into_iter()
            .map(|(t, why)| format!("{t}: {why}"))
            .collect(),
    )
    .into())
}

/// True when an error means a missing or damaged object rather than a failing store.
fn is_broken(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<StoreError>()
            .is_some_and(StoreError::is_damaged)
    })
}

/// Arguments of `strata rmi`.
#[derive(clap::Args)]
pub struct RmiArgs {
    /// Tags to delete (NAME:TAG).
    #[arg(required = true)]
    pub tags: Vec<String>,
    /// Delete only if the tag still names this image (compare-and-swap against a digest you saw).
    #[arg(long)]
    pub expect: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// `strata rmi`: deletes each tag by compare-and-swap; the first failure stops (tags before it stay
/// deleted, and are reported).
pub fn rmi(store: &Store, a: RmiArgs) -> Result<()> {
    let expect = a
        .expect
        .as_deref()
        .map(|e| e.parse::<Digest>().map_err(|e| Usage(e.to_string())))
        .transpose()?;
    let tags = a
        .tags
        .iter()
        .map(|t| TagName::parse(t))
        .collect::<Result<Vec<_>, _>>()?;
    for t in &tags {
        let state = store
            .tag_get(t)?
            .ok_or_else(|| NotFound(format!("no image tagged {t} in {}", store.url())))?;
        if let Some(want) = expect {
            if state.digest != want {
                return Err(StoreError::TagConflict {
                    tag: t.to_string(),
                    expected: want.to_string(),
                    found: state.digest.to_string(),
                }
                .into());
            }
        }
        store.tag_delete(t, &state)?;
        if a.json {
            println!(
                "{}",
                json!({"tag": t.to_string(), "deleted": state.digest.to_string()})
            );
        } else {
            println!("untagged {t} ({})", state.digest);
        }
    }
    Ok(())
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
    /// Collect even if tags, manifests or layer descriptors are broken: what only a broken tag reaches
    /// (and could not be read) is deleted as if the tag did not exist. Without it, gc deletes nothing
    /// while any tag is broken.
    #[arg(long)]
    pub skip_broken: bool,
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
    let mut o = GcOptions::new(parse_duration(&a.grace)?);
    o.dry_run = a.dry_run;
    o.skip_broken = a.skip_broken;
    let compacted = a.compact.run(store, a.dry_run)?;
    let r = strata_registry::gc::collect(store, &o)?;
    for b in &r.broken {
        eprintln!("warning: skipped broken tag {}: {}", b.tag, b.error);
    }
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
    let (verb, cverb) = if a.dry_run {
        ("would delete", "would condemn")
    } else {
        ("deleted", "condemned")
    };
    println!(
        "{} tags, {} live objects; {verb} {} objects ({}); {cverb} {} unreferenced objects ({}) for \
         deletion by a gc at least {} later; {} condemned earlier, not yet due; kept {} unreferenced \
         objects younger than {}",
        r.tags,
        r.live,
        r.deleted,
        human(r.deleted_bytes),
        r.condemned,
        human(r.condemned_bytes),
        a.grace,
        r.pending,
        r.young,
        a.grace
    );
    if r.spool.files > 0 {
        println!(
            "{verb} {} spool files ({}) that writers which died left in the store's tmp/",
            r.spool.files,
            human(r.spool.bytes)
        );
    }
    Ok(())
}
