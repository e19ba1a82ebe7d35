//! The `strata` program as installed: the lean binary a node agent starts once per sandbox.
//!
//! `strata mount` and `strata umount` run here, parsed by a parser of those two commands alone
//! ([`args::NodeCli`]) and sent to stratad with the control API's small client ([`strata_api`]).
//! Every other command — and every help text or parse error, so that they read as the full CLI's —
//! is handed, with the same arguments, to the full CLI: the binary named as this one with `-full`
//! appended, beside it (`strata-full`), else `strata-full` on `PATH` (`strata_tools`). So this binary
//! links neither the store clients (their TLS library runs CPU probes in a constructor at every
//! start), nor RocksDB, nor the builder, nor a log subscriber, and `scripts/install` links it
//! statically: its start is a small static program's, no dynamic loader, no relocation of a large
//! image (BENCHMARKS.md, "The CLI's own cost": 1.3 → 0.6 ms a process, `/bin/true`'s time here).

pub mod args;
pub mod node;

use std::ffi::OsString;

use clap::Parser;

use crate::args::{NodeCli, NodeCmd};
use crate::node::NodeError;

/// `strata`'s `main`: runs `mount` and `umount`, hands anything else to the full CLI.
pub fn lean_main() {
    die_quietly_on_broken_pipes();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let Ok(cli) = NodeCli::try_parse_from(&argv) else {
        exec_full(&argv)
    };
    let socket = &cli.globals.socket;
    let done = match &cli.cmd {
        NodeCmd::Mount(a) => node::mount(socket, a),
        NodeCmd::Umount(a) => node::umount(socket, a),
    };
    match done {
        Ok(()) => {}
        Err(NodeError::NoBatchRoute) => exec_full(&argv),
        Err(e) => {
            eprintln!("strata: error: {}", message(&e));
            std::process::exit(e.exit_code());
        }
    }
}

/// An error and its causes on one line, each said once: a part whose text an earlier part already
/// holds is left out — an error that writes its source into its own message (`{path}: {source}`)
/// would otherwise repeat it ("…: No such file or directory (os error 2): No such file or directory
/// (os error 2)").
pub fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut cause = Some(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// A closed standard output (`strata images | head -1`) ends the program quietly, as it ends `ls` or
/// `cat`: Rust ignores SIGPIPE, so `println!` would panic (exit 101) on the broken pipe instead.
pub fn die_quietly_on_broken_pipes() {
    // SAFETY: restoring a signal's default disposition before any thread is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Runs the full CLI in this process's place with `argv` (its name stays `strata` for messages).
fn exec_full(argv: &[OsString]) -> ! {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        let e = NodeError::Upper {
            path: "x".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(message(&e), "--upper x: entity not found");
        let api = NodeError::Daemon(strata_api::ClientError::Reply("no status"));
        assert_eq!(message(&api), "stratad sent a bad reply: no status");
    }
}
