//! `pack_diff`, built inside this package so that integration tests can run it by path.

fn main() {
    strata_tools::pack_diff_main();
}
