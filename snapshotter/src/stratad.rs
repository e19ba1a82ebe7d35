//! Reaching stratad's layer service over its control socket (`POST/DELETE/GET /v1/layers`, see
//! `strata_fs::layers`), behind a small trait so the snapshot logic is tested without a daemon.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::json;
use strata_api::{Client, ClientError, ErrorKind};
use strata_fs::layers::percent_encode;
use strata_registry::digest::Digest;

/// Prefix of every hold this snapshotter takes: `snapshotter:<snapshot name>`.
pub const HOLDER_PREFIX: &str = "snapshotter:";

/// The holder name of a committed snapshot's layer hold.
pub fn holder(snapshot: &str) -> String {
    format!("{HOLDER_PREFIX}{snapshot}")
}

/// Errors of the layer service.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Api(#[from] ClientError),
    #[error("stratad sent a bad reply: {0}")]
    Reply(String),
}

/// One hold, as stratad lists it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Hold {
    pub digest: Digest,
    pub holder: String,
    pub path: PathBuf,
}

/// What the snapshotter needs of stratad.
pub trait LayerService: Send + Sync {
    /// Takes (or finds) `holder`'s hold on layer `digest`: its mount point.
    fn hold(
        &self,
        digest: &Digest,
        holder: &str,
        store: Option<&str>,
    ) -> Result<PathBuf, LayerError>;
    /// Drops a hold; a hold that does not exist is not an error.
    fn release(&self, digest: &Digest, holder: &str) -> Result<(), LayerError>;
    /// Every hold on the node.
    fn holds(&self) -> Result<Vec<Hold>, LayerError>;
}

/// stratad's control socket.
pub struct Stratad {
    pub client: Client,
}

impl LayerService for Stratad {
    fn hold(
        &self,
        digest: &Digest,
        holder: &str,
        store: Option<&str>,
    ) -> Result<PathBuf, LayerError> {
        let body = json!({"digest": digest, "holder": holder, "store": store});
        let v = self.client.call("POST", "/v1/layers", Some(&body))?;
        let h: Hold = serde_json::from_value(v).map_err(|e| LayerError::Reply(e.to_string()))?;
        Ok(h.path)
    }

    fn release(&self, digest: &Digest, holder: &str) -> Result<(), LayerError> {
        let path = format!("/v1/layers/{digest}?holder={}", percent_encode(holder));
        match self.client.call("DELETE", &path, None) {
            Ok(_) => Ok(()),
            Err(ClientError::Api {
                kind: ErrorKind::NotFound,
                ..
            }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn holds(&self) -> Result<Vec<Hold>, LayerError> {
        let v = self.client.call("GET", "/v1/layers", None)?;
        serde_json::from_value(v).map_err(|e| LayerError::Reply(e.to_string()))
    }
}
