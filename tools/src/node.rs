//! The node commands the full CLI runs its own way: `umount` and `rm` against a daemon older than the
//! batch delete (one by one), and `daemon` (upgrade, status, scrub). The lean CLI (`strata_cli`) has
//! the rest.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use strata_api::{Client, ClientError};
use strata_cli::args::{RmArgs, UmountArgs};
use strata_cli::node::{batch, failures, print_removed, rm_request, umount_request};
use strata_fs::teardown::{Candidate, DeleteRequest};

use crate::images::human;

/// `strata umount` (as the full CLI runs it): stops the sandboxes (one batch request), or with
/// `--purge` removes them; against a daemon without the batch route, one by one.
pub fn umount(socket: &Path, a: &UmountArgs) -> Result<()> {
    let reply = delete(socket, &umount_request(a))?;
    failures(&reply).map_or(Ok(()), |e| Err(e.into()))
}

/// `strata rm` (as the full CLI runs it): as the lean CLI's (`strata_cli::node::rm`), and against a
/// daemon without the batch route, one by one.
pub fn rm(socket: &Path, a: &RmArgs) -> Result<()> {
    let reply = delete(socket, &rm_request(a))?;
    print_removed(&reply, a.json)?;
    failures(&reply).map_or(Ok(()), |e| Err(e.into()))
}

/// One batch delete's reply. A daemon older than the batch route (it answers `404`, "no route") gets
/// the same selection made here and one `DELETE` per sandbox: a CLI upgraded before its node's daemon
/// still tears down.
fn delete(socket: &Path, body: &Value) -> Result<Value> {
    match batch(socket, body)? {
        Some(reply) => Ok(reply),
        None => one_by_one(&Client::at(socket), body),
    }
}

/// The batch delete `body` asks for, done against a daemon without the batch route: the selection made
/// from `GET /v1/sandboxes` as the daemon would make it, then one `DELETE` per sandbox; answers as the
/// batch route does.
fn one_by_one(c: &Client, body: &Value) -> Result<Value> {
    let req: DeleteRequest =
        serde_json::from_value(body.clone()).context("batch delete request")?;
    let purge = req.purge.unwrap_or(true);
    let list = c.call("GET", "/v1/sandboxes", None)?;
    let candidates = list.as_array().into_iter().flatten().filter_map(|s| {
        Some(Candidate {
            id: s["id"].as_str()?,
            image: s["image"].as_str()?,
            manifest: s["manifest"].as_str()?,
            stopped: s["state"] == "stopped",
        })
    });
    let query = match (purge, req.force) {
        (true, true) => "?purge=1&force=1",
        (true, false) => "?purge=1",
        (false, _) => "",
    };
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    for id in req.select_among(candidates, purge) {
        match c.call("DELETE", &format!("/v1/sandboxes/{id}{query}"), None) {
            Ok(v) => removed.push(v),
            Err(ClientError::Api { kind, message, .. }) => {
                failed.push(json!({"id": id, "error": message, "kind": kind}))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(json!({"removed": removed, "failed": failed, "purge": purge}))
}

/// `strata daemon ...`.
#[derive(clap::Subcommand)]
pub enum DaemonCmd {
    /// Replace the serving stratad with the binary now installed, without disturbing sandboxes: the
    /// descriptor holder starts the new server on the same FUSE connection. Waits until it serves.
    Upgrade {
        /// Seconds the whole upgrade may take (every call to stratad included); exits non-zero, with
        /// the reason, when the upgrade did not happen within it.
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
        #[arg(long)]
        json: bool,
    },
    /// The daemon's status document (JSON).
    Status,
    /// Check the node's cached data at rest: every chunk of the chunk cache and (fanotify mode) every
    /// filled chunk of every view file is read back and hashed; a bad one is fetched again on its next
    /// read. Prints files, chunks, bytes, bad chunks and seconds.
    Scrub {
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `strata daemon` command.
pub fn daemon(socket: &Path, cmd: DaemonCmd) -> Result<()> {
    let c = Client::at(socket);
    match cmd {
        DaemonCmd::Status => {
            println!("{}", c.call("GET", "/v1/status", None)?);
            Ok(())
        }
        DaemonCmd::Upgrade { timeout, json } => crate::upgrade::upgrade(&c, timeout, json),
        DaemonCmd::Scrub { json } => {
            let r = c.call("POST", "/v1/scrub", None)?;
            if json {
                println!("{r}");
            } else {
                let n = |k: &str| r[k].as_u64().unwrap_or(0);
                let secs = r["seconds"].as_f64().unwrap_or(0.0);
                println!(
                    "scrubbed the chunk cache and {} view files: {} chunks, {} in {:.2} s ({:.0} MB/s); {} bad, fetched again when read",
                    n("files"),
                    n("chunks"),
                    human(n("bytes")),
                    secs,
                    n("bytes") as f64 / secs.max(1e-9) / 1e6,
                    n("bad"),
                );
            }
            if r["bad"].as_u64().unwrap_or(0) > 0 {
                return Err(anyhow::anyhow!(
                    "scrub found {} bad chunks (now refetched on read)",
                    r["bad"]
                ));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
