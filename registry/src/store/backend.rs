//! The [`StoreBackend`] of real stores, `file://` directories and `s3://` buckets: the one module that
//! speaks `object_store`.
//!
//! strata's callers are synchronous (builder workers, FUSE handler threads, the CLI), so the backend owns a
//! small tokio runtime and exposes blocking calls; it must not be called from inside an async context.
//! Timeouts and retries are bounded so that an unreachable store fails within seconds with an error naming
//! the URL, instead of retrying for minutes. A range read's deadline is one `tokio` timeout around the
//! whole read — connection, request, first byte, body, and the client's own retries — so it holds whatever
//! the server does (measured against a server that accepts and never answers: `Timeout` at the deadline).
//! Every other operation has a deadline too ([`ObjectStoreBackend::with_deadline`], default
//! [`super::DEFAULT_STORE_TIMEOUT`]), applied the same way: a whole-object read or write, a `head`, a
//! delete, one page of a listing, and each part of a multipart upload (a blob upload as a whole may take
//! longer; it fails when one part stalls). Past it the call fails with [`StoreError::Timeout`], so that
//! no command waits on a store that accepts and never answers for longer than that.
//!
//! A local directory's range reads are the exception: they run on the caller's thread, without the
//! runtime and so without the deadline, while the directory answers fast ([`super::tripwire`]).
//!
//! A local directory has no conditional put in `object_store`: create-only uses its no-clobber link,
//! if-match compares versions and writes while holding the store's exclusive `flock` on `tags/.lock`
//! (a regular file: on MooseFS `flock` of a directory is local to each client, of a file global).
//!
//! An S3 server is probed once, before its first conditional put, for what it does with
//! `If-None-Match` and `If-Match` ([`super::conditional`]): a server that ignores them makes every
//! conditional put fail with [`StoreError::NoConditionalWrites`] instead of overwriting blindly, and
//! one that wants bare ETags in `If-Match` (Ceph radosgw 16) gets them.

use std::ops::Range;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion, WriteMultipart,
};
use tokio::io::AsyncReadExt;

use super::conditional::{self, Conditional};
use super::object::{check_range, timeout, ObjectMeta, PutMode as Mode, StoreBackend, Version};
use super::{tagfile, StoreError};

/// Blocking access to one bucket or directory through `object_store`.
pub struct ObjectStoreBackend {
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Runtime,
    /// Shown in errors.
    url: String,
    /// The root of a local directory, which has no conditional put of its own: if-match is
    /// read-compare-write under the store's exclusive `flock` (`tags/.lock`).
    local: Option<std::path::PathBuf>,
    /// Deadline of every call but a range read (which brings its own).
    deadline: Duration,
    /// What the S3 server does with conditional puts, once probed.
    conditional: std::sync::OnceLock<Conditional>,
    /// Whether a local directory's range reads may run on their callers' threads.
    tripwire: super::tripwire::Tripwire,
}

/// True when an S3 error says the bucket itself is missing (its body's `NoSuchBucket` code, which
/// object_store keeps in the error's text): every request of the store fails alike, reads with a
/// 404 that would otherwise read as a missing object.
fn no_bucket(e: &object_store::Error) -> bool {
    e.to_string().contains("<Code>NoSuchBucket</Code>")
}

fn s3_err(url: &str, key: &str, e: object_store::Error) -> StoreError {
    if no_bucket(&e) {
        let bucket = url
            .strip_prefix("s3://")
            .and_then(|r| r.split('/').next())
            .unwrap_or(url);
        return StoreError::NoBucket {
            url: url.to_string(),
            bucket: bucket.to_string(),
        };
    }
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(key.to_string()),
        object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. } => {
            StoreError::Precondition(key.to_string())
        }
        other => StoreError::Backend {
            url: url.to_string(),
            key: key.to_string(),
            source: Box::new(other),
        },
    }
}

fn meta(m: object_store::ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        key: m.location.to_string(),
        size: m.size,
        modified: m.last_modified.timestamp(),
        version: Version {
            e_tag: m.e_tag,
            version: m.version,
        },
    }
}

impl ObjectStoreBackend {
    fn runtime() -> Result<tokio::runtime::Runtime, StoreError> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strata-store")
            .enable_all()
            .build()
            .map_err(|e| StoreError::io("tokio runtime", e))
    }

    /// A local directory (created if missing).
    pub fn local(root: &FsPath) -> Result<ObjectStoreBackend, StoreError> {
        std::fs::create_dir_all(root).map_err(|e| StoreError::io(root, e))?;
        let fs = LocalFileSystem::new_with_prefix(root).map_err(|e| StoreError::Backend {
            url: root.display().to_string(),
            key: String::new(),
            source: Box::new(e),
        })?;
        Ok(ObjectStoreBackend {
            store: Arc::new(fs),
            rt: Self::runtime()?,
            url: format!("file://{}", root.display()),
            local: Some(root.to_path_buf()),
            deadline: super::DEFAULT_STORE_TIMEOUT,
            conditional: std::sync::OnceLock::new(),
            tripwire: Default::default(),
        })
    }

    /// An S3 bucket (path-style requests; endpoint, region and credentials from `AWS_*` variables).
    pub fn s3(
        bucket: &str,
        prefix: &str,
        endpoint: Option<&str>,
    ) -> Result<ObjectStoreBackend, StoreError> {
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_virtual_hosted_style_request(false)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(50),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: 3,
                retry_timeout: Duration::from_secs(15),
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(3))
                    .with_timeout(Duration::from_secs(120))
                    .with_allow_http(true),
            );
        if let Some(ep) = endpoint {
            b = b.with_endpoint(ep);
        }
        if std::env::var_os("AWS_REGION").is_none()
            && std::env::var_os("AWS_DEFAULT_REGION").is_none()
        {
            b = b.with_region("us-east-1");
        }
        let url = format!("s3://{bucket}/{prefix}");
        let s3 = b.build().map_err(|e| StoreError::Backend {
            url: url.clone(),
            key: String::new(),
            source: Box::new(e),
        })?;
        let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(PrefixStore::new(s3, prefix))
        };
        Ok(ObjectStoreBackend {
            store,
            rt: Self::runtime()?,
            url,
            local: None,
            deadline: super::DEFAULT_STORE_TIMEOUT,
            conditional: std::sync::OnceLock::new(),
            tripwire: Default::default(),
        })
    }

    /// The same backend with `deadline` for every call but a range read (see the module documentation).
    pub fn with_deadline(mut self, deadline: Duration) -> ObjectStoreBackend {
        self.deadline = deadline;
        self
    }

    /// Runs `f` to completion within the backend's deadline.
    fn within<T>(
        &self,
        key: &str,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.rt.block_on(self.step(key, f))
    }

    /// `f` within the backend's deadline, inside the runtime.
    async fn step<T>(
        &self,
        key: &str,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.deadline, f)
            .await
            .map_err(|_| timeout(&self.url, key, self.deadline))?
    }

    fn err(&self, key: &str, e: object_store::Error) -> StoreError {
        s3_err(&self.url, key, e)
    }

    async fn head_async(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError> {
        match self.store.head(&Path::from(key)).await {
            Ok(m) => Ok(Some(meta(m))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(key, e)),
        }
    }

    /// A range read without a deadline: exactly `range`, or why not. `direct`: a local directory's
    /// range is tried with direct I/O first (unless the caller just tried that itself).
    async fn read_range(
        &self,
        key: &str,
        range: Range<u64>,
        direct: bool,
    ) -> Result<Bytes, StoreError> {
        if direct {
            if let Some(b) = self.read_local_direct(key, &range).await {
                return Ok(b);
            }
        }
        let p = Path::from(key);
        if range.start >= range.end {
            let size = self
                .head_async(key)
                .await?
                .ok_or_else(|| StoreError::NotFound(key.to_string()))?
                .size;
            check_range(key, &range, size)?;
            return Ok(Bytes::new());
        }
        match self.store.get_range(&p, range.clone()).await {
            Ok(b) if b.len() as u64 == range.end - range.start => {
                self.drop_pages(key, &range);
                Ok(b)
            }
            Ok(b) => Err(self.cut_short(key, &range, b.len() as u64)),
            Err(e) => Err(self.range_refused(key, &range, e).await),
        }
    }

    /// A local store's range, read with direct I/O (`super::direct`: no page is left in the page
    /// cache, none is dropped); `None` for anything but a whole range read that way — a filesystem
    /// without `O_DIRECT`, a missing object, a range past its end — which the ordinary path then reads,
    /// or reports.
    async fn read_local_direct(&self, key: &str, range: &Range<u64>) -> Option<Bytes> {
        let path = self.local.as_ref()?.join(key);
        let range = range.clone();
        let read = tokio::task::spawn_blocking(move || direct_range(&path, range));
        read.await.ok()?.ok()
    }

    /// A local store's range was read for a node's chunk cache or a reader that keeps its own copy:
    /// its pages leave the page cache (a byte should be in memory once; see `strata_fs::pagecache`).
    /// Best effort: a failure only leaves them cached.
    fn drop_pages(&self, key: &str, range: &Range<u64>) {
        let Some(root) = &self.local else { return };
        if let Ok(f) = std::fs::File::open(root.join(key)) {
            super::direct::drop_pages(&f, range.start, range.end - range.start);
        }
    }

    /// The server sent `got` bytes for `range`: cut at the end of the object (a range past its end), or
    /// a broken answer.
    fn cut_short(&self, key: &str, range: &Range<u64>, got: u64) -> StoreError {
        match check_range(key, range, range.start + got) {
            Err(e) => e,
            Ok(()) => StoreError::Backend {
                url: self.url.clone(),
                key: key.to_string(),
                source: format!("{got} bytes for a range of {range:?}").into(),
            },
        }
    }

    /// Why a range read was refused. A range that starts past the end is refused in a backend-specific
    /// way: the object's size tells.
    async fn range_refused(
        &self,
        key: &str,
        range: &Range<u64>,
        e: object_store::Error,
    ) -> StoreError {
        if matches!(e, object_store::Error::NotFound { .. }) {
            return self.err(key, e);
        }
        match self.head_async(key).await {
            Ok(Some(m)) => match check_range(key, range, m.size) {
                Err(past) => past,
                Ok(()) => self.err(key, e),
            },
            _ => self.err(key, e),
        }
    }

    /// A non-empty range read handed to `sink` piece by piece as the body arrives.
    async fn stream_range(
        &self,
        key: &str,
        range: Range<u64>,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), StoreError> {
        let opts = GetOptions::default().with_range(Some(range.clone()));
        let r = match self.store.get_opts(&Path::from(key), opts).await {
            Ok(r) => r,
            Err(e) => return Err(self.range_refused(key, &range, e).await),
        };
        let want = range.end - range.start;
        let mut got = 0u64;
        let mut body = r.into_stream();
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| self.err(key, e))?;
            got += piece.len() as u64;
            if got > want {
                return Err(self.cut_short(key, &range, got));
            }
            sink(&piece);
        }
        match got == want {
            true => Ok(()),
            false => Err(self.cut_short(key, &range, got)),
        }
    }

    async fn put_async(&self, key: &str, data: Bytes, mode: Mode) -> Result<Version, StoreError> {
        let mode = match mode {
            Mode::Overwrite => PutMode::Overwrite,
            Mode::Create => PutMode::Create,
            Mode::IfMatch(v) => PutMode::Update(UpdateVersion {
                e_tag: v.e_tag,
                version: v.version,
            }),
        };
        let conditional = !matches!(mode, PutMode::Overwrite);
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&Path::from(key), PutPayload::from(data), opts)
            .await
        {
            Ok(r) => Ok(Version {
                e_tag: r.e_tag,
                version: r.version,
            }),
            // S3 answers if-match on an absent object with 404: a lost race all the same.
            Err(e @ object_store::Error::NotFound { .. }) if conditional && !no_bucket(&e) => {
                Err(StoreError::Precondition(key.to_string()))
            }
            Err(e) => Err(self.err(key, e)),
        }
    }

    /// What the S3 server does with conditional puts: probed on the first call, then remembered (a
    /// probe that fails is not).
    pub fn conditional_writes(&self) -> Result<Conditional, StoreError> {
        if let Some(c) = self.conditional.get() {
            return Ok(*c);
        }
        let put = |k: &str, d: Bytes, m: Mode| self.within(k, self.put_async(k, d, m));
        let delete = |k: &str| StoreBackend::delete(self, k);
        let found = conditional::probe(&conditional::probe_key(), &put, &delete)?;
        Ok(*self.conditional.get_or_init(|| found))
    }

    /// A conditional put on S3, as the server understands it (see [`Self::conditional_writes`]).
    fn put_conditional(&self, key: &str, data: Bytes, mode: Mode) -> Result<Version, StoreError> {
        let mode = match (self.conditional_writes()?, mode) {
            (Conditional::Missing(feature), _) => {
                return Err(StoreError::NoConditionalWrites {
                    url: self.url.clone(),
                    feature,
                })
            }
            (Conditional::BareETags, Mode::IfMatch(v)) => Mode::IfMatch(conditional::bare(&v)),
            (_, mode) => mode,
        };
        self.within(key, self.put_async(key, data, mode))
    }

    /// If-match on a local directory: compare and write under the store's lock. It used to `flock` the
    /// root directory itself, which MooseFS 3.0 does not share between clients (a file's `flock` it
    /// does: checked with two mounts), so two machines could both win.
    fn put_if_match_local(
        &self,
        root: &FsPath,
        key: &str,
        data: Bytes,
        prev: &Version,
    ) -> Result<Version, StoreError> {
        let _lock = tagfile::lock(root)?;
        match self.head(key)? {
            Some(m) if m.version == *prev => {
                self.within(key, self.put_async(key, data, Mode::Overwrite))
            }
            _ => Err(StoreError::Precondition(key.to_string())),
        }
    }
}

impl StoreBackend for ObjectStoreBackend {
    fn url(&self) -> &str {
        &self.url
    }

    fn get(&self, key: &str) -> Result<(Bytes, Version), StoreError> {
        let p = Path::from(key);
        self.within(key, async {
            let r = self.store.get(&p).await.map_err(|e| self.err(key, e))?;
            let v = Version {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            let b = r.bytes().await.map_err(|e| self.err(key, e))?;
            Ok((b, v))
        })
    }

    /// The deadline covers the whole read (connecting, the first byte, the body, the client's retries):
    /// the future is dropped when it passes, whatever the server is doing.
    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
    ) -> Result<Bytes, StoreError> {
        // A local directory that answers fast is read on this thread (see the module documentation);
        // anything but a whole direct read takes the ordinary path, without trying direct I/O again.
        let tried = match (&self.local, self.tripwire.begin()) {
            (Some(root), Some(_running)) => match direct_range(&root.join(key), range.clone()) {
                Ok(b) => return Ok(b),
                Err(_) => true,
            },
            _ => false,
        };
        self.rt.block_on(async {
            tokio::time::timeout(deadline, self.read_range(key, range, !tried))
                .await
                .map_err(|_| timeout(&self.url, key, deadline))?
        })
    }

    /// Streams from S3 (the body is handed over as it arrives, under the same whole-read deadline); a
    /// local directory reads the range at once, which costs less than reading it in pieces.
    fn get_range_streamed(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), StoreError> {
        if self.local.is_some() || range.start >= range.end {
            let b = self.get_range(key, range, deadline)?;
            sink(&b);
            return Ok(());
        }
        self.rt.block_on(async {
            tokio::time::timeout(deadline, self.stream_range(key, range, sink))
                .await
                .map_err(|_| timeout(&self.url, key, deadline))?
        })
    }

    /// A local directory's object is read on this thread in pieces with direct I/O, under the tripwire
    /// as a range read is, and leaves no page cached; an S3 object's body is handed over as it arrives.
    fn get_streamed(&self, key: &str, sink: &mut dyn FnMut(&[u8])) -> Result<(), StoreError> {
        if let Some(root) = &self.local {
            let path = root.join(key);
            return match (self.tripwire.begin(), super::direct::open(&path)) {
                (Some(_running), Ok(f)) => direct_pieces(&f, &path, sink),
                // Refused, missing, or a directory that answers slowly: read whole, under the deadline.
                _ => {
                    sink(&self.get(key)?.0);
                    Ok(())
                }
            };
        }
        self.within(key, async {
            let r = self
                .store
                .get(&Path::from(key))
                .await
                .map_err(|e| self.err(key, e))?;
            let mut body = r.into_stream();
            while let Some(piece) = body.next().await {
                sink(&piece.map_err(|e| self.err(key, e))?);
            }
            Ok(())
        })
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError> {
        self.within(key, self.head_async(key))
    }

    fn put(&self, key: &str, data: Bytes, mode: Mode) -> Result<Version, StoreError> {
        match (&self.local, &mode) {
            (Some(root), Mode::IfMatch(prev)) => self.put_if_match_local(root, key, data, prev),
            (None, Mode::Create | Mode::IfMatch(_)) => self.put_conditional(key, data, mode),
            _ => self.within(key, self.put_async(key, data, mode)),
        }
    }

    /// Multipart and streaming: the file is never in memory as a whole. Each step (starting the upload,
    /// waiting for room to send a part, finishing) has the backend's deadline.
    fn put_file(&self, key: &str, file: &FsPath) -> Result<(), StoreError> {
        let p = Path::from(key);
        self.rt.block_on(async {
            let mut f = tokio::fs::File::open(file)
                .await
                .map_err(|e| StoreError::io(file, e))?;
            let upload = self
                .step(key, async {
                    self.store
                        .put_multipart(&p)
                        .await
                        .map_err(|e| self.err(key, e))
                })
                .await?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, 16 << 20);
            let mut buf = vec![0u8; 4 << 20];
            loop {
                let n = f
                    .read(&mut buf)
                    .await
                    .map_err(|e| StoreError::io(file, e))?;
                if n == 0 {
                    break;
                }
                self.step(key, async {
                    w.wait_for_capacity(4).await.map_err(|e| self.err(key, e))
                })
                .await?;
                w.write(&buf[..n]);
            }
            self.step(key, async {
                w.finish().await.map(|_| ()).map_err(|e| self.err(key, e))
            })
            .await
        })
    }

    /// The deadline holds for each object listed (so for each page a server sends), not for the whole
    /// listing of a large store.
    fn list_info(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let prefix = prefix.trim_matches('/');
        let p = Path::from(prefix);
        self.rt.block_on(async {
            let mut out = Vec::new();
            let mut s = self.store.list((!prefix.is_empty()).then_some(&p));
            while let Some(item) = self.step(prefix, async { Ok(s.next().await) }).await? {
                out.push(meta(item.map_err(|e| self.err(prefix, e))?));
            }
            out.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(out)
        })
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        let p = Path::from(key);
        self.within(key, async {
            match self.store.delete(&p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }
}

/// The pieces [`StoreBackend::get_streamed`] reads a local object in.
const PIECE: u64 = 1 << 20;

/// The file at `path` (opened for direct I/O) handed to `sink` in pieces of [`PIECE`] bytes as they are
/// read, its pages dropped after (a writer on this machine may have left some).
fn direct_pieces(
    f: &std::fs::File,
    path: &FsPath,
    sink: &mut dyn FnMut(&[u8]),
) -> Result<(), StoreError> {
    let size = f.metadata().map_err(|e| StoreError::io(path, e))?.len();
    let mut at = 0;
    while at < size {
        let n = (size - at).min(PIECE) as usize;
        let (buf, start) = super::direct::read(f, at, n).map_err(|e| StoreError::io(path, e))?;
        sink(&buf[start..start + n]);
        at += n as u64;
    }
    super::direct::drop_pages(f, 0, size);
    Ok(())
}

/// `range` of the file at `path`, read with direct I/O, its pages dropped after (a writer on this
/// machine may have left some: a build into this store).
fn direct_range(path: &FsPath, range: Range<u64>) -> std::io::Result<Bytes> {
    let len = usize::try_from(range.end - range.start).map_err(std::io::Error::other)?;
    let f = super::direct::open(path)?;
    let (buf, at) = super::direct::read(&f, range.start, len)?;
    super::direct::drop_pages(&f, range.start, len as u64);
    Ok(Bytes::from(buf).slice(at..at + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client error the store has no kind for stays the client's error, as the source.
    #[test]
    fn a_backend_error_keeps_the_clients_error() {
        let client = object_store::Error::NotImplemented {
            operation: "copy".into(),
            implementer: "test".into(),
        };
        let e = s3_err("s3://b/p", "blobs/x", client);
        assert!(
            matches!(&e, StoreError::Backend { key, .. } if key == "blobs/x"),
            "{e}"
        );
        let source = std::error::Error::source(&e).expect("a source");
        assert!(
            source.downcast_ref::<object_store::Error>().is_some(),
            "{source}"
        );
        assert!(e.to_string().contains(&source.to_string()), "{e}");
    }

    #[test]
    fn a_local_directory_conforms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = ObjectStoreBackend::local(dir.path()).expect("local");
        super::super::conformance::run(&b);
    }

    /// A local directory whose reads were slow (the tripwire tripped) is read through the runtime,
    /// under the deadline, with the same bytes; a missing object is still reported as missing.
    #[test]
    fn a_tripped_local_directory_is_read_under_the_deadline() {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let mut b = ObjectStoreBackend::local(dir.path()).expect("local");
        // Any read on a caller's thread is "slow": the first trips the wire for a minute.
        b.tripwire = super::super::tripwire::Tripwire::new(Duration::ZERO, Duration::from_secs(60));
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
        b.put("blobs/y", Bytes::from(data.clone()), Mode::Overwrite)
            .expect("put");
        let d = Duration::from_secs(10);
        let first = b
            .get_range("blobs/y", 5..70_000, d)
            .expect("on this thread");
        assert!(b.tripwire.tripped());
        let second = b
            .get_range("blobs/y", 5..70_000, d)
            .expect("through the runtime");
        assert!(first == second && first[..] == data[5..70_000]);
        assert!(matches!(
            b.get_range("blobs/missing", 0..10, d),
            Err(StoreError::NotFound(_))
        ));
    }

    /// A range read of a local store leaves none of the file's pages in the page cache (the node keeps
    /// its own verified copy; the kernel keeps the reader's).
    #[test]
    fn local_range_reads_leave_no_pages_cached() {
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let b = ObjectStoreBackend::local(dir.path()).expect("local");
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        b.put("blobs/x", Bytes::from(data.clone()), Mode::Overwrite)
            .expect("put");
        let path = dir.path().join("blobs/x");
        std::process::Command::new("sync").status().expect("sync");
        let got = b
            .get_range("blobs/x", 1 << 20..3 << 20, Duration::from_secs(10))
            .expect("range");
        assert_eq!(&got[..], &data[1 << 20..3 << 20]);
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
            .arg(&path)
            .output()
            .expect("fincore");
        let cached: u64 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("RES");
        assert_eq!(cached, 0, "{cached} bytes cached");
    }
}
