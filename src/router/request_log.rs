//! The router's one log line per request (target [`TARGET`]), written when
//! the request is over: for a response made here or a whole replica body
//! when it has been handed to hyper, for a relayed stream when the relay
//! ends, however it ends, because the line is written by the record's
//! `Drop` (the request handler holds one clone, the [`super::relay::Relay`]
//! another).
//!
//! Fields: `request_id` (the id the replica was sent, see
//! [`crate::http::request_id`]), `http_method`, `route`, `status`,
//! `replica` (the one whose answer, or whose silence past the head timeout,
//! the client got; absent for an answer made here), `attempts` (replicas
//! tried; absent when none was), `error` (a relay cut after the head, or
//! [`crate::http::request_log::PANICKED`]), and `total_ms`. The replica logs its own line for the same `request_id`.

use crate::http::request_id::RequestId;
use crate::http::request_log::{LineFields, LineHead, SharedLine};
use hyper::Method;
use std::sync::{Arc, MutexGuard};

/// The target of the router's per-request line
/// (`RUST_LOG=specgate::router::request=warn` silences it).
pub const TARGET: &str = "specgate::router::request";

/// A request's log record. Cloning shares it; the line is written once,
/// when the last clone is dropped.
#[derive(Clone)]
pub struct RouteLog(SharedLine<Fields>);

#[derive(Default)]
pub(crate) struct Fields {
    status: Option<u16>,
    replica: Option<Arc<str>>,
    attempts: Option<usize>,
    error: Option<String>,
}

impl RouteLog {
    /// A record for a request that started now.
    pub fn new(id: RequestId, http_method: &Method, path: &str) -> Self {
        RouteLog(SharedLine::new(id, http_method, path))
    }

    /// The request's id.
    pub fn id(&self) -> &RequestId {
        self.0.id()
    }

    fn fields(&self) -> MutexGuard<'_, Fields> {
        self.0.fields()
    }

    /// The status sent to the client (for a stream: the one in its head).
    pub fn set_status(&self, status: u16) {
        self.fields().status = Some(status);
    }

    /// `n` replicas have been tried so far.
    pub fn tried(&self, n: usize) {
        self.fields().attempts = Some(n);
    }

    /// `replica` answered (or timed out); the last call names the replica
    /// the client's answer came from.
    pub fn answered_by(&self, replica: &Arc<str>) {
        self.fields().replica = Some(replica.clone());
    }

    /// The relayed answer was cut after its head had been sent, or the
    /// handler panicked ([`crate::http::request_log::PANICKED`]).
    pub fn failed(&self, error: &str) {
        self.fields().error = Some(error.to_owned());
    }
}

/// The line, at `$level`: the same fields whatever the level.
macro_rules! route_line {
    ($level:ident, $h:expr, $f:expr, $total:expr) => {
        tracing::$level!(
            target: TARGET,
            request_id = %$h.id,
            http_method = %$h.http_method,
            route = %$h.route,
            status = $f.status,
            replica = $f.replica.as_deref(),
            attempts = $f.attempts,
            total_ms = $total,
            error = $f.error.as_deref(),
            "request"
        )
    };
}

impl LineFields for Fields {
    fn status(&self) -> Option<u16> {
        self.status
    }

    fn write(&self, head: &LineHead, total_ms: f64, quiet: bool) {
        if quiet {
            route_line!(debug, head, self, total_ms);
        } else {
            route_line!(info, head, self, total_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request_log::tests::{id, lines};

    #[test]
    fn one_line_when_the_relay_lets_go() {
        let got = lines("info", || {
            let log = RouteLog::new(id("r1"), &Method::POST, "/v1/chat/completions");
            let relay = log.clone();
            log.tried(2);
            log.answered_by(&Arc::from("http://10.0.0.2:8000"));
            log.set_status(200);
            drop(log);
            relay.failed("replica http://10.0.0.2:8000: no response bytes for 5 ms");
            drop(relay);
        });
        assert_eq!(got.len(), 1, "{got:?}");
        let l = &got[0];
        assert_eq!(l["target"], TARGET);
        assert_eq!(l["request_id"], "r1");
        assert_eq!(l["http_method"], "POST");
        assert_eq!(l["route"], "/v1/chat/completions");
        assert_eq!(l["status"], 200);
        assert_eq!(l["replica"], "http://10.0.0.2:8000");
        assert_eq!(l["attempts"], 2);
        assert!(l["error"].as_str().unwrap().contains("no response bytes"));
        assert!(l["total_ms"].is_f64(), "{l}");
    }

    #[test]
    fn a_local_answer_names_no_replica() {
        let got = lines("info", || {
            let log = RouteLog::new(id("r2"), &Method::GET, "/nowhere");
            log.set_status(404);
        });
        assert_eq!(got[0]["status"], 404);
        assert!(got[0].get("replica").is_none(), "{}", got[0]);
        assert!(got[0].get("attempts").is_none(), "{}", got[0]);
        assert!(got[0].get("error").is_none(), "{}", got[0]);
    }

    #[test]
    fn healthy_probes_log_at_debug_and_failed_ones_at_info() {
        let probe = |route, status| {
            let log = RouteLog::new(id("p"), &Method::GET, route);
            log.set_status(status);
        };
        assert!(lines("info", || probe("/health", 200)).is_empty());
        assert!(lines("info", || probe("/metrics", 200)).is_empty());
        assert_eq!(lines("debug", || probe("/health", 200)).len(), 1);
        assert_eq!(lines("info", || probe("/health", 503))[0]["status"], 503);
    }

    #[test]
    fn a_long_route_is_cut() {
        let path = format!("/{}", "a".repeat(1000));
        let got = lines("info", || {
            RouteLog::new(id("r3"), &Method::GET, &path);
        });
        assert!(got[0]["route"].as_str().unwrap().len() < 300, "{}", got[0]);
    }
}
