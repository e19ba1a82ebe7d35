//! The `strata` binary; the program lives in the `strata_tools` library.

fn main() {
    strata_tools::main();
}
