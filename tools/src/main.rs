//! The `strata` binary; the program lives in the `strata_tools` library. Commands that need a store
//! run in `strata-full` (see `strata_tools::lean_main`).

fn main() {
    strata_tools::lean_main();
}
