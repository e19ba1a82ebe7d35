//! The image-config flags `build`, `compose`, `import`, `pack_diff` and `flatten` share.
//!
//! The flags declare a [`LayerConfig`] (the merge rules are in [`strata_registry::config`]):
//! `--env KEY=VALUE` (repeatable; `$NAME`/`${NAME}` is NAME's value below, `$$` a dollar),
//! `--entrypoint` and `--cmd` (a JSON array of strings, or any other value as one argument; `[]`
//! clears), `--workdir` (absolute), `--user`, `--label KEY=VALUE` (repeatable). `--config-from IMAGE`
//! starts from IMAGE's config instead of the one the command inherits; the other flags apply on top.

use anyhow::{Context, Result};
use strata_registry::model::{ImageConfig, LayerConfig};
use strata_registry::store::Store;

use crate::exit::Usage;
use crate::images::resolve_image;

/// Image config flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ConfigArgs {
    /// Environment variable KEY=VALUE (repeatable). $NAME or ${NAME} in VALUE is NAME's value below
    /// (PATH unset below is the default PATH); $$ is a literal $. E.g. --env 'PATH=/opt/tk/bin:$PATH'.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Entrypoint: a JSON array of strings ('["/usr/bin/tini","--"]'), or one argument; '[]' clears.
    #[arg(long, value_name = "JSON|ARG", allow_hyphen_values = true)]
    pub entrypoint: Option<String>,
    /// Command (arguments after the entrypoint): a JSON array of strings, or one argument; '[]' clears.
    #[arg(long, value_name = "JSON|ARG", allow_hyphen_values = true)]
    pub cmd: Option<String>,
    /// Working directory of the image's processes (absolute).
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<String>,
    /// User of the image's processes: uid, uid:gid, name or name:group (names from the image's
    /// /etc/passwd and /etc/group).
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    /// Image label KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// Start from this image's config instead of the inherited one; the other flags apply on top.
    #[arg(long, value_name = "IMAGE")]
    pub config_from: Option<String>,
}

fn key_value<'a>(what: &str, s: &'a str) -> Result<(&'a str, &'a str)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k, v)),
        _ => Err(Usage(format!("{what} {s:?} is not KEY=VALUE")).into()),
    }
}

/// `--entrypoint`/`--cmd`: a JSON array, or one argument.
fn argv(flag: &str, s: &str) -> Result<Vec<String>> {
    if s.trim_start().starts_with('[') {
        return serde_json::from_str(s).map_err(|e| {
            Usage(format!(
                "--{flag} {s:?}: not a JSON array of strings ({e}); a value not starting with '[' is one argument"
            ))
            .into()
        });
    }
    Ok(vec![s.to_string()])
}

impl ConfigArgs {
    /// The config the flags other than `--config-from` declare.
    pub fn declared(&self) -> Result<LayerConfig> {
        let mut c = LayerConfig::default();
        for e in &self.env {
            let (k, v) = key_value("--env", e)?;
            // Each entry sees the ones before it, as if declared by a layer of its own.
            c = c.then(&LayerConfig {
                env: vec![format!("{k}={v}")],
                ..Default::default()
            });
        }
        c.entrypoint = self
            .entrypoint
            .as_deref()
            .map(|s| argv("entrypoint", s))
            .transpose()?;
        c.cmd = self.cmd.as_deref().map(|s| argv("cmd", s)).transpose()?;
        if let Some(w) = &self.workdir {
            if !w.starts_with('/') {
                return Err(Usage(format!("--workdir {w:?} must be an absolute path")).into());
            }
            c.working_dir = Some(w.clone());
        }
        c.user = self.user.clone();
        for l in &self.labels {
            let (k, v) = key_value("--label", l)?;
            c.labels.insert(k.to_string(), v.to_string());
        }
        Ok(c)
    }

    /// `--config-from`'s image config, if given.
    fn source_config(&self, store: &Store) -> Result<Option<ImageConfig>> {
        self.config_from
            .as_deref()
            .map(|r| {
                resolve_image(store, r)
                    .map(|(_, m)| m.config)
                    .with_context(|| format!("--config-from {r}"))
            })
            .transpose()
    }

    /// The config of an image that would otherwise have `inherited`: `--config-from`'s (if given)
    /// instead, with the other flags applied on top.
    pub fn image_config(&self, store: &Store, inherited: ImageConfig) -> Result<ImageConfig> {
        let start = self.source_config(store)?.unwrap_or(inherited);
        Ok(self.declared()?.apply(&start))
    }

    /// The config a new layer declares on top of what it inherits (`inherited`, itself declared):
    /// `--config-from`'s config literally (if given) instead, then the other flags.
    pub fn layer_config(&self, store: &Store, inherited: LayerConfig) -> Result<LayerConfig> {
        let start = match self.source_config(store)? {
            Some(c) => LayerConfig::from_image(&c),
            None => inherited,
        };
        Ok(start.then(&self.declared()?))
    }
}

/// An image config for people: one line per set field.
pub fn describe(c: &ImageConfig) -> Vec<String> {
    let mut out = Vec::new();
    let list = |v: &[String]| serde_json::to_string(v).unwrap_or_default();
    for e in &c.env {
        out.push(format!("env        {e}"));
    }
    if !c.entrypoint.is_empty() {
        out.push(format!("entrypoint {}", list(&c.entrypoint)));
    }
    if !c.cmd.is_empty() {
        out.push(format!("cmd        {}", list(&c.cmd)));
    }
    if let Some(w) = &c.working_dir {
        out.push(format!("workdir    {w}"));
    }
    if let Some(u) = &c.user {
        out.push(format!("user       {u}"));
    }
    for (k, v) in &c.labels {
        out.push(format!("label      {k}={v}"));
    }
    out
}

/// A declared config for people (env values as declared, `$` references and all).
pub fn describe_declared(c: &LayerConfig) -> Vec<String> {
    let mut shown = c.apply(&ImageConfig::default());
    // Show env as declared, not expanded.
    shown.env = c.env.clone();
    let mut out = describe(&shown);
    if c.entrypoint.as_ref().is_some_and(Vec::is_empty) {
        out.push("entrypoint []  (cleared)".into());
    }
    if c.cmd.as_ref().is_some_and(Vec::is_empty) {
        out.push("cmd        []  (cleared)".into());
    }
    out
}
