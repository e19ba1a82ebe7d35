//! The `strata-snapshotter` binary: see the library's documentation.

fn main() -> anyhow::Result<()> {
    strata_snapshotter::main()
}
