//! The object-store backend: the one module that speaks `object_store`.
//!
//! strata's callers are synchronous (builder workers, FUSE handler threads, the CLI), so the backend owns a
//! small tokio runtime and exposes blocking calls; it must not be called from inside an async context.
//! Timeouts and retries are bounded so that an unreachable store fails within seconds with an error naming
//! the URL, instead of retrying for minutes.

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
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion, WriteMultipart,
};
use tokio::io::AsyncReadExt;

use super::StoreError;

/// A version of an object, for compare-and-swap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version {
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// Blocking access to one bucket or directory.
pub struct Backend {
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Runtime,
    /// Shown in errors.
    url: String,
}

fn s3_err(url: &str, key: &str, e: object_store::Error) -> StoreError {
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(key.to_string()),
        object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. } => {
            StoreError::Precondition(key.to_string())
        }
        other => StoreError::Backend {
            url: url.to_string(),
            key: key.to_string(),
            message: other.to_string(),
        },
    }
}

impl Backend {
    fn runtime() -> Result<tokio::runtime::Runtime, StoreError> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strata-store")
            .enable_all()
            .build()
            .map_err(|e| StoreError::io("tokio runtime", e))
    }

    /// A local directory (created if missing).
    pub fn local(root: &FsPath) -> Result<Backend, StoreError> {
        std::fs::create_dir_all(root).map_err(|e| StoreError::io(root, e))?;
        let fs = LocalFileSystem::new_with_prefix(root).map_err(|e| StoreError::Backend {
            url: root.display().to_string(),
            key: String::new(),
            message: e.to_string(),
        })?;
        Ok(Backend {
            store: Arc::new(fs),
            rt: Self::runtime()?,
            url: format!("file://{}", root.display()),
        })
    }

    /// An S3 bucket (path-style requests; endpoint, region and credentials from `AWS_*` variables).
    pub fn s3(bucket: &str, prefix: &str, endpoint: Option<&str>) -> Result<Backend, StoreError> {
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
            message: e.to_string(),
        })?;
        let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(PrefixStore::new(s3, prefix))
        };
        Ok(Backend {
            store,
            rt: Self::runtime()?,
            url,
        })
    }

    fn err(&self, key: &str, e: object_store::Error) -> StoreError {
        s3_err(&self.url, key, e)
    }

    /// Whole object.
    pub fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        let p = Path::from(key);
        self.rt.block_on(async {
            let r = self.store.get(&p).await.map_err(|e| self.err(key, e))?;
            r.bytes().await.map_err(|e| self.err(key, e))
        })
    }

    /// Whole object and its version.
    pub fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), StoreError> {
        let p = Path::from(key);
        self.rt.block_on(async {
            let r = self.store.get(&p).await.map_err(|e| self.err(key, e))?;
            let v = Version {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            let b = r.bytes().await.map_err(|e| self.err(key, e))?;
            Ok((b, v))
        })
    }

    /// A byte range, with a deadline.
    pub fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
    ) -> Result<Bytes, StoreError> {
        let p = Path::from(key);
        let want = range.end - range.start;
        let b = self.rt.block_on(async {
            tokio::time::timeout(deadline, self.store.get_range(&p, range))
                .await
                .map_err(|_| StoreError::Timeout {
                    url: self.url.clone(),
                    key: key.to_string(),
                    after: deadline,
                })?
                .map_err(|e| self.err(key, e))
        })?;
        if b.len() as u64 != want {
            return Err(StoreError::Backend {
                url: self.url.clone(),
                key: key.to_string(),
                message: format!("short range read: {} of {want} bytes", b.len()),
            });
        }
        Ok(b)
    }

    /// Size of an object, or `None` if it does not exist.
    pub fn head(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let p = Path::from(key);
        match self.rt.block_on(self.store.head(&p)) {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(key, e)),
        }
    }

    /// Writes an object (overwriting: callers write content-addressed keys, or use [`Self::put_cas`]).
    pub fn put(&self, key: &str, data: Bytes) -> Result<(), StoreError> {
        let p = Path::from(key);
        self.rt
            .block_on(self.store.put(&p, PutPayload::from(data)))
            .map(|_| ())
            .map_err(|e| self.err(key, e))
    }

    /// Writes an object only if it is absent (`prev` None) or still at version `prev`.
    pub fn put_cas(
        &self,
        key: &str,
        data: Bytes,
        prev: Option<&Version>,
    ) -> Result<(), StoreError> {
        let p = Path::from(key);
        let mode = match prev {
            None => PutMode::Create,
            Some(v) => PutMode::Update(UpdateVersion {
                e_tag: v.e_tag.clone(),
                version: v.version.clone(),
            }),
        };
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        self.rt
            .block_on(self.store.put_opts(&p, PutPayload::from(data), opts))
            .map(|_| ())
            .map_err(|e| self.err(key, e))
    }

    /// Uploads a local file (multipart, streaming) to `key`.
    pub fn put_file(&self, key: &str, file: &FsPath) -> Result<(), StoreError> {
        let p = Path::from(key);
        self.rt.block_on(async {
            let mut f = tokio::fs::File::open(file)
                .await
                .map_err(|e| StoreError::io(file, e))?;
            let upload = self
                .store
                .put_multipart(&p)
                .await
                .map_err(|e| self.err(key, e))?;
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
                w.wait_for_capacity(4).await.map_err(|e| self.err(key, e))?;
                w.write(&buf[..n]);
            }
            w.finish().await.map(|_| ()).map_err(|e| self.err(key, e))
        })
    }

    /// Keys under a prefix (recursive).
    pub fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        Ok(self
            .list_info(prefix)?
            .into_iter()
            .map(|(k, _, _)| k)
            .collect())
    }

    /// Keys under a prefix (recursive) with their sizes and last-modified times (Unix seconds).
    pub fn list_info(&self, prefix: &str) -> Result<Vec<(String, u64, i64)>, StoreError> {
        let p = Path::from(prefix);
        self.rt.block_on(async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&p));
            while let Some(item) = s.next().await {
                let m = item.map_err(|e| self.err(prefix, e))?;
                out.push((m.location.to_string(), m.size, m.last_modified.timestamp()));
            }
            out.sort();
            Ok(out)
        })
    }

    /// Deletes an object (absent is fine).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let p = Path::from(key);
        self.rt.block_on(async {
            match self.store.delete(&p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }

    /// The URL this backend was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }
}
