//! One flight per key: work on a key — a layer's fetch, a blob's table of contents — done by one
//! thread at a time, while work on other keys goes on at once.
//!
//! Sandboxes come in bursts: a hundred of one new image must fetch its layers once, and sandboxes of
//! other images, or the other layers of the same image, must not wait for that fetch. A [`Flights`]
//! gives the first caller of a key its [`Flight`]; a caller of a key in flight waits until that
//! flight lands (its [`Flight`] is dropped, on any path), then takes its own — and, checking again
//! what it came for, finds the work done.
//!
//! Invariant (under the lock): a key is in `busy` exactly while one [`Flight`] of it lives.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex, MutexGuard};

use strata_registry::digest::Digest;

/// Keys in flight (see the module documentation).
#[derive(Default)]
pub(crate) struct Flights {
    busy: Mutex<HashSet<Digest>>,
    landed: Condvar,
}

/// The one flight of a key; the key lands when this is dropped.
pub(crate) struct Flight<'a> {
    flights: &'a Flights,
    key: Digest,
}

impl Flights {
    fn busy(&self) -> MutexGuard<'_, HashSet<Digest>> {
        self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `key` is not in flight, then takes its flight.
    pub(crate) fn enter(&self, key: &Digest) -> Flight<'_> {
        let mut busy = self.busy();
        while busy.contains(key) {
            busy = self.landed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        busy.insert(*key);
        Flight {
            flights: self,
            key: *key,
        }
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        self.flights.busy().remove(&self.key);
        self.flights.landed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    fn key(n: u8) -> Digest {
        Digest([n; 32])
    }

    /// Callers of one key take turns (never two inside at once, whatever the timing); a flight that
    /// ends in a panic lands too.
    #[test]
    fn one_key_one_flight_at_a_time() {
        let flights = Flights::default();
        let (inside, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let _f = flights.enter(&key(1));
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 1);
        let panicked = std::thread::scope(|s| {
            s.spawn(|| {
                let _f = flights.enter(&key(1));
                panic!("a fetch that panics");
            })
            .join()
        });
        assert!(panicked.is_err());
        drop(flights.enter(&key(1)));
    }

    /// Flights of different keys overlap: a second key is entered while the first is in flight.
    #[test]
    fn other_keys_do_not_wait() {
        let flights = Flights::default();
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let first = flights.enter(&key(1));
            s.spawn(|| {
                let _f = flights.enter(&key(2));
                tx.send(()).expect("send");
            });
            let got = rx.recv_timeout(Duration::from_secs(60));
            drop(first);
            assert!(got.is_ok(), "key 2 waited for key 1");
        });
    }
}
