//! `strata-full`: the whole `strata` CLI. The installed `strata` runs the node commands itself and
//! hands every other command to this binary (see `strata_cli`).

fn main() {
    strata_tools::main();
}
