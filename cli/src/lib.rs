//! The `strata` program as installed: the lean binary a node agent starts once per sandbox.
//!
//! The per-sandbox commands — `mount`, `umount`, `rm`, `ps`, `bundle`, `run` — run here, parsed by a
//! parser of those alone ([`args::NodeCli`]) and sent to stratad with the control API's small client
//! ([`strata_api`]).
//! Every other command — and every help text or parse error, so that they read as the full CLI's —
//! is handed, with the same arguments, to the full CLI: the binary named as this one with `-full`
//! appended, beside it (`strata-full`), else `strata-full` on `PATH` (`strata_tools`). So this binary
//! links neither the store clients (their TLS library runs CPU probes in a constructor at every
//! start), nor RocksDB, nor the builder, nor a log subscriber, and `scripts/install` links it
//! statically: its start is a small static program's, no dynamic loader, no relocation of a large
//! image (BENCHMARKS.md, "The CLI's own cost": `strata mount` 1.3 → 0.6 ms a process, `/bin/true`'s time
//! here; `strata rm` 2.0 → 0.7 ms).

pub mod args;
pub mod bundle;
pub mod node;
pub mod ps;
pub mod run;
pub mod signals;

use std::ffi::OsString;

use clap::Parser;

use crate::args::{NodeCli, NodeCmd};
use crate::node::NodeError;

/// A sandbox whose state forbids the request (exit 7), found outside stratad: a VM still running, a
/// process stratad could not resolve in the image.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SandboxState(pub String);

/// The `strata` binary's whole program, called from its C `main` (`#![no_main]`) instead of through the
/// Rust runtime's start-up, which a program started once per sandbox pays for at every start: it maps
/// a signal stack, installs stack-overflow handlers and reads `/proc/self/maps` to find the main
/// thread's stack guard — a quarter of the static `strata`'s own time here (`strata mount` that cannot
/// connect: 0.98–1.06 → 0.73–0.79 ms a process under `hyperfine -N`, CPU time 0.93 → 0.64 ms under
/// `perf stat`; BENCHMARKS.md, "Twenty-fifth session"). What of it this program needs is done here:
/// standard descriptors that are closed are opened on `/dev/null` (so that no file `bundle` writes
/// becomes standard output), a panic exits 101 after its message as in any Rust program, and the exit
/// goes through [`std::process::exit`], which flushes standard output. The arguments come from the C
/// library's start-up as ever ([`std::env::args_os`]). SIGPIPE keeps its default disposition (the
/// runtime would ignore it), so a closed standard output ends the program quietly, as
/// [`die_quietly_on_broken_pipes`] makes the full CLI do. A stack overflow is a plain SIGSEGV, without
/// the runtime's message.
pub fn start() -> i32 {
    open_closed_standard_fds();
    match std::panic::catch_unwind(lean_main) {
        Ok(()) => std::process::exit(0),
        // The panic's message is out (the default hook); the code is the runtime's.
        Err(_) => std::process::exit(101),
    }
}

/// The C `main` of a binary that is the lean CLI (with `#![no_main]` at its root): calls [`start`].
#[macro_export]
macro_rules! c_main {
    () => {
        #[no_mangle]
        pub extern "C" fn main(
            _argc: ::std::ffi::c_int,
            _argv: *const *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            $crate::start()
        }
    };
}

/// Opens `/dev/null` on each of descriptors 0, 1 and 2 that is closed.
fn open_closed_standard_fds() {
    use rustix::fd::{AsRawFd, BorrowedFd, IntoRawFd};
    for fd in 0..=2 {
        // SAFETY: only asks whether the descriptor is open; nothing is read or closed through it.
        let probe = unsafe { BorrowedFd::borrow_raw(fd) };
        if rustix::io::fcntl_getfd(probe) != Err(rustix::io::Errno::BADF) {
            continue;
        }
        // The lowest free descriptor: this one, as those below it are open.
        if let Ok(null) = rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDWR,
            rustix::fs::Mode::empty(),
        ) {
            if null.as_raw_fd() == fd {
                let _ = null.into_raw_fd();
            }
        }
    }
}

/// `strata`'s program: runs the per-sandbox commands, hands anything else to the full CLI.
fn lean_main() {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let Ok(NodeCli { globals, cmd }) = NodeCli::try_parse_from(&argv) else {
        exec_full(&argv)
    };
    let socket = &globals.socket;
    let done = match cmd {
        NodeCmd::Mount(a) => node::mount(socket, &a).map_err(anyhow::Error::from),
        NodeCmd::Umount(a) => node::umount(socket, &a).map_err(anyhow::Error::from),
        NodeCmd::Rm(a) => node::rm(socket, &a).map_err(anyhow::Error::from),
        NodeCmd::Ps(a) => ps::ps(socket, a.json),
        NodeCmd::Bundle(a) => bundle::bundle(socket, &a.image, &a.sandbox, &a.dir, &a.cmd),
        NodeCmd::Run(a) => run::run(socket, a),
    };
    if let Err(e) = done {
        if let Some(NodeError::NoBatchRoute) = e.downcast_ref() {
            exec_full(&argv)
        }
        eprintln!("strata: error: {}", message(e.as_ref()));
        std::process::exit(exit_code(&e));
    }
}

/// The documented exit code (`docs/CLI.md`) of an error of these commands.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain().find_map(code_of).unwrap_or(1)
}

/// The exit code one cause of an error decides, if it is one of this crate's or the client's; the
/// full CLI asks this too.
pub fn code_of(cause: &(dyn std::error::Error + 'static)) -> Option<i32> {
    if let Some(n) = cause.downcast_ref::<NodeError>() {
        return Some(n.exit_code());
    }
    if let Some(c) = cause.downcast_ref::<strata_api::ClientError>() {
        return Some(c.exit_code());
    }
    cause.downcast_ref::<SandboxState>().map(|_| 7)
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
