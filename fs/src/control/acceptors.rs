//! The control socket's connections served by the threads that accept them.
//!
//! A connection used to be accepted by one thread and handed to a thread started for it: every request
//! paid for a thread's start (its stack and signal stack mapped, the scheduler placing it, often on the
//! other CPU) before its first byte was read. Here each serving thread blocks in `accept` itself and
//! serves what it accepted; the kernel wakes one of the threads waiting in `accept` per connection. So
//! that a slow request (a first mount, a pull) never holds the others up, a thread that takes the last
//! idle place starts another acceptor before it serves; a thread that finds [`SPARE`] others idle when
//! it is done ends. A burst of N slow requests therefore runs N at once, as before, and a sequence of
//! quick ones (a shell loop of `strata mount`) is served by the same thread with no start at all.
//!
//! Invariants: at least one thread is in (or on its way back to) `accept` whenever none is serving
//! the last connection accepted — the thread that made the count of idle ones zero started another
//! first; the first thread never ends.

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rustix::io::Errno;

/// Idle acceptors beyond which a thread that is done ends.
pub const SPARE: usize = 2;

/// Serves one accepted connection.
pub type Serve = dyn Fn(UnixStream) + Send + Sync;

struct Shared {
    listener: UnixListener,
    serve: Box<Serve>,
    /// Threads waiting in `accept` (or about to).
    idle: AtomicUsize,
}

/// Serves `listener`'s connections with `serve` on threads that accept them (module documentation);
/// the calling thread is the first of them and returns only when `accept` fails for good.
pub fn serve(listener: UnixListener, serve: Box<Serve>) -> std::io::Result<()> {
    let s = Arc::new(Shared {
        listener,
        serve,
        idle: AtomicUsize::new(0),
    });
    run(&s, true)
}

/// The name of the threads [`start`] starts.
const NAME: &str = "strata-api";

fn run(s: &Arc<Shared>, first: bool) -> std::io::Result<()> {
    loop {
        s.idle.fetch_add(1, Ordering::SeqCst);
        let conn = s.listener.accept();
        let idle = s.idle.fetch_sub(1, Ordering::SeqCst) - 1;
        let stream = match conn {
            Ok((stream, _)) => stream,
            // The listener is gone: only the first thread reports it.
            Err(e) if errno_in(&e, FATAL) => match first {
                true => return Err(e),
                false => return Ok(()),
            },
            // Out of descriptors or memory: give the serving threads time to close some.
            Err(e) if errno_in(&e, RESOURCE) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            // A client that went away before it was accepted.
            Err(_) => continue,
        };
        if idle == 0 {
            start(s);
        }
        (s.serve)(stream);
        if !first && s.idle.load(Ordering::SeqCst) >= SPARE {
            return Ok(());
        }
    }
}

/// Starts another acceptor. Without a thread to spare, the connections wait in the backlog for the
/// threads there are.
fn start(s: &Arc<Shared>) {
    let t = s.clone();
    let started = std::thread::Builder::new()
        .name(NAME.into())
        .spawn(move || {
            let _ = run(&t, false);
        });
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start a control API thread");
    }
}

/// `accept` errors that only time (connections closing) cures.
const RESOURCE: &[Errno] = &[Errno::MFILE, Errno::NFILE, Errno::NOBUFS, Errno::NOMEM];

/// `accept` errors that will not go away by trying again.
const FATAL: &[Errno] = &[Errno::BADF, Errno::INVAL, Errno::NOTSOCK, Errno::OPNOTSUPP];

fn errno_in(e: &std::io::Error, set: &[Errno]) -> bool {
    Errno::from_io_error(e).is_some_and(|n| set.contains(&n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::Barrier;
    use std::time::Duration;

    /// This process's threads that [`start`] started and that have not ended.
    fn started() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("tasks")
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == NAME)
            })
            .count()
    }

    /// Connections that block in their handler all run at once: each thread that takes the last idle
    /// place starts another; once they are done, at most `SPARE` idle threads stay besides the first.
    /// (The only test that starts these threads: it counts them by name.)
    #[test]
    fn slow_connections_run_side_by_side_then_threads_end() {
        const N: usize = 6;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let barrier = Arc::new(Barrier::new(N));
        let b = barrier.clone();
        let shared = Arc::new(Shared {
            listener,
            serve: Box::new(move |mut c: UnixStream| {
                let mut byte = [0u8; 1];
                let _ = c.read_exact(&mut byte);
                if byte[0] == b's' {
                    // Every slow connection waits for all N to be served at once.
                    b.wait();
                }
                let _ = c.write_all(b"ok");
            }),
            idle: AtomicUsize::new(0),
        });
        std::thread::spawn(move || run(&shared, true));
        let ask = |what: &'static [u8]| {
            let p = path.clone();
            std::thread::spawn(move || {
                let mut c = UnixStream::connect(&p).expect("connect");
                c.set_read_timeout(Some(Duration::from_secs(20)))
                    .expect("timeout");
                c.write_all(what).expect("send");
                let mut reply = String::new();
                c.read_to_string(&mut reply).expect("reply");
                reply
            })
        };
        let slow: Vec<_> = (0..N).map(|_| ask(b"s")).collect();
        for h in slow {
            assert_eq!(h.join().expect("client"), "ok", "a slow one was not served");
        }
        // Quick ones in a row are served by the threads there are.
        for _ in 0..20 {
            assert_eq!(ask(b"q").join().expect("client"), "ok");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while started() > SPARE && std::time::Instant::now() < deadline {
            // A thread ends after its next connection: nudge them.
            assert_eq!(ask(b"q").join().expect("client"), "ok");
        }
        let stayed = started();
        assert!(stayed <= SPARE, "{stayed} threads stayed");
    }
}
