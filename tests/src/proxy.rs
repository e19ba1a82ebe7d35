//! A TCP proxy on loopback between strata and a store server, for fault injection and slow-link
//! simulation: it can be taken down (refusing and cutting connections) or made silent (a black hole that
//! accepts connections and never answers) and brought back, it can add a delay per direction change and
//! cap the bandwidth, and it can hang every request that mentions a given string (one blob's key, say):
//! accepted, never answered.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running proxy.
pub struct Proxy {
    pub port: u16,
    down: Arc<AtomicBool>,
    silent: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    /// Extra latency added once per request (each client→server burst), in microseconds.
    pub delay_us: Arc<AtomicU64>,
    /// Bytes per second server→client (0: unlimited).
    pub rate: Arc<AtomicU64>,
    /// Requests containing these bytes are swallowed: never forwarded, never answered.
    pub hang: Arc<Mutex<Option<Vec<u8>>>>,
}

type Hang = Arc<Mutex<Option<Vec<u8>>>>;

fn hangs(hang: &Option<Hang>, burst: &[u8]) -> bool {
    let Some(h) = hang else { return false };
    let Ok(g) = h.lock() else { return false };
    g.as_ref()
        .is_some_and(|p| !p.is_empty() && burst.windows(p.len()).any(|w| w == p.as_slice()))
}

fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Option<Arc<AtomicU64>>,
    rate: Option<Arc<AtomicU64>>,
    hang: Option<Hang>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if hangs(&hang, &buf[..n]) {
            // Swallow the request and whatever follows until the client gives up.
            while matches!(from.read(&mut buf), Ok(n) if n > 0) {}
            break;
        }
        if let Some(d) = &delay {
            let us = d.load(Ordering::Relaxed);
            if us > 0 {
                std::thread::sleep(Duration::from_micros(us));
            }
        }
        if let Some(r) = &rate {
            let bps = r.load(Ordering::Relaxed);
            if bps > 0 {
                std::thread::sleep(Duration::from_secs_f64(n as f64 / bps as f64));
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Proxy {
    /// Proxies a new loopback port to `127.0.0.1:target`.
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let p = Proxy {
            port,
            down: Arc::new(AtomicBool::new(false)),
            silent: Arc::new(AtomicBool::new(false)),
            stop: Arc::new(AtomicBool::new(false)),
            conns: Arc::new(Mutex::new(Vec::new())),
            delay_us: Arc::new(AtomicU64::new(0)),
            rate: Arc::new(AtomicU64::new(0)),
            hang: Arc::new(Mutex::new(None)),
        };
        let (down, silent, stop, conns, delay, rate, hang) = (
            p.down.clone(),
            p.silent.clone(),
            p.stop.clone(),
            p.conns.clone(),
            p.delay_us.clone(),
            p.rate.clone(),
            p.hang.clone(),
        );
        std::thread::spawn(move || {
            for c in listener.incoming() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(client) = c else { continue };
                if down.load(Ordering::Relaxed) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                if silent.load(Ordering::Relaxed) {
                    // Held open, never read or answered, until the proxy is brought back or dropped.
                    if let Ok(mut v) = conns.lock() {
                        v.push(client);
                    }
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                    if let Ok(mut v) = conns.lock() {
                        v.push(c2);
                        v.push(s2);
                    }
                }
                let (c1, s1) = match (client.try_clone(), server.try_clone()) {
                    (Ok(a), Ok(b)) => (a, b),
                    _ => continue,
                };
                let d = delay.clone();
                let (r, h) = (rate.clone(), hang.clone());
                std::thread::spawn(move || pump(c1, server, Some(d), None, Some(h)));
                std::thread::spawn(move || pump(s1, client, None, Some(r), None));
            }
        });
        p
    }

    /// Hangs every request that contains `pattern` from now on (`None`: none).
    pub fn set_hang(&self, pattern: Option<&[u8]>) {
        if let Ok(mut h) = self.hang.lock() {
            *h = pattern.map(<[u8]>::to_vec);
        }
    }

    /// Takes the store "down": cuts every open connection and refuses new ones.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
        if down {
            self.cut();
        }
    }

    /// Makes the store a black hole: cuts every open connection, then accepts new ones and never
    /// answers them (a server that hangs, or a dropped network path behind a load balancer).
    pub fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Relaxed);
        self.cut();
    }

    fn cut(&self) {
        if let Ok(mut v) = self.conns.lock() {
            for c in v.drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.set_down(true);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}
