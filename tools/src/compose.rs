//! `strata compose`: an image from layers, in the order given, with a merged config, never on a base
//! its layers were not built on.
//!
//! **Order.** `--base` is the bottom; the `--workspace` and `--toolkit` layers stack above it in the
//! order they appear on the command line, the first given lowest (`--workspace` and `--toolkit` only
//! say what the layer is for). clap's derive keeps each flag's values apart, so [`Compose`] reads their
//! positions from the matches to restore the order they were given in.
//!
//! **Config.** The base contributes its config (an image's manifest config, a layer's declared one);
//! each argument above applies what its layers declare, bottom to top ([`LayerConfig::apply`]) — an
//! image given above the base contributes its layers' declared configs, not its own config (which
//! already holds the base it was made on). `--config-from` and the config flags apply last.
//!
//! **Bases.** A layer that records what it was built on ([`BuiltOn`]: `build --on`, a `pack_diff` diff,
//! a flattened upper range) must sit on exactly those layers: the image's layers from the bottom up to it
//! must start with them. Otherwise compose refuses, naming both, unless `--rebase`: the layer's files
//! would hide the new base's (a toolkit's `/var/lib/dpkg/status` hides the base's packages: `dpkg -l`
//! lies in the sandbox).

use anyhow::Result;
use clap::{ArgMatches, FromArgMatches};
use serde_json::json;
use strata_registry::digest::Digest;
use strata_registry::model::{BuiltOn, ImageConfig, LayerDescriptor, LayerKind, TagName};
use strata_registry::store::Store;

use crate::exit::Usage;
use crate::images::{make_image, resolve, ComposeArgs, Resolved};

/// `strata compose`'s arguments with the layers above the base in command-line order.
pub struct Compose {
    pub args: ComposeArgs,
    /// `--workspace` and `--toolkit` values, bottom to top as given.
    pub above: Vec<(LayerKind, String)>,
}

impl FromArgMatches for Compose {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let args = ComposeArgs::from_arg_matches(m)?;
        let mut above = Vec::new();
        for (id, kind) in [
            ("workspace", LayerKind::Workspace),
            ("toolkit", LayerKind::Toolkit),
        ] {
            if let (Some(ix), Some(vals)) = (m.indices_of(id), m.get_many::<String>(id)) {
                above.extend(ix.zip(vals).map(|(i, v)| (i, kind, v.clone())));
            }
        }
        above.sort_by_key(|(i, _, _)| *i);
        let above = above.into_iter().map(|(_, k, v)| (k, v)).collect();
        Ok(Compose { args, above })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Compose::from_arg_matches(m)?;
        Ok(())
    }
}

impl clap::Args for Compose {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        ComposeArgs::augment_args(cmd)
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        ComposeArgs::augment_args_for_update(cmd)
    }
}

/// What `--on REF` names: an image (its manifest and layers) or one layer.
pub fn built_on(store: &Store, r: &str) -> Result<BuiltOn> {
    Ok(match resolve(store, r)? {
        Resolved::Image(d, m) => BuiltOn {
            image: Some(d),
            layers: m.layers.iter().map(|l| l.digest).collect(),
        },
        Resolved::Layer(d, _) => BuiltOn {
            image: None,
            layers: vec![d],
        },
    })
}

/// Short form of a list of layers for messages.
fn layer_list(layers: &[Digest]) -> String {
    match layers {
        [] => "nothing".into(),
        _ => layers
            .iter()
            .map(|d| format!("blake3:{}", d.short()))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn built_on_text(on: &BuiltOn) -> String {
    match &on.image {
        Some(m) => format!("image {m} (layers {})", layer_list(&on.layers)),
        None => format!("layers {}", layer_list(&on.layers)),
    }
}

/// Checks every layer that records its base sits on it; with `rebase`, warns instead.
pub fn check_bases(layers: &[(Digest, LayerDescriptor)], base: &str, rebase: bool) -> Result<()> {
    let digests: Vec<Digest> = layers.iter().map(|(d, _)| *d).collect();
    for (i, (d, l)) in layers.iter().enumerate() {
        let Some(on) = &l.built_on else { continue };
        if digests[..i].starts_with(&on.layers) {
            continue;
        }
        let msg = format!(
            "{} layer {d} was built on {} but would be put on {base} (the layers below it: {}); its \
             files would hide the base's (a toolkit's /var/lib/dpkg/status hides the base's packages)",
            l.kind,
            built_on_text(on),
            layer_list(&digests[..i])
        );
        if !rebase {
            return Err(Usage(format!(
                "{msg}. Build it again on this base (strata build --on), or pass --rebase to compose it anyway"
            ))
            .into());
        }
        eprintln!("strata: warning: --rebase: {msg}");
    }
    Ok(())
}

/// `strata compose`.
pub fn compose(store: &Store, c: Compose) -> Result<()> {
    let a = &c.args;
    let tag = TagName::parse(&a.tag)?;
    let mut layers: Vec<(Digest, LayerDescriptor)> = Vec::new();
    let mut config = ImageConfig::default();
    let parts = std::iter::once((LayerKind::Base, a.base.clone())).chain(c.above.iter().cloned());
    for (i, (_, r)) in parts.enumerate() {
        match resolve(store, &r)? {
            Resolved::Layer(d, l) => {
                config = l.declared().apply(&config);
                layers.push((d, l));
            }
            Resolved::Image(_, m) => {
                if i == 0 {
                    config = m.config.clone();
                }
                for ml in &m.layers {
                    let l = store.get_layer(&ml.digest)?;
                    if i > 0 {
                        config = l.declared().apply(&config);
                    }
                    layers.push((ml.digest, l));
                }
            }
        }
    }
    check_bases(&layers, &a.base, a.rebase)?;
    let config = a.config.image_config(store, config)?;
    let digest = make_image(store, layers, config, &tag, a.force)?;
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
