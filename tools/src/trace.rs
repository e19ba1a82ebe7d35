//! `strata trace IMAGE -- CMD`: records which chunks a run of CMD in IMAGE reads, as the image's prefetch
//! plan.
//!
//! Through stratad: a trace is started (one at a time per node), the page cache is dropped so that every
//! read reaches the blob server (`--keep-caches` skips that, at the cost of an incomplete trace), a
//! sandbox of the image is mounted and CMD runs in it under bubblewrap with the image's environment and
//! working directory; then the sandbox is purged (its upper directory too), the trace stopped, the
//! entries kept to the image's own blobs and stored as the image's plan ([`strata_prefetch::Plan`]). From
//! then on, every node that creates a sandbox of the image warms the plan in the background. The plan is
//! stored even when CMD fails (a failing run still says what a start reads); the exit status says so.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use strata_api::{Client, ClientError, ErrorKind};
use strata_prefetch::{layerplan, Plan, PlanEntry};
use strata_registry::model::LayerDescriptor;
use strata_registry::store::Store;

use crate::images::{human, resolve_image};

/// Arguments of `strata trace`.
#[derive(clap::Args)]
pub struct TraceArgs {
    /// Image (tag or manifest digest).
    pub image: String,
    /// Do not drop the page cache first (reads it serves are then missing from the plan).
    #[arg(long)]
    pub keep_caches: bool,
    #[arg(long)]
    pub json: bool,
    /// The command to run in the image, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Stops the daemon's trace on every path out.
struct TraceGuard<'a> {
    client: &'a Client,
    stopped: bool,
}

impl TraceGuard<'_> {
    fn stop(&mut self) -> Result<Vec<PlanEntry>> {
        self.stopped = true;
        let v = self.client.call("POST", "/v1/trace/stop", None)?;
        Ok(serde_json::from_value(v["entries"].clone())?)
    }
}

impl Drop for TraceGuard<'_> {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.client.call("POST", "/v1/trace/stop", None);
        }
    }
}

fn drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("strata: warning: cannot drop the page cache ({e}): the trace may miss reads");
    }
}

fn run_in(
    rootfs: &Path,
    config: &strata_registry::model::ImageConfig,
    cmd: &[String],
) -> Result<i32> {
    let mut c = Command::new("bwrap");
    c.arg("--bind")
        .arg(rootfs)
        .arg("/")
        .args([
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--unshare-pid",
            "--die-with-parent",
        ])
        .args([
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ]);
    for e in &config.env {
        if let Some((k, v)) = e.split_once('=') {
            c.args(["--setenv", k, v]);
        }
    }
    if let Some(w) = &config.working_dir {
        c.args(["--chdir", w]);
    }
    c.arg("--").args(cmd);
    let st = c
        .status()
        .context("running bubblewrap (apt-get install bubblewrap)")?;
    Ok(st.code().unwrap_or(128))
}

/// Removes the trace's own sandbox for good. stratad waits for processes that are exiting (bubblewrap's
/// sandbox PID 1 outlives it by a moment); one still running there after the command ended was left
/// behind by it, and goes with the sandbox.
fn remove_trace_sandbox(client: &Client, id: &str) -> Result<serde_json::Value, ClientError> {
    let path = format!("/v1/sandboxes/{id}?purge=1");
    match client.call("DELETE", &path, None) {
        Err(ClientError::Api {
            kind: ErrorKind::Sandbox,
            ..
        }) => client.call("DELETE", &format!("{path}&force=1"), None),
        other => other,
    }
}

/// `strata trace`.
pub fn trace(store: &Store, socket: &Path, a: TraceArgs) -> Result<()> {
    let start = Instant::now();
    let (digest, manifest) = resolve_image(store, &a.image)?;
    let digest = match digest {
        Some(d) => d,
        None => store.put_manifest(&manifest)?,
    };
    let mut layers = Vec::new();
    for l in &manifest.layers {
        layers.push(store.get_layer(&l.digest)?);
    }
    let blobs: std::collections::HashSet<_> = layers
        .iter()
        .flat_map(|l| l.blobs.iter().map(|b| b.digest))
        .collect();
    let client = Client {
        socket: socket.to_path_buf(),
    };
    client
        .call("POST", "/v1/trace/start", None)
        .with_context(|| format!("starting a trace through stratad ({})", socket.display()))?;
    let mut guard = TraceGuard {
        client: &client,
        stopped: false,
    };
    if !a.keep_caches {
        drop_caches();
    }
    let id = format!("trace-{}", std::process::id());
    let sb = client.call(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"image": digest.to_string(), "id": id})),
    )?;
    let rootfs = PathBuf::from(sb["rootfs"].as_str().unwrap_or_default());
    let code = run_in(&rootfs, &manifest.config, &a.command);
    let removed = remove_trace_sandbox(&client, &id);
    let entries = guard.stop()?;
    removed?;
    let code = code?;
    let plan = Plan::recorded(digest, a.command.clone(), entries, &blobs);
    let bytes: u64 = plan_bytes(store, &layers, &plan)?;
    let plan_digest = plan.put(store)?;
    let with_digests: Vec<_> = manifest
        .layers
        .iter()
        .map(|l| l.digest)
        .zip(layers.iter().cloned())
        .collect();
    let layer_plans = layerplan::record_run(store, &with_digests, &plan.entries)?;
    if a.json {
        println!(
            "{}",
            json!({
                "image": digest.to_string(), "plan": plan_digest.to_string(),
                "chunks": plan.entries.len(), "bytes": bytes, "exit_code": code,
                "layer_plans": layer_plans,
                "seconds": start.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "plan {plan_digest} for image {digest}: {} chunks, {}; merged into {layer_plans} layer plan(s)",
            plan.entries.len(),
            human(bytes)
        );
    }
    if code != 0 {
        bail!("the traced command exited with status {code} (the plan was stored)");
    }
    Ok(())
}

/// Uncompressed bytes of a plan's chunks.
fn plan_bytes(store: &Store, layers: &[LayerDescriptor], plan: &Plan) -> Result<u64> {
    let mut sizes = std::collections::HashMap::new();
    for l in layers {
        for b in &l.blobs {
            if sizes.contains_key(&b.digest) {
                continue;
            }
            // Plans name units: a pieced chunk's pieces.
            let (toc, _) = strata_registry::pieces::units(store.get_toc(b)?);
            sizes.insert(
                b.digest,
                toc.chunks
                    .iter()
                    .map(|c| u64::from(c.len))
                    .collect::<Vec<_>>(),
            );
        }
    }
    Ok(plan
        .entries
        .iter()
        .filter_map(|e| sizes.get(&e.blob)?.get(e.chunk as usize).copied())
        .sum())
}
