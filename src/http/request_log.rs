//! The one log line per HTTP request, written when the request is over:
//! for a whole response when it is handed to hyper, for a stream when the
//! stream ends, however it ends (done, error event, timeout, or the client
//! going away), because the line is written by the record's `Drop`.
//!
//! The record is shared (`Arc`) between the request wrapper
//! ([`super::request_id::handle`]), the generation handler and its stream
//! task; each fills in what it knows. Fields: `request_id`, `http_method`,
//! `route`, `status`, `api` (the wire API of a route that has one:
//! `chat_completions`, `completions`, `responses`, `messages`,
//! `count_tokens`; also counted in `specgate_api_requests_total`), then
//! for generations `model`, `prompt_tokens`,
//! `completion_tokens`, `spec_method`, `drafted_tokens`, `accepted_tokens`,
//! `queue_ms`, `ttft_ms`, `finish` (`stop`, `length`, `error`, or
//! `cancelled` when the client left first) and `error`; always `total_ms`.
//! A field the request never reached is left out.

use super::request_id::RequestId;
use crate::engine::SpecMethod;
use crate::logging::REQUEST_TARGET;
use hyper::{Method, Request};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

/// The longest route logged, in bytes as logged (a hostile client may send
/// a very long path).
const MAX_ROUTE: usize = 256;

/// The `error` of a request whose handler panicked (the client got a 500);
/// the router's line says it the same way.
pub(crate) const PANICKED: &str = "the handler panicked";

/// `path` as logged, also the router's `route` field: every byte that is
/// not visible ASCII, and `"`, `\`, `=` and `%`, written as `%XX`, so the
/// field has no space, quote, control or bidirectional character that could
/// make a text line ambiguous or forge one, and it percent-decodes to
/// exactly the path's bytes. Past [`MAX_ROUTE`] bytes it is cut (never
/// inside an escape) and `...` follows.
pub(crate) fn loggable_route(path: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut route = String::with_capacity(path.len().min(MAX_ROUTE) + 3);
    for &b in path.as_bytes() {
        let plain = b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b'=' | b'%');
        let width = if plain { 1 } else { 3 };
        if route.len() + width > MAX_ROUTE {
            route.push_str("...");
            break;
        }
        if plain {
            route.push(b as char);
        } else {
            route.push('%');
            route.push(HEX[usize::from(b >> 4)] as char);
            route.push(HEX[usize::from(b & 15)] as char);
        }
    }
    route
}

/// What every request line starts with (the server's and the router's).
pub(crate) struct LineHead {
    pub(crate) id: RequestId,
    pub(crate) http_method: Method,
    pub(crate) route: String,
    started: Instant,
}

/// The fields one kind of request line adds to [`LineHead`], and how that
/// line is written.
pub(crate) trait LineFields: Default {
    /// The status sent to the client, if one was.
    fn status(&self) -> Option<u16>;
    /// Writes the line at info, or at debug when `quiet`.
    fn write(&self, head: &LineHead, total_ms: f64, quiet: bool);
}

/// A shared log record: cloning shares it; the line is written once, by
/// `Drop`, when the last clone goes (so a request is logged however it
/// ends: answered, streamed, cut, or abandoned by its client).
pub(crate) struct SharedLine<F: LineFields>(Arc<Record<F>>);

impl<F: LineFields> Clone for SharedLine<F> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

struct Record<F: LineFields> {
    head: LineHead,
    fields: Mutex<F>,
}

impl<F: LineFields> SharedLine<F> {
    /// A record for a request that started now.
    pub(crate) fn new(id: RequestId, http_method: &Method, path: &str) -> Self {
        Self(Arc::new(Record {
            head: LineHead {
                id,
                http_method: http_method.clone(),
                route: loggable_route(path),
                started: Instant::now(),
            },
            fields: Mutex::new(F::default()),
        }))
    }

    /// The request's id.
    pub(crate) fn id(&self) -> &RequestId {
        &self.0.head.id
    }

    /// When the request arrived.
    pub(crate) fn started(&self) -> Instant {
        self.0.head.started
    }

    /// The fields, to fill in (a poisoned lock still logs).
    pub(crate) fn fields(&self) -> MutexGuard<'_, F> {
        self.0.fields.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<F: LineFields> Drop for Record<F> {
    fn drop(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(|e| e.into_inner());
        let total = self.head.started.elapsed().as_secs_f64() * 1e3;
        // Orchestrators probe /health and Prometheus scrapes /metrics every
        // few seconds: at info those lines would drown the requests.
        let probe = self.head.http_method == Method::GET
            && matches!(self.head.route.as_str(), "/health" | "/metrics")
            && f.status() == Some(200);
        f.write(&self.head, total, probe);
    }
}

/// A request's log record (the server's line). Cloning shares it; the line
/// is written once, when the last clone is dropped.
#[derive(Clone)]
pub struct RequestLog(SharedLine<Fields>);

#[derive(Default)]
struct Fields {
    status: Option<u16>,
    /// The wire API of the route (`chat_completions`, `responses`, ...).
    api: Option<&'static str>,
    model: Option<String>,
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    spec_method: Option<SpecMethod>,
    drafted: Option<u64>,
    accepted: Option<u64>,
    queue: Option<Duration>,
    ttft: Option<Duration>,
    finish: Option<&'static str>,
    error: Option<String>,
    /// Whether the engine took the request (a finish is then expected).
    submitted: bool,
}

impl RequestLog {
    /// A record for a request that started now.
    pub fn new(id: RequestId, http_method: &Method, path: &str) -> Self {
        RequestLog(SharedLine::new(id, http_method, path))
    }

    /// The record the request wrapper attached to `req`, or a new one (with
    /// the request's id) for a handler reached some other way.
    pub fn of<B>(req: &Request<B>) -> Self {
        req.extensions()
            .get::<RequestLog>()
            .cloned()
            .unwrap_or_else(|| {
                RequestLog::new(
                    RequestId::for_headers(req.headers()),
                    req.method(),
                    req.uri().path(),
                )
            })
    }

    /// The request's id.
    pub fn id(&self) -> &RequestId {
        self.0.id()
    }

    fn fields(&self) -> MutexGuard<'_, Fields> {
        self.0.fields()
    }

    /// The HTTP status sent (for a stream: the one in its head).
    pub fn set_status(&self, status: u16) {
        self.fields().status = Some(status);
    }

    /// The wire API the request speaks (see `http::Api::as_str`).
    pub fn set_api(&self, api: &'static str) {
        self.fields().api = Some(api);
    }

    /// The model the request named.
    pub fn set_model(&self, model: &str) {
        self.fields().model = Some(model.to_owned());
    }

    /// The engine accepted the request with this many prompt tokens and
    /// this requested proposer (`None`: the server's).
    pub fn submitted(&self, prompt_tokens: usize, method: Option<SpecMethod>) {
        let mut f = self.fields();
        f.submitted = true;
        f.prompt_tokens = Some(prompt_tokens);
        f.spec_method = method;
    }

    /// Output tokens arrived; the first call fixes the time to first token.
    pub fn tokens_arrived(&self) {
        let ttft = self.0.started().elapsed();
        self.fields().ttft.get_or_insert(ttft);
    }

    /// The engine's account of a finished sequence.
    pub fn engine_finished(
        &self,
        method: SpecMethod,
        drafted: u64,
        accepted: u64,
        queue_time: Duration,
    ) {
        let mut f = self.fields();
        f.spec_method = Some(method);
        f.drafted = Some(drafted);
        f.accepted = Some(accepted);
        f.queue = Some(queue_time);
    }

    /// The answer ended normally (`"stop"` or `"length"`).
    pub fn finished(&self, finish: &'static str, completion_tokens: usize) {
        let mut f = self.fields();
        f.finish = Some(finish);
        f.completion_tokens = Some(completion_tokens);
    }

    /// The handler panicked (the client got a 500).
    pub fn panicked(&self) {
        self.fields().error = Some(PANICKED.to_owned());
    }

    /// The answer ended with an error (after its head, for a stream).
    pub fn failed(&self, error: &str, completion_tokens: usize) {
        let mut f = self.fields();
        f.finish = Some("error");
        f.error = Some(error.to_owned());
        f.completion_tokens = Some(completion_tokens);
    }
}

fn method_name(m: SpecMethod) -> &'static str {
    match m {
        SpecMethod::Off => "off",
        SpecMethod::Ngram => "ngram",
        SpecMethod::Draft => "draft",
    }
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1e3)
}

/// The line, at `$level`: the same fields whatever the level.
macro_rules! request_line {
    ($level:ident, $h:expr, $f:expr, $finish:expr, $total:expr) => {
        tracing::$level!(
            target: REQUEST_TARGET,
            request_id = %$h.id,
            http_method = %$h.http_method,
            route = %$h.route,
            status = $f.status,
            api = $f.api,
            model = $f.model.as_deref(),
            prompt_tokens = $f.prompt_tokens,
            completion_tokens = $f.completion_tokens,
            spec_method = $f.spec_method.map(method_name),
            drafted_tokens = $f.drafted,
            accepted_tokens = $f.accepted,
            queue_ms = ms($f.queue),
            ttft_ms = ms($f.ttft),
            total_ms = $total,
            finish = $finish,
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
        // Taken by the engine but never finished: the client went away (or
        // the stream was abandoned) first.
        let finish = self.finish.or(self.submitted.then_some("cancelled"));
        if let Some(api) = self.api {
            let status = self
                .status
                .map_or_else(|| "none".to_owned(), |s| s.to_string());
            metrics::counter!(crate::metrics::API_REQUESTS, "api" => api, "status" => status)
                .increment(1);
        }
        if quiet {
            request_line!(debug, head, self, finish, total_ms);
        } else {
            request_line!(info, head, self, finish, total_ms);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    pub(crate) use crate::logging::tests::json_lines as lines;

    /// A client-sent id (test helper shared with the router's line).
    pub(crate) fn id(s: &str) -> RequestId {
        RequestId::from_client(s.as_bytes()).unwrap()
    }

    #[test]
    fn one_line_when_the_last_holder_lets_go() {
        let got = lines("info", || {
            let log = RequestLog::new(id("r1"), &Method::POST, "/v1/completions");
            let stream_task = log.clone();
            log.set_status(200);
            log.set_model("m");
            log.submitted(7, None);
            drop(log);
            stream_task.tokens_arrived();
            stream_task.engine_finished(SpecMethod::Ngram, 10, 6, Duration::from_millis(3));
            stream_task.finished("length", 5);
            drop(stream_task);
        });
        assert_eq!(got.len(), 1, "{got:?}");
        let l = &got[0];
        assert_eq!(l["target"], REQUEST_TARGET);
        assert_eq!(l["request_id"], "r1");
        assert_eq!(l["route"], "/v1/completions");
        assert_eq!(l["http_method"], "POST");
        assert_eq!(l["status"], 200);
        assert_eq!(l["model"], "m");
        assert_eq!(l["prompt_tokens"], 7);
        assert_eq!(l["completion_tokens"], 5);
        assert_eq!(l["spec_method"], "ngram");
        assert_eq!(l["drafted_tokens"], 10);
        assert_eq!(l["accepted_tokens"], 6);
        assert_eq!(l["queue_ms"], 3.0);
        assert_eq!(l["finish"], "length");
        assert!(l["ttft_ms"].is_f64() && l["total_ms"].is_f64(), "{l}");
        assert!(l.get("error").is_none(), "{l}");
    }

    #[test]
    fn a_submitted_request_that_never_finished_is_cancelled() {
        let got = lines("info", || {
            let log = RequestLog::new(id("r2"), &Method::POST, "/v1/chat/completions");
            log.set_status(200);
            log.submitted(3, Some(SpecMethod::Draft));
        });
        assert_eq!(got[0]["finish"], "cancelled");
        assert_eq!(got[0]["spec_method"], "draft");
        assert!(got[0].get("completion_tokens").is_none());
    }

    #[test]
    fn an_error_before_the_engine_has_no_finish() {
        let got = lines("info", || {
            let log = RequestLog::new(id("r3"), &Method::GET, "/nowhere");
            log.set_status(404);
        });
        assert_eq!(got[0]["status"], 404);
        assert!(got[0].get("finish").is_none());
        assert!(got[0].get("prompt_tokens").is_none());
    }

    #[test]
    fn healthy_probes_log_at_debug_and_failed_ones_at_info() {
        let probe = |status| {
            let log = RequestLog::new(id("p"), &Method::GET, "/health");
            log.set_status(status);
        };
        assert!(lines("info", || probe(200)).is_empty());
        assert_eq!(lines("debug", || probe(200)).len(), 1);
        assert_eq!(lines("info", || probe(503))[0]["status"], 503);
    }

    #[test]
    fn a_long_route_is_cut() {
        let path = format!("/{}", "a".repeat(1000));
        let got = lines("info", || {
            RequestLog::new(id("r4"), &Method::GET, &path);
        });
        assert_eq!(got[0]["route"].as_str().unwrap().len(), MAX_ROUTE + 3);
    }

    /// A multi-byte character across the cut used to panic (`truncate` off
    /// a char boundary).
    #[test]
    fn a_character_across_the_cut_neither_panics_nor_is_split() {
        for pad in 250..260 {
            let path = format!("/{}\u{e9}\u{2028}b", "a".repeat(pad));
            let r = loggable_route(&path);
            assert!(r.len() <= MAX_ROUTE + 3, "{r}");
            let kept = r.trim_end_matches("...");
            assert!(kept.is_ascii(), "{r}");
            // Never half an escape at the end.
            let tail = kept.rsplit('%').next().unwrap();
            assert!(!kept.contains('%') || tail.len() >= 2, "{r}");
        }
    }

    /// In the text format a field is `key=value` up to the next space: a
    /// route or id with a quote, `=`, a line or paragraph separator or a
    /// bidi override could forge fields or lines there.
    #[test]
    fn a_hostile_route_and_id_stay_one_unambiguous_text_line() {
        use crate::logging::{tests::capture, LogFormat};
        // Refused as a client id: the line gets a generated one instead.
        assert!(RequestId::from_client(b"x\" status=200 a=\"").is_none());
        let path = "/v1/x\" status=200 y=\"\u{2028}\u{202e}\r\nINFO forged";
        let out = capture(LogFormat::Text, "info", || {
            let log = RequestLog::new(id("r-5"), &Method::GET, path);
            log.set_status(404);
        });
        assert_eq!(out.lines().count(), 1, "{out:?}");
        assert!(
            !out.contains('\u{2028}') && !out.contains('\u{202e}'),
            "{out:?}"
        );
        let route = out
            .split(' ')
            .find_map(|f| f.strip_prefix("route="))
            .unwrap_or_else(|| panic!("no route field: {out}"));
        assert!(!route.contains(['"', '=']), "{route}");
        assert!(out.contains("request_id=r-5 "), "{out}");
        assert_eq!(out.matches("status=").count(), 1, "{out}");
    }

    #[test]
    fn a_route_that_could_break_a_text_line_is_escaped_and_decodes_back() {
        let path = "/v1/a\"b c=d%e\\f\u{2028}\u{202e}\n\u{7f}";
        let r = loggable_route(path);
        assert_eq!(r, "/v1/a%22b%20c%3Dd%25e%5Cf%E2%80%A8%E2%80%AE%0A%7F");
        let mut decoded = Vec::new();
        let mut bytes = r.bytes();
        while let Some(b) = bytes.next() {
            if b == b'%' {
                let hex: String = bytes.by_ref().take(2).map(char::from).collect();
                decoded.push(u8::from_str_radix(&hex, 16).unwrap());
            } else {
                decoded.push(b);
            }
        }
        assert_eq!(decoded, path.as_bytes());
        // A plain route is unchanged.
        assert_eq!(
            loggable_route("/v1/chat/completions"),
            "/v1/chat/completions"
        );
    }
}
