//! `strata daemon upgrade`: replace the serving stratad with the binary installed at its path, and say
//! truthfully whether that happened.
//!
//! 1. Ask the status (it names stratad's path and the holder's last upgrade, `holder.upgrade.seq`).
//! 2. Check the installed binary: it runs and answers `--version` (bounded). A missing, non-executable
//!    or foreign file fails here, before anything is touched.
//! 3. `POST /v1/upgrade`; the holder checks the binary again, hands over, and reports the outcome with
//!    the next `seq`.
//! 4. Poll the status until that outcome is there. A failed upgrade (the new server died or did not
//!    answer, and the last working binary serves again) exits non-zero with the holder's reason.
//!
//! Every control call is bounded by what is left of `--timeout`: a daemon that does not answer ends the
//! command with an error at its timeout, never a hang.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use strata_api::Client;

use crate::holder::report::Upgrade;
use crate::holder::server::Binary;
use crate::holder::PROBE_LIMIT;

/// The time left before `deadline`, or an error naming what was being waited for.
fn left(deadline: Instant, timeout: f64, what: &str) -> Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => bail!("not upgraded (as far as is known): {what} did not complete within --timeout {timeout} s"),
    }
}

fn seq_of(status: &Value) -> u64 {
    status["holder"]["upgrade"]["seq"].as_u64().unwrap_or(0)
}

/// Runs the upgrade; prints the outcome (`json`: one JSON document).
pub fn upgrade(c: &Client, timeout: f64, json: bool) -> Result<()> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(timeout.max(0.0));
    let before = c.call_within(
        "GET",
        "/v1/status",
        None,
        Some(left(deadline, timeout, "the status call")?),
    )?;
    let old = before["pid"].as_u64().unwrap_or(0);
    let holder_mode = before["mode"] == "holder";
    if holder_mode && before["holder_alive"] == false {
        bail!("not upgraded: stratad's descriptor holder is gone (the server keeps serving, but nobody can start a new one); restart the node when convenient");
    }
    if let Some(exe) = before["holder"]["exe"].as_str() {
        let limit = left(deadline, timeout, "checking the new binary")?.min(PROBE_LIMIT);
        Binary::open(Path::new(exe))
            .and_then(|b| b.probe(limit))
            .map_err(|e| anyhow::anyhow!("not upgraded, the running server stays: {e}"))?;
    }
    let seq = seq_of(&before);
    c.call_within(
        "POST",
        "/v1/upgrade",
        None,
        Some(left(deadline, timeout, "the upgrade request")?),
    )?;
    let after = loop {
        // Connections made while no server runs wait in the socket's backlog: bounded by the deadline.
        let wait = left(deadline, timeout, "the upgrade")?;
        if let Ok(v) = c.call_within("GET", "/v1/status", None, Some(wait)) {
            // A holder reports each upgrade's outcome; under systemd, a new pid is the outcome.
            let done = match holder_mode {
                true => seq_of(&v) > seq,
                false => v["pid"].as_u64().is_some_and(|p| p != old),
            };
            if done {
                break v;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let outcome: Option<Upgrade> = serde_json::from_value(after["holder"]["upgrade"].clone()).ok();
    if let Some(Upgrade {
        ok: false, error, ..
    }) = &outcome
    {
        bail!(
            "upgrade failed: {}",
            error.as_deref().unwrap_or("no reason given")
        );
    }
    let out = json!({
        "old_pid": old,
        "pid": after["pid"],
        "old_version": before["version"],
        "version": after["version"],
        "seconds": start.elapsed().as_secs_f64(),
    });
    match json {
        true => println!("{out}"),
        false => println!(
            "stratad upgraded: pid {old} -> {}, version {} -> {}",
            after["pid"], before["version"], after["version"]
        ),
    }
    Ok(())
}
