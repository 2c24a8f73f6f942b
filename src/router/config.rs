//! `[router]`: the settings of `specgate route` (listen address, where the
//! replicas are, health/load polling and its hysteresis, affinity, retries,
//! and the limits on waiting for a replica).
//!
//! This module stands alone: it has its own error type and knows nothing of
//! the server's config file, which embeds [`RouterConfig`] as `[router]` and
//! turns a [`RouterConfigError`] into its own error (dependencies run one
//! way, config -> router).

use serde::Deserialize;

/// A `[router]` value out of its bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterConfigError {
    /// `key` is the full config key (`router.max_attempts`).
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

/// `[router]` of the config file. Replicas come from `replicas` (static base
/// URLs), from `discovery_dns` (a `host:port` whose every resolved address
/// is a replica, e.g. a Kubernetes headless Service), or both.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    pub host: String,
    pub port: u16,
    /// Base URLs such as `http://10.0.0.7:8000` (plain HTTP).
    pub replicas: Vec<String>,
    /// `name:port` re-resolved every `discovery_interval_ms`.
    pub discovery_dns: Option<String>,
    pub discovery_interval_ms: u64,
    /// How often each replica's /health and /metrics are polled.
    pub health_interval_ms: u64,
    /// Limit on connecting to a replica.
    pub connect_timeout_ms: u64,
    /// Limit on one poll (/health then /metrics); a busy replica's answers
    /// can be slow, and slow is not down.
    pub health_timeout_ms: u64,
    /// Consecutive failed polls that take a healthy replica out (one slow
    /// or lost poll must not shed a replica's traffic).
    pub health_failure_threshold: u32,
    /// Consecutive good polls that bring a replica that was taken out back
    /// (a replica never yet healthy joins on its first good poll).
    pub health_success_threshold: u32,
    /// Limit on a replica's response head (connect + request + headers) for
    /// a non-streamed request. Its head comes only once the whole answer is
    /// generated, so this bounds one generation; past it the client gets a
    /// 504 and the request is not sent elsewhere (the replica may still be
    /// computing it).
    pub head_timeout_ms: u64,
    /// The same limit for a `"stream": true` request, whose head a replica
    /// sends as soon as the request is admitted.
    pub stream_head_timeout_ms: u64,
    /// Longest wait for the next bytes of a replica's response body. A
    /// replica's SSE stream sends keep-alive comments while a slow step
    /// runs, so this is tens of seconds, above the replicas'
    /// `server.keep_alive_secs`; total stream time is not limited.
    pub body_idle_timeout_ms: u64,
    /// A client's request body must arrive whole within this long (408
    /// beyond): the router holds the body before any replica sees it, so
    /// a trickling client must not hold a connection and task for ever.
    pub body_read_timeout_ms: u64,
    /// Prompt bytes per affinity chunk; prompts shorter than one chunk are
    /// placed by load only.
    pub prefix_chunk_bytes: usize,
    /// Prefix hashes remembered (LRU).
    pub affinity_entries: usize,
    /// A remembered replica keeps a prefix while its load (running +
    /// waiting sequences) is at most this much above the least loaded.
    pub affinity_slack: f64,
    /// Replicas tried per request before giving up (only while nothing of
    /// the answer has been sent).
    pub max_attempts: usize,
    /// Largest request body accepted (413 beyond); bodies are held to retry.
    pub max_body_bytes: usize,
    /// The API key sent on polls of the replicas' /metrics, for replicas
    /// that set `server.metrics_auth` (unset: sent without one).
    pub replica_metrics_key: Option<String>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            replicas: Vec::new(),
            discovery_dns: None,
            discovery_interval_ms: 5000,
            health_interval_ms: 1000,
            connect_timeout_ms: 1000,
            health_timeout_ms: 3000,
            health_failure_threshold: 3,
            health_success_threshold: 2,
            head_timeout_ms: 600_000,
            stream_head_timeout_ms: 30_000,
            body_idle_timeout_ms: 60_000,
            body_read_timeout_ms: 30_000,
            prefix_chunk_bytes: 256,
            affinity_entries: 65536,
            affinity_slack: 4.0,
            max_attempts: 3,
            max_body_bytes: 1 << 20,
            replica_metrics_key: None,
        }
    }
}

fn invalid(key: &str, message: &str) -> RouterConfigError {
    RouterConfigError::Invalid {
        key: format!("router.{key}"),
        message: message.into(),
    }
}

/// Longest duration any `*_ms` key may hold: an hour. Beyond it a typo
/// (an extra zero or two) would read as "never".
pub const MAX_MS: u64 = 3_600_000;
/// Largest health threshold: at the default interval, 100 polls already
/// leave a dead replica in the set for well over a minute.
pub const MAX_HEALTH_THRESHOLD: u32 = 100;
/// Most replicas one request may be sent to.
pub const MAX_ATTEMPTS: usize = 16;

impl RouterConfig {
    /// Checks the section's values (always, even when not routing).
    ///
    /// Errors: an interval or timeout of 0 or above [`MAX_MS`]; a head
    /// timeout below `connect_timeout_ms` (a slow connect must stay a
    /// retryable connection failure, not a 504); a health threshold of 0 or
    /// above [`MAX_HEALTH_THRESHOLD`]; `max_attempts` of 0 or above
    /// [`MAX_ATTEMPTS`]; another zero size or count; a negative slack; a
    /// replica URL that is not `http://host:port`; a discovery name without
    /// a port.
    pub fn validate(&self) -> Result<(), RouterConfigError> {
        for (key, v) in [
            ("discovery_interval_ms", self.discovery_interval_ms),
            ("health_interval_ms", self.health_interval_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("health_timeout_ms", self.health_timeout_ms),
            ("head_timeout_ms", self.head_timeout_ms),
            ("stream_head_timeout_ms", self.stream_head_timeout_ms),
            ("body_idle_timeout_ms", self.body_idle_timeout_ms),
            ("body_read_timeout_ms", self.body_read_timeout_ms),
        ] {
            if v == 0 || v > MAX_MS {
                return Err(invalid(
                    key,
                    &format!("{v} is out of range; allowed 1..={MAX_MS} (milliseconds)"),
                ));
            }
        }
        for (key, v) in [
            ("head_timeout_ms", self.head_timeout_ms),
            ("stream_head_timeout_ms", self.stream_head_timeout_ms),
        ] {
            if v < self.connect_timeout_ms {
                return Err(invalid(
                    key,
                    "must be at least router.connect_timeout_ms (the head's wait includes the connect)",
                ));
            }
        }
        for (key, v) in [
            ("health_failure_threshold", self.health_failure_threshold),
            ("health_success_threshold", self.health_success_threshold),
        ] {
            if v == 0 || v > MAX_HEALTH_THRESHOLD {
                return Err(invalid(
                    key,
                    &format!("{v} is out of range; allowed 1..={MAX_HEALTH_THRESHOLD} (polls)"),
                ));
            }
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(invalid(
                "max_attempts",
                &format!(
                    "{} is out of range; allowed 1..={MAX_ATTEMPTS}",
                    self.max_attempts
                ),
            ));
        }
        for (key, v) in [
            ("prefix_chunk_bytes", self.prefix_chunk_bytes),
            ("affinity_entries", self.affinity_entries),
            ("max_body_bytes", self.max_body_bytes),
        ] {
            if v == 0 {
                return Err(invalid(key, "0 is out of range; allowed 1 or more"));
            }
        }
        if self.affinity_slack.is_nan() || self.affinity_slack < 0.0 {
            return Err(invalid(
                "affinity_slack",
                &format!("{} is out of range; allowed 0 or more", self.affinity_slack),
            ));
        }
        if let Some(k) = &self.replica_metrics_key {
            if k.is_empty() || k.len() > 512 || !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "replica_metrics_key",
                    "must be 1..=512 visible ASCII characters",
                ));
            }
        }
        for r in &self.replicas {
            let ok = r
                .parse::<hyper::Uri>()
                .ok()
                .filter(|u| u.scheme_str() == Some("http") && u.authority().is_some());
            if ok.is_none() {
                return Err(invalid(
                    "replicas",
                    &format!("'{r}' is not a plain http://host:port URL"),
                ));
            }
        }
        if let Some(d) = &self.discovery_dns {
            let port = d.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
            if !matches!(port, Some(Ok(_))) {
                return Err(invalid(
                    "discovery_dns",
                    &format!("'{d}' needs the form name:port"),
                ));
            }
        }
        Ok(())
    }

    /// Checks that there is somewhere to route to.
    ///
    /// Errors: neither `replicas` nor `discovery_dns` is set.
    pub fn validate_for_routing(&self) -> Result<(), RouterConfigError> {
        self.validate()?;
        if self.replicas.is_empty() && self.discovery_dns.is_none() {
            return Err(invalid(
                "replicas",
                "set router.replicas or router.discovery_dns (or pass --replica URL)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{RouterConfig, RouterConfigError};

    /// The section as `[router]` of a file holds it (unknown keys refused),
    /// checked; errors as text.
    fn parse(s: &str) -> Result<RouterConfig, String> {
        let c: RouterConfig = toml::from_str(s).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn router_section_parses_and_is_checked() {
        let c = parse(
            "port = 9000\nreplicas = [\"http://10.0.0.1:8000\"]\ndiscovery_dns = \"engines.default.svc:8000\"",
        )
        .unwrap();
        assert_eq!(c.port, 9000);
        c.validate_for_routing().unwrap();
        let e = parse("replica = []").unwrap_err();
        assert!(e.contains("replica"), "{e}");
        let e = parse("replicas = [\"https://x:1\"]").unwrap_err();
        assert!(e.contains("router.replicas"), "{e}");
        let e = parse("discovery_dns = \"engines\"").unwrap_err();
        assert!(e.contains("router.discovery_dns"), "{e}");
        let e = parse("max_attempts = 0").unwrap_err();
        assert!(e.contains("router.max_attempts"), "{e}");
        for bad in [
            "head_timeout_ms = 0",
            "body_idle_timeout_ms = 3600001",
            "stream_head_timeout_ms = 10\nconnect_timeout_ms = 20",
            "health_failure_threshold = 0",
            "health_success_threshold = 101",
            "max_attempts = 17",
        ] {
            let key = bad.split(' ').next().unwrap();
            let e = parse(bad).unwrap_err();
            assert!(e.contains(&format!("router.{key}")), "{bad}: {e}");
        }
        let d = RouterConfig::default();
        assert_eq!(
            (d.health_failure_threshold, d.health_success_threshold),
            (3, 2)
        );
        assert!(
            d.body_idle_timeout_ms >= 30_000,
            "above the replicas' keep-alive"
        );
        let RouterConfigError::Invalid { key, .. } =
            parse("").unwrap().validate_for_routing().unwrap_err();
        assert_eq!(key, "router.replicas");
    }
}
