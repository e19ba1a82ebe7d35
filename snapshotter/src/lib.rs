//! `strata-snapshotter`: strata as a containerd proxy snapshotter.
//!
//! containerd names it in `proxy_plugins` and speaks its snapshots gRPC API on `--address`
//! ([`grpc`], generated from containerd's vendored `snapshots.proto`). The snapshot model lives in
//! [`snapshots`], its crash-safe records in [`meta`]; strata layers are mounted by stratad, reached
//! over its control socket (`STRATA_SOCKET`, as the CLI does) through its layer service ([`stratad`]).
//!
//! **Why a binary of its own, not a part of stratad.** stratad serves every byte a container reads
//! and hands its FUSE connection over on upgrades; the snapshotter is control plane only, and holds no
//! kernel object (containerd mounts the overlays, stratad owns the layer mounts and their refcounts).
//! So it can crash, restart or be upgraded on containerd's schedule without a single read noticing,
//! and stratad's data path stays free of gRPC, HTTP/2 and their dependencies (tonic, hyper, axum: a
//! large part of this binary). Both share one layer mount per node, one chunk cache and one cache
//! bound, because the snapshotter asks stratad for the very mounts sandboxes use.

pub mod grpc;
pub mod meta;
pub mod snapshots;
pub mod stratad;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use strata_builder::oci::distribution::auth::Credentials;

use crate::snapshots::Snapshots;

/// strata's containerd snapshotter.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// The Unix socket containerd connects to (its `proxy_plugins` address).
    #[arg(long, default_value = "/run/strata/snapshotter.sock")]
    address: PathBuf,
    /// Where snapshot records and the directories of plain layers and containers live.
    #[arg(long, default_value = "/var/lib/strata-snapshotter")]
    root: PathBuf,
    /// stratad's control socket.
    #[arg(
        long,
        env = "STRATA_SOCKET",
        default_value = "/run/strata/stratad.sock"
    )]
    strata_socket: PathBuf,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Pulls an image through containerd's CRI plugin, which unpacks as it fetches: strata layers are
    /// mounted by the snapshotter and never downloaded (`ctr image pull` downloads every layer).
    Pull {
        /// The image (`HOST/REPO:TAG`), as the kubelet names it.
        image: String,
        /// containerd's socket.
        #[arg(long, default_value = "/run/containerd/containerd.sock")]
        containerd: PathBuf,
        /// Registry credentials `USER:PASSWORD` (else STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD, then
        /// the registry's entry in an auth file — $DOCKER_CONFIG/config.json or ~/.docker/config.json,
        /// as `strata login` writes it — as `strata import` finds them; else containerd's own registry
        /// configuration).
        #[arg(long, env = "STRATA_REGISTRY_CREDS", hide_env_values = true)]
        creds: Option<String>,
    },
}

/// The registry host of a CRI image name: its first component when that names a host
/// (`HOST[:PORT]/…`, `localhost/…`), else Docker Hub.
fn registry_host(image: &str) -> &str {
    match image.split_once('/') {
        Some((h, _)) if h.contains(['.', ':']) || h == "localhost" => h,
        _ => "docker.io",
    }
}

/// The credentials of a pull's `PullImage` request: `--creds`, else those `strata import` would use
/// for the image's registry ([`Credentials::find`]); `None` leaves containerd's own configuration.
fn pull_auth(image: &str, creds: Option<String>) -> anyhow::Result<Option<(String, String)>> {
    if let Some(c) = creds {
        return Ok(Some(match c.split_once(':') {
            Some((u, p)) => (u.to_string(), p.to_string()),
            None => (c, String::new()),
        }));
    }
    let host = registry_host(image);
    let mut found = Credentials::find(host)?;
    if found.is_none() && host == "docker.io" {
        // Docker Hub's entry is under `index.docker.io`.
        found = Credentials::find("index.docker.io")?;
    }
    match found {
        Some(f) => f
            .credentials
            .user_password()
            .map(Some)
            .ok_or_else(|| anyhow::anyhow!("{}: not base64 of USER:PASSWORD", f.from)),
        None => Ok(None),
    }
}

/// Runs `f` to completion on a small runtime.
fn block_on<T>(f: impl std::future::Future<Output = T>) -> anyhow::Result<T> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    Ok(rt.block_on(f))
}

/// Makes stratad's holds match the records, retrying while stratad is unreachable.
fn reconcile(s: Arc<Snapshots>) {
    std::thread::spawn(move || {
        let mut wait = Duration::from_millis(200);
        loop {
            match s.reconcile() {
                Ok((dropped, taken)) => {
                    tracing::info!(dropped, taken, "layer holds reconciled with stratad");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reconciling layer holds with stratad: retrying");
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    });
}

/// The program: serves containerd (the default) or pulls an image through containerd's CRI plugin.
pub fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Some(Cmd::Pull {
        image,
        containerd,
        creds,
    }) = args.cmd
    {
        let auth = pull_auth(&image, creds)?;
        let id = block_on(grpc::cri::pull(&containerd, &image, auth))??;
        println!("{id}");
        return Ok(());
    }
    let meta = meta::Meta::open(&args.root)
        .with_context(|| format!("opening the snapshot records in {}", args.root.display()))?;
    let layers = stratad::Stratad {
        client: strata_api::Client {
            socket: args.strata_socket.clone(),
        },
    };
    let s = Arc::new(Snapshots::new(meta, Box::new(layers)));
    s.cleanup();
    reconcile(s.clone());
    block_on(async {
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(_) => return std::future::pending().await,
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("stopping (snapshots and mounts stay)");
        };
        grpc::serve(s, &args.address, shutdown).await
    })??;
    Ok(())
}

#[cfg(test)]
mod pull_tests {
    #[test]
    fn registry_hosts() {
        assert_eq!(
            super::registry_host("127.0.0.1:5000/a/b:v1"),
            "127.0.0.1:5000"
        );
        assert_eq!(super::registry_host("localhost/a:v1"), "localhost");
        assert_eq!(super::registry_host("reg.example/a"), "reg.example");
        assert_eq!(super::registry_host("library/debian:12"), "docker.io");
        assert_eq!(super::registry_host("debian"), "docker.io");
    }
}
