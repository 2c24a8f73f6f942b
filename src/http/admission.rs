//! Admission: which requests may do work, and for how long they hold the
//! right to. A request is admitted against the global bound
//! (`max_concurrent_requests`) and against its client's: the address it
//! connects from and the API key it sends each hold at most
//! `max_requests_per_client` admissions, so one client cannot take every
//! slot. The [`Admit`] it gets lives as long as the work it admits: it is
//! moved into the blocking job that templates, tokenizes and compiles the
//! request's grammar ([`Admission::run_blocking`]), so a client that hangs
//! up while that job runs frees nothing until the job is done, and such
//! jobs run at most `max_blocking_jobs` at once.
//!
//! Connections are bounded the same way, per client address beside the
//! global `max_connections` ([`ClientConns`]), so a client holding many
//! keep-alive sockets cannot keep `/health` waiting in the backlog.

use crate::api::ApiError;
use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The client a connection came from, put in each request's extensions
/// by the accept loop: its address as [`ClientAddr::of`] groups it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

impl ClientAddr {
    /// The client of a peer address: an IPv4 address (a v4-mapped IPv6
    /// one included) as itself, an IPv6 address by its /64, the block one
    /// host is usually handed, so one host cannot pass for many.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    Self(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

/// Counts per key, each at most a limit; the entry goes when its count
/// reaches 0, so the map holds only clients with something open.
struct Counts<K> {
    limit: usize,
    open: Mutex<HashMap<K, usize>>,
}

impl<K: Hash + Eq + Clone> Counts<K> {
    fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one for `key`; `false` when `key` is at its limit.
    fn take(&self, key: &K) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(key.clone()).or_insert(0);
        if *n >= self.limit {
            return false;
        }
        *n += 1;
        true
    }

    fn give_back(&self, key: &K) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                open.remove(key);
            }
        }
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.open.lock().unwrap().len()
    }
}

/// One held count of a [`Counts`]; given back on drop.
struct Held<K: Hash + Eq + Clone> {
    counts: Arc<Counts<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Drop for Held<K> {
    fn drop(&mut self) {
        self.counts.give_back(&self.key);
    }
}

/// Open connections per client address (see the module doc).
pub struct ClientConns(Arc<Counts<IpAddr>>);

/// One connection's place in [`ClientConns`]; freed on drop.
pub struct ConnSlot {
    _held: Held<IpAddr>,
}

impl ClientConns {
    /// At most `limit` (>= 1) connections from one address.
    pub fn new(limit: usize) -> Self {
        Self(Arc::new(Counts::new(limit)))
    }

    /// A slot for a connection from `client`; `None` when that client has
    /// its limit open already (the connection is then closed).
    pub fn open(&self, client: ClientAddr) -> Option<ConnSlot> {
        let ip = client.0;
        self.0.take(&ip).then(|| ConnSlot {
            _held: Held {
                counts: self.0.clone(),
                key: ip,
            },
        })
    }
}

/// A request's admission: the global permit and its client's counts,
/// all freed when it drops.
pub struct Admit {
    _global: OwnedSemaphorePermit,
    _addr: Option<Held<IpAddr>>,
    _key: Option<Held<u64>>,
}

/// The server's admission state (see the module doc).
pub struct Admission {
    global: Arc<Semaphore>,
    global_limit: usize,
    by_addr: Arc<Counts<IpAddr>>,
    by_key: Arc<Counts<u64>>,
    per_client: usize,
    blocking: Arc<Semaphore>,
}

impl Admission {
    /// `global` requests at once, `per_client` of them per address and
    /// per key, and `blocking_jobs` blocking jobs at once (each >= 1).
    pub fn new(global: usize, per_client: usize, blocking_jobs: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(global.max(1))),
            global_limit: global.max(1),
            by_addr: Arc::new(Counts::new(per_client)),
            by_key: Arc::new(Counts::new(per_client)),
            per_client: per_client.max(1),
            blocking: Arc::new(Semaphore::new(blocking_jobs.max(1))),
        }
    }

    /// Admits a request from `addr` (when known) sent with the API key
    /// whose hash is `key` (0: no key, not counted per key).
    ///
    /// Errors: 429 when the server, the address or the key has no room.
    pub fn admit(&self, addr: Option<IpAddr>, key: u64) -> Result<Admit, ApiError> {
        let global = self.global.clone().try_acquire_owned().map_err(|_| {
            ApiError::rate_limited(format!(
                "Too many requests in flight (limit {}); retry later.",
                self.global_limit
            ))
        })?;
        let client_full = || {
            ApiError::rate_limited(format!(
                "Too many requests in flight from this client (limit {}); retry later.",
                self.per_client
            ))
        };
        let addr = match addr {
            Some(ip) if self.by_addr.take(&ip) => Some(Held {
                counts: self.by_addr.clone(),
                key: ip,
            }),
            Some(_) => return Err(client_full()),
            None => None,
        };
        let key = match key {
            0 => None,
            k if self.by_key.take(&k) => Some(Held {
                counts: self.by_key.clone(),
                key: k,
            }),
            _ => return Err(client_full()),
        };
        Ok(Admit {
            _global: global,
            _addr: addr,
            _key: key,
        })
    }

    /// Runs `job` on the blocking pool once one of the `blocking_jobs`
    /// places is free, holding `admit` until the job is done, and hands
    /// both back. When the caller is dropped (its client went away) before
    /// the job starts, the job never starts; once started it runs to its
    /// end (tokenizers and grammar compilers cannot be interrupted) and
    /// only then frees the admission.
    ///
    /// Errors: 500 when the job panicked.
    pub async fn run_blocking<T: Send + 'static>(
        &self,
        admit: Admit,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<(T, Admit), ApiError> {
        let place = self
            .blocking
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("The blocking-job pool is closed."))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let handle = tokio::task::spawn_blocking(move || {
            if tx.is_closed() {
                return;
            }
            let out = job();
            // The place is free before the caller hears the job ended (a
            // caller that counts places then sees its own returned).
            drop(place);
            let _ = tx.send((out, admit));
        });
        match rx.await {
            Ok(done) => Ok(done),
            Err(_) => {
                let e = handle.await.err();
                Err(ApiError::internal(format!(
                    "A request's background job failed{}.",
                    e.map(|e| format!(": {e}")).unwrap_or_default()
                )))
            }
        }
    }

    /// Blocking jobs running or waiting for their pool thread now.
    #[cfg(test)]
    fn blocking_in_use(&self, limit: usize) -> usize {
        limit - self.blocking.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn ip(n: u8) -> Option<IpAddr> {
        Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n)))
    }

    #[test]
    fn each_address_and_key_has_its_own_limit_under_the_global_one() {
        let a = Admission::new(5, 2, 1);
        let one = a.admit(ip(1), 0).unwrap();
        let _two = a.admit(ip(1), 0).unwrap();
        let e = a.admit(ip(1), 0).err().unwrap();
        assert_eq!(e.status(), 429);
        // Another address, and the same key from two addresses.
        let _k1 = a.admit(ip(2), 9).unwrap();
        let _k2 = a.admit(ip(3), 9).unwrap();
        assert_eq!(a.admit(ip(4), 9).err().unwrap().status(), 429);
        drop(one);
        let _three = a.admit(ip(1), 0).unwrap();
        let _four = a.admit(ip(5), 0).unwrap();
        // Global limit (5) reached.
        assert_eq!(a.admit(ip(6), 0).err().unwrap().status(), 429);
    }

    #[test]
    fn counts_forget_clients_with_nothing_open() {
        let c = ClientConns::new(1);
        let one = ClientAddr::of(ip(1).unwrap());
        let s = c.open(one).unwrap();
        assert!(c.open(one).is_none());
        drop(s);
        assert_eq!(c.0.tracked(), 0);
        assert!(c.open(one).is_some());
    }

    #[test]
    fn ipv6_clients_are_grouped_by_their_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(ClientAddr::of(a), ClientAddr::of(b));
        assert_ne!(ClientAddr::of(a), ClientAddr::of(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(
            ClientAddr::of(mapped),
            ClientAddr("10.0.0.1".parse().unwrap())
        );
    }

    /// The caller of a blocking job going away (its client hung up) must
    /// not free the admission while the job still runs; the admission is
    /// freed when the job ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_caller_keeps_its_admission_until_the_job_ends() {
        let a = Arc::new(Admission::new(1, 1, 4));
        let admit = a.admit(ip(1), 0).unwrap();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
        let a2 = a.clone();
        let caller = tokio::spawn(async move {
            a2.run_blocking(admit, move || {
                started_tx.send(()).unwrap();
                finish_rx.recv().unwrap();
            })
            .await
            .map(|_| ())
        });
        tokio::task::spawn_blocking(move || started_rx.recv().unwrap())
            .await
            .unwrap();
        caller.abort();
        let _ = caller.await;
        assert_eq!(
            a.admit(ip(2), 0).err().map(|e| e.status()),
            Some(429),
            "the admission was freed while its job ran"
        );
        finish_tx.send(()).unwrap();
        let t = tokio::time::Instant::now();
        while a.admit(ip(2), 0).is_err() {
            assert!(t.elapsed() < Duration::from_secs(10), "never freed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// No more than `blocking_jobs` jobs run at once, however many
    /// requests wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocking_jobs_are_bounded() {
        let a = Arc::new(Admission::new(64, 64, 2));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut jobs = Vec::new();
        for i in 0..12 {
            let (a, running, most) = (a.clone(), running.clone(), most.clone());
            jobs.push(tokio::spawn(async move {
                let admit = a.admit(None, i + 1).unwrap();
                a.run_blocking(admit, move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    running.fetch_sub(1, Ordering::SeqCst);
                })
                .await
                .map(|_| ())
            }));
        }
        for j in jobs {
            j.await.unwrap().unwrap();
        }
        assert!(most.load(Ordering::SeqCst) <= 2, "{most:?} at once");
        assert_eq!(a.blocking_in_use(2), 0);
    }

    /// A job whose caller left before a pool place was free never runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_whose_caller_left_before_it_started_does_not_run() {
        let a = Arc::new(Admission::new(8, 8, 1));
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let first = {
            let a = a.clone();
            let admit = a.admit(None, 0).unwrap();
            tokio::spawn(async move {
                a.run_blocking(admit, move || {
                    let _ = hold.recv();
                })
                .await
                .map(|_| ())
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let ran = Arc::new(AtomicUsize::new(0));
        let second = {
            let (a, ran) = (a.clone(), ran.clone());
            let admit = a.admit(None, 0).unwrap();
            tokio::spawn(async move {
                a.run_blocking(admit, move || {
                    ran.fetch_add(1, Ordering::SeqCst);
                })
                .await
                .map(|_| ())
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        second.abort();
        let _ = second.await;
        release.send(()).unwrap();
        first.await.unwrap().unwrap();
        // The pool place is free again and the second job did not run.
        let admit = a.admit(None, 0).unwrap();
        a.run_blocking(admit, || ()).await.unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    }
}
