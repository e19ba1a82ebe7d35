//! The event loop follows its readers' CPU.
//!
//! Most events of a start are reads of ranges already filled, allowed at once (the fat image's cold
//! numpy + pandas import: ~1,100 against ~70 fills), so what such an event costs the reader is two
//! wake-ups: its event wakes the loop, the loop's answer wakes it. The scheduler wakes a sleeping
//! thread on an idle CPU rather than behind the running one, and on a virtual machine whose idle CPUs
//! halt each wake-up on another CPU costs tens of microseconds: here a pipe round trip between two
//! threads takes 41–47 µs on two CPUs and 5–6 µs on one, and a warm import whose every read is such an
//! event ran 11 % faster with the loop and the import pinned to the same CPU (~60 µs an event;
//! `benches/eventcost.py`, BENCHMARKS.md).
//!
//! So the loop keeps itself on the CPU of the process whose events it last answered: at most every
//! [`EVERY`] it reads that process's CPU (`/proc/<pid>/stat`, a few microseconds) and, if it moved,
//! moves there (`sched_setaffinity`). A loop that has had no event for [`IDLE`] lets the scheduler
//! place it again, so that an idle node's loop is not held on a CPU a busy sandbox took since.
//! Several readers on several CPUs: the loop is on the last one's, the others' events cost what they
//! cost without this. A reader on a CPU the daemon may not use (a sandbox in another cpuset) is not
//! followed. The process's CPU is its main thread's (events name the process, not the thread).
//! Loops per CPU were tried instead and were slower: every event then wakes every loop, and the
//! reader pays for the wake-ups it sends to the other CPUs (BENCHMARKS.md).

use std::time::{Duration, Instant};

/// How often the loop looks where its reader runs.
pub const EVERY: Duration = Duration::from_millis(2);
/// How long without events before the loop is free to run anywhere again.
pub const IDLE: Duration = Duration::from_millis(500);

/// The loop's placement: the CPU it keeps to, and when it last looked.
pub struct Follow {
    on: bool,
    /// The CPUs the loop may use when it follows no reader (its own at the start).
    all: Option<rustix::thread::CpuSet>,
    pinned: Option<usize>,
    looked: Instant,
    last_event: Instant,
}

impl Follow {
    /// A loop that follows its readers if `on`.
    pub fn new(on: bool) -> Follow {
        let now = Instant::now();
        Follow {
            on,
            all: rustix::thread::sched_getaffinity(None).ok(),
            pinned: None,
            looked: now.checked_sub(EVERY).unwrap_or(now),
            last_event: now,
        }
    }

    /// After a batch whose last reader (not the server itself) was `pid`: moves to its CPU if it is
    /// time to look and it ran elsewhere.
    pub fn answered(&mut self, pid: Option<u32>) {
        let now = Instant::now();
        self.last_event = now;
        let Some(pid) = pid.filter(|_| self.on) else {
            return;
        };
        if now.duration_since(self.looked) < EVERY {
            return;
        }
        self.looked = now;
        let Some(cpu) = cpu_of(pid) else { return };
        // A reader on a CPU the daemon may not use (another cpuset): not followed.
        let allowed = self.all.as_ref().is_some_and(|s| s.is_set(cpu));
        if allowed && self.pinned != Some(cpu) && pin(&one(cpu)) {
            self.pinned = Some(cpu);
        }
    }

    /// After a wait without events: lets the scheduler place the loop again once idle long enough.
    pub fn idle(&mut self) {
        if self.pinned.is_none() || self.last_event.elapsed() < IDLE {
            return;
        }
        if self.all.as_ref().is_some_and(pin) {
            self.pinned = None;
        }
    }
}

/// The set of CPU `cpu` alone.
fn one(cpu: usize) -> rustix::thread::CpuSet {
    let mut s = rustix::thread::CpuSet::new();
    s.set(cpu);
    s
}

/// Keeps the calling thread on `set`.
fn pin(set: &rustix::thread::CpuSet) -> bool {
    match rustix::thread::sched_setaffinity(None, set) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "moving the fanotify event loop");
            false
        }
    }
}

/// The CPU process `pid` last ran on, from `/proc/<pid>/stat`.
fn cpu_of(pid: u32) -> Option<usize> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_in_stat(&stat)
}

/// The `processor` field (the 39th) of a `/proc/<pid>/stat` line. The command name (the 2nd, in
/// parentheses) may hold spaces and parentheses: fields are counted after its last `)`.
pub fn cpu_in_stat(stat: &str) -> Option<usize> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(39 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_is_read_after_any_command_name() {
        let fields: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        let line = |comm: &str| format!("1234 ({comm}) {}\n", fields.join(" "));
        assert_eq!(cpu_in_stat(&line("python3")), Some(39));
        assert_eq!(cpu_in_stat(&line("a) (b c)")), Some(39));
        assert_eq!(cpu_in_stat("1234 (x) 1 2 3"), None);
        assert_eq!(cpu_in_stat("garbage"), None);
        let own = std::fs::read_to_string("/proc/self/stat").expect("own stat");
        let cpu = cpu_in_stat(&own).expect("own cpu");
        assert!(cpu < rustix::thread::CpuSet::MAX_CPU);
    }
}
