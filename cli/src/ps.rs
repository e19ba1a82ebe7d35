//! `strata ps`: the node's sandboxes and the daemon's status, for people (a table) or machines (`--json`).

use std::path::Path;

use anyhow::Result;
use serde_json::json;
use strata_api::Client;

/// Bytes for humans.
pub fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// `strata ps`.
pub fn ps(socket: &Path, json_out: bool) -> Result<()> {
    let c = Client::at(socket);
    let sandboxes = c.call("GET", "/v1/sandboxes", None)?;
    let status = c.call("GET", "/v1/status", None)?;
    if json_out {
        println!("{}", json!({"sandboxes": sandboxes, "status": status}));
        return Ok(());
    }
    println!(
        "{:<24} {:<32} {:<8} {:>6} {:>12} {:>9} {:>12}  ROOTFS (STOPPED: UPPER DIRECTORY; VM: SCRATCH DRIVE)",
        "SANDBOX", "IMAGE", "STATE", "LAYERS", "FETCHED", "WAITED", "IMAGE SIZE"
    );
    for s in sandboxes.as_array().into_iter().flatten() {
        println!(
            "{:<24} {:<32} {:<8} {:>6} {:>12} {:>9} {:>12}  {}",
            s["id"].as_str().unwrap_or(""),
            s["image"].as_str().unwrap_or(""),
            s["state"].as_str().unwrap_or(""),
            s["layers"].as_array().map_or(0, |l| l.len()),
            human(s["fetched_bytes"].as_u64().unwrap_or(0)),
            format!("{:.2} s", s["read_wait_seconds"].as_f64().unwrap_or(0.0)),
            human(s["image_bytes"].as_u64().unwrap_or(0)),
            match (s["vm"]["scratch"].as_str(), s["state"].as_str()) {
                // A microVM has no rootfs on the host: its scratch drive.
                (Some(scratch), _) => format!("(vm) {scratch}"),
                // A stopped sandbox's rootfs is gone: what it keeps is its upper directory.
                (None, Some("stopped")) => format!("(upper) {}", s["upper"].as_str().unwrap_or("")),
                (None, _) => s["rootfs"].as_str().unwrap_or("").to_string(),
            }
        );
    }
    let cache = &status["cache"];
    // `fanotify` mode caches blobs in their view files (the chunk cache holds only what they could not
    // take): those are what the node holds.
    let views = &status["fanotify"];
    let (what, used, chunks) = match views.is_object() {
        true => ("view files", &views["disk_bytes"], &views["kept_chunks"]),
        false => ("cache", &cache["used"], &cache["chunks"]),
    };
    println!(
        "fetched for no sandbox: {}  layers mounted: {}  {what}: {} of {} ({} chunks)",
        human(status["fetched_unattributed"].as_u64().unwrap_or(0)),
        status["layers"].as_array().map_or(0, |l| l.len()),
        human(used.as_u64().unwrap_or(0)),
        human(cache["capacity"].as_u64().unwrap_or(0)),
        chunks.as_u64().unwrap_or(0)
    );
    if let Some(mode) = status["mount_mode"].as_str() {
        let passed = status["mount_modes"]["passed_over"].as_array().cloned();
        let why: Vec<String> = passed
            .into_iter()
            .flatten()
            .map(|p| {
                format!(
                    "not {}: {}",
                    p["mode"].as_str().unwrap_or("?"),
                    p["reason"].as_str().unwrap_or("")
                )
            })
            .collect();
        match why.is_empty() {
            true => println!("mount mode: {mode}"),
            false => println!("mount mode: {mode} ({})", why.join("; ")),
        }
    }
    for (image, w) in status["prefetch"].as_object().into_iter().flatten() {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        let source = match w["source"].as_str() {
            Some("layers") => format!(
                " (inherited: {} layer plan(s))",
                w["layers"].as_array().map_or(0, Vec::len)
            ),
            _ => String::new(),
        };
        println!(
            "prefetch {image}{source}: {} chunks planned, {} fetched ({}){}{}",
            n("planned"),
            n("fetched"),
            human(n("bytes")),
            match n("errors") {
                0 => String::new(),
                e => format!(", {e} errors"),
            },
            if w["done"].as_bool() == Some(true) {
                ", done"
            } else {
                ""
            }
        );
    }
    if let Some(image) = status["recording_plan"].as_str() {
        println!("recording a prefetch plan for {image}");
    }
    Ok(())
}
