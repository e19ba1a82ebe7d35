//! `stratad`: configuration (TOML file, then flags), then one of three ways to run (docs/DAEMON.md):
//!
//! - **holder** (the default): this process holds the FUSE connection and runs servers that answer it
//!   ([`crate::holder`]); a server that dies is replaced at once and sandboxes never notice;
//! - **server**: started by a holder ([`crate::holder::ENV`]) or by systemd with the connection in its
//!   file-descriptor store ([`crate::systemd`]): adopts the node and serves it. SIGTERM hands over
//!   (stops, leaves every mount for a successor); SIGUSR1 tears the node down;
//! - **plain** (`--no-holder`): one process as before — SIGTERM and SIGINT tear the node down cleanly,
//!   and sandboxes do not outlive it.

use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use rustix::process::{kill_process, Pid, Signal};
use serde_json::json;
use strata_fs::api::Hooks;
use strata_fs::daemon::{Config, Daemon, Fuse};
use strata_fs::fuse::journal::Journal;
use strata_fs::fuse::Channel;
use strata_fs::modes::ModeRequest;
use strata_fs::size::parse_size;
use strata_fs::trees::Kept;

use crate::{holder, systemd};
use strata_cli::signals;

/// The configuration file read when `--config` is not given (it may be missing).
const DEFAULT_CONFIG: &str = "/etc/strata/stratad.toml";

/// strata's node daemon: mounts images lazily and gives each sandbox an overlay rootfs.
///
/// Every option is also a key of the configuration file (dist/stratad.toml lists them all); a flag
/// overrides the file, and the defaults below apply when neither sets it.
#[derive(Parser)]
#[command(name = "stratad", version)]
struct Args {
    /// TOML configuration file (keys as in docs/DAEMON.md); flags override it. Default:
    /// /etc/strata/stratad.toml, if it exists.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Store URL: file:///PATH or s3://BUCKET/PREFIX [default: file:///var/lib/strata/store].
    #[arg(long, env = "STRATA_STORE", value_name = "URL")]
    store: Option<String>,
    /// Layer metadata, the chunk cache, node records and sandboxes' upper directories; a disk
    /// filesystem (ext4, xfs) [default: /var/lib/strata].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// The control socket, the blob server's FUSE mount and the mount points; one node per runtime
    /// directory [default: /run/strata].
    #[arg(long, value_name = "DIR")]
    runtime_dir: Option<PathBuf>,
    /// Chunk cache bound, e.g. 10G, 512M [default: 10G].
    #[arg(long, value_name = "SIZE")]
    cache_size: Option<String>,
    /// Seconds before a read that cannot be served fails with EIO [default: 30].
    #[arg(long, value_name = "SECS")]
    read_timeout: Option<f64>,
    /// Seconds before any other store operation fails (a tag, manifest, descriptor or metadata read of
    /// a mount; a listing; a write) [default: 60].
    #[arg(long, value_name = "SECS")]
    store_timeout: Option<f64>,
    /// Largest compressed span of one range request, e.g. 4M [default: 256K from a file:// store, 2M
    /// over a network].
    #[arg(long, value_name = "SIZE")]
    max_fetch_span: Option<String>,
    /// Compressed bytes before a miss also fetched, in the background, e.g. 1M, 0 for none [default:
    /// none from a file:// store, 1M over a network].
    #[arg(long, value_name = "SIZE")]
    max_fetch_behind: Option<String>,
    /// Compressed bytes of a missing file's directory (its other files of at most 256 KiB) also
    /// fetched, in the background, e.g. 1M [default: 0, none].
    #[arg(long, value_name = "SIZE")]
    max_fetch_group: Option<String>,
    /// Compressed bytes of a blob walked after a miss at the lowest CPU priority, fetching what is
    /// not cached, e.g. 8M, 0 for none [default: 4M from a file:// store, none over a network].
    #[arg(long, value_name = "SIZE")]
    max_fetch_stream: Option<String>,
    /// Worker threads answering the blob server's FUSE requests; all but two may also serve reads that
    /// fetch [default: 8].
    #[arg(long, value_name = "N")]
    fuse_threads: Option<usize>,
    /// Group (gid) allowed to use the control socket and read the blob files besides root [default:
    /// none].
    #[arg(long, value_name = "GID")]
    group: Option<u32>,
    /// Do not warm images' prefetch plans when their sandboxes are created.
    #[arg(long)]
    no_prefetch: bool,
    /// Concurrent prefetch fetches [default: 4 from a file:// store, 32 over a network].
    #[arg(long, value_name = "N")]
    prefetch_threads: Option<usize>,
    /// Prefetch bandwidth cap per second, e.g. 256M; 0: none [default: 256M].
    #[arg(long, value_name = "SIZE")]
    prefetch_rate: Option<String>,
    /// Bound of the metadata kept for layers no longer mounted, e.g. 4G [default: 4G].
    #[arg(long, value_name = "SIZE")]
    metadata_cache_size: Option<String>,
    /// Record the reads of this many seconds after an image without a prefetch plan is first mounted
    /// and store them as its plan (needs write access to the store) [default: 0, off].
    #[arg(long, value_name = "SECS")]
    record_plans: Option<f64>,
    /// Check the cached data at rest (chunk cache, fanotify view files) this often, in seconds; 0: never
    /// [default: 86400].
    #[arg(long, value_name = "SECS")]
    scrub_interval: Option<f64>,
    /// fanotify mode: how long a view file's chunk marked for eviction waits before it is punched out
    /// [default: 30].
    #[arg(long, value_name = "SECS")]
    view_evict_grace: Option<f64>,
    /// fanotify mode: the view files' reserve, given up to reads that find their disk full, e.g. 256M;
    /// 0: none [default: 256M, at most 1/16 of the disk].
    #[arg(long, value_name = "SIZE")]
    view_reserve: Option<String>,
    /// fanotify mode: the share of the view files' disk, in percent, eviction keeps free when other
    /// data grows; 0: cache_size alone bounds them [default: 5].
    #[arg(long, value_name = "PERCENT")]
    view_keep_free: Option<f64>,
    /// fanotify mode: whether the event loop keeps to the CPU of the readers it answers (an event's
    /// two wake-ups then stay on one CPU) [default: true].
    #[arg(long, value_name = "BOOL")]
    fanotify_follow_readers: Option<bool>,
    /// Sandboxes kept made ahead (directories made, overlay mounted) for each image that has running
    /// sandboxes, so that a create takes one instead of making it; 0: none [default: 0].
    #[arg(long, value_name = "N")]
    sandbox_pool: Option<usize>,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Run as one process without a descriptor holder: sandboxes then end with stratad.
    #[arg(long)]
    no_holder: bool,
    /// How layers are mounted: auto (probe this kernel, take the fastest mode that works), file
    /// (file-backed EROFS, Linux 6.12+), loop (EROFS on loop devices, 5.16+) or fuse (stratad serves
    /// each layer's tree, any kernel with FUSE) [default: auto].
    #[arg(long, value_name = "MODE")]
    mount_mode: Option<ModeRequest>,
    /// In loop mode, bind loop devices with direct I/O (true) or buffered (false) [default: true].
    #[arg(long, value_name = "BOOL")]
    loop_direct_io: Option<bool>,
    /// Probe this kernel, print which mount mode stratad would run in and why, and exit (0 if some
    /// mode works) without starting.
    #[arg(long)]
    check: bool,
    /// With --check: print the report as JSON.
    #[arg(long, requires = "check")]
    json: bool,
}

/// stratad's command line, for its man page (`strata man --dir`).
pub fn command() -> clap::Command {
    <Args as clap::CommandFactory>::command()
}

/// The configuration in `path`; a missing file is an error unless it is the default one (`given` false).
fn read_config(path: &Path, given: bool) -> Result<Config> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text).with_context(|| format!("config {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !given => Ok(Config::default()),
        Err(e) => Err(e).with_context(|| format!("config {}", path.display())),
    }
}

fn load(args: &Args) -> Result<Config> {
    let mut c = match &args.config {
        Some(path) => read_config(path, true)?,
        None => read_config(Path::new(DEFAULT_CONFIG), false)?,
    };
    if let Some(s) = &args.store {
        c.store = s.clone();
    }
    if let Some(p) = &args.state_dir {
        c.state_dir = p.clone();
    }
    if let Some(p) = &args.runtime_dir {
        c.runtime_dir = p.clone();
    }
    if let Some(s) = &args.cache_size {
        c.cache_size = parse_size(s)?;
    }
    if let Some(t) = args.read_timeout {
        c.read_timeout_secs = t;
    }
    if let Some(t) = args.store_timeout {
        c.store_timeout_secs = t;
    }
    if let Some(s) = &args.max_fetch_span {
        c.max_fetch_span = Some(parse_size(s)?);
    }
    if let Some(s) = &args.max_fetch_behind {
        c.max_fetch_behind = Some(parse_size(s)?);
    }
    if let Some(s) = &args.max_fetch_group {
        c.max_fetch_group = parse_size(s)?;
    }
    if let Some(s) = &args.max_fetch_stream {
        c.max_fetch_stream = Some(parse_size(s)?);
    }
    if let Some(n) = args.fuse_threads {
        c.fuse_threads = n;
    }
    if let Some(s) = &args.metadata_cache_size {
        c.metadata_cache_size = parse_size(s)?;
    }
    if args.no_prefetch {
        c.prefetch = false;
    }
    if let Some(n) = args.prefetch_threads {
        c.prefetch_threads = Some(n);
    }
    if let Some(s) = &args.prefetch_rate {
        c.prefetch_rate = parse_size(s)?;
    }
    if args.group.is_some() {
        c.group = args.group;
    }
    if let Some(t) = args.scrub_interval {
        c.scrub_interval_secs = t;
    }
    if let Some(t) = args.view_evict_grace {
        c.view_evict_grace_secs = t;
    }
    if let Some(s) = &args.view_reserve {
        c.view_reserve_bytes = parse_size(s)?;
    }
    if let Some(p) = args.view_keep_free {
        c.view_keep_free_percent = p;
    }
    if let Some(b) = args.fanotify_follow_readers {
        c.fanotify_follow_readers = b;
    }
    if let Some(n) = args.sandbox_pool {
        c.sandbox_pool = n;
    }
    if let Some(t) = args.record_plans {
        c.record_plans_secs = t;
    }
    if let Some(m) = args.mount_mode {
        c.mount_mode = m;
    }
    if let Some(b) = args.loop_direct_io {
        c.loop_direct_io = b;
    }
    Ok(c)
}

/// Bounds glibc's malloc arenas to two. By default every thread that allocates may get an arena of its
/// own (up to 8 per core), each keeping the memory freed in it: the server's many short-lived read
/// threads, each with a read buffer of up to 1 MiB, left 260–330 MiB resident under load (BENCHMARKS.md,
/// node daemon survival).
fn limit_malloc_arenas() {
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Raises the open-file limit to its hard limit: the chunk cache keeps two descriptors per segment
/// (a 1 TB cache has 4,000 segments) and every sandbox's mounts and connections take more.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a pointer to a local struct that outlives the calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn init_logging(args: &Args) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if args.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .init();
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    init_logging(&args);
    let config = load(&args)?;
    if args.check {
        return check(&config, args.json);
    }
    limit_malloc_arenas();
    raise_fd_limit();
    if let Some(inh) = holder::take_inherited()? {
        return serve_for_holder(config, inh);
    }
    if systemd::notify_socket().is_some() || std::env::var_os("LISTEN_FDS").is_some() {
        return serve_for_systemd(config);
    }
    if args.no_holder {
        return serve_plain(config);
    }
    holder::hold(&config, std::env::args_os().skip(1).collect())
}

/// `stratad --check`: the mount-mode report, without starting; exits 1 if no mode works (or the forced
/// one does not).
fn check(config: &Config, json_out: bool) -> Result<()> {
    // The probe image goes where layer metadata will: it must be a disk filesystem.
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("state directory {}", config.state_dir.display()))?;
    let report = strata_fs::modes::probe_and_decide(&config.state_dir, config.mount_mode);
    match json_out {
        true => println!("{}", serde_json::to_string(&report)?),
        false => report.lines().iter().for_each(|l| println!("{l}")),
    }
    if let Err(e) = report.usable() {
        if !json_out {
            eprintln!("stratad: {e}");
        }
        std::process::exit(1);
    }
    Ok(())
}

/// Starts the API on `listener` in the background.
fn api_thread(daemon: &Arc<Daemon>, listener: UnixListener, hooks: Hooks) {
    let d = daemon.clone();
    std::thread::spawn(move || {
        if let Err(e) = strata_fs::api::serve_listener(d, listener, Arc::new(hooks)) {
            tracing::error!(error = %e, "control socket failed");
        }
    });
}

/// Whether the holder that started this server still lives: it is this process's parent as long as it
/// does (a dead holder's children are reparented).
fn holder_alive(holder: u32) -> bool {
    rustix::process::getppid().is_some_and(|p| p.as_raw_nonzero().get() as u32 == holder)
}

/// The holder's part of `GET /v1/status`: its pid only while it lives, and its report (the running
/// binary, the last upgrade's outcome, failed server starts).
fn holder_status(holder: u32, runtime_dir: &Path) -> serde_json::Value {
    let alive = holder_alive(holder);
    json!({
        "mode": "holder",
        "holder_pid": alive.then_some(holder),
        "holder_alive": alive,
        "holder": holder::report::Report::read(runtime_dir),
    })
}

/// A server under a holder: SIGTERM hands over, SIGUSR1 tears the node down.
fn serve_for_holder(config: Config, inh: holder::Inherited) -> Result<()> {
    let set = signals::block(&[libc::SIGTERM, libc::SIGUSR1, libc::SIGINT]);
    // Beside the takeover of a predecessor's reads, not after it; after the block, so that the thread
    // takes none of the signals `signals::wait` is for.
    strata_fs::residentcode::populate_in_background();
    let mut chan = Channel::from_fd(inh.fuse);
    if let Some(j) = inh.journal {
        chan = chan.with_journal(Journal::from_fd(j).context("the FUSE request journal")?);
    }
    let fuse = match inh.fresh {
        true => Fuse::Fresh(chan),
        false => Fuse::Adopt(chan),
    };
    let kept = Kept {
        fds: inh.kept,
        keeper: inh
            .store
            .map(|s| Box::new(systemd::Keeper::Holder(s)) as Box<dyn strata_fs::trees::Keeper>),
    };
    let daemon = Daemon::start_kept(config.clone(), fuse, kept).context("starting stratad")?;
    let holder = inh.holder;
    let runtime_dir = config.runtime_dir.clone();
    let hooks = Hooks {
        upgrade: Some(Box::new(move || {
            if !holder_alive(holder) {
                return Err(std::io::Error::other(format!(
                    "the descriptor holder (pid {holder}) is gone: nobody can start a new server; restart the node when convenient"
                )));
            }
            let pid =
                Pid::from_raw(holder as i32).ok_or_else(|| std::io::Error::other("no holder"))?;
            Ok(kill_process(pid, Signal::HUP)?)
        })),
        status: Some(Box::new(move || holder_status(holder, &runtime_dir))),
    };
    api_thread(&daemon, UnixListener::from(inh.api), hooks);
    tracing::info!(
        pid = std::process::id(),
        adopted = daemon.adopted,
        "stratad serving"
    );
    loop {
        match signals::wait(&set) {
            // The holder handles SIGINT (a terminal's ^C reaches both): ignore it here.
            libc::SIGINT => continue,
            libc::SIGUSR1 => {
                daemon.shutdown();
                tracing::info!("stopped");
            }
            _ => {
                daemon.stop_serving();
                tracing::info!("handed over: mounts left for the successor");
            }
        }
        drop(inh.lock);
        drop(inh.rlock);
        // Exit without running destructors that could touch the mounts the successor serves.
        std::process::exit(0);
    }
}

/// A server under systemd: the FUSE connection and control socket live in the unit's file-descriptor
/// store, so SIGTERM (a restart) hands over like an upgrade.
fn serve_for_systemd(config: Config) -> Result<()> {
    let set = signals::block(&[libc::SIGTERM, libc::SIGINT]);
    strata_fs::residentcode::populate_in_background();
    let locks = holder::locks::lock_node(&config.state_dir, &config.runtime_dir)?;
    let mut fds = systemd::take_listen_fds();
    let mut take = |name: &str| {
        fds.iter()
            .position(|(n, _)| n == name)
            .map(|i| fds.remove(i).1)
    };
    let (fuse, api, journal) = (take("fuse"), take("api"), take("journal"));
    let chan = match fuse {
        Some(fd) => {
            let mut c = Channel::from_fd(fd);
            if let Some(j) = journal {
                c = c.with_journal(Journal::from_fd(j).context("the FUSE request journal")?);
            }
            Fuse::Adopt(c)
        }
        None => {
            holder::locks::check_stale_mounts(&locks, &config.state_dir, &config.runtime_dir)?;
            let c = strata_fs::daemon::mount_fresh(&config).context("mounting the blob server")?;
            systemd::notify("FDSTORE=1\nFDNAME=fuse", &[c.fd()])?;
            if let Some(j) = c.journal() {
                systemd::notify("FDSTORE=1\nFDNAME=journal", &[j.fd()])?;
            }
            Fuse::Fresh(c)
        }
    };
    let listener = match api {
        Some(fd) => UnixListener::from(fd),
        None => {
            let socket = config.runtime_dir.join("stratad.sock");
            let l = strata_fs::api::bind(&socket, config.group)?;
            systemd::notify("FDSTORE=1\nFDNAME=api", &[l.as_fd()])?;
            l
        }
    };
    // What is left in the store: `fuse` mode's tree connections (strata_fs::trees).
    let kept = Kept {
        fds,
        keeper: Some(Box::new(systemd::Keeper::Systemd)),
    };
    let daemon = Daemon::start_kept(config, chan, kept).context("starting stratad")?;
    let d2 = daemon.clone();
    let hooks = Hooks {
        upgrade: Some(Box::new(move || {
            // systemd (Restart=always) starts the successor with the stored descriptors.
            let d = d2.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                d.stop_serving();
                std::process::exit(0);
            });
            Ok(())
        })),
        status: Some(Box::new(|| json!({"mode": "systemd"}))),
    };
    api_thread(&daemon, listener, hooks);
    // Ready only once the control socket answers.
    let client = strata_api::Client {
        socket: daemon.config.runtime_dir.join("stratad.sock"),
    };
    client
        .call("GET", "/v1/status", None)
        .context("control socket does not answer")?;
    systemd::notify(&format!("READY=1\nMAINPID={}", std::process::id()), &[])?;
    tracing::info!(
        pid = std::process::id(),
        adopted = daemon.adopted,
        "stratad serving (systemd)"
    );
    let _ = signals::wait(&set);
    daemon.stop_serving();
    let _ = systemd::notify("STOPPING=1", &[]);
    drop(locks);
    std::process::exit(0);
}

/// One process, no holder: sandboxes end with it.
fn serve_plain(config: Config) -> Result<()> {
    let set = signals::block(&[libc::SIGTERM, libc::SIGINT]);
    strata_fs::residentcode::populate_in_background();
    let locks = holder::locks::lock_node(&config.state_dir, &config.runtime_dir)?;
    holder::locks::check_stale_mounts(&locks, &config.state_dir, &config.runtime_dir)?;
    let daemon = Daemon::start(config.clone(), Fuse::Mount).context("starting stratad")?;
    let socket = config.runtime_dir.join("stratad.sock");
    let listener = strata_fs::api::bind(&socket, config.group)?;
    api_thread(&daemon, listener, Hooks::default());
    tracing::info!(socket = %socket.display(), store = %config.store, "stratad ready (no holder)");
    let sig = signals::wait(&set);
    tracing::info!(signal = sig, "stopping");
    daemon.shutdown();
    let _ = std::fs::remove_file(&socket);
    tracing::info!("stopped");
    Ok(())
}

/// The `stratad` program.
pub fn main() {
    if let Err(e) = run() {
        eprintln!("stratad: error: {}", crate::exit::message(&e));
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_config_file_is_an_error_only_when_given() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        let e = read_config(&missing, true).unwrap_err();
        assert!(format!("{e:#}").contains("nope.toml"), "{e:#}");
        assert_eq!(read_config(&missing, false).unwrap().cache_size, 10 << 30);
    }

    #[test]
    fn the_shipped_example_config_parses_and_states_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/stratad.toml");
        let c = read_config(&path, true).unwrap();
        let d = Config::default();
        assert_eq!(
            serde_json::to_value(&c).unwrap(),
            serde_json::to_value(&d).unwrap(),
            "dist/stratad.toml must state the defaults"
        );
        // And name every option, set or commented out.
        let text = std::fs::read_to_string(&path).unwrap();
        let serde_json::Value::Object(keys) = serde_json::to_value(&d).unwrap() else {
            panic!("the config is a table")
        };
        for k in keys.keys() {
            let named = text.lines().any(|l| {
                let l = l.trim_start_matches(['#', ' ']);
                l.strip_prefix(k.as_str())
                    .is_some_and(|rest| rest.trim_start().starts_with('='))
            });
            assert!(named, "dist/stratad.toml does not name {k}");
        }
    }

    #[test]
    fn sizes_in_the_file_take_units_or_integers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stratad.toml");
        let text = "cache_size = \"20G\"\nmax_fetch_span = \"4M\"\nprefetch_rate = 1048576\n\
                    metadata_cache_size = \"1.5G\"\n";
        std::fs::write(&path, text).unwrap();
        let c = read_config(&path, true).unwrap();
        assert_eq!(c.cache_size, 20 << 30);
        assert_eq!(c.max_fetch_span, Some(4 << 20));
        assert_eq!(c.prefetch_rate, 1 << 20);
        assert_eq!(c.metadata_cache_size, 3 << 29);
        std::fs::write(&path, "mount_mode = \"loop\"\nloop_direct_io = false\n").unwrap();
        let c = read_config(&path, true).unwrap();
        assert_eq!(c.mount_mode, ModeRequest::Loop);
        assert!(!c.loop_direct_io);
        assert_eq!(Config::default().mount_mode, ModeRequest::Auto);
        std::fs::write(&path, "mount_mode = \"block\"\n").unwrap();
        assert!(read_config(&path, true).is_err());
        std::fs::write(&path, "cache_size = \"lots\"\n").unwrap();
        let e = read_config(&path, true).unwrap_err();
        assert!(format!("{e:#}").contains("lots"), "{e:#}");
    }
}
