//! The `strata` CLI, built inside this package so that integration tests can run it by path
//! (`CARGO_BIN_EXE_strata-under-test`): the lean binary, as installed (its C `main` too), which hands
//! store commands to `strata-under-test-full` beside it.

// `cargo test` builds this binary with the test harness's `main`.
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
strata_cli::c_main!();
