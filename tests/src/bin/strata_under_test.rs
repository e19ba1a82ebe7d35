//! The `strata` CLI, built inside this package so that integration tests can run it by path
//! (`CARGO_BIN_EXE_strata-under-test`).

fn main() {
    strata_tools::main();
}
