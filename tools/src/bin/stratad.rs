//! `stratad`: strata's node daemon. One per node; see `docs/API.md` and `docs/DAEMON.md`.

fn main() {
    strata_tools::daemon::main();
}
