//! The `strata` binary as installed: the lean CLI (`strata_cli`), which runs the per-sandbox commands
//! and hands every other command to `strata-full`. It uses nothing of this package's library, so it
//! links none of it.
//!
//! Its `main` is the C one ([`strata_cli::start`] says why): a node agent starts this program once per
//! sandbox, and the Rust runtime's own start-up was a quarter of its time.

// `cargo test` builds this binary with the test harness's `main`.
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
strata_cli::c_main!();
