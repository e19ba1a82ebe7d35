//! `stratad`: configuration (TOML file, then flags), start, serve the control API, stop on a signal.
//!
//! SIGTERM and SIGINT stop the daemon cleanly: every sandbox rootfs and layer mount is detached and the
//! FUSE blob server unmounted, so no "Transport endpoint is not connected" mount is left behind. A daemon
//! that was killed (`kill -9`) leaves its mounts; the next start detaches them before mounting anew.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use strata_fs::daemon::{Config, Daemon};
use strata_fs::size::parse_size;

/// The configuration file read when `--config` is not given (it may be missing).
const DEFAULT_CONFIG: &str = "/etc/strata/stratad.toml";

/// strata's node daemon: mounts images lazily and gives each sandbox an overlay rootfs.
#[derive(Parser)]
#[command(name = "stratad", version)]
struct Args {
    /// TOML configuration file (keys as in docs/DAEMON.md); flags override it. Default:
    /// /etc/strata/stratad.toml, if it exists.
    #[arg(long)]
    config: Option<PathBuf>,
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
            .with_ansi(std::io::stderr().is_terminal())
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
        std::fs::write(&path, "cache_size = \"lots\"\n").unwrap();
        let e = read_config(&path, true).unwrap_err();
        assert!(format!("{e:#}").contains("lots"), "{e:#}");
    }
}
