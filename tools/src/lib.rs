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

/// The full `strata` program (`strata-full`): parses the command line, runs it, exits with the
/// documented code.
pub fn main() {
    strata_cli::die_quietly_on_broken_pipes();
    let args = cli::Cli::parse();
    init_logs();
    if let Err(e) = cli::run(args) {
        eprintln!("strata: error: {}", exit::message(&e));
        std::process::exit(exit::code(&e));
    }
}

/// The `pack_diff` program (the same as `strata pack-diff`).
pub fn pack_diff_main() {
    strata_cli::die_quietly_on_broken_pipes();
    let args = cli::PackDiffCli::parse();
    init_logs();
    if let Err(e) = cli::run_pack_diff(args) {
        eprintln!("pack_diff: error: {}", exit::message(&e));
        std::process::exit(exit::code(&e));
    }
}
