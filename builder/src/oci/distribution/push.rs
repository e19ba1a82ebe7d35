//! Pushing an image to a registry through the OCI distribution API: what `strata export … docker://`
//! (and `strata push`) does after writing the image as an OCI layout.
//!
//! The same [`Client`] as a pull (schemes, timeouts, Basic or bearer authentication), connected with
//! push access (the token scope `repository:REPO:pull,push`). Blobs go first, layers then the config,
//! so that the manifest — put last, with its media type as `Content-Type` — never names a blob the
//! registry lacks. For each blob:
//!
//! - `HEAD /v2/REPO/blobs/DIGEST`: a blob the repository has already is skipped (counted in
//!   [`Pushed::skipped`]): a second push of an image, or of one that shares its base, sends only
//!   what changed.
//! - `POST /v2/REPO/blobs/uploads/` opens an upload session (`202` and a `Location`), then a blob of at
//!   most [`CHUNK`] bytes goes in one `PUT LOCATION?digest=…` (a monolithic upload); a larger one in
//!   `PATCH` requests of [`CHUNK`] bytes with their `Content-Range` (each answer's `Location` is the
//!   next one's URL), closed by an empty `PUT …?digest=…`. So a blob is never in memory whole, and each
//!   request stays well inside the request deadline. The registry checks the digest when the upload
//!   is closed.
//!
//! The manifest is `PUT` to `/v2/REPO/manifests/TAG`; the digest the registry answers with
//! (`Docker-Content-Digest`) must be the manifest's own.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use reqwest::header::{CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION};
use reqwest::{Method, StatusCode};

use super::client::Client;
use super::{PullOptions, Reference, RegistryRef};
use crate::oci::{OciError, Sha256Digest};

/// Largest piece of a blob sent in one request.
pub const CHUNK: u64 = 16 << 20;

/// A blob to push: its digest, size, and the file that holds it.
#[derive(Clone, Debug)]
pub struct Blob {
    pub digest: Sha256Digest,
    pub size: u64,
    pub path: PathBuf,
}

/// What a push did.
#[derive(Clone, Debug)]
pub struct Pushed {
    /// The digest of the manifest pushed.
    pub manifest: Sha256Digest,
    /// Blobs uploaded, and their bytes.
    pub uploaded: u64,
    pub uploaded_bytes: u64,
    /// Blobs the repository had already, and their bytes.
    pub skipped: u64,
    pub skipped_bytes: u64,
}

/// Connects to the registry `r` names with push access (before the image is written, so that a
/// registry that cannot be reached or refuses the credentials fails the push early).
pub fn connect(r: &RegistryRef, opts: &PullOptions) -> Result<Client, OciError> {
    let opts = PullOptions {
        push: true,
        ..opts.clone()
    };
    Client::connect(r, &opts)
}

/// Pushes `blobs` (in that order) and then `manifest` (of `media_type`) as the image `r` names,
/// through `client` ([`connect`]). `progress` counts the blob bytes sent.
pub fn push(
    client: &Client,
    r: &RegistryRef,
    blobs: &[Blob],
    manifest: &[u8],
    media_type: &str,
    progress: &AtomicU64,
) -> Result<Pushed, OciError> {
    let digest = Sha256Digest::of(manifest);
    if let Reference::Digest(d) = &r.reference {
        if *d != digest {
            return Err(OciError::Usage(format!(
                "docker://{r}: the image's manifest is {digest}, not {d}; push it by tag"
            )));
        }
    }
    let mut out = Pushed {
        manifest: digest,
        uploaded: 0,
        uploaded_bytes: 0,
        skipped: 0,
        skipped_bytes: 0,
    };
    for b in blobs {
        if has_blob(client, b)? {
            out.skipped += 1;
            out.skipped_bytes += b.size;
            progress.fetch_add(b.size, Ordering::Relaxed);
            continue;
        }
        upload(client, b, progress)?;
        out.uploaded += 1;
        out.uploaded_bytes += b.size;
    }
    let what = format!("manifest {}", r.reference);
    let body = bytes::Bytes::copy_from_slice(manifest);
    let resp = client.call(
        &what,
        Method::PUT,
        &format!("/v2/{}/manifests/{}", r.repository, r.reference),
        &|req| req.header(CONTENT_TYPE, media_type).body(body.clone()),
    )?;
    let resp = client.success(&what, resp)?;
    let named = resp
        .headers()
        .get("docker-content-digest")
        .and_then(|h| h.to_str().ok())
        .and_then(|s| s.parse::<Sha256Digest>().ok());
    if let Some(n) = named.filter(|n| *n != digest) {
        return Err(OciError::DigestMismatch {
            what: format!("{r}: {what} (Docker-Content-Digest)"),
            expected: digest.to_string(),
            actual: n.to_string(),
        });
    }
    Ok(out)
}

/// True when the repository has the blob.
fn has_blob(client: &Client, b: &Blob) -> Result<bool, OciError> {
    let what = format!("blob {}", b.digest);
    let path = format!("/v2/{}/blobs/{}", client.repository, b.digest);
    let resp = client.call(&what, Method::HEAD, &path, &|req| req)?;
    if resp.status() == StatusCode::NOT_FOUND {
        return Ok(false);
    }
    client.success(&what, resp).map(|_| true)
}

/// The `Location` of an upload answer, as an absolute URL.
fn location(client: &Client, what: &str, resp: &reqwest::Response) -> Result<String, OciError> {
    let loc = resp
        .headers()
        .get(LOCATION)
        .and_then(|h| h.to_str().ok())
        .ok_or_else(|| {
            OciError::Malformed(format!(
                "registry {}: {what}: the answer has no Location",
                client.registry
            ))
        })?;
    client.absolute(loc).map(|u| u.to_string())
}

/// Reads the next `n` bytes of `f`.
fn piece(f: &mut std::fs::File, b: &Blob, n: u64) -> Result<bytes::Bytes, OciError> {
    let mut buf = Vec::with_capacity(n as usize);
    f.by_ref()
        .take(n)
        .read_to_end(&mut buf)
        .map_err(|e| OciError::io(b.path.display(), e))?;
    if buf.len() as u64 != n {
        return Err(OciError::SizeMismatch {
            what: format!("blob {} ({})", b.digest, b.path.display()),
            expected: b.size,
            actual: buf.len() as u64,
        });
    }
    Ok(buf.into())
}

/// Uploads one blob: an upload session, then one `PUT`, or `PATCH`es of [`CHUNK`] bytes and a `PUT`.
fn upload(client: &Client, b: &Blob, progress: &AtomicU64) -> Result<(), OciError> {
    let what = format!("upload of blob {}", b.digest);
    let start = format!("/v2/{}/blobs/uploads/", client.repository);
    let resp = client.call(&what, Method::POST, &start, &|req| {
        req.header(CONTENT_LENGTH, "0")
    })?;
    let resp = client.success(&what, resp)?;
    let mut url = location(client, &what, &resp)?;
    let mut f = std::fs::File::open(&b.path).map_err(|e| OciError::io(b.path.display(), e))?;
    let octets = "application/octet-stream";
    let mut last = bytes::Bytes::new();
    if b.size <= CHUNK {
        last = piece(&mut f, b, b.size)?;
    } else {
        let mut at = 0;
        while at < b.size {
            let n = CHUNK.min(b.size - at);
            let body = piece(&mut f, b, n)?;
            let range = format!("{at}-{}", at + n - 1);
            let resp = client.call(&what, Method::PATCH, &url, &|req| {
                req.header(CONTENT_TYPE, octets)
                    .header(CONTENT_RANGE, &range)
                    .body(body.clone())
            })?;
            let resp = client.success(&what, resp)?;
            url = location(client, &what, &resp)?;
            at += n;
            progress.fetch_add(n, Ordering::Relaxed);
        }
    }
    let mut done = reqwest::Url::parse(&url).map_err(|e| {
        OciError::Malformed(format!(
            "registry {}: {what}: Location {url:?}: {e}",
            client.registry
        ))
    })?;
    done.query_pairs_mut()
        .append_pair("digest", &b.digest.to_string());
    let n = last.len() as u64;
    let resp = client.call(&what, Method::PUT, done.as_str(), &|req| {
        req.header(CONTENT_TYPE, octets).body(last.clone())
    })?;
    client.success(&what, resp)?;
    progress.fetch_add(n, Ordering::Relaxed);
    Ok(())
}
