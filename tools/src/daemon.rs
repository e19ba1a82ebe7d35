//! `stratad`: configuration (TOML file, then flags), start, serve the control API, stop on a signal.
//!
//! SIGTERM and SIGINT stop the daemon cleanly: every sandbox rootfs and layer mount is detached and the
//! FUSE blob server unmounted, so no "Transport endpoint is not connected" mount is left behind. A daemon
//! that was killed (`kill -9`) leaves its mounts; the next start detaches them before mounting anew.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use strata_fs::daemon::{Config, Daemon};

/// strata's node daemon: mounts images lazily and gives each sandbox an overlay rootfs.
#[derive(Parser)]
#[command(name = "stratad", version)]
struct Args {
    /// TOML configuration file (keys as in docs/DAEMON.md); flags override it.
    #[arg(long, default_value = "/etc/strata/stratad.toml")]
    config: PathBuf,
    /// Store URL.
    #[arg(long, env = "STRATA_STORE")]
    store: Option<String>,
    #[arg(long)]
    state_dir: Option<PathBuf>,
    #[arg(long)]
    runtime_dir: Option<PathBuf>,
    /// Chunk cache bound, e.g. 10G, 512M.
    #[arg(long)]
    cache_size: Option<String>,
    /// Seconds before a read that cannot be served fails with EIO.
    #[arg(long)]
    read_timeout: Option<f64>,
    /// Largest compressed span of one range request, e.g. 4M.
    #[arg(long)]
    max_fetch_span: Option<String>,
    #[arg(long)]
    fuse_threads: Option<usize>,
    /// Group (gid) allowed to use the control socket besides root.
    #[arg(long)]
    group: Option<u32>,
    /// Do not warm images' prefetch plans when their sandboxes are created.
    #[arg(long)]
    no_prefetch: bool,
    /// Concurrent prefetch fetches.
    #[arg(long)]
    prefetch_threads: Option<usize>,
    /// Prefetch bandwidth cap per second, e.g. 256M (0: none).
    #[arg(long)]
    prefetch_rate: Option<String>,
    /// Bound of the metadata kept for layers no longer mounted, e.g. 4G.
    #[arg(long)]
    metadata_cache_size: Option<String>,
    /// Record the reads of this many seconds after an image without a prefetch plan is first mounted
    /// and store them as its plan (needs write access to the store; 0: off).
    #[arg(long, value_name = "SECS")]
    record_plans: Option<f64>,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

/// Parses sizes like `10G`, `512M`, `4096`.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1u64 << 40,
                _ => anyhow::bail!("size {s:?}: unknown unit (K, M, G, T)"),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let n: f64 = num.parse().with_context(|| format!("size {s:?}"))?;
    Ok((n * mult as f64) as u64)
}

fn load(args: &Args) -> Result<Config> {
    let mut c: Config = match std::fs::read_to_string(&args.config) {
        Ok(text) => {
            toml::from_str(&text).with_context(|| format!("config {}", args.config.display()))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Config::default(),
        Err(e) => return Err(e).with_context(|| format!("config {}", args.config.display())),
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
    if let Some(s) = &args.max_fetch_span {
        c.max_fetch_span = Some(parse_size(s)?);
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
    if let Some(t) = args.record_plans {
        c.record_plans_secs = t;
    }
    Ok(c)
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

/// Blocks SIGTERM and SIGINT in every thread; returns once one arrives.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a zeroed, initialized sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: `set` was initialized by block_signals; sig is a valid out pointer.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

fn run() -> Result<()> {
    let args = Args::parse();
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
            .with_writer(std::io::stderr)
            .init();
    }
    let config = load(&args)?;
    let set = block_signals();
    raise_fd_limit();
    let daemon = Daemon::start(config.clone()).context("starting stratad")?;
    let socket = config.runtime_dir.join("stratad.sock");
    let d2: Arc<Daemon> = daemon.clone();
    let sock2 = socket.clone();
    std::thread::spawn(move || {
        if let Err(e) = strata_fs::api::serve(d2, &sock2, config.group) {
            tracing::error!(error = %e, "control socket failed");
        }
    });
    tracing::info!(socket = %socket.display(), store = %config.store, "stratad ready");
    let sig = wait_signal(&set);
    tracing::info!(signal = sig, "stopping");
    daemon.shutdown();
    let _ = std::fs::remove_file(&socket);
    tracing::info!("stopped");
    Ok(())
}

/// The `stratad` program.
pub fn main() {
    if let Err(e) = run() {
        eprintln!("stratad: error: {e:#}");
        std::process::exit(1);
    }
}
