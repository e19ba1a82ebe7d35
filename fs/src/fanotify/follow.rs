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
//! [`EVERY`] it reads that process's CPU and, if it ran elsewhere, moves there (`sched_setaffinity`).
//! The CPU is its main thread's `processor` field, read from `/proc/<pid>/task/<pid>/stat`, which is
//! opened once per reader and read again from its start at each look. Opening `/proc/<pid>/stat` at
//! each look instead (its path, access checks, a sum over every thread of the process) made the loop
//! spend 18.4 µs an event on a cold import against 15.7 µs now (`benches/loopcost.py`) — on the
//! reader's CPU, while the reader waited for its answer. A loop that has had no event for [`IDLE`] lets the scheduler
//! place it again, so that an idle node's loop is not held on a CPU a busy sandbox took since.
//! Several readers on several CPUs: the loop is on the last one's, the others' events cost what they
//! cost without this. A reader on a CPU the daemon may not use (a sandbox in another cpuset) is not
//! followed. The process's CPU is its main thread's (events name the process, not the thread).
//! Loops per CPU were tried instead and were slower: every event then wakes every loop, and the
//! reader pays for the wake-ups it sends to the other CPUs (BENCHMARKS.md).

use std::fs::File;
use std::os::unix::fs::FileExt;
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
    /// The process followed and its main thread's `stat`, kept open (none while it cannot be read).
    reader: Option<(u32, Option<File>)>,
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
            reader: None,
            looked: now.checked_sub(EVERY).unwrap_or(now),
            last_event: now,
        }
    }

    /// After a batch whose last reader (not the server itself) was `pid`: moves to its CPU if it is
    /// time to look and it ran elsewhere.
    pub fn answered(&mut self, pid: Option<u32>) {
        let now = Instant::now();
        self.last_event = now;
        // (A reader in a PID namespace this process cannot see is reported as 0.)
        let Some(pid) = pid.filter(|&p| self.on && p != 0) else {
            return;
        };
        if now.duration_since(self.looked) < EVERY {
            return;
        }
        self.looked = now;
        let stat = match &mut self.reader {
            Some((p, f)) if *p == pid && f.is_some() => f,
            r => &mut r.insert((pid, File::open(stat_path(pid)).ok())).1,
        };
        let Some(cpu) = stat.as_ref().and_then(cpu_of) else {
            // Gone, or not readable: opened again at the next look.
            *stat = None;
            return;
        };
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
            self.reader = None;
        }
    }
}

/// Process `pid`'s main thread's `stat`: its own fields only (`/proc/<pid>/stat` sums the times
/// of every thread).
fn stat_path(pid: u32) -> String {
    format!("/proc/{pid}/task/{pid}/stat")
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

/// The CPU a thread last ran on, from its open `/proc/<pid>/task/<tid>/stat` (read again from the
/// start).
fn cpu_of(stat: &File) -> Option<usize> {
    // 52 fields of at most 20 digits, and a command name of at most 64 bytes in parentheses.
    let mut buf = [0u8; 1536];
    let n = stat.read_at(&mut buf, 0).ok()?;
    cpu_in_stat(&buf[..n])
}

/// The `processor` field (the 39th) of a `/proc/<pid>/stat` line. The command name (the 2nd, in
/// parentheses) may hold spaces, parentheses and bytes that are not UTF-8: fields are counted after
/// its last `)`.
pub fn cpu_in_stat(stat: &[u8]) -> Option<usize> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    rest.split_ascii_whitespace().nth(39 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_is_read_after_any_command_name() {
        let fields: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        let line = |comm: &str| format!("1234 ({comm}) {}\n", fields.join(" "));
        assert_eq!(cpu_in_stat(line("python3").as_bytes()), Some(39));
        assert_eq!(cpu_in_stat(line("a) (b c)").as_bytes()), Some(39));
        assert_eq!(cpu_in_stat(b"1234 (x) 1 2 3"), None);
        assert_eq!(cpu_in_stat(b"garbage"), None);
        let own = std::fs::read("/proc/self/stat").expect("own stat");
        let cpu = cpu_in_stat(&own).expect("own cpu");
        assert!(cpu < rustix::thread::CpuSet::MAX_CPU);
        let mut odd = b"1234 (\xff) ".to_vec();
        odd.extend_from_slice(fields.join(" ").as_bytes());
        assert_eq!(cpu_in_stat(&odd), Some(39), "a name that is not UTF-8");
    }

    /// Looks at `pid` once the next look is due.
    fn look(f: &mut Follow, pid: u32) {
        std::thread::sleep(EVERY);
        f.answered(Some(pid));
    }

    #[test]
    fn moves_to_its_readers_cpu_keeping_the_readers_file_open() {
        let mine = rustix::thread::sched_getaffinity(None).expect("affinity");
        let Some(cpu) = (0..rustix::thread::CpuSet::MAX_CPU).rfind(|&c| mine.is_set(c)) else {
            panic!("no CPU to run on");
        };
        // A reader that stays on one CPU: a process sleeping there.
        let mut reader = std::process::Command::new("taskset")
            .args(["-c", &cpu.to_string(), "sleep", "30"])
            .spawn()
            .expect("run taskset");
        let pid = reader.id();
        std::thread::sleep(Duration::from_millis(50)); // it is `sleep` on `cpu` by now
        let mut f = Follow::new(true);
        f.answered(Some(pid));
        assert_eq!(f.pinned, Some(cpu), "moved to the reader's CPU");
        assert!(f
            .reader
            .as_ref()
            .is_some_and(|(p, s)| *p == pid && s.is_some()));
        look(&mut f, pid);
        assert_eq!(f.pinned, Some(cpu));
        // The reader gone: its file no longer reads, and the loop stays where it is.
        let _ = reader.kill();
        let _ = reader.wait();
        look(&mut f, pid);
        assert!(f.reader.as_ref().is_some_and(|(_, s)| s.is_none()));
        assert_eq!(f.pinned, Some(cpu));
        // Another reader is looked at with its own file.
        look(&mut f, 1);
        assert!(f
            .reader
            .as_ref()
            .is_some_and(|(p, s)| *p == 1 && s.is_some()));
    }

    #[test]
    fn unseen_readers_and_a_loop_that_does_not_follow_are_never_looked_at() {
        let mut f = Follow::new(true);
        f.answered(Some(u32::MAX - 1)); // above any pid_max
        assert!(f.reader.as_ref().is_some_and(|(_, s)| s.is_none()));
        assert_eq!(f.pinned, None);
        let mut f = Follow::new(true);
        f.answered(Some(0));
        assert!(f.reader.is_none());
        let mut off = Follow::new(false);
        off.answered(Some(std::process::id()));
        assert!(off.reader.is_none() && off.pinned.is_none());
    }
}
