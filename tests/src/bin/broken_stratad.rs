//! A stratad that passes the upgrade's version probe (`--version` prints a stratad version) and exits at
//! once when started as a server: what a bad build installed at stratad's path looks like to the holder.

fn main() {
    if std::env::args().any(|a| a == "--version") {
        println!("stratad 0.0.0-broken");
        return;
    }
    eprintln!("broken-stratad: exiting at once");
    std::process::exit(1);
}
