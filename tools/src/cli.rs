//! Command-line definitions and dispatch.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use strata_registry::store::{Store, StoreOptions, DEFAULT_STORE};

use crate::{
    catalog, compose, copy, export, images, import, index, layers, manual, node, progress,
    registry, snapshot, trace, view, vm,
};

/// strata: lazily loaded, deduplicated EROFS images for agent sandboxes.
#[derive(Parser)]
#[command(name = "strata", version)]
pub struct Cli {
    #[command(flatten)]
    pub globals: Globals,
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Options every command takes, before or after its name.
#[derive(clap::Args)]
pub struct Globals {
    /// Store URL: file:///path or s3://bucket/prefix (endpoint and credentials from AWS_* variables).
    #[arg(long, global = true, env = "STRATA_STORE", default_value = DEFAULT_STORE)]
    pub store: String,
    /// stratad's control socket.
    #[arg(long, global = true, env = "STRATA_SOCKET", default_value = strata_cli::args::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Seconds a store operation (a whole-object read or write, a listing page, a range read) may take
    /// before it fails (exit 6).
    #[arg(long, global = true, env = "STRATA_STORE_TIMEOUT", value_name = "SECS", default_value = "60", value_parser = parse_secs)]
    pub store_timeout: std::time::Duration,
    /// Progress of long commands on standard error: a redrawn line on a terminal (tty), a line every
    /// few seconds (plain: the default when standard error is not a terminal), or none.
    #[arg(
        long,
        global = true,
        env = "STRATA_PROGRESS",
        value_enum,
        default_value = "auto"
    )]
    pub progress: progress::Mode,
}

pub use strata_cli::args::{
    parse_secs, BundleArgs, MountArgs, PsArgs, RmArgs, RunArgs, UmountArgs,
};

#[derive(Subcommand)]
pub enum Cmd {
    /// Build a layer from a directory or tar stream; prints its digest.
    Build(layers::BuildArgs),
    /// Make an image from layers (no data is copied): --base at the bottom, then the --workspace and
    /// --toolkit layers in the order given, the first lowest. Refuses a layer built on another base
    /// unless --rebase.
    Compose(compose::Compose),
    /// Point NAME:TAG at an image (compare-and-swap).
    Tag(images::TagArgs),
    /// Delete tags (compare-and-swap); `strata gc` then reclaims what nothing reaches.
    Rmi(catalog::RmiArgs),
    /// List tagged images; tags that cannot be followed are reported by name (exit status 5).
    Images {
        #[arg(long)]
        json: bool,
    },
    /// Show an image's manifest and layers, or a layer's descriptor.
    Inspect {
        /// Image tag, manifest digest or layer digest.
        reference: String,
        #[arg(long)]
        json: bool,
    },
    /// List a directory of an image's merged view (or one entry).
    Ls {
        reference: String,
        #[arg(default_value = "/")]
        path: String,
        #[arg(long)]
        json: bool,
    },
    /// Print a file of an image's merged view, fetching only the chunks it needs.
    Cat { reference: String, path: String },
    /// Mount an image for a sandbox through stratad; prints the rootfs path. Several --sandbox create
    /// several sandboxes of the image in one call (a burst at the control socket's rate), one line each.
    Mount(MountArgs),
    /// Stop a sandbox: remove its rootfs (its upper directory stays, for pack_diff or --resume, unless --purge).
    Umount(UmountArgs),
    /// Remove sandboxes for good: rootfs, upper and work directories, record.
    Rm(RmArgs),
    /// Manage the node daemon.
    #[command(subcommand)]
    Daemon(node::DaemonCmd),
    /// Sandboxes, layers mounted, bytes fetched against image size, cache use.
    Ps(PsArgs),
    /// Mount a sandbox and write an OCI runtime bundle (DIR/config.json) that `runc run` starts.
    Bundle(BundleArgs),
    /// Run an image as its config says (env, working directory, user, entrypoint and cmd) in a sandbox
    /// through stratad, with bubblewrap or runc; exits with the process's status; removes the sandbox
    /// afterwards unless --keep.
    Run(RunArgs),
    /// A microVM sandbox through stratad: the image's layers as drives, a scratch drive, and a launch
    /// description in DIR (vm.json, qemu.sh, ...). See docs/VM.md.
    Vm(vm::VmArgs),
    /// Import an OCI image layout (oci:DIR[:REF]), docker save archive (docker-archive:FILE[:REF]) or an
    /// image from a registry (docker://HOST[:PORT]/REPO[:TAG|@DIGEST]). `strata pull` is the same.
    #[command(visible_alias = "pull")]
    Import(import::ImportArgs),
    /// Write an image as an OCI image layout (oci:DIR[:REF]) that umoci and skopeo read, or push it to
    /// a registry (docker://HOST[:PORT]/REPO[:TAG]). `strata push` is the same.
    #[command(visible_alias = "push")]
    Export(export::ExportArgs),
    /// Check credentials for a registry and store them in the docker config file
    /// ($DOCKER_CONFIG/config.json or ~/.docker/config.json), where pulls and pushes find them.
    Login(registry::LoginArgs),
    /// Remove a registry's credentials from the docker config file.
    Logout {
        /// The registry: HOST[:PORT].
        registry: String,
    },
    /// Copy an image into another store (file:// or s3://), sending only the objects it lacks.
    Copy(copy::CopyArgs),
    /// Pack a sandbox's writable delta (an overlay upper directory) as a diff layer on its image.
    PackDiff(snapshot::PackDiffArgs),
    /// Collapse an image's layers (from --from N to the top) into one, applying whiteouts.
    Flatten(snapshot::FlattenArgs),
    /// Delete store objects no tag reaches (older than --grace); deletes nothing while a tag is broken.
    Gc(catalog::GcArgs),
    /// The store-wide chunk index builds deduplicate against.
    #[command(subcommand)]
    Index(index::IndexCmd),
    /// Record which chunks a command reads in an image (through stratad), as the image's prefetch plan.
    Trace(trace::TraceArgs),
    /// Write a layer's metadata and uncompressed blob views so the kernel or fsck.erofs can read it.
    Materialize {
        /// Layer digest, or an image with exactly one layer.
        layer: String,
        dir: PathBuf,
    },
    /// Print a shell completion script (e.g. `strata completions bash > /etc/bash_completion.d/strata`).
    Completions(manual::CompletionsArgs),
    /// Print the strata(1) man page, or write every page (subcommands, stratad, pack_diff) into --dir.
    Man(manual::ManArgs),
}

/// The `pack_diff` program: the same as `strata pack-diff`.
#[derive(Parser)]
#[command(
    name = "pack_diff",
    version,
    about = "Pack a sandbox's writable delta as a new image layer"
)]
pub struct PackDiffCli {
    /// Store URL: file:///path or s3://bucket/prefix (endpoint and credentials from AWS_* variables).
    #[arg(long, env = "STRATA_STORE", default_value = DEFAULT_STORE)]
    pub store: String,
    /// stratad's control socket.
    #[arg(long, env = "STRATA_SOCKET", default_value = strata_cli::args::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Progress on standard error: auto, tty, plain (a line every few seconds) or none.
    #[arg(long, env = "STRATA_PROGRESS", value_enum, default_value = "auto")]
    pub progress: progress::Mode,
    /// Seconds a store operation may take before it fails (exit 6).
    #[arg(long, env = "STRATA_STORE_TIMEOUT", value_name = "SECS", default_value = "60", value_parser = parse_secs)]
    pub store_timeout: std::time::Duration,
    #[command(flatten)]
    pub args: snapshot::PackDiffArgs,
}

/// Runs `pack_diff`.
pub fn run_pack_diff(cli: PackDiffCli) -> Result<()> {
    progress::set_mode(cli.progress);
    // Every store error names the store's URL: no context needed.
    let store = Store::open_existing_with(&cli.store, &store_options(cli.store_timeout))?;
    snapshot::pack_diff(&store, &cli.socket, cli.args)
}

/// How commands open stores: every operation within `timeout`, range reads included.
pub fn store_options(timeout: std::time::Duration) -> StoreOptions {
    StoreOptions { timeout }
}

/// Opens a store as commands do (see [`store_options`]).
fn open_store(
    url: &str,
    timeout: std::time::Duration,
    create: bool,
) -> Result<Store, strata_registry::store::StoreError> {
    let opts = store_options(timeout);
    let mut store = match create {
        true => Store::open_with(url, &opts),
        false => Store::open_existing_with(url, &opts),
    }?;
    store.range_deadline = timeout;
    Ok(store)
}

/// Runs a parsed command line. Commands that only talk to stratad (`mount`, `umount`, `ps`, and
/// `bundle`, which gets the image's process from stratad) open no store: opening one builds an async
/// runtime (threads started, then joined at exit) and creates a local store's directory, which cost
/// `strata mount` more than its request to the daemon.
pub fn run(cli: Cli) -> Result<()> {
    let Some(cli) = run_node(cli)? else {
        return Ok(());
    };
    let socket = &cli.globals.socket;
    let cmd = cli.cmd;
    // Only commands that add to a store create it; the rest need one that exists.
    let create = matches!(cmd, Cmd::Build(_) | Cmd::Import(_));
    let store = open_store(&cli.globals.store, cli.globals.store_timeout, create)?;
    match cmd {
        Cmd::Build(a) => layers::build(&store, a),
        Cmd::Compose(a) => compose::compose(&store, a),
        Cmd::Tag(a) => images::tag(&store, a),
        Cmd::Rmi(a) => catalog::rmi(&store, a),
        Cmd::Images { json } => catalog::list(&store, json),
        Cmd::Inspect { reference, json } => images::inspect(&store, &reference, json),
        Cmd::Ls {
            reference,
            path,
            json,
        } => view::ls(&store, &reference, &path, json),
        Cmd::Cat { reference, path } => view::cat(&store, &reference, &path),
        Cmd::Import(a) => import::import(&store, a),
        Cmd::Copy(a) => copy::copy(&store, a, cli.globals.store_timeout),
        Cmd::Export(a) => export::export(&store, a),
        Cmd::Materialize { layer, dir } => layers::materialize(&store, &layer, &dir),
        Cmd::PackDiff(a) => snapshot::pack_diff(&store, socket, a),
        Cmd::Flatten(a) => snapshot::flatten(&store, a),
        Cmd::Trace(a) => trace::trace(&store, socket, a),
        Cmd::Vm(a) => vm::vm(&store, socket, a),
        Cmd::Gc(a) => catalog::gc(&store, a),
        Cmd::Index(c) => index::index(&store, c),
        Cmd::Mount(_)
        | Cmd::Bundle(_)
        | Cmd::Run(_)
        | Cmd::Umount(_)
        | Cmd::Rm(_)
        | Cmd::Daemon(_)
        | Cmd::Completions(_)
        | Cmd::Man(_)
        | Cmd::Login(_)
        | Cmd::Logout { .. }
        | Cmd::Ps(_) => Ok(()),
    }
}

/// Runs `cli` if it is a command that needs no store (it talks to stratad, or prints help text):
/// `None` when it ran, else the command back. (The lean `strata` binary, `strata_cli`, runs the
/// per-sandbox commands itself and hands everything else to this program.)
pub fn run_node(cli: Cli) -> Result<Option<Cli>> {
    progress::set_mode(cli.globals.progress);
    let socket = &cli.globals.socket;
    match cli.cmd {
        Cmd::Mount(a) => Ok(strata_cli::node::mount(socket, &a).map(|()| None)?),
        Cmd::Umount(a) => node::umount(socket, &a).map(|()| None),
        Cmd::Rm(a) => node::rm(socket, &a).map(|()| None),
        Cmd::Daemon(c) => node::daemon(socket, c).map(|()| None),
        Cmd::Ps(a) => strata_cli::ps::ps(socket, a.json).map(|()| None),
        Cmd::Bundle(a) => {
            strata_cli::bundle::bundle(socket, &a.image, &a.sandbox, &a.dir, &a.cmd).map(|()| None)
        }
        Cmd::Run(a) => strata_cli::run::run(socket, a).map(|()| None),
        Cmd::Completions(a) => manual::completions(a).map(|()| None),
        Cmd::Man(a) => manual::man(a).map(|()| None),
        Cmd::Login(a) => registry::login(a).map(|()| None),
        Cmd::Logout { registry } => registry::logout(&registry).map(|()| None),
        cmd => Ok(Some(Cli { cmd, ..cli })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;
    use strata_cli::args::{NodeCli, NodeCmd, PROGRESS_MODES};

    fn node(args: &[&str]) -> Option<NodeCli> {
        NodeCli::try_parse_from(args).ok()
    }

    #[test]
    fn the_lean_parser_takes_mount_and_umount_as_the_full_one_does() {
        let argv = [
            "strata",
            "--socket",
            "/s",
            "--progress",
            "plain",
            "--store-timeout",
            "2.5",
            "mount",
            "img:v1",
            "--sandbox",
            "a",
            "--store",
            "file:///x",
        ];
        let lean = node(&argv).expect("mount");
        let NodeCmd::Mount(m) = lean.cmd else {
            panic!("not a mount")
        };
        let Cmd::Mount(full) = Cli::try_parse_from(argv).expect("full").cmd else {
            panic!("not a mount")
        };
        assert_eq!((&m.image, &m.sandbox), (&full.image, &full.sandbox));
        assert_eq!(lean.globals.socket, PathBuf::from("/s"));
        // The global options' values are the full parser's.
        let modes: Vec<String> = progress::Mode::value_variants()
            .iter()
            .filter_map(|m| Some(m.to_possible_value()?.get_name().to_string()))
            .collect();
        assert_eq!(modes, PROGRESS_MODES);
    }

    #[test]
    fn the_lean_parser_takes_the_other_sandbox_commands_as_the_full_one_does() {
        for argv in [
            &["strata", "rm", "--all", "--force", "--json"][..],
            &["strata", "rm", "a", "b"],
            &["strata", "ps", "--json"],
            &[
                "strata",
                "bundle",
                "img:v1",
                "--sandbox",
                "s",
                "/d",
                "--",
                "sh",
                "-c",
                "x",
            ],
            &[
                "strata",
                "run",
                "img:v1",
                "--runtime",
                "runc",
                "--keep",
                "--",
                "true",
            ],
        ] {
            let full = Cli::try_parse_from(argv).expect("full");
            let lean = node(argv).expect("lean");
            let same = match (&lean.cmd, &full.cmd) {
                (NodeCmd::Rm(l), Cmd::Rm(f)) => (l.sandboxes == f.sandboxes) & (l.all == f.all),
                (NodeCmd::Ps(l), Cmd::Ps(f)) => l.json == f.json,
                (NodeCmd::Bundle(l), Cmd::Bundle(f)) => (l.cmd == f.cmd) & (l.dir == f.dir),
                (NodeCmd::Run(l), Cmd::Run(f)) => (l.cmd == f.cmd) & (l.runtime == f.runtime),
                _ => false,
            };
            assert!(same, "{argv:?}");
        }
        // A command line either parser refuses is the full one's to explain.
        for argv in [&["strata", "rm"][..], &["strata", "bundle", "img"]] {
            assert!(node(argv).is_none() && Cli::try_parse_from(argv).is_err());
        }
    }

    #[test]
    fn everything_else_is_left_to_the_full_parser() {
        for argv in [
            &["strata", "--help"][..],
            &["strata", "--version"],
            &["strata", "mount", "--help"],
            &["strata", "mount", "img"],
            &["strata", "umount", "--sandbox", "a", "--force"],
            &["strata", "--progress", "loud", "umount", "--sandbox", "a"],
            &["strata", "images"],
            &["strata", "daemon", "status"],
            &["strata", "build", "."],
            &["strata"],
        ] {
            assert!(node(argv).is_none(), "{argv:?}");
            assert!(Cli::try_parse_from(argv)
                .map_or(true, |c| !matches!(c.cmd, Cmd::Mount(_) | Cmd::Umount(_))));
        }
    }
}
