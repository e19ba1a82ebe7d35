//! The full `strata` CLI under test (`strata-full` as installed), run by `strata-under-test` for the
//! commands that need a store.

fn main() {
    strata_tools::main();
}
