//! The `strata` binary as installed: the lean CLI (`strata_cli`), which runs the per-sandbox commands
//! and hands every other command to `strata-full`. It uses nothing of this package's library, so it
//! links none of it.

fn main() {
    strata_cli::lean_main();
}
