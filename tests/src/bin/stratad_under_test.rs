//! The `stratad` daemon, built inside this package so that integration tests can run it by path
//! (`CARGO_BIN_EXE_stratad-under-test`).

fn main() {
    strata_tools::daemon::main();
}
