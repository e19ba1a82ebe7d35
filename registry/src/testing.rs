//! Test support shared by every crate's tests (not part of the registry's API): what a test does when
//! the machine lacks something it needs — root, kernel EROFS, `/dev/fuse`, moto, bubblewrap, runc, ….
//!
//! Outside CI such a test skips: it says so on standard error and appends a line `test<TAB>what` to the
//! skip log ([`skip_log`]), which `scripts/test` empties before the run and counts after it, so a run
//! that skipped says how much. In CI (`CI=true`) or with `STRATA_REQUIRE_ALL=1` nothing may be missing:
//! the test panics, naming what is missing, so that a suite cannot pass by skipping.

use std::io::Write;
use std::path::PathBuf;

/// True when every test must run: `CI=true` (or `1`), or `STRATA_REQUIRE_ALL=1` (or `true`).
pub fn strict() -> bool {
    let on = |var: &str| {
        std::env::var(var).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "True"))
    };
    on("CI") || on("STRATA_REQUIRE_ALL")
}

/// The skip log: `$STRATA_SKIP_LOG`, else `/var/tmp/strata-tests/skips`.
pub fn skip_log() -> PathBuf {
    std::env::var_os("STRATA_SKIP_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/strata-tests/skips"))
}

/// `available` when `what` (a phrase: "root, kernel EROFS and /dev/fuse") is there. When it is not, the
/// calling test fails in strict mode ([`strict`]); otherwise the skip is reported and logged, and the
/// caller skips what needs it.
pub fn require(what: &str, available: bool) -> bool {
    if available {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_string();
    if strict() {
        panic!(
            "{test} needs {what}, which is missing (CI=true or STRATA_REQUIRE_ALL=1: no skipping)"
        );
    }
    eprintln!("SKIP {test}: needs {what}");
    let log = skip_log();
    if let Some(dir) = log.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // One write of one line to a file opened for appending: lines of parallel tests do not interleave.
    let line = format!("{test}\t{what}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("(could not log the skip in {}: {e})", log.display());
    }
    false
}
