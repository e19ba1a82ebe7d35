//! The HTTP side of a pull: one repository of one registry, authenticated as it asks.
//!
//! Requests go through `reqwest` (already in the tree for the S3 store), driven by a small tokio runtime
//! of the client's own; callers are synchronous. A blob's body is handed out as a [`Read`]er that pulls
//! one chunk of the response at a time ([`BodyReader`]), so a layer is never held in memory whole.
//! Every read waits at most [`READ_TIMEOUT`] for the next bytes; connecting at most [`CONNECT_TIMEOUT`].
//!
//! **Authentication.** The first request is `GET /v2/` (the API's ping). If it answers `401`, its
//! `WWW-Authenticate` challenge says how to authenticate ([`Challenge`]): Basic with the credentials, or
//! a bearer token fetched from the challenge's realm for `repository:REPO:pull`. The resulting
//! `Authorization` header is sent with every later request; a later `401` (a token expired) runs the
//! flow again once, with the scope the new challenge names.
//!
//! **Plain HTTP.** HTTPS by default. A registry on loopback (`localhost`, `127.0.0.0/8`, `::1`) is tried
//! over HTTPS and, when that cannot connect, over plain HTTP; `--plain-http` uses plain HTTP for any host.

use std::io::{self, Read};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::{Response, StatusCode};

use super::auth::{Challenge, Credentials};
use super::{PullOptions, RegistryRef};
use crate::oci::OciError;

/// Longest wait to connect to a registry or token server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the next bytes of a response.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Most bytes of an error response kept for the message.
const ERROR_BODY_LIMIT: usize = 4096;

/// A client for one repository.
pub struct Client {
    rt: Arc<tokio::runtime::Runtime>,
    http: reqwest::Client,
    /// `http://host:port` or `https://host:port`, once the ping chose.
    base: String,
    pub registry: String,
    pub repository: String,
    creds: Option<Credentials>,
    authorization: Mutex<Option<String>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client({}/{})", self.base, self.repository)
    }
}

/// True for `localhost`, `127.x.x.x` and `::1` (with or without a port).
pub fn is_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => registry.split(':').next().unwrap_or_default(),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Client {
    /// Connects to the registry `r` names: pings it, choosing the scheme, and authenticates if asked.
    pub fn connect(r: &RegistryRef, opts: &PullOptions) -> Result<Client, OciError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("strata-registry")
            .enable_all()
            .build()
            .map_err(|e| OciError::io("tokio runtime", e))?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .user_agent(concat!("strata/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| transport(&r.registry, "building the HTTP client", e))?;
        // Docker Hub's entry in an auth file is under `index.docker.io`.
        let creds = opts.credentials.clone().or_else(|| {
            Credentials::find(&r.registry).or_else(|| {
                (r.api_host() != r.registry.as_str())
                    .then(|| Credentials::find("index.docker.io"))
                    .flatten()
            })
        });
        let mut client = Client {
            rt: Arc::new(rt),
            http,
            base: String::new(),
            registry: r.registry.clone(),
            repository: r.repository.clone(),
            creds,
            authorization: Mutex::new(None),
        };
        let schemes: &[&str] = if opts.plain_http {
            &["http"]
        } else if is_loopback(r.api_host()) {
            &["https", "http"]
        } else {
            &["https"]
        };
        let mut last = None;
        for scheme in schemes {
            client.base = format!("{scheme}://{}", r.api_host());
            match client.get("the API ping (GET /v2/)", "/v2/", None) {
                Ok(_) => return Ok(client),
                Err(e @ OciError::Transport { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| OciError::Usage("no URL scheme to try".into())))
    }

    /// `GET path` (under the registry's base URL), authenticating when the registry asks. Any status
    /// but success is an error naming `what`, the status and the registry's own error message.
    pub fn get(&self, what: &str, path: &str, accept: Option<&str>) -> Result<Response, OciError> {
        let url = format!("{}{path}", self.base);
        // Errors name the repository too.
        let what = &format!("{}: {what}", self.repository);
        let mut retried = false;
        loop {
            let mut req = self.http.get(&url);
            if let Some(a) = accept {
                req = req.header(ACCEPT, a);
            }
            let auth = self
                .authorization
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(a) = auth {
                req = req.header(AUTHORIZATION, a);
            }
            let resp = self
                .rt
                .block_on(async { req.send().await })
                .map_err(|e| transport(&self.registry, what, e))?;
            if resp.status() == StatusCode::UNAUTHORIZED && !retried {
                retried = true;
                let challenge = resp
                    .headers()
                    .get(WWW_AUTHENTICATE)
                    .and_then(|h| h.to_str().ok())
                    .and_then(Challenge::parse);
                if let Some(c) = challenge {
                    self.authenticate(what, &c)?;
                    continue;
                }
            }
            if !resp.status().is_success() {
                return Err(self.status_error(what, resp));
            }
            return Ok(resp);
        }
    }

    /// Sets the `Authorization` header the challenge asks for.
    fn authenticate(&self, what: &str, c: &Challenge) -> Result<(), OciError> {
        let header = match c {
            Challenge::Basic => {
                let Some(creds) = &self.creds else {
                    return Err(OciError::Http {
                        registry: self.registry.clone(),
                        what: what.to_string(),
                        status: 401,
                        detail: " (the registry asks for a user and password: give --creds \
                                 USER:PASSWORD, STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD or an \
                                 auth file entry)"
                            .into(),
                    });
                };
                match creds {
                    Credentials::Encoded(e) => format!("Basic {e}"),
                    Credentials::Password { .. } => {
                        // Let reqwest encode it: build a throwaway request and take its header.
                        let req = creds
                            .apply(self.http.get(&self.base))
                            .build()
                            .map_err(|e| transport(&self.registry, what, e))?;
                        req.headers()
                            .get(AUTHORIZATION)
                            .and_then(|h| h.to_str().ok())
                            .map(str::to_string)
                            .unwrap_or_default()
                    }
                }
            }
            Challenge::Bearer { realm, params } => format!("Bearer {}", self.token(realm, params)?),
        };
        *self
            .authorization
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(header);
        Ok(())
    }

    /// Fetches a bearer token from `realm` (the distribution token flow).
    fn token(
        &self,
        realm: &str,
        params: &std::collections::BTreeMap<String, String>,
    ) -> Result<String, OciError> {
        let what = format!("token from {realm}");
        let mut url = reqwest::Url::parse(realm).map_err(|e| {
            OciError::Malformed(format!(
                "registry {}: token realm {realm:?} is not a URL: {e}",
                self.registry
            ))
        })?;
        {
            let mut q = url.query_pairs_mut();
            if let Some(s) = params.get("service") {
                q.append_pair("service", s);
            }
            let scope = params
                .get("scope")
                .cloned()
                .unwrap_or_else(|| format!("repository:{}:pull", self.repository));
            q.append_pair("scope", &scope);
        }
        let mut req = self.http.get(url);
        if let Some(c) = &self.creds {
            req = c.apply(req);
        }
        let resp = self
            .rt
            .block_on(async { req.send().await })
            .map_err(|e| transport(&self.registry, &what, e))?;
        if !resp.status().is_success() {
            return Err(self.status_error(&what, resp));
        }
        let body = self.read_limited(&what, resp, 1 << 20)?;
        #[derive(serde::Deserialize)]
        struct Token {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let t: Token = serde_json::from_slice(&body)
            .map_err(|e| OciError::Malformed(format!("registry {}: {what}: {e}", self.registry)))?;
        t.token
            .or(t.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                OciError::Malformed(format!(
                    "registry {}: {what}: no token in the answer",
                    self.registry
                ))
            })
    }

    /// The error for a failed response: status, and the registry's error codes and messages.
    fn status_error(&self, what: &str, resp: Response) -> OciError {
        let status = resp.status().as_u16();
        let body = self
            .read_limited(what, resp, ERROR_BODY_LIMIT)
            .unwrap_or_default();
        #[derive(serde::Deserialize)]
        struct Errors {
            errors: Vec<ErrorItem>,
        }
        #[derive(serde::Deserialize)]
        struct ErrorItem {
            #[serde(default)]
            code: String,
            #[serde(default)]
            message: String,
        }
        let detail = match serde_json::from_slice::<Errors>(&body) {
            Ok(e) if !e.errors.is_empty() => {
                let items: Vec<String> = e
                    .errors
                    .iter()
                    .map(|i| format!("{}: {}", i.code, i.message))
                    .collect();
                format!(" ({})", items.join("; "))
            }
            _ => String::new(),
        };
        OciError::Http {
            registry: self.registry.clone(),
            what: what.to_string(),
            status,
            detail,
        }
    }

    /// Reads a whole response of at most `limit` bytes.
    pub fn read_limited(
        &self,
        what: &str,
        resp: Response,
        limit: usize,
    ) -> Result<Vec<u8>, OciError> {
        let mut r = self.reader(what, resp);
        let mut out = Vec::new();
        (&mut r)
            .take(limit as u64 + 1)
            .read_to_end(&mut out)
            .map_err(|e| OciError::io(format!("registry {}: {what}", self.registry), e))?;
        if out.len() > limit {
            return Err(OciError::Malformed(format!(
                "registry {}: {what} is over {limit} bytes",
                self.registry
            )));
        }
        Ok(out)
    }

    /// The body of `resp` as a reader that fetches one chunk at a time.
    pub fn reader(&self, what: &str, resp: Response) -> BodyReader {
        BodyReader {
            rt: self.rt.clone(),
            resp,
            buf: Bytes::new(),
            what: format!("registry {}: {what}", self.registry),
        }
    }
}

/// The `Content-Type` of a response, without parameters.
pub fn content_type(resp: &Response) -> Option<String> {
    resp.headers()
        .get(CONTENT_TYPE)
        .and_then(|h| h.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or_default().trim().to_string())
}

fn transport(registry: &str, what: &str, e: reqwest::Error) -> OciError {
    OciError::Transport {
        registry: registry.to_string(),
        what: what.to_string(),
        source: e,
    }
}

/// A response body read one network chunk at a time.
pub struct BodyReader {
    rt: Arc<tokio::runtime::Runtime>,
    resp: Response,
    buf: Bytes,
    what: String,
}

impl Read for BodyReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.buf.is_empty() {
            match self.rt.block_on(async { self.resp.chunk().await }) {
                Ok(Some(b)) => self.buf = b,
                Ok(None) => return Ok(0),
                Err(e) => return Err(io::Error::other(format!("{}: {e}", self.what))),
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}
