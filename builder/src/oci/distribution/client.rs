//! The HTTP side of a pull: one repository of one registry, authenticated as it asks.
//!
//! Requests go through `reqwest` (already in the tree for the S3 store), driven by a small tokio runtime
//! of the client's own; callers are synchronous. A blob's body is handed out as a [`Read`]er that pulls
//! one chunk of the response at a time ([`BodyReader`]), so a layer is never held in memory whole.
//!
//! **Limits.** A hostile or broken registry must not hold an import forever or fill the disk: connecting
//! waits at most [`CONNECT_TIMEOUT`]; every wait for the next bytes of an answer (its headers, each piece
//! of its body) at most the stall timeout ([`STALL_TIMEOUT`]); and a request as a whole — sending it,
//! the answer's headers, the whole body — has a deadline ([`REQUEST_TIMEOUT`]), which a registry that
//! trickles a byte now and then cannot evade. Both are [`PullOptions`]. A blob's body is read to the size
//! its descriptor declares and no further: one byte more is a size mismatch, whatever `Content-Length`
//! said (or did not say). Timeouts are [`OciError::Timeout`].
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
use std::time::{Duration, Instant};

use bytes::Bytes;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::{Method, Response, StatusCode};

use super::auth::{Challenge, Credentials, Found};
use super::{PullOptions, RegistryRef};
use crate::oci::OciError;

/// Longest wait to connect to a registry or token server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default longest wait for the next bytes of a response.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Default deadline of one request, body included (a 10 GB layer at 10 MB/s takes 17 minutes).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);
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
    creds: Option<Found>,
    /// Token scope actions: `pull`, or `pull,push`.
    actions: &'static str,
    authorization: Mutex<Option<String>>,
    /// Deadline of a request, body included.
    timeout: Duration,
    /// Longest wait for the next bytes.
    stall: Duration,
}

/// When a request must be complete (kept in its response's extensions for the body's reader).
#[derive(Clone, Copy)]
struct Deadline(Instant);

/// Why reading an answer stopped, carried inside the `io::Error` a [`BodyReader`] returns (see
/// [`from_io`]).
#[derive(Clone, Debug, thiserror::Error)]
pub enum BodyError {
    #[error("{what}: the body is longer than the {limit} bytes its descriptor declares")]
    TooLong { what: String, limit: u64, got: u64 },
    #[error("{what}: {why}")]
    Timeout { what: String, why: String },
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
            .read_timeout(opts.stall_timeout)
            .user_agent(concat!("strata/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| transport(&r.registry, "building the HTTP client", e))?;
        // Docker Hub's entry in an auth file is under `index.docker.io`.
        let creds = match &opts.credentials {
            Some(c) => Some(c.clone()),
            None => match Credentials::find(&r.registry)? {
                Some(c) => Some(c),
                None if r.api_host() != r.registry.as_str() => {
                    Credentials::find("index.docker.io")?
                }
                None => None,
            },
        };
        let mut client = Client {
            rt: Arc::new(rt),
            http,
            base: String::new(),
            registry: r.registry.clone(),
            repository: r.repository.clone(),
            creds,
            actions: if opts.push { "pull,push" } else { "pull" },
            authorization: Mutex::new(None),
            timeout: opts.timeout,
            stall: opts.stall_timeout,
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
        let resp = self.call(what, Method::GET, path, &|req| match accept {
            Some(a) => req.header(ACCEPT, a),
            None => req,
        })?;
        self.success(what, resp)
    }

    /// `resp` if its status is a success, else the error naming `what`, the status and the registry's
    /// own error message.
    pub fn success(&self, what: &str, resp: Response) -> Result<Response, OciError> {
        match resp.status().is_success() {
            true => Ok(resp),
            false => Err(self.status_error(&self.named(what), resp)),
        }
    }

    /// `loc` (a `Location` header: absolute, or relative to the registry) as an absolute URL.
    pub fn absolute(&self, loc: &str) -> Result<reqwest::Url, OciError> {
        reqwest::Url::parse(&self.base)
            .and_then(|b| b.join(loc))
            .map_err(|e| {
                OciError::Malformed(format!(
                    "registry {}: Location {loc:?} is not a URL: {e}",
                    self.registry
                ))
            })
    }

    /// Errors name the repository too.
    fn named(&self, what: &str) -> String {
        match self.repository.is_empty() {
            true => what.to_string(),
            false => format!("{}: {what}", self.repository),
        }
    }

    /// `method target` — a path under the registry's base URL, or an absolute URL (an upload's
    /// `Location`) — with what `prep` adds (headers, a body; it may be called twice), authenticating
    /// when the registry asks (a `401` with a challenge: once per call). The answer, whatever its
    /// status.
    pub fn call(
        &self,
        what: &str,
        method: Method,
        target: &str,
        prep: &dyn Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<Response, OciError> {
        let url = match target.starts_with("http://") || target.starts_with("https://") {
            true => target.to_string(),
            false => format!("{}{target}", self.base),
        };
        let what = &self.named(what);
        let mut retried = false;
        loop {
            let mut req = prep(self.http.request(method.clone(), &url));
            let auth = self
                .authorization
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(a) = auth {
                req = req.header(AUTHORIZATION, a);
            }
            let resp = self.send(what, req)?;
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
            return Ok(resp);
        }
    }

    /// Sends a request and waits for the answer's headers, within the stall timeout and the request's
    /// deadline (which then holds for the body too: [`Client::reader`]).
    fn send(&self, what: &str, req: reqwest::RequestBuilder) -> Result<Response, OciError> {
        let deadline = Deadline(Instant::now() + self.timeout);
        let wait = self.stall.min(self.timeout);
        let mut resp = self
            .rt
            .block_on(async { tokio::time::timeout(wait, req.send()).await })
            .map_err(|_| OciError::Timeout {
                registry: self.registry.clone(),
                what: what.to_string(),
                why: format!("no answer within {wait:?}"),
            })?
            .map_err(|e| transport(&self.registry, what, e))?;
        resp.extensions_mut().insert(deadline);
        Ok(resp)
    }

    /// Sets the `Authorization` header the challenge asks for.
    fn authenticate(&self, what: &str, c: &Challenge) -> Result<(), OciError> {
        let header = match c {
            Challenge::Basic => {
                let Some(Found {
                    credentials: creds, ..
                }) = &self.creds
                else {
                    return Err(OciError::Auth {
                        registry: self.registry.clone(),
                        why: format!("{what}: HTTP 401{}", self.credentials_hint()),
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
            let scope = params.get("scope").cloned().or_else(|| {
                (!self.repository.is_empty())
                    .then(|| format!("repository:{}:{}", self.repository, self.actions))
            });
            if let Some(scope) = scope {
                q.append_pair("scope", &scope);
            }
        }
        let mut req = self.http.get(url);
        if let Some(c) = &self.creds {
            req = c.credentials.apply(req);
        }
        let resp = self.send(&what, req)?;
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
        if status == 401 || status == 403 {
            return OciError::Auth {
                registry: self.registry.clone(),
                why: format!("{what}: HTTP {status}{detail}{}", self.credentials_hint()),
            };
        }
        OciError::Http {
            registry: self.registry.clone(),
            what: what.to_string(),
            status,
            detail,
        }
    }

    /// What to do about a refusal: which credentials were refused, or where to give some.
    fn credentials_hint(&self) -> String {
        match &self.creds {
            Some(f) => format!(" (the registry refused the credentials from {})", f.from),
            None => format!(
                " (the registry asks for credentials: `strata login {}`, --creds USER:PASSWORD or \
                 STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD)",
                self.registry
            ),
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
            .map_err(|e| from_io(format!("registry {}: {what}", self.registry), e))?;
        if out.len() > limit {
            return Err(OciError::Malformed(format!(
                "registry {}: {what} is over {limit} bytes",
                self.registry
            )));
        }
        Ok(out)
    }

    /// The body of `resp` as a reader that fetches one chunk at a time, within the stall timeout and
    /// the request's deadline.
    pub fn reader(&self, what: &str, resp: Response) -> BodyReader {
        let deadline = resp
            .extensions()
            .get::<Deadline>()
            .map_or_else(|| Instant::now() + self.timeout, |d| d.0);
        BodyReader {
            rt: self.rt.clone(),
            resp,
            buf: Bytes::new(),
            what: format!("registry {}: {what}", self.registry),
            limit: None,
            got: 0,
            deadline,
            timeout: self.timeout,
            stall: self.stall,
            failed: None,
        }
    }
}

/// The error of a failed read of a registry's answer: a [`BodyError`] inside `e` becomes the
/// [`OciError`] it stands for (a body too long is a size mismatch, exit 5; a timeout, [`OciError::Timeout`]),
/// anything else an I/O error at `path`.
pub fn from_io(path: impl std::fmt::Display, e: io::Error) -> OciError {
    match e.get_ref().and_then(|i| i.downcast_ref::<BodyError>()) {
        Some(BodyError::TooLong { what, limit, got }) => OciError::SizeMismatch {
            what: format!("{what} (cut off past its declared size)"),
            expected: *limit,
            actual: *got,
        },
        Some(BodyError::Timeout { what, why }) => {
            let (registry, what) = what
                .strip_prefix("registry ")
                .and_then(|w| w.split_once(": "))
                .unwrap_or(("", what));
            OciError::Timeout {
                registry: registry.to_string(),
                what: what.to_string(),
                why: why.clone(),
            }
        }
        None => OciError::io(path, e),
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

/// A response body read one network chunk at a time, within limits (see the module documentation).
pub struct BodyReader {
    rt: Arc<tokio::runtime::Runtime>,
    resp: Response,
    buf: Bytes,
    what: String,
    /// Most bytes the body may have (a blob's declared size).
    pub limit: Option<u64>,
    got: u64,
    deadline: Instant,
    timeout: Duration,
    stall: Duration,
    /// The first failure, returned again by every later read.
    failed: Option<BodyError>,
}

impl BodyReader {
    fn fail(&mut self, e: BodyError) -> io::Error {
        self.failed = Some(e.clone());
        let kind = match e {
            BodyError::TooLong { .. } => io::ErrorKind::InvalidData,
            BodyError::Timeout { .. } => io::ErrorKind::TimedOut,
        };
        io::Error::new(kind, e)
    }

    /// The next piece of the body (`None` at its end), within the stall timeout and the deadline.
    fn next_piece(&mut self) -> io::Result<Option<Bytes>> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let wait = self.stall.min(left);
        let (rt, resp) = (&self.rt, &mut self.resp);
        let piece = match rt.block_on(async { tokio::time::timeout(wait, resp.chunk()).await }) {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(io::Error::other(format!("{}: {e}", self.what))),
            Err(_) => {
                let why = match wait < self.stall {
                    true => format!(
                        "not complete within the request's deadline of {:?} ({} bytes read)",
                        self.timeout, self.got
                    ),
                    false => format!("no bytes for {:?}", self.stall),
                };
                let e = BodyError::Timeout {
                    what: self.what.clone(),
                    why,
                };
                return Err(self.fail(e));
            }
        };
        if let (Some(p), Some(limit)) = (&piece, self.limit) {
            if self.got + p.len() as u64 > limit {
                let e = BodyError::TooLong {
                    what: self.what.clone(),
                    limit,
                    got: self.got + p.len() as u64,
                };
                return Err(self.fail(e));
            }
        }
        self.got += piece.as_ref().map_or(0, |p| p.len() as u64);
        Ok(piece)
    }
}

impl Read for BodyReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some(e) = &self.failed {
            let e = e.clone();
            return Err(self.fail(e));
        }
        while self.buf.is_empty() {
            match self.next_piece()? {
                Some(b) => self.buf = b,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}
