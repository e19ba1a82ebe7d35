//! Image configs and the configs layers declare, and how they merge.
//!
//! An image's [`ImageConfig`] (in its manifest) is what a runtime starts: concrete values, as in an OCI
//! image config. A layer may *declare* a [`LayerConfig`] (in its descriptor): what it adds to the
//! config of whatever it is put on. Declared env values may refer to the value below — `--env
//! PATH=/opt/toolkit/bin:$PATH` — so a toolkit can add to `PATH` without knowing the base's.
//!
//! **Env values.** `$NAME` and `${NAME}` (NAME: a letter or `_`, then letters, digits, `_`) stand for
//! NAME's value below; `$$` is a literal `$`; any other `$` is literal. A NAME not set below is
//! empty, except `PATH`, which is [`DEFAULT_PATH`] (what `strata bundle` and container runtimes use when
//! an image sets none) — so `PATH=/opt/x/bin:$PATH` never leaves an empty (current directory) entry.
//! The entries of one config apply in order, each seeing the ones before it.
//!
//! **Merging** a declared config onto an image config ([`LayerConfig::apply`]): env merged by key (a
//! key keeps its place; new keys are appended); entrypoint, cmd, working directory and user replace
//! when declared — and a config that declares an entrypoint but no cmd clears the cmd below (it was
//! meant for another entrypoint, as in a Dockerfile); labels merged by key. Two declared configs
//! compose into one ([`LayerConfig::then`]) with `a.then(b).apply(c) == b.apply(a.apply(c))`, so a
//! flattened range of layers declares what its layers did. References still unresolved in a declared
//! value are kept as `${NAME}`, literal dollars as `$$`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `PATH` when an image sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The runtime configuration an image carries (used by `strata bundle` and stratad's API).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl ImageConfig {
    /// The command a process of the image runs: entrypoint then cmd, `/bin/sh` when both are empty.
    pub fn args(&self) -> Vec<String> {
        let args: Vec<String> = self.entrypoint.iter().chain(&self.cmd).cloned().collect();
        match args.is_empty() {
            true => vec!["/bin/sh".into()],
            false => args,
        }
    }

    /// The environment of a process of the image: its env, with [`DEFAULT_PATH`] if it sets no `PATH`.
    pub fn process_env(&self) -> Vec<String> {
        let mut env = self.env.clone();
        if !env.iter().any(|e| e.starts_with("PATH=")) {
            env.push(format!("PATH={DEFAULT_PATH}"));
        }
        env
    }

    /// The working directory of a process of the image (`/` when unset).
    pub fn cwd(&self) -> String {
        self.working_dir.clone().unwrap_or_else(|| "/".into())
    }
}

/// The config a layer declares: what it changes in the config of what it is put on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerConfig {
    /// `KEY=VALUE`, values possibly referring to the value below (`$NAME`, `${NAME}`; `$$` = `$`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Declared entrypoint (an empty list clears it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    /// Declared cmd (an empty list clears it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// Splits `KEY=VALUE` (a malformed entry is a key with an empty value).
fn split(entry: &str) -> (&str, &str) {
    entry.split_once('=').unwrap_or((entry, ""))
}

/// Sets `key` in an ordered env list: in place if present, else appended.
fn set(env: &mut Vec<String>, key: &str, value: &str) {
    let entry = format!("{key}={value}");
    match env.iter_mut().find(|e| split(e).0 == key) {
        Some(e) => *e = entry,
        None => env.push(entry),
    }
}

fn lookup<'a>(env: &'a [String], key: &str) -> Option<&'a str> {
    env.iter()
        .map(|e| split(e))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// One piece of a declared value.
enum Piece<'a> {
    Text(&'a str),
    Dollar,
    Var(&'a str),
}

/// Splits a declared value into literal text, literal dollars and references.
fn pieces(v: &str) -> Vec<Piece<'_>> {
    let name_len = |s: &str| {
        let b = s.as_bytes();
        if b.first()
            .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
        {
            b.iter()
                .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
                .count()
        } else {
            0
        }
    };
    let mut out = Vec::new();
    let mut rest = v;
    while let Some(i) = rest.find('$') {
        if i > 0 {
            out.push(Piece::Text(&rest[..i]));
        }
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push(Piece::Dollar);
            rest = r;
        } else if let Some(braced) = after.strip_prefix('{') {
            let n = name_len(braced);
            if n > 0 && braced[n..].starts_with('}') {
                out.push(Piece::Var(&braced[..n]));
                rest = &braced[n + 1..];
            } else {
                out.push(Piece::Dollar);
                rest = after;
            }
        } else {
            let n = name_len(after);
            match n {
                0 => out.push(Piece::Dollar),
                _ => out.push(Piece::Var(&after[..n])),
            }
            rest = &after[n..];
        }
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    out
}

/// Expands a declared value against concrete values below (`below`): the concrete result.
pub fn expand(value: &str, below: &[String]) -> String {
    let mut out = String::new();
    for p in pieces(value) {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Dollar => out.push('$'),
            Piece::Var(n) => match lookup(below, n) {
                Some(v) => out.push_str(v),
                None if n == "PATH" => out.push_str(DEFAULT_PATH),
                None => {}
            },
        }
    }
    out
}

/// Rewrites a declared value against declared values below: references they set are replaced by their
/// (declared) values, others kept as `${NAME}`; literal dollars become `$$`.
fn substitute(value: &str, below: &[String]) -> String {
    let mut out = String::new();
    for p in pieces(value) {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Dollar => out.push_str("$$"),
            Piece::Var(n) => match lookup(below, n) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("${");
                    out.push_str(n);
                    out.push('}');
                }
            },
        }
    }
    out
}

/// Whether no value of `env` names a key set before it in `env` (its own key it may name: an entry's
/// value is expanded before the entry is set).
fn refs_stay_below(env: &[String]) -> bool {
    env.iter().enumerate().all(|(p, e)| {
        pieces(split(e).1).iter().all(|piece| match piece {
            Piece::Var(n) => !env[..p].iter().any(|before| split(before).0 == *n),
            _ => true,
        })
    })
}

/// A literal value written as a declared one (every `$` doubled).
pub fn escape(value: &str) -> String {
    value.replace('$', "$$")
}

impl LayerConfig {
    /// Whether it declares nothing.
    pub fn is_empty(&self) -> bool {
        *self == LayerConfig::default()
    }

    /// Declares everything `c` sets, literally (no references).
    pub fn from_image(c: &ImageConfig) -> LayerConfig {
        LayerConfig {
            env: c
                .env
                .iter()
                .map(|e| {
                    let (k, v) = split(e);
                    format!("{k}={}", escape(v))
                })
                .collect(),
            entrypoint: Some(c.entrypoint.clone()),
            cmd: Some(c.cmd.clone()),
            working_dir: c.working_dir.clone(),
            user: c.user.clone(),
            labels: c.labels.clone(),
        }
    }

    /// This config merged onto `below` (see the module documentation).
    pub fn apply(&self, below: &ImageConfig) -> ImageConfig {
        let mut c = below.clone();
        for e in &self.env {
            let (k, v) = split(e);
            let v = expand(v, &c.env);
            set(&mut c.env, k, &v);
        }
        if let Some(ep) = &self.entrypoint {
            c.entrypoint = ep.clone();
            if self.cmd.is_none() {
                c.cmd.clear();
            }
        }
        if let Some(cmd) = &self.cmd {
            c.cmd = cmd.clone();
        }
        if let Some(w) = &self.working_dir {
            c.working_dir = Some(w.clone());
        }
        if let Some(u) = &self.user {
            c.user = Some(u.clone());
        }
        c.labels
            .extend(self.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        c
    }

    /// One declared config equal to declaring `self`, then `upper` on top of it.
    pub fn then(&self, upper: &LayerConfig) -> LayerConfig {
        let mut env: Vec<String> = Vec::new();
        for e in self.env.iter().chain(&upper.env) {
            let (k, v) = split(e);
            let v = substitute(v, &env);
            set(&mut env, k, &v);
        }
        // Entries apply in order, each seeing the ones before it. A substituted value that still names
        // a key set before it in the merged list would see that key's new value, not the one below
        // (`B=$B:x` then `PATH=$B` merge into `B=$B:x`, `PATH=$B:x`). Then the two lists, one after the
        // other, say what the two configs did.
        if !refs_stay_below(&env) {
            env = self.env.iter().chain(&upper.env).cloned().collect();
        }
        let cmd = match (&upper.cmd, &upper.entrypoint) {
            (Some(c), _) => Some(c.clone()),
            (None, Some(_)) => Some(Vec::new()),
            (None, None) => self.cmd.clone(),
        };
        let mut labels = self.labels.clone();
        labels.extend(upper.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        LayerConfig {
            env,
            entrypoint: upper.entrypoint.clone().or_else(|| self.entrypoint.clone()),
            cmd,
            working_dir: upper
                .working_dir
                .clone()
                .or_else(|| self.working_dir.clone()),
            user: upper.user.clone().or_else(|| self.user.clone()),
            labels,
        }
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
