//! `strata-snapshotter`, built inside this package so that integration tests can run it by path.

fn main() -> anyhow::Result<()> {
    strata_snapshotter::main()
}
