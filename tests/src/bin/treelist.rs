//! `treelist DIR`: prints [`strata_tests::snapshot`] of DIR, one line per entry (the root left out: a
//! sandbox's root takes its upper directory's attributes), paths hex-encoded. The stock-kernel tier
//! (tests/tests/stock_kernel.rs) runs this same program on the host over the source tree and inside the
//! guest over the mounted image, so the two listings compare byte for byte; reading every file, it is
//! also the guest's reader. Exits non-zero (a panic naming the path) on any error reading the tree.

use std::io::Write;

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: treelist DIR");
        std::process::exit(2);
    };
    let snap = strata_tests::snapshot(std::path::Path::new(&dir));
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for (path, e) in snap.iter().filter(|(p, _)| !p.is_empty()) {
        let hex: String = path.iter().map(|b| format!("{b:02x}")).collect();
        if writeln!(out, "{hex} {e:?}").is_err() {
            std::process::exit(1);
        }
    }
    if out.flush().is_err() {
        std::process::exit(1);
    }
}
