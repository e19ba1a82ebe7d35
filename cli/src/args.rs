//! The lean parser: `mount` and `umount` and the options every `strata` command takes. The full CLI
//! (`strata_tools::cli::Cli`) uses [`MountArgs`] and [`UmountArgs`] for the same commands, so the two
//! parsers take them alike (`strata_tools`'s tests compare them).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// The control socket when neither `--socket` nor `STRATA_SOCKET` names one.
pub const DEFAULT_SOCKET: &str = "/run/strata/stratad.sock";

/// `--progress`'s values (the full CLI's `progress::Mode`; its tests check they agree).
pub const PROGRESS_MODES: [&str; 4] = ["auto", "tty", "plain", "none"];

/// The per-sandbox commands alone (`mount`, `umount`), what the lean binary parses: a node agent's
/// `strata mount` then builds a command tree of two commands, not of the whole CLI (BENCHMARKS.md,
/// "The CLI's own cost"). Anything else, help and errors included, goes to the full CLI.
#[derive(Parser)]
#[command(
    name = "strata",
    disable_help_flag = true,
    disable_help_subcommand = true
)]
pub struct NodeCli {
    #[command(flatten)]
    pub globals: NodeGlobals,
    #[command(subcommand)]
    pub cmd: NodeCmd,
}

/// The global options as the lean parser takes them: the socket is used; the others are accepted and
/// checked as the full CLI checks them (`mount` and `umount` need no store).
#[derive(clap::Args)]
pub struct NodeGlobals {
    #[arg(long, global = true, env = "STRATA_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    #[arg(long, global = true)]
    pub store: Option<String>,
    #[arg(long, global = true, value_parser = parse_secs)]
    pub store_timeout: Option<Duration>,
    #[arg(long, global = true, value_parser = PROGRESS_MODES)]
    pub progress: Option<String>,
}

/// See [`NodeCli`].
#[derive(Subcommand)]
pub enum NodeCmd {
    Mount(MountArgs),
    Umount(UmountArgs),
}

// `strata mount`'s arguments (its help text is the full CLI's `Cmd::Mount` variant's).
#[derive(clap::Args)]
pub struct MountArgs {
    pub image: String,
    #[arg(long, required = true)]
    pub sandbox: Vec<String>,
    /// Directory for the sandbox's upper and work directories (default: in stratad's state).
    #[arg(long)]
    pub upper: Option<PathBuf>,
    /// The id has a stopped sandbox of the same image: continue with its upper directory.
    #[arg(long, conflicts_with = "fresh")]
    pub resume: bool,
    /// The id has a stopped sandbox: delete its upper directory and start empty.
    #[arg(long)]
    pub fresh: bool,
    #[arg(long)]
    pub json: bool,
}

// `strata umount`'s arguments (its help text is the full CLI's `Cmd::Umount` variant's).
#[derive(clap::Args)]
pub struct UmountArgs {
    /// Sandbox id (repeatable: several are stopped in one request).
    #[arg(long, required = true)]
    pub sandbox: Vec<String>,
    /// Also delete its upper and work directories and its record (refused while processes run in
    /// its rootfs, unless --force).
    #[arg(long)]
    pub purge: bool,
    /// With --purge: even if processes still run in the rootfs.
    #[arg(long, requires = "purge")]
    pub force: bool,
}

/// A positive number of seconds (`--store-timeout`, `--timeout`s).
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v < 1e9 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(args: &[&str]) -> Option<NodeCli> {
        NodeCli::try_parse_from(args).ok()
    }

    #[test]
    fn global_options_are_taken_before_or_after_the_command_and_checked() {
        let after =
            node(&["strata", "umount", "--sandbox", "a", "--socket", "/t"]).expect("umount");
        assert_eq!(after.globals.socket, PathBuf::from("/t"));
        let all = [
            "--store",
            "file:///s",
            "--store-timeout",
            "5",
            "--progress",
            "none",
        ];
        let before = [&["strata"][..], &all, &["mount", "i", "--sandbox", "a"]].concat();
        assert!(node(&before).is_some());
        // What the full parser refuses, the lean one leaves to it.
        for refused in [
            &[
                "strata",
                "--progress",
                "loud",
                "mount",
                "i",
                "--sandbox",
                "a",
            ][..],
            &[
                "strata",
                "--store-timeout",
                "0",
                "mount",
                "i",
                "--sandbox",
                "a",
            ],
            &[
                "strata",
                "mount",
                "i",
                "--sandbox",
                "a",
                "--resume",
                "--fresh",
            ],
            &["strata", "umount", "--sandbox", "a", "--force"],
            &["strata", "mount", "--help"],
            &["strata", "ps"],
        ] {
            assert!(node(refused).is_none(), "{refused:?}");
        }
    }

    #[test]
    fn seconds_are_positive_and_finite() {
        assert_eq!(parse_secs("1.5"), Ok(Duration::from_millis(1500)));
        for bad in ["0", "-1", "inf", "NaN", "x", "1e10"] {
            assert!(parse_secs(bad).is_err(), "{bad}");
        }
    }
}
