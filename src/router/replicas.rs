//! The replica set: who the replicas are (static URLs plus DNS discovery),
//! whether each is healthy, how loaded each is (polled /metrics gauges plus
//! this router's requests since the poll), and the [`Balancer`] that picks
//! among the healthy ones. One mutex guards it all; it is held only for
//! bookkeeping, never across I/O.
//!
//! Health has hysteresis ([`Hysteresis`]): a healthy replica is taken out
//! after `fall` consecutive failed polls of /health, and one taken out
//! comes back after `rise` consecutive good ones, so a replica whose polls
//! fail now and then (a slow answer under load, a lost packet) neither
//! sheds its traffic nor flaps. Two shortcuts: a replica never yet healthy
//! joins on its first good poll (a new or starting replica has no history
//! to smooth), and one that refuses a request's connection is taken out at
//! once (a refused connect is no transient; it then needs `rise` polls).

use super::balancer::{Balancer, Candidate, Reason};
use super::Client;
use crate::metrics as names;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode, Uri};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many consecutive polls change a replica's health (both >= 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hysteresis {
    /// Failed polls in a row that take a healthy replica out.
    pub fall: u32,
    /// Good polls in a row that bring back a replica that was taken out.
    pub rise: u32,
}

/// One replica's state.
struct Replica {
    url: Arc<str>,
    healthy: bool,
    /// It has been healthy at some time (else the first good poll admits it).
    was_healthy: bool,
    /// Consecutive failed polls (reset by a good one).
    failures: u32,
    /// Consecutive good polls (reset by a failed one or a refused request).
    successes: u32,
    /// running + waiting at the last successful poll.
    polled: f64,
    /// `inflight` when that poll was taken: requests sent since are not in
    /// the polled gauges yet.
    inflight_at_poll: usize,
    /// Requests this router has open on the replica now.
    inflight: Arc<AtomicUsize>,
    /// Listed in the config: discovery never removes it.
    fixed: bool,
}

impl Replica {
    fn new(url: Arc<str>, fixed: bool) -> Self {
        Self {
            url,
            healthy: false,
            was_healthy: false,
            failures: 0,
            successes: 0,
            polled: 0.0,
            inflight_at_poll: 0,
            inflight: Arc::new(AtomicUsize::new(0)),
            fixed,
        }
    }

    fn load(&self) -> f64 {
        let since = self
            .inflight
            .load(Ordering::Relaxed)
            .saturating_sub(self.inflight_at_poll);
        self.polled + since as f64
    }
}

/// A replica chosen for one request: counts as in flight on it until
/// dropped (the response body is finished or abandoned).
pub struct Lease {
    pub url: Arc<str>,
    pub reason: Reason,
    inflight: Arc<AtomicUsize>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

struct State {
    replicas: Vec<Replica>,
    balancer: Balancer,
    hysteresis: Hysteresis,
}

/// The replica set shared by the request handlers and the pollers.
pub struct Pool {
    state: Mutex<State>,
    /// Sent as a bearer key on polls of /metrics (replicas with
    /// `server.metrics_auth`).
    metrics_key: Option<Arc<str>>,
}

impl Pool {
    /// A pool of the static `urls` (all unhealthy until their first poll)
    /// whose health changes as `hysteresis` says (thresholds of 0 act as 1).
    pub fn new(urls: &[String], balancer: Balancer, hysteresis: Hysteresis) -> Self {
        let replicas = urls
            .iter()
            .map(|u| Replica::new(u.trim_end_matches('/').into(), true))
            .collect();
        let hysteresis = Hysteresis {
            fall: hysteresis.fall.max(1),
            rise: hysteresis.rise.max(1),
        };
        Self {
            state: Mutex::new(State {
                replicas,
                balancer,
                hysteresis,
            }),
            metrics_key: None,
        }
    }

    /// The pool, sending `key` as `Authorization: Bearer` when it polls a
    /// replica's /metrics.
    pub fn with_metrics_key(mut self, key: Option<&str>) -> Self {
        self.metrics_key = key.map(Arc::from);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Picks a healthy replica not in `tried` for a prompt with `hashes`;
    /// `None` when none is left.
    pub fn choose(&self, hashes: &[u64], tried: &[Arc<str>]) -> Option<Lease> {
        let mut st = self.lock();
        let eligible: Vec<usize> = (0..st.replicas.len())
            .filter(|&i| st.replicas[i].healthy && !tried.contains(&st.replicas[i].url))
            .collect();
        let cands: Vec<Candidate> = eligible
            .iter()
            .map(|&i| Candidate {
                id: st.replicas[i].url.clone(),
                load: st.replicas[i].load(),
            })
            .collect();
        let (k, reason) = st.balancer.pick(hashes, &cands)?;
        let r = &st.replicas[eligible[k]];
        r.inflight.fetch_add(1, Ordering::Relaxed);
        Some(Lease {
            url: r.url.clone(),
            reason,
            inflight: r.inflight.clone(),
        })
    }

    /// Remembers `url` as the replica holding the prefixes `hashes` (it
    /// accepted a request with that prompt).
    pub fn remember(&self, hashes: &[u64], url: &Arc<str>) {
        self.lock().balancer.remember(hashes, url);
    }

    /// Takes a replica out at once after a request could not connect to
    /// it; it comes back after `rise` consecutive good polls.
    pub fn mark_down(&self, url: &str) {
        let mut st = self.lock();
        if let Some(r) = st.replicas.iter_mut().find(|r| &*r.url == url) {
            if r.healthy {
                tracing::warn!(
                    replica = %url,
                    "replica refused a request's connection; taken out until healthy"
                );
            }
            r.healthy = false;
            r.successes = 0;
        }
        publish_counts(&st);
    }

    /// Records a poll: `load` is `Some(running + waiting)` when the replica
    /// answered /health with 200 and its metrics were read. Health changes
    /// only as [`Hysteresis`] allows.
    fn record_poll(&self, url: &str, load: Option<f64>) {
        let mut st = self.lock();
        let Hysteresis { fall, rise } = st.hysteresis;
        if let Some(r) = st.replicas.iter_mut().find(|r| &*r.url == url) {
            match load {
                Some(l) => {
                    r.failures = 0;
                    r.successes = r.successes.saturating_add(1);
                    r.polled = l;
                    r.inflight_at_poll = r.inflight.load(Ordering::Relaxed);
                    if !r.healthy && (!r.was_healthy || r.successes >= rise) {
                        tracing::info!(replica = %url, "replica is healthy");
                        r.healthy = true;
                        r.was_healthy = true;
                    }
                }
                None => {
                    r.successes = 0;
                    r.failures = r.failures.saturating_add(1);
                    if r.healthy && r.failures >= fall {
                        tracing::warn!(
                            replica = %url,
                            failures = r.failures,
                            "replica failed health checks in a row; taken out"
                        );
                        r.healthy = false;
                    }
                }
            }
        }
        publish_counts(&st);
    }

    /// Replaces the discovered replicas by `urls`, keeping the state of
    /// those already known and never touching the static ones.
    pub fn set_discovered(&self, urls: &[String]) {
        let mut st = self.lock();
        st.replicas
            .retain(|r| r.fixed || urls.iter().any(|u| **u == *r.url));
        for u in urls {
            if !st.replicas.iter().any(|r| *r.url == **u) {
                tracing::info!(replica = %u, "discovered a replica");
                st.replicas.push(Replica::new(u.as_str().into(), false));
            }
        }
        publish_counts(&st);
    }

    /// The replicas' URLs now.
    pub fn urls(&self) -> Vec<Arc<str>> {
        self.lock().replicas.iter().map(|r| r.url.clone()).collect()
    }

    /// How many replicas are healthy now.
    pub fn healthy(&self) -> usize {
        self.lock().replicas.iter().filter(|r| r.healthy).count()
    }
}

fn publish_counts(st: &State) {
    let healthy = st.replicas.iter().filter(|r| r.healthy).count();
    metrics::gauge!(names::ROUTER_HEALTHY_REPLICAS).set(healthy as f64);
    metrics::gauge!(names::ROUTER_REPLICAS).set(st.replicas.len() as f64);
}

/// Sums the samples of metric `name` (all label sets) in Prometheus text.
/// `None` when the metric is absent (a replica that has not run a step yet
/// publishes no gauges: that reads as 0 load, see [`load_from_metrics`]).
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // Exactly this name: next is a label set or the value.
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(v) = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// running + waiting sequences from a replica's /metrics text.
pub fn load_from_metrics(text: &str) -> f64 {
    metric_sum(text, names::RUNNING).unwrap_or(0.0)
        + metric_sum(text, names::WAITING).unwrap_or(0.0)
}

async fn get(
    client: &Client,
    url: &str,
    timeout: Duration,
    key: Option<&str>,
) -> Option<(StatusCode, Bytes)> {
    let uri: Uri = url.parse().ok()?;
    let mut req = Request::get(uri);
    if let Some(key) = key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let req = req.body(Full::new(Bytes::new())).ok()?;
    let fetch = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status();
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    };
    tokio::time::timeout(timeout, fetch).await.ok().flatten()
}

/// One health + load poll of `url`: `Some(load)` when healthy.
async fn poll_one(
    client: &Client,
    url: &str,
    timeout: Duration,
    key: Option<Arc<str>>,
) -> Option<f64> {
    let (status, _) = get(client, &format!("{url}/health"), timeout, None).await?;
    if status != StatusCode::OK {
        return None;
    }
    let (status, text) = get(client, &format!("{url}/metrics"), timeout, key.as_deref()).await?;
    if status != StatusCode::OK {
        return None;
    }
    Some(load_from_metrics(&String::from_utf8_lossy(&text)))
}

/// Polls every replica once, concurrently.
pub async fn poll_all(pool: &Pool, client: &Client, timeout: Duration) {
    let mut set = tokio::task::JoinSet::new();
    for url in pool.urls() {
        let client = client.clone();
        let key = pool.metrics_key.clone();
        set.spawn(async move {
            let load = poll_one(&client, &url, timeout, key).await;
            (url, load)
        });
    }
    while let Some(Ok((url, load))) = set.join_next().await {
        pool.record_poll(&url, load);
    }
}

/// Polls forever, every `every`.
pub async fn poll_loop(pool: Arc<Pool>, client: Client, every: Duration, timeout: Duration) {
    loop {
        tokio::time::sleep(every).await;
        poll_all(&pool, &client, timeout).await;
    }
}

/// Resolves `name_port` (e.g. a headless Service `engines.ns.svc:8000`):
/// every address is a replica `http://addr`. `None` on a lookup failure
/// (the caller keeps the set it has).
pub async fn resolve(name_port: &str) -> Option<Vec<String>> {
    match tokio::net::lookup_host(name_port).await {
        Ok(addrs) => {
            let mut urls: Vec<String> = addrs.map(|a| format!("http://{a}")).collect();
            urls.sort();
            urls.dedup();
            Some(urls)
        }
        Err(e) => {
            tracing::warn!(
                name = %name_port,
                error = %e,
                "resolving replicas failed; keeping the known replicas"
            );
            None
        }
    }
}

/// Re-resolves `name_port` forever, every `every`.
pub async fn discovery_loop(pool: Arc<Pool>, name_port: String, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if let Some(urls) = resolve(&name_port).await {
            pool.set_discovered(&urls);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;

    const SAMPLE: &str = "# HELP specgate_num_requests_running Requests being decoded\n\
        # TYPE specgate_num_requests_running gauge\n\
        specgate_num_requests_running 3\n\
        specgate_num_requests_running_extra 100\n\
        specgate_num_requests_waiting 2\n\
        specgate_request_success_total{finished_reason=\"stop\"} 4\n\
        specgate_request_success_total{finished_reason=\"length\"} 5\n";

    #[test]
    fn metrics_text_is_read_by_exact_name() {
        assert_eq!(load_from_metrics(SAMPLE), 5.0);
        assert_eq!(metric_sum(SAMPLE, names::REQUEST_SUCCESS), Some(9.0));
        assert_eq!(metric_sum(SAMPLE, "absent"), None);
        assert_eq!(load_from_metrics(""), 0.0);
    }

    fn pool_with(urls: &[&str], fall: u32, rise: u32) -> Pool {
        let urls: Vec<String> = urls.iter().map(|s| s.to_string()).collect();
        Pool::new(
            &urls,
            Balancer::new(NonZeroUsize::new(16).unwrap(), 1.0),
            Hysteresis { fall, rise },
        )
    }

    fn pool(urls: &[&str]) -> Pool {
        pool_with(urls, 1, 1)
    }

    #[test]
    fn health_changes_only_after_consecutive_polls() {
        let p = pool_with(&["http://a:1"], 3, 2);
        let poll = |ok: bool| {
            p.record_poll("http://a:1", ok.then_some(0.0));
            p.healthy() == 1
        };
        assert!(!poll(false), "not healthy before a good poll");
        assert!(poll(true), "a replica never healthy joins at once");
        // Failures that are not 3 in a row keep it in.
        for ok in [false, true, false, false, true, false, false] {
            assert!(poll(ok));
        }
        assert!(!poll(false), "the third failure in a row takes it out");
        assert!(!poll(true), "one good poll is not enough to return");
        assert!(!poll(false));
        assert!(!poll(true));
        assert!(poll(true), "two good polls in a row return it");
        // A refused connection takes it out at once; it then needs two.
        p.mark_down("http://a:1");
        assert_eq!(p.healthy(), 0);
        assert!(!poll(true));
        assert!(poll(true));
    }

    #[test]
    fn only_healthy_untried_replicas_are_chosen_and_leases_count() {
        let p = pool(&["http://a:1", "http://b:1/"]);
        assert!(
            p.choose(&[], &[]).is_none(),
            "nothing is healthy before a poll"
        );
        p.record_poll("http://a:1", Some(0.0));
        p.record_poll("http://b:1", Some(0.0));
        assert_eq!(p.healthy(), 2);
        let l1 = p.choose(&[], &[]).unwrap();
        // The lease counts as load: the next request goes to the other one.
        let l2 = p.choose(&[], &[]).unwrap();
        assert_ne!(l1.url, l2.url);
        let again = p.choose(&[], std::slice::from_ref(&l1.url)).unwrap();
        assert_eq!(again.url, l2.url);
        drop((l1, l2, again));
        p.mark_down("http://b:1");
        for _ in 0..4 {
            assert_eq!(&*p.choose(&[], &[]).unwrap().url, "http://a:1");
        }
        assert!(p.choose(&[], &["http://a:1".into()]).is_none());
        p.record_poll("http://b:1", Some(0.0));
        assert_eq!(p.healthy(), 2);
    }

    #[test]
    fn polled_load_plus_new_requests_decides() {
        let p = pool(&["http://a:1", "http://b:1"]);
        p.record_poll("http://a:1", Some(4.5));
        p.record_poll("http://b:1", Some(2.0));
        let leases: Vec<Lease> = (0..3).map(|_| p.choose(&[], &[]).unwrap()).collect();
        // b counts 2 + the requests sent since the poll: it takes requests
        // while under a's 4.5, then is at 5 and a is chosen.
        assert!(leases.iter().all(|l| &*l.url == "http://b:1"));
        assert_eq!(&*p.choose(&[], &[]).unwrap().url, "http://a:1");
    }

    #[test]
    fn discovery_adds_and_removes_but_keeps_static() {
        let p = pool(&["http://s:1"]);
        p.set_discovered(&["http://d1:1".into(), "http://d2:1".into()]);
        assert_eq!(p.urls().len(), 3);
        p.record_poll("http://d1:1", Some(0.0));
        p.set_discovered(&["http://d1:1".into()]);
        let urls: Vec<String> = p.urls().iter().map(|u| u.to_string()).collect();
        assert_eq!(urls, vec!["http://s:1", "http://d1:1"]);
        assert_eq!(p.healthy(), 1, "d1 kept its state");
    }

    #[tokio::test]
    async fn localhost_resolves_to_replica_urls() {
        let urls = resolve("localhost:8123").await.unwrap();
        assert!(urls.iter().all(|u| u.ends_with(":8123")), "{urls:?}");
        assert!(!urls.is_empty());
        assert!(resolve("no-such-host.invalid:1").await.is_none());
    }
}
