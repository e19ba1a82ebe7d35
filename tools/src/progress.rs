//! Progress of long commands (build, import, pack_diff, flatten) on standard error.
//!
//! `--progress` (or `STRATA_PROGRESS`) picks how:
//!
//! - `tty` — a spinner line redrawn in place (indicatif);
//! - `plain` — a line every few seconds (`STRATA_PROGRESS_SECS`, default 5), for CI logs and anything
//!   else that is not a terminal: bytes, rate, files when counted, ETA when the total is known;
//! - `none` — nothing;
//! - `auto` (the default) — `tty` on a terminal, else `plain`.
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
    /// Total bytes, when known in advance (for the ETA).
    pub total: Option<u64>,
}

impl Counters {
    fn line(&self, start: Instant) -> String {
        let n = self.bytes.load(Ordering::Relaxed);
        let secs = start.elapsed().as_secs_f64().max(0.001);
        let rate = n as f64 / secs;
        let mut s = format!("{} read, {}/s, {:.0} s", human(n), human(rate as u64), secs);
        if let Some(f) = &self.files {
            s.push_str(&format!(", {} files", f.load(Ordering::Relaxed)));
        }
        if let Some(total) = self.total.filter(|&t| t > 0) {
            let pct = 100.0 * n as f64 / total as f64;
            s.push_str(&format!(", {pct:.0} % of {}", human(total)));
            if rate > 0.0 && n < total {
                s.push_str(&format!(", ETA {:.0} s", (total - n) as f64 / rate));
            }
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

/// Runs `f`, showing progress of `c` as the mode says.
pub fn watch<T>(what: &str, c: Counters, f: impl FnOnce() -> T) -> T {
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
    } else if start.elapsed() >= plain_interval() {
        eprintln!("{what}: done, {}", c.line(start));
    }
    out
}
