//! `strata`: build, compose, tag, inspect and read images.
//!
//! Every command takes its store from `--store URL` or `STRATA_STORE` (default: the embedded local store
//! `file:///var/lib/strata/store`). Output for humans goes to standard output; `--json` prints one JSON
//! document for machines; progress goes to standard error only when it is a terminal. Exit codes are
//! documented in `docs/CLI.md` and come from [`exit::code`].

mod catalog;
pub mod cli;
mod compact;
mod compose;
mod config;
mod copy;
pub mod daemon;
#[cfg(test)]
mod docs_tests;
mod exit;
mod export;
mod freeze;
mod holder;
mod images;
mod import;
mod index;
mod layers;
mod manual;
mod node;
mod progress;
mod registry;
mod run;
mod signals;
mod snapshot;
mod systemd;
mod trace;
mod upgrade;
mod view;
mod vm;

use std::io::IsTerminal;

use clap::Parser;

fn init_logs() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

/// A closed standard output (`strata images | head -1`) ends the program quietly, as it ends `ls` or
/// `cat`: Rust ignores SIGPIPE, so `println!` would panic (exit 101) on the broken pipe instead.
fn die_quietly_on_broken_pipes() {
    // SAFETY: restoring a signal's default disposition before any thread is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// The `strata` program as installed: the commands that need no store (`mount`, `rm`, `ps`, `daemon`,
/// `run`, ... — what a node agent runs per sandbox) run here, in a binary that links neither the
/// builder's index (RocksDB, C++) nor the store clients' runtime, so that starting it costs what a
/// small program's start costs (a quarter of the full CLI's: BENCHMARKS.md, "The CLI's own cost");
/// every other command is handed, with the same arguments, to the full CLI ([`main`]): the binary
/// named as this one with `-full` appended, beside it (`strata-full`), else `strata-full` on `PATH`.
/// `mount` and `umount` are parsed first by a parser of those two alone ([`cli::NodeCli`]): building
/// clap's tree of every command was a quarter of `strata mount`'s start (1.6 → 1.2 ms, 282 → 195 page
/// faults).
pub fn lean_main() {
    die_quietly_on_broken_pipes();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `mount` and `umount` (a node agent's per-sandbox commands) parse without the whole command
    // tree; anything else, and every help text or error, is the full parser's.
    if let Ok(node) = cli::NodeCli::try_parse_from(&argv) {
        init_logs();
        if let Err(e) = cli::run_node_cmd(node) {
            eprintln!("strata: error: {}", exit::message(&e));
            std::process::exit(exit::code(&e));
        }
        return;
    }
    let args = cli::Cli::parse_from(&argv);
    init_logs();
    match cli::run_node(args) {
        Ok(None) => {}
        Ok(Some(_)) => exec_full(&argv),
        Err(e) => {
            eprintln!("strata: error: {}", exit::message(&e));
            std::process::exit(exit::code(&e));
        }
    }
}

/// Runs the full CLI in this process's place with `argv` (its name stays `strata` for messages).
fn exec_full(argv: &[std::ffi::OsString]) -> ! {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe().ok().and_then(|p| {
        let mut name = p.file_name()?.to_os_string();
        name.push("-full");
        Some(p.parent()?.join(name))
    });
    let path = beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| std::path::PathBuf::from("strata-full"));
    let err = std::process::Command::new(&path)
        .arg0(argv.first().map_or("strata".into(), |a| a.clone()))
        .args(argv.iter().skip(1))
        .exec();
    eprintln!(
        "strata: error: cannot run {} (the CLI's store commands; installed beside strata): {err}",
        path.display()
    );
    std::process::exit(1);
}

/// The full `strata` program (`strata-full`): parses the command line, runs it, exits with the
/// documented code.
pub fn main() {
    die_quietly_on_broken_pipes();
    let args = cli::Cli::parse();
    init_logs();
    if let Err(e) = cli::run(args) {
        eprintln!("strata: error: {}", exit::message(&e));
        std::process::exit(exit::code(&e));
    }
}

/// The `pack_diff` program (the same as `strata pack-diff`).
pub fn pack_diff_main() {
    die_quietly_on_broken_pipes();
    let args = cli::PackDiffCli::parse();
    init_logs();
    if let Err(e) = cli::run_pack_diff(args) {
        eprintln!("pack_diff: error: {}", exit::message(&e));
        std::process::exit(exit::code(&e));
    }
}
