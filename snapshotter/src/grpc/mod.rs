//! The snapshots gRPC service over a Unix socket, and ([`cri`]) the one CRI call a lazy pull needs: the
//! only module that uses `tonic` and `prost`.
//!
//! The code is generated at build time from containerd's vendored `snapshots.proto` (see `build.rs`);
//! each call is translated to [`Snapshots`] (synchronous: it takes a lock, writes a record, may ask
//! stratad) on tokio's blocking pool, and its errors to the gRPC codes containerd's `errdefs` maps
//! back (`NotFound`, `AlreadyExists` — the remote-snapshot answer —, `FailedPrecondition`, …).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Response, Status};

pub mod cri;

use crate::meta::Kind;
use crate::snapshots::{Info, Mount, SnapError, Snapshots};

/// Generated from the vendored protos (nested as their packages, as the generated paths expect).
#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod containerd {
    pub mod types {
        tonic::include_proto!("containerd.types");
    }
    pub mod services {
        pub mod snapshots {
            pub mod v1 {
                tonic::include_proto!("containerd.services.snapshots.v1");
            }
        }
    }
}

use containerd::services::snapshots::v1 as pb;
use pb::snapshots_server::{Snapshots as SnapshotsApi, SnapshotsServer};

fn status(e: SnapError) -> Status {
    let msg = e.to_string();
    match e {
        SnapError::NotFound(_) => Status::not_found(msg),
        SnapError::AlreadyExists(_) => Status::already_exists(msg),
        SnapError::FailedPrecondition(_) => Status::failed_precondition(msg),
        SnapError::InvalidArgument(_) => Status::invalid_argument(msg),
        SnapError::Layer(_) => Status::unavailable(msg),
        SnapError::Meta(_) | SnapError::Io { .. } => Status::internal(msg),
    }
}

fn mount_pb(m: Mount) -> containerd::types::Mount {
    containerd::types::Mount {
        r#type: m.kind,
        source: m.source,
        target: String::new(),
        options: m.options,
    }
}

fn timestamp(nanos: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (nanos / 1_000_000_000) as i64,
        nanos: (nanos % 1_000_000_000) as i32,
    }
}

fn info_pb(i: Info) -> pb::Info {
    let kind = match i.kind {
        Kind::View => pb::Kind::View,
        Kind::Active => pb::Kind::Active,
        Kind::Committed => pb::Kind::Committed,
    };
    pb::Info {
        name: i.name,
        parent: i.parent,
        kind: kind as i32,
        created_at: Some(timestamp(i.created)),
        updated_at: Some(timestamp(i.updated)),
        labels: i.labels.into_iter().collect(),
    }
}

fn labels(m: std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    m.into_iter().collect()
}

/// The service: [`Snapshots`] behind gRPC.
struct Service(Arc<Snapshots>);

impl Service {
    /// Runs `f` on the blocking pool (it may wait on disk or on stratad).
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Snapshots) -> Result<T, SnapError> + Send + 'static,
    ) -> Result<T, Status> {
        let s = self.0.clone();
        match tokio::task::spawn_blocking(move || f(&s)).await {
            Ok(r) => r.map_err(status),
            Err(e) => Err(Status::internal(format!("snapshot operation failed: {e}"))),
        }
    }
}

type ListStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::ListSnapshotsResponse, Status>>>;

#[tonic::async_trait]
impl SnapshotsApi for Service {
    async fn prepare(
        &self,
        r: Request<pb::PrepareSnapshotRequest>,
    ) -> Result<Response<pb::PrepareSnapshotResponse>, Status> {
        let r = r.into_inner();
        tracing::debug!(key = r.key, parent = r.parent, labels = ?r.labels, "prepare");
        let m = self
            .run(move |s| s.prepare(&r.key, &r.parent, labels(r.labels), false))
            .await?;
        Ok(Response::new(pb::PrepareSnapshotResponse {
            mounts: m.into_iter().map(mount_pb).collect(),
        }))
    }

    async fn view(
        &self,
        r: Request<pb::ViewSnapshotRequest>,
    ) -> Result<Response<pb::ViewSnapshotResponse>, Status> {
        let r = r.into_inner();
        let m = self
            .run(move |s| s.prepare(&r.key, &r.parent, labels(r.labels), true))
            .await?;
        Ok(Response::new(pb::ViewSnapshotResponse {
            mounts: m.into_iter().map(mount_pb).collect(),
        }))
    }

    async fn mounts(
        &self,
        r: Request<pb::MountsRequest>,
    ) -> Result<Response<pb::MountsResponse>, Status> {
        let key = r.into_inner().key;
        let m = self.run(move |s| s.mounts(&key)).await?;
        Ok(Response::new(pb::MountsResponse {
            mounts: m.into_iter().map(mount_pb).collect(),
        }))
    }

    async fn commit(&self, r: Request<pb::CommitSnapshotRequest>) -> Result<Response<()>, Status> {
        let r = r.into_inner();
        self.run(move |s| s.commit(&r.name, &r.key, labels(r.labels)))
            .await?;
        Ok(Response::new(()))
    }

    async fn remove(&self, r: Request<pb::RemoveSnapshotRequest>) -> Result<Response<()>, Status> {
        let key = r.into_inner().key;
        self.run(move |s| s.remove(&key)).await?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        r: Request<pb::StatSnapshotRequest>,
    ) -> Result<Response<pb::StatSnapshotResponse>, Status> {
        let key = r.into_inner().key;
        let i = self.run(move |s| s.stat(&key)).await?;
        Ok(Response::new(pb::StatSnapshotResponse {
            info: Some(info_pb(i)),
        }))
    }

    async fn update(
        &self,
        r: Request<pb::UpdateSnapshotRequest>,
    ) -> Result<Response<pb::UpdateSnapshotResponse>, Status> {
        let r = r.into_inner();
        let info = r
            .info
            .ok_or_else(|| Status::invalid_argument("update without info"))?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let i = self
            .run(move |s| s.update(&info.name, labels(info.labels), &paths))
            .await?;
        Ok(Response::new(pb::UpdateSnapshotResponse {
            info: Some(info_pb(i)),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        _: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let all = self.run(|s| Ok(s.list())).await?;
        // Batches of 100 (containerd's own page size), each well under gRPC's message limit.
        let pages: Vec<_> = all
            .chunks(100)
            .map(|c| {
                Ok(pb::ListSnapshotsResponse {
                    info: c.iter().cloned().map(info_pb).collect(),
                })
            })
            .collect();
        Ok(Response::new(tokio_stream::iter(pages)))
    }

    async fn usage(
        &self,
        r: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let key = r.into_inner().key;
        let (size, inodes) = self.run(move |s| s.usage(&key)).await?;
        Ok(Response::new(pb::UsageResponse {
            size: size as i64,
            inodes: inodes as i64,
        }))
    }

    async fn cleanup(&self, _: Request<pb::CleanupRequest>) -> Result<Response<()>, Status> {
        self.run(|s| {
            s.cleanup();
            Ok(())
        })
        .await?;
        Ok(Response::new(()))
    }
}

/// Errors serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("binding {path}: {source}")]
    Bind {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `snapshots` on a Unix socket at `address` (replacing a stale one) until `shutdown` ends.
pub async fn serve(
    snapshots: Arc<Snapshots>,
    address: &Path,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let bind = |source| ServeError::Bind {
        path: address.to_path_buf(),
        source,
    };
    if let Some(dir) = address.parent() {
        std::fs::create_dir_all(dir).map_err(bind)?;
    }
    match std::fs::remove_file(address) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(bind(e)),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(address).map_err(bind)?;
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(0o600);
        std::fs::set_permissions(address, mode).map_err(bind)?;
    }
    tracing::info!(address = %address.display(), "serving containerd's snapshots API");
    tonic::transport::Server::builder()
        .add_service(SnapshotsServer::new(Service(snapshots)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            shutdown,
        )
        .await?;
    Ok(())
}
