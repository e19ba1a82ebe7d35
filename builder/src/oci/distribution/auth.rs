//! Registry credentials and the `WWW-Authenticate` challenge.
//!
//! A registry that wants credentials answers `401` with a challenge. `Basic realm=…` asks for the user
//! and password on every request; `Bearer realm=…,service=…,scope=…` (the distribution token flow) asks
//! the client to fetch a token from `realm` (with the credentials, if any, as Basic auth; anonymously
//! otherwise) and send it as `Authorization: Bearer`. [`Challenge::parse`] reads either.
//!
//! Credentials come, first found wins, from the command line (`--creds USER:PASSWORD`), the variables
//! `STRATA_REGISTRY_USER` / `STRATA_REGISTRY_PASSWORD`, or an auth file ([`super::dockercfg`]):
//! `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json` (what `skopeo login` writes), then
//! `$DOCKER_CONFIG/config.json` or `~/.docker/config.json` (what `docker login` and `strata login`
//! write) — its `auths` entry, or the credential helper it names. Each [`Found`] says where it came
//! from, so that a refusal names the source to fix.

use std::collections::BTreeMap;

use super::dockercfg;
use crate::oci::OciError;

/// Credentials for a registry.
#[derive(Clone)]
pub enum Credentials {
    /// A user and password.
    Password { user: String, password: String },
    /// `base64(user:password)` as an auth file holds it.
    Encoded(String),
}

/// Credentials and where they were found (`--creds`, a variable, a file), for error messages.
#[derive(Clone, Debug)]
pub struct Found {
    pub credentials: Credentials,
    pub from: String,
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

    /// Credentials from the environment or an auth file for `registry` (`host[:port]`); an error when
    /// the file that has them keeps them in a credential helper that cannot give them.
    pub fn find(registry: &str) -> Result<Option<Found>, OciError> {
        if let (Ok(user), Ok(password)) = (
            std::env::var("STRATA_REGISTRY_USER"),
            std::env::var("STRATA_REGISTRY_PASSWORD"),
        ) {
            return Ok(Some(Found {
                credentials: Credentials::Password { user, password },
                from: "STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD".into(),
            }));
        }
        for file in dockercfg::auth_files() {
            if let Some(found) = dockercfg::lookup(&file, registry)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// The user and password (an encoded entry decoded), for clients that take them apart (the CRI
    /// `AuthConfig`).
    pub fn user_password(&self) -> Option<(String, String)> {
        match self {
            Credentials::Password { user, password } => Some((user.clone(), password.clone())),
            Credentials::Encoded(e) => {
                use base64::Engine as _;
                let raw = base64::engine::general_purpose::STANDARD
                    .decode(e.trim())
                    .ok()?;
                let s = String::from_utf8(raw).ok()?;
                let (u, p) = s.split_once(':')?;
                Some((u.to_string(), p.to_string()))
            }
        }
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
    fn credentials_parse_and_decode() {
        assert!(
            matches!(Credentials::parse("u:p:q"), Some(Credentials::Password { password, .. }) if password == "p:q")
        );
        assert!(Credentials::parse("nocolon").is_none());
        let e = Credentials::Encoded("YWxpY2U6czNjcmV0".into());
        assert_eq!(
            e.user_password(),
            Some(("alice".to_string(), "s3cret".to_string()))
        );
        assert_eq!(Credentials::Encoded("!!".into()).user_password(), None);
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
