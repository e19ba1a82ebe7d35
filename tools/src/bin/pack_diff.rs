//! `pack_diff`: a sandbox's writable delta as a new layer (the same as `strata pack-diff`).

fn main() {
    strata_tools::pack_diff_main();
}
