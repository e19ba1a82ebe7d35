//! The `strata` CLI, built inside this package so that integration tests can run it by path
//! (`CARGO_BIN_EXE_strata-under-test`): the lean binary, as installed (its C `main` too), which hands
//! store commands to `strata-under-test-full` beside it.

#![no_main]

strata_cli::c_main!();
