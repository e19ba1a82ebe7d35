//! Pulling from a registry through the OCI distribution API (`/v2/`): `docker://HOST[:PORT]/REPO:TAG`
//! or `…/REPO@sha256:…`.
//!
//! [`open`] resolves the reference to an [`OciImage`] as [`super::open`] does for a layout: the manifest
//! is fetched with an `Accept` for the OCI and Docker v2 schema 2 manifest and index types, checked
//! against the digest asked for (a reference by digest) or the one the registry names
//! (`Docker-Content-Digest`), an index is resolved by [`Platform`] (each nested manifest fetched by
//! digest and checked against its descriptor), and the config is fetched and checked. JSON documents are
//! read whole, up to [`JSON_LIMIT`]. Layers are not fetched here: each [`OciLayer`] is a remote blob
//! that [`OciLayer::open`] streams from the registry when the importer reads it, verified in the same
//! pass like a layout's ([`crate::import`]), so a layer is never held in memory or on disk whole.
//!
//! The HTTP side — schemes, timeouts, authentication — is [`client`]; credentials and challenges are
//! [`auth`].

pub mod auth;
pub mod client;
pub mod dockercfg;
pub mod push;

use std::fmt;
use std::sync::Arc;

use super::spec::{self, Descriptor, ImageManifest, Index};
use super::{
    image_of, manifest_media_type, parse_digest, parse_json, BlobLoc, OciError, OciImage, Platform,
    Sha256Digest, JSON_LIMIT,
};
use client::Client;

/// Nested indexes followed at most.
const MAX_DEPTH: usize = 8;

/// What `Accept` lists for a manifest.
const MANIFEST_TYPES: &str = "application/vnd.oci.image.index.v1+json, \
    application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.list.v2+json, \
    application/vnd.docker.distribution.manifest.v2+json";

/// A tag or a manifest digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    Tag(String),
    Digest(Sha256Digest),
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Tag(t) => write!(f, "{t}"),
            Reference::Digest(d) => write!(f, "{d}"),
        }
    }
}

/// `HOST[:PORT]/REPO[:TAG|@sha256:…]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryRef {
    /// `host[:port]`.
    pub registry: String,
    /// `a/b/c`.
    pub repository: String,
    pub reference: Reference,
}

impl fmt::Display for RegistryRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sep = match self.reference {
            Reference::Tag(_) => ':',
            Reference::Digest(_) => '@',
        };
        write!(
            f,
            "{}/{}{sep}{}",
            self.registry, self.repository, self.reference
        )
    }
}

impl RegistryRef {
    /// Parses what follows `docker://`. The registry host is required (no default registry:
    /// `docker.io/debian` for Docker Hub, where a one-component name means `library/NAME`); the tag
    /// defaults to `latest`.
    pub fn parse(s: &str) -> Result<RegistryRef, OciError> {
        let usage = |why: &str| {
            OciError::Usage(format!(
                "docker://{s}: {why} (expected docker://HOST[:PORT]/REPO[:TAG|@sha256:DIGEST])"
            ))
        };
        let (registry, rest) = s.split_once('/').ok_or_else(|| usage("no repository"))?;
        if registry.is_empty()
            || !registry
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        {
            return Err(usage("bad registry host"));
        }
        let (name, reference) = if let Some((n, d)) = rest.split_once('@') {
            let d = parse_digest("reference", d).map_err(|_| usage("bad digest"))?;
            (n, Reference::Digest(d))
        } else {
            // A tag follows the last ':' after the last '/'.
            let last = rest.rfind('/').map_or(0, |i| i + 1);
            match rest[last..].rfind(':') {
                Some(i) => (
                    &rest[..last + i],
                    Reference::Tag(rest[last + i + 1..].to_string()),
                ),
                None => (rest, Reference::Tag("latest".into())),
            }
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        };
        if !name.split('/').all(component_ok) {
            return Err(usage("bad repository name"));
        }
        if let Reference::Tag(t) = &reference {
            let ok = !t.is_empty()
                && t.len() <= 128
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok {
                return Err(usage("bad tag"));
            }
        }
        // Docker Hub's official images live under `library/`, as `docker pull debian` means.
        let repository = if is_docker_hub(registry) && !name.contains('/') {
            format!("library/{name}")
        } else {
            name.to_string()
        };
        Ok(RegistryRef {
            registry: registry.to_string(),
            repository,
            reference,
        })
    }

    /// The `host[:port]` the API is at: Docker Hub's names (`docker.io`, `index.docker.io`) serve it at
    /// `registry-1.docker.io`.
    pub fn api_host(&self) -> &str {
        if is_docker_hub(&self.registry) {
            "registry-1.docker.io"
        } else {
            &self.registry
        }
    }
}

fn is_docker_hub(registry: &str) -> bool {
    matches!(
        registry,
        "docker.io" | "index.docker.io" | "registry-1.docker.io"
    )
}

/// How to reach a registry, for a pull or a push.
#[derive(Clone, Debug)]
pub struct PullOptions {
    /// Plain HTTP for any host (loopback registries may use it anyway).
    pub plain_http: bool,
    /// Credentials; without them, the environment and auth files are looked up ([`auth`]).
    pub credentials: Option<auth::Found>,
    /// Ask for push access as well as pull (the token scope `repository:REPO:pull,push`).
    pub push: bool,
    /// Deadline of one request, its whole body included ([`client::REQUEST_TIMEOUT`]).
    pub timeout: std::time::Duration,
    /// Longest wait for the next bytes of an answer ([`client::STALL_TIMEOUT`]).
    pub stall_timeout: std::time::Duration,
}

impl Default for PullOptions {
    fn default() -> PullOptions {
        PullOptions {
            plain_http: false,
            credentials: None,
            push: false,
            timeout: client::REQUEST_TIMEOUT,
            stall_timeout: client::STALL_TIMEOUT,
        }
    }
}

/// A layer blob in a registry.
#[derive(Clone)]
pub(super) struct RemoteBlob {
    client: Arc<Client>,
    digest: Sha256Digest,
}

impl fmt::Debug for RemoteBlob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.shown())
    }
}

impl RemoteBlob {
    pub(super) fn shown(&self) -> String {
        format!(
            "{}/{}@{}",
            self.client.registry, self.client.repository, self.digest
        )
    }

    /// Starts the download; the size the registry announces is checked against `expected`, and the body
    /// is cut off (an error) at the first byte past it.
    pub(super) fn open(
        &self,
        what: &str,
        expected: Option<u64>,
    ) -> Result<Box<dyn std::io::Read + Send>, OciError> {
        let path = format!("/v2/{}/blobs/{}", self.client.repository, self.digest);
        let resp = self
            .client
            .get(&format!("{what} blob {}", self.digest), &path, None)?;
        let what = format!("{what} blob {}", self.shown());
        if let (Some(want), Some(have)) = (expected, resp.content_length()) {
            if want != have {
                return Err(OciError::SizeMismatch {
                    what,
                    expected: want,
                    actual: have,
                });
            }
        }
        let mut r = self.client.reader(&what, resp);
        r.limit = expected;
        Ok(Box::new(r))
    }
}

/// Opens the image `r` names, for `platform`.
pub fn open(
    r: &RegistryRef,
    platform: &Platform,
    opts: &PullOptions,
) -> Result<OciImage, OciError> {
    let client = Arc::new(Client::connect(r, opts)?);
    let (manifest_digest, manifest) = resolve(&client, r, platform)?;
    let config_digest = parse_digest("config", &manifest.config.digest)?;
    let cmt = manifest.config.media_type.as_str();
    if !cmt.is_empty() && cmt != spec::OCI_CONFIG && cmt != spec::DOCKER_CONFIG {
        return Err(OciError::Unsupported(format!(
            "{r}: config {config_digest}: unsupported media type {cmt:?} (not a container image)"
        )));
    }
    let what = format!("config {config_digest}");
    let resp = client.get(
        &what,
        &format!("/v2/{}/blobs/{config_digest}", r.repository),
        None,
    )?;
    let config_bytes = client.read_limited(&what, resp, JSON_LIMIT as usize)?;
    check(
        &what,
        r,
        &config_digest,
        Some(manifest.config.size),
        &config_bytes,
    )?;
    image_of(
        manifest_digest,
        &manifest,
        config_digest,
        &config_bytes,
        |_, d, _| {
            Ok(BlobLoc::Remote(RemoteBlob {
                client: client.clone(),
                digest: *d,
            }))
        },
    )
}

/// Checks fetched bytes against the digest (and size) that named them.
fn check(
    what: &str,
    r: &RegistryRef,
    digest: &Sha256Digest,
    size: Option<u64>,
    bytes: &[u8],
) -> Result<(), OciError> {
    let actual = Sha256Digest::of(bytes);
    if actual != *digest {
        return Err(OciError::DigestMismatch {
            what: format!("{r}: {what}"),
            expected: digest.to_string(),
            actual: actual.to_string(),
        });
    }
    match size {
        Some(n) if n != bytes.len() as u64 => Err(OciError::SizeMismatch {
            what: format!("{r}: {what}"),
            expected: n,
            actual: bytes.len() as u64,
        }),
        _ => Ok(()),
    }
}

/// Fetches the manifest `r` names and follows indexes to the image manifest for `platform`.
fn resolve(
    client: &Client,
    r: &RegistryRef,
    platform: &Platform,
) -> Result<(Sha256Digest, ImageManifest), OciError> {
    let mut reference = r.reference.to_string();
    let mut want: Option<(Sha256Digest, Option<u64>)> = match &r.reference {
        Reference::Digest(d) => Some((*d, None)),
        Reference::Tag(_) => None,
    };
    for depth in 0..=MAX_DEPTH {
        let what = if depth == 0 {
            format!("manifest {reference}")
        } else {
            format!("manifest {reference} (nested index level {depth})")
        };
        let path = format!("/v2/{}/manifests/{reference}", r.repository);
        let resp = client.get(&what, &path, Some(MANIFEST_TYPES))?;
        let header_type = client::content_type(&resp);
        let named = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|h| h.to_str().ok())
            .and_then(|s| s.parse::<Sha256Digest>().ok());
        let bytes = client.read_limited(&what, resp, JSON_LIMIT as usize)?;
        let digest = match want {
            Some((d, size)) => {
                check(&what, r, &d, size, &bytes)?;
                d
            }
            None => {
                let actual = Sha256Digest::of(&bytes);
                if let Some(n) = named.filter(|n| *n != actual) {
                    return Err(OciError::DigestMismatch {
                        what: format!("{r}: {what} (Docker-Content-Digest)"),
                        expected: n.to_string(),
                        actual: actual.to_string(),
                    });
                }
                actual
            }
        };
        let declared = header_type.filter(|h| spec::is_index(h) || spec::is_manifest(h));
        let media_type = manifest_media_type(&what, &bytes, declared.as_deref())?;
        if spec::is_index(&media_type) {
            let index: Index = parse_json(&what, &bytes)?;
            let next = pick(&index.manifests, platform, &format!("{r}: index {digest}"))?;
            let d = parse_digest(&what, &next.digest)?;
            want = Some((d, Some(next.size)));
            reference = d.to_string();
            continue;
        }
        if !spec::is_manifest(&media_type) {
            return Err(OciError::Unsupported(format!(
                "{r}: {what}: unsupported media type {media_type:?}"
            )));
        }
        return Ok((digest, parse_json(&what, &bytes)?));
    }
    Err(OciError::Malformed(format!(
        "{r}: indexes nested deeper than {MAX_DEPTH}"
    )))
}

/// The entry of an index for `platform`.
fn pick<'a>(
    all: &'a [Descriptor],
    platform: &Platform,
    what: &str,
) -> Result<&'a Descriptor, OciError> {
    let refs: Vec<&Descriptor> = all.iter().collect();
    match refs.as_slice() {
        [one] if one.platform.is_none() => Ok(one),
        many => super::layout::pick_platform(many, platform, what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse() {
        let r = RegistryRef::parse("127.0.0.1:5000/a/b:v1").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "a/b");
        assert_eq!(r.reference, Reference::Tag("v1".into()));
        assert_eq!(r.to_string(), "127.0.0.1:5000/a/b:v1");
        let r = RegistryRef::parse("reg.example/x").unwrap();
        assert_eq!(r.reference, Reference::Tag("latest".into()));
        let d = Sha256Digest::of(b"m");
        let r = RegistryRef::parse(&format!("localhost:1/x/y@{d}")).unwrap();
        assert_eq!(r.reference, Reference::Digest(d));
        assert_eq!(r.repository, "x/y");
        let hub = RegistryRef::parse("docker.io/debian:12").unwrap();
        assert_eq!(hub.repository, "library/debian");
        assert_eq!(hub.api_host(), "registry-1.docker.io");
        assert_eq!(
            RegistryRef::parse("docker.io/a/b").unwrap().repository,
            "a/b"
        );
        assert_eq!(r.api_host(), "localhost:1");
        for bad in [
            "noslash",
            "/x:1",
            "h/UPPER:1",
            "h/x:",
            "h/x@sha256:12",
            "h//x",
            "h/x:bad/tag",
            "ho st/x",
        ] {
            assert!(RegistryRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn loopback_hosts() {
        for h in ["localhost:5000", "127.0.0.1", "127.1.2.3:80", "[::1]:5000"] {
            assert!(client::is_loopback(h), "{h}");
        }
        for h in ["example.com", "10.0.0.1:5000", "localhost.example:1"] {
            assert!(!client::is_loopback(h), "{h}");
        }
    }

    proptest::proptest! {
        /// Any text parses or is refused; what parses prints back as itself.
        #[test]
        fn references_never_panic_and_round_trip(s in "[a-z0-9.:/@_-]{0,80}") {
            if let Ok(r) = RegistryRef::parse(&s) {
                proptest::prop_assert_eq!(RegistryRef::parse(&r.to_string()).ok(), Some(r));
            }
        }
    }
}
