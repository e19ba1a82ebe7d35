//! Progress of long commands (build, import, pack_diff, flatten) on standard error.
//!
//! `--progress` (or `STRATA_PROGRESS`) picks how:
//!
//! - `tty` — a spinner line redrawn in place (indicatif);
//! - `plain` — a line every few seconds (`STRATA_PROGRESS_SECS`, default 5), for CI logs and anything
//!   else that is not a terminal: bytes done (of the total and a percentage once the total is known),
//!   rate, files when counted, ETA;
//! - `none` — nothing;
//! - `auto` (the default) — `tty` on a terminal, else `plain`.
//!
//! Both end with one last line, however short the work was: what was done, at what rate, in how long.
//! A total comes from the work when it knows one, or from [`total_of_dir`], a walk that sums a
//! directory's file sizes beside the build (stat only; the display has no total until it is done).
//!
//! The mode is chosen once per process ([`set_mode`], from the command line) and read by every command.
//! The work reports through atomic counters the builder already keeps, so watching costs a thread that
//! wakes a few times a second and nothing on the work's path.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::images::human;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Auto,
    Tty,
    Plain,
    None,
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// Sets the process's mode (the first call wins).
pub fn set_mode(m: Mode) {
    let _ = MODE.set(m);
}

fn mode() -> Mode {
    match MODE.get().copied().unwrap_or(Mode::Auto) {
        Mode::Auto if std::io::stderr().is_terminal() => Mode::Tty,
        Mode::Auto => Mode::Plain,
        m => m,
    }
}

/// What a running command counts.
#[derive(Clone, Default)]
pub struct Counters {
    /// Bytes processed.
    pub bytes: Arc<AtomicU64>,
    /// Files processed, when the work counts them.
    pub files: Option<Arc<AtomicU64>>,
    /// Total bytes, 0 until known (for the percentage and the ETA).
    pub total: Arc<AtomicU64>,
}

/// The total size of the regular files under `root` (not following symbolic links, on its own
/// filesystem), summed by a thread of its own: 0 until the walk is done.
pub fn total_of_dir(root: &std::path::Path) -> Arc<AtomicU64> {
    let total = Arc::new(AtomicU64::new(0));
    let (t, root) = (total.clone(), root.to_path_buf());
    let _ = std::thread::Builder::new()
        .name("strata-progress-total".into())
        .spawn(move || {
            let sum = walkdir::WalkDir::new(root)
                .same_file_system(true)
                .into_iter()
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum();
            t.store(sum, Ordering::Relaxed);
        });
    total
}

impl Counters {
    fn line(&self, start: Instant) -> String {
        let n = self.bytes.load(Ordering::Relaxed);
        let secs = start.elapsed().as_secs_f64().max(0.001);
        let rate = n as f64 / secs;
        let total = self.total.load(Ordering::Relaxed);
        let mut s = match total {
            0 => format!("{} read", human(n)),
            t => format!(
                "{} of {} ({:.0} %)",
                human(n),
                human(t),
                100.0 * n as f64 / t as f64
            ),
        };
        s.push_str(&format!(", {}/s, {:.0} s", human(rate as u64), secs));
        if let Some(f) = &self.files {
            s.push_str(&format!(", {} files", f.load(Ordering::Relaxed)));
        }
        if total > n && rate > 0.0 {
            s.push_str(&format!(", ETA {:.0} s", (total - n) as f64 / rate));
        }
        s
    }

    /// What was done, at what rate, in how long (the total no longer matters: part of it may have been
    /// left out, as excluded files are).
    fn last_line(&self, start: Instant) -> String {
        let n = self.bytes.load(Ordering::Relaxed);
        let secs = start.elapsed().as_secs_f64().max(0.001);
        let mut s = format!(
            "{} in {:.1} s, {}/s",
            human(n),
            secs,
            human((n as f64 / secs) as u64)
        );
        if let Some(f) = &self.files {
            s.push_str(&format!(", {} files", f.load(Ordering::Relaxed)));
        }
        s
    }
}

fn plain_interval() -> Duration {
    let secs = std::env::var("STRATA_PROGRESS_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs)
}

/// Runs `f`, showing progress of `c` as the mode says; the last line says whether it is done or failed
/// (how far it got), the error itself being the caller's to report.
pub fn watch<T, E>(what: &str, c: Counters, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let m = mode();
    if m == Mode::None {
        return f();
    }
    let start = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let bar = (m == Mode::Tty).then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.enable_steady_tick(Duration::from_millis(120));
        b
    });
    let (d2, c2, b2, what2) = (done.clone(), c.clone(), bar.clone(), what.to_string());
    let watcher = std::thread::spawn(move || {
        let interval = plain_interval();
        let mut next = start + interval;
        while !d2.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            match &b2 {
                Some(b) => b.set_message(c2.line(start)),
                None if Instant::now() >= next => {
                    eprintln!("{what2}: {}", c2.line(start));
                    next += interval;
                }
                None => {}
            }
        }
    });
    let out = f();
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // The last line, always: a short command's only one.
    let end = match out.is_ok() {
        true => "done",
        false => "failed",
    };
    eprintln!("{what}: {end}, {}", c.last_line(start));
    out
}
