//! A userspace slow link for benchmarks: a TCP proxy on loopback that behaves like a network path with a
//! round-trip time and a bandwidth (this kernel has no `netem`).
//!
//! ```text
//! linkproxy --target 127.0.0.1:9000 [--listen 127.0.0.1:0] [--rtt-ms 20] [--mbit 1000] [--stats FILE]
//! ```
//!
//! Prints `listening <port>` on standard output once ready, then runs until killed. With `--stats`, it
//! rewrites FILE every 50 ms with `<bytes up> <bytes down> <connections>` since it started, so that a
//! benchmark can count every byte that crossed the link (requests, metadata, data).
//!
//! Each direction of each connection is a *delay line*: a reader thread takes up to 64 KiB at a time from
//! one side, computes when those bytes would arrive over the link, and hands them to a writer thread that
//! sends them at that time. Arrival = the moment the shared link is free to transmit them (a FIFO link per
//! direction, shared by every connection, so parallel connections share the bandwidth as they would on
//! a real path) + transmission time at the link's rate + half the round-trip time. Reading never waits
//! for the delay, so a stream keeps its bandwidth whatever the delay; a bounded queue between the threads
//! (about 2 MiB, more than the bandwidth-delay product of 1 Gbit/s × 10 ms) keeps TCP back pressure. A new
//! connection's first bytes also wait one extra round trip, as a real TCP handshake would make them.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One direction of the link, shared by every connection: when it is next free to transmit.
struct Link {
    free_at: Mutex<Instant>,
    /// Bytes per second; 0 = unlimited.
    rate: f64,
    one_way: Duration,
    /// Bytes carried so far.
    bytes: AtomicU64,
}

impl Link {
    /// When `n` bytes handed to the link now arrive at the other end.
    fn arrival(&self, n: usize) -> Instant {
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        let now = Instant::now();
        let mut free = self.free_at.lock().unwrap_or_else(|p| p.into_inner());
        let start = (*free).max(now);
        let tx = if self.rate > 0.0 {
            Duration::from_secs_f64(n as f64 / self.rate)
        } else {
            Duration::ZERO
        };
        *free = start + tx;
        start + tx + self.one_way
    }
}

fn reader(
    mut from: TcpStream,
    link: Arc<Link>,
    extra: Duration,
    tx: SyncSender<(Instant, Vec<u8>)>,
) {
    let mut first = true;
    loop {
        let mut buf = vec![0u8; 64 << 10];
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.truncate(n);
        let mut at = link.arrival(n);
        if first {
            at += extra;
            first = false;
        }
        if tx.send((at, buf)).is_err() {
            break;
        }
    }
}

fn writer(mut to: TcpStream, rx: Receiver<(Instant, Vec<u8>)>) {
    for (at, buf) in rx {
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        if to.write_all(&buf).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Wires one direction: `from` → link → `to`.
fn direction(from: TcpStream, to: TcpStream, link: Arc<Link>, extra: Duration) {
    let (tx, rx) = sync_channel(32);
    std::thread::spawn(move || reader(from, link, extra, tx));
    std::thread::spawn(move || writer(to, rx));
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: linkproxy --target HOST:PORT [--listen ADDR] [--rtt-ms MS] [--mbit MBIT] [--stats FILE]";
    let Some(target) = arg(&args, "--target") else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let listen = arg(&args, "--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let num = |name: &str, default: f64| -> f64 {
        match arg(&args, name) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| {
                eprintln!("{name}: not a number: {v}\n{usage}");
                std::process::exit(2)
            }),
        }
    };
    let rtt = Duration::from_secs_f64(num("--rtt-ms", 20.0) / 1000.0);
    let rate = num("--mbit", 1000.0) * 1e6 / 8.0;
    let link = |one_way| {
        Arc::new(Link {
            free_at: Mutex::new(Instant::now()),
            rate,
            one_way,
            bytes: AtomicU64::new(0),
        })
    };
    let (up, down) = (link(rtt / 2), link(rtt / 2));
    let conns = Arc::new(AtomicU64::new(0));
    if let Some(path) = arg(&args, "--stats") {
        let (up, down, conns) = (up.clone(), down.clone(), conns.clone());
        std::thread::spawn(move || loop {
            let line = format!(
                "{} {} {}\n",
                up.bytes.load(Ordering::Relaxed),
                down.bytes.load(Ordering::Relaxed),
                conns.load(Ordering::Relaxed)
            );
            let tmp = format!("{path}.tmp");
            if std::fs::write(&tmp, line)
                .and_then(|_| std::fs::rename(&tmp, &path))
                .is_err()
            {
                eprintln!("linkproxy: cannot write {path}");
            }
            std::thread::sleep(Duration::from_millis(50));
        });
    }
    let listener = TcpListener::bind(&listen)?;
    println!("listening {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    for c in listener.incoming() {
        let Ok(client) = c else { continue };
        let server = match TcpStream::connect(&target) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("linkproxy: connect {target}: {e}");
                continue;
            }
        };
        conns.fetch_add(1, Ordering::Relaxed);
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
            continue;
        };
        // The handshake's round trip delays the first request.
        direction(client, server, up.clone(), rtt);
        direction(s2, c2, down.clone(), Duration::ZERO);
    }
    Ok(())
}
