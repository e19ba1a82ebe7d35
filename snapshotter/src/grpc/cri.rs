//! `strata-snapshotter pull`: a lazy pull through containerd's CRI plugin (what the kubelet does).
//!
//! `ctr image pull` (containerd 1.6) downloads every layer into the content store before it unpacks,
//! and passes no labels to the snapshotter. The CRI plugin's pull unpacks as it fetches and hands each
//! layer descriptor's `containerd.io/snapshot/…` annotations to `Prepare` (with
//! `disable_snapshot_annotations = false`), so strata layers are never downloaded. This client makes
//! that one call, `runtime.v1.ImageService/PullImage`, on containerd's socket — the same image lands in
//! containerd's `k8s.io` namespace, where `ctr -n k8s.io run --snapshotter strata` starts it.
//!
//! The two messages are written out here rather than generated: the CRI `api.proto`
//! (k8s.io/cri-api, Apache-2.0) is large and only these fields are needed; their numbers are CRI's.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// `runtime.v1.ImageSpec` (the fields a pull needs).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}

/// `runtime.v1.AuthConfig` (username and password).
#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthConfig {
    #[prost(string, tag = "1")]
    pub username: String,
    #[prost(string, tag = "2")]
    pub password: String,
}

/// `runtime.v1.PullImageRequest` (without the pod sandbox config).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PullImageRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
    #[prost(message, optional, tag = "2")]
    pub auth: Option<AuthConfig>,
}

/// `runtime.v1.PullImageResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PullImageResponse {
    #[prost(string, tag = "1")]
    pub image_ref: String,
}

/// Errors of a CRI pull.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("connecting to containerd at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("containerd's CRI plugin: {0}")]
    Cri(#[from] tonic::Status),
}

async fn connect(socket: &Path) -> Result<Channel, PullError> {
    let path = socket.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(TokioIo::new)
        }
    });
    // The URI is not used: every connection goes to the socket.
    Endpoint::from_static("http://containerd")
        .connect_with_connector(connector)
        .await
        .map_err(|source| PullError::Connect {
            path: socket.to_path_buf(),
            source,
        })
}

/// Pulls `image` through the CRI plugin on containerd's `socket`; returns the image id.
pub async fn pull(
    socket: &Path,
    image: &str,
    auth: Option<(String, String)>,
) -> Result<String, PullError> {
    let channel = connect(socket).await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let req = PullImageRequest {
        image: Some(ImageSpec {
            image: image.to_string(),
        }),
        auth: auth.map(|(username, password)| AuthConfig { username, password }),
    };
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/runtime.v1.ImageService/PullImage");
    let codec = tonic_prost::ProstCodec::<PullImageRequest, PullImageResponse>::default();
    let reply = grpc
        .unary(tonic::Request::new(req), path, codec)
        .await?
        .into_inner();
    Ok(reply.image_ref)
}
