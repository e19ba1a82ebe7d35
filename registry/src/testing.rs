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

/// `n` mutations of `seed` for the fuzzing entries' stable smoke tests, deterministic from `state`: a
/// byte set, a bit flipped, the input cut short, a run of up to 16 bytes repeated. Three in four fall
/// within the first `head` bytes, where a format's headers are.
pub fn mutations(
    seed: &[u8],
    mut state: u64,
    n: usize,
    head: usize,
) -> impl Iterator<Item = Vec<u8>> + '_ {
    state |= 1;
    (0..n).map(move |_| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let x = state;
        let mut m = seed.to_vec();
        if m.is_empty() {
            return vec![x as u8];
        }
        let span = if x.is_multiple_of(4) {
            m.len()
        } else {
            m.len().min(head.max(1))
        };
        let at = (x >> 8) as usize % span;
        match (x >> 4) % 4 {
            0 => m[at] = (x >> 32) as u8,
            1 => m[at] ^= 1 << ((x >> 40) % 8),
            2 => m.truncate(at),
            _ => {
                let run: Vec<u8> = m[at..].iter().take(16).copied().collect();
                m.splice(at..at, run);
            }
        }
        m
    })
}
