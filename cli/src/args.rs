//! The lean parser: the per-sandbox commands (`mount`, `umount`, `rm`, `ps`, `bundle`, `run`) and the
//! options every `strata` command takes. The full CLI (`strata_tools::cli::Cli`) uses these argument
//! structs for the same commands, so the two parsers take them alike (`strata_tools`'s tests compare
//! them).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

pub use crate::run::{RunArgs, Runtime};

/// The control socket when neither `--socket` nor `STRATA_SOCKET` names one.
pub const DEFAULT_SOCKET: &str = "/run/strata/stratad.sock";

/// `--progress`'s values (the full CLI's `progress::Mode`; its tests check they agree).
pub const PROGRESS_MODES: [&str; 4] = ["auto", "tty", "plain", "none"];

/// The per-sandbox commands alone, what the lean binary parses: a node agent's `strata mount` then
/// builds a command tree of six commands, not of the whole CLI (BENCHMARKS.md, "The CLI's own cost").
/// Anything else, help and errors included, goes to the full CLI.
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
/// checked as the full CLI checks them (these commands need no store).
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
    Rm(RmArgs),
    Ps(PsArgs),
    Bundle(BundleArgs),
    Run(RunArgs),
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

// `strata rm`'s arguments (its help text is the full CLI's `Cmd::Rm` variant's).
#[derive(clap::Args)]
pub struct RmArgs {
    /// Sandbox ids (all removed in one request to stratad).
    #[arg(required_unless_present_any = ["stopped", "all", "image"])]
    pub sandboxes: Vec<String>,
    /// Every stopped sandbox (left over after `strata umount` or a node restart).
    #[arg(long)]
    pub stopped: bool,
    /// Every sandbox of the node, running or stopped.
    #[arg(long)]
    pub all: bool,
    /// Every sandbox of this image (the tag or digest it was created from, or its manifest digest).
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// Even if processes still run in a sandbox's rootfs.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

// `strata ps`'s arguments.
#[derive(clap::Args)]
pub struct PsArgs {
    #[arg(long)]
    pub json: bool,
}

// `strata bundle`'s arguments.
#[derive(clap::Args)]
pub struct BundleArgs {
    pub image: String,
    #[arg(long)]
    pub sandbox: String,
    pub dir: PathBuf,
    /// Command and arguments replacing the image's cmd (its entrypoint stays).
    #[arg(last = true, value_name = "CMD")]
    pub cmd: Vec<String>,
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
            &["strata", "build", "."],
            &["strata", "rm"],
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
