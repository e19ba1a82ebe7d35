//! Registry credentials and the `WWW-Authenticate` challenge.
//!
//! A registry that wants credentials answers `401` with a challenge. `Basic realm=…` asks for the user
//! and password on every request; `Bearer realm=…,service=…,scope=…` (the distribution token flow) asks
//! the client to fetch a token from `realm` (with the credentials, if any, as Basic auth; anonymously
//! otherwise) and send it as `Authorization: Bearer`. [`Challenge::parse`] reads either.
//!
//! Credentials come, first found wins, from the command line (`--creds USER:PASSWORD`), the variables
//! `STRATA_REGISTRY_USER` / `STRATA_REGISTRY_PASSWORD`, or an auth file's `auths` entry for the
//! registry: `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json` (what `skopeo login` writes),
//! then `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`. Only the simple form of an entry is
//! read (`"auth": base64(user:password)`); credential helpers are not run.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Credentials for a registry.
#[derive(Clone)]
pub enum Credentials {
    /// A user and password.
    Password { user: String, password: String },
    /// `base64(user:password)` as an auth file holds it.
    Encoded(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints a secret.
        match self {
            Credentials::Password { user, .. } => write!(f, "Credentials({user}:***)"),
            Credentials::Encoded(_) => write!(f, "Credentials(auth file entry)"),
        }
    }
}

impl Credentials {
    /// Parses `USER:PASSWORD` (a password may hold `:`); `None` without a `:`.
    pub fn parse(s: &str) -> Option<Credentials> {
        let (user, password) = s.split_once(':')?;
        Some(Credentials::Password {
            user: user.to_string(),
            password: password.to_string(),
        })
    }

    /// Credentials from the environment or an auth file for `registry` (`host[:port]`).
    pub fn find(registry: &str) -> Option<Credentials> {
        if let (Ok(user), Ok(password)) = (
            std::env::var("STRATA_REGISTRY_USER"),
            std::env::var("STRATA_REGISTRY_PASSWORD"),
        ) {
            return Some(Credentials::Password { user, password });
        }
        auth_files()
            .into_iter()
            .find_map(|f| from_auth_file(&std::fs::read(f).ok()?, registry))
    }

    /// Adds these credentials to a request as Basic auth.
    pub(super) fn apply(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self {
            Credentials::Password { user, password } => req.basic_auth(user, Some(password)),
            Credentials::Encoded(e) => {
                req.header(reqwest::header::AUTHORIZATION, format!("Basic {e}"))
            }
        }
    }
}

fn auth_files() -> Vec<PathBuf> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let mut out = Vec::new();
    out.extend(var("REGISTRY_AUTH_FILE"));
    out.extend(var("XDG_RUNTIME_DIR").map(|d| d.join("containers/auth.json")));
    match var("DOCKER_CONFIG") {
        Some(d) => out.push(d.join("config.json")),
        None => out.extend(var("HOME").map(|h| h.join(".docker/config.json"))),
    }
    out
}

/// The `auths` entry for `registry` of an auth file (`{"auths": {"host:port": {"auth": "…"}}}`); keys
/// may carry a scheme and a path (`https://host/v1/`).
fn from_auth_file(bytes: &[u8], registry: &str) -> Option<Credentials> {
    #[derive(serde::Deserialize)]
    struct Entry {
        #[serde(default)]
        auth: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        auths: BTreeMap<String, Entry>,
    }
    let file: File = serde_json::from_slice(bytes).ok()?;
    file.auths.into_iter().find_map(|(k, e)| {
        let host = k
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap_or_default();
        (host == registry)
            .then_some(e.auth)
            .flatten()
            .filter(|a| !a.is_empty())
            .map(Credentials::Encoded)
    })
}

/// A `WWW-Authenticate` challenge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    /// The token flow: fetch a token from `realm` with these query parameters.
    Bearer {
        realm: String,
        params: BTreeMap<String, String>,
    },
}

impl Challenge {
    /// Parses `Basic realm="…"` or `Bearer realm="…",service="…",scope="…"`; `None` for anything else.
    pub fn parse(header: &str) -> Option<Challenge> {
        let header = header.trim();
        let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return Some(Challenge::Basic);
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let mut params = parse_params(rest)?;
        let realm = params.remove("realm")?;
        Some(Challenge::Bearer { realm, params })
    }
}

/// `k=v, k="quoted, with commas"` into a map (keys lowercased).
fn parse_params(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (k, after) = rest.split_once('=')?;
        let after = after.trim_start();
        let (v, tail) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim(), &after[end..])
        };
        out.insert(k.trim().to_ascii_lowercase(), v.to_string());
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        )
        .unwrap();
        let Challenge::Bearer { realm, params } = c else {
            panic!("not bearer")
        };
        assert_eq!(realm, "https://auth.example/token");
        assert_eq!(params["service"], "registry.example");
        assert_eq!(params["scope"], "repository:a/b:pull,push");
        assert_eq!(
            Challenge::parse(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(Challenge::parse("Negotiate"), None);
        assert_eq!(Challenge::parse(r#"Bearer service="x""#), None);
        assert_eq!(Challenge::parse(r#"Bearer realm="unterminated"#), None);
    }

    #[test]
    fn auth_file_entries_match_the_registry() {
        let f = br#"{"auths":{"https://reg.example:5000/v1/":{"auth":"dTpw"},"other":{"auth":"eDp5"}}}"#;
        assert!(
            matches!(from_auth_file(f, "reg.example:5000"), Some(Credentials::Encoded(a)) if a == "dTpw")
        );
        assert!(from_auth_file(f, "reg.example").is_none());
        assert!(from_auth_file(b"not json", "other").is_none());
        assert!(
            matches!(Credentials::parse("u:p:q"), Some(Credentials::Password { password, .. }) if password == "p:q")
        );
        assert!(Credentials::parse("nocolon").is_none());
    }

    proptest::proptest! {
        /// A challenge is untrusted network input: any header parses or is refused, never panics.
        #[test]
        fn any_header_is_handled(h in ".{0,200}") {
            let _ = Challenge::parse(&h);
        }

        /// Quoted parameters come back as they were sent, commas and all.
        #[test]
        fn bearer_parameters_round_trip(
            realm in "https?://[a-z0-9.:/]{1,40}",
            service in "[a-zA-Z0-9 .:,_-]{0,40}",
            scope in "[a-z0-9/:,_-]{0,60}",
        ) {
            let h = format!(r#"Bearer realm="{realm}", service="{service}",scope="{scope}""#);
            let Some(Challenge::Bearer { realm: r, params }) = Challenge::parse(&h) else {
                panic!("{h} did not parse");
            };
            proptest::prop_assert_eq!(r, realm);
            proptest::prop_assert_eq!(&params["service"], &service);
            proptest::prop_assert_eq!(&params["scope"], &scope);
        }
    }
}
