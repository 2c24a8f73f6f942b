//! Request ids: every HTTP request gets one, taken from the client's
//! `X-Request-Id` when that is a sane token, otherwise made here. The id is
//! returned as the `x-request-id` header on every response (errors, 404 and
//! /health included), prefixes the generation response ids
//! (`chatcmpl-<id>`, `cmpl-<id>`, `msg_<id>`; never a stored response's
//! `resp_` id, which is random: [`super::response_id`]) and is the `request_id` of the request's
//! log line ([`super::request_log`]), so a client's report, a proxy's log
//! and this server's log can be joined on it. The router (`specgate route`)
//! assigns ids with the same [`RequestId`] and sends its id on to the
//! replica, so one id names the request in both logs.

use super::request_log::RequestLog;
use super::{error_response, route, AppState, ResBody};
use crate::api::ApiError;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

/// The header a request id comes in and goes out with.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client id honoured; a longer one is replaced (it would be
/// copied into every log line and response id).
pub const MAX_LEN: usize = 128;

/// A request's id. Invariant: 1..=[`MAX_LEN`] bytes, each an ASCII letter,
/// digit or one of [`ID_PUNCTUATION`], so it is a valid header value, needs
/// no quoting in a `key=value` log line (no `"`, `=`, space or control) and
/// cannot forge a log line or a header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(String);

/// The punctuation a request id may hold besides letters and digits: what
/// UUIDs, ULIDs, trace ids and `service:host/n`-style ids use.
pub const ID_PUNCTUATION: &[u8] = b"-_.:/+@~";

impl RequestId {
    /// The client's id, if it keeps the invariant (`None` otherwise: empty,
    /// too long, spaces, quotes, `=`, control or non-ASCII bytes).
    pub fn from_client(raw: &[u8]) -> Option<RequestId> {
        let ok = (1..=MAX_LEN).contains(&raw.len())
            && raw
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || ID_PUNCTUATION.contains(b));
        // Visible ASCII is valid UTF-8.
        ok.then(|| RequestId(String::from_utf8_lossy(raw).into_owned()))
    }

    /// A fresh id: 16 lowercase hex digits from the OS's CSPRNG, so the ids
    /// a client sees (`/health`'s included) tell nothing of other requests'
    /// ids or of how many there were. Should the OS give no random bytes,
    /// a keyed mix of a counter stands in: the id only names log lines (a
    /// stored response's id never derives from it, see
    /// [`super::response_id`]).
    pub fn generate() -> RequestId {
        let n = getrandom::u64().unwrap_or_else(|_| {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            static KEY: OnceLock<u64> = OnceLock::new();
            let key = *KEY.get_or_init(|| {
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u64(0x5bd1_e995);
                h.finish()
            });
            mix(COUNTER.fetch_add(1, Ordering::Relaxed) ^ key)
        });
        RequestId(format!("{n:016x}"))
    }

    /// The id of a request with these headers: the first `X-Request-Id` if
    /// it is acceptable, else a generated one.
    pub fn for_headers(headers: &HeaderMap) -> RequestId {
        headers
            .get(&HEADER)
            .and_then(|v| RequestId::from_client(v.as_bytes()))
            .unwrap_or_else(RequestId::generate)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as a header value (always valid, by the invariant).
    pub fn header_value(&self) -> HeaderValue {
        HeaderValue::from_str(self.as_str()).expect("a request id is visible ASCII")
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// splitmix64's finalizer: a bijection on u64 (xor-shifts and odd
/// multipliers are invertible), so distinct inputs give distinct ids while
/// consecutive counters look unrelated.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The server's request handler: assigns the request its id and its log
/// record (handlers find the record in the request's extensions), routes
/// it, stamps the id on the response, and notes the status. The log line
/// itself is written when the last holder of the record lets go: here for a
/// whole response, at the end of the stream for a streamed one.
///
/// A handler that panics is answered with a 500 JSON error (with the id),
/// not a reset connection; the panic is logged by the process's panic hook
/// and the request line says so.
pub(super) async fn handle(state: Arc<AppState>, mut req: Request<Incoming>) -> Response<ResBody> {
    let id = RequestId::for_headers(req.headers());
    let log = RequestLog::new(id.clone(), req.method(), req.uri().path());
    req.extensions_mut().insert(log.clone());
    let mut res = answer_or_500(route(state, req), &log).await;
    log.set_status(res.status().as_u16());
    res.headers_mut().insert(HEADER, id.header_value());
    res
}

/// `handler`'s response, or a 500 JSON error when polling it panics.
async fn answer_or_500(
    handler: impl Future<Output = Response<ResBody>>,
    log: &RequestLog,
) -> Response<ResBody> {
    match caught(handler).await {
        Some(res) => res,
        None => {
            log.panicked();
            error_response(&panicked_error())
        }
    }
}

/// The 500 a client gets when its handler panicked (the server's and the
/// router's): the id names the process's log line about it.
pub(crate) fn panicked_error() -> ApiError {
    ApiError::internal(
        "The server failed while handling this request; the failure is logged \
         under this request's x-request-id.",
    )
}

/// `fut`'s output, or `None` when a poll of it panicked: one request's
/// panic ends that request, not the connection's task or the process.
pub(crate) fn caught<F: Future>(fut: F) -> impl Future<Output = Option<F::Output>> {
    CatchPanic(Box::pin(fut))
}

/// A future's output, or `None` when a poll of it panicked (it is not
/// polled again). The future is boxed, so this wrapper is `Unpin`.
struct CatchPanic<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchPanic<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // The panicked future is dropped with this wrapper and never polled
        // again, so no broken state of it is observed.
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(v)) => Poll::Ready(Some(v)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_client_id_is_kept() {
        let id = RequestId::from_client(b"req-42_abc.DEF:1/2").unwrap();
        assert_eq!(id.as_str(), "req-42_abc.DEF:1/2");
        let longest = vec![b'x'; MAX_LEN];
        assert!(RequestId::from_client(&longest).is_some());
    }

    #[test]
    fn an_unsafe_client_id_is_refused() {
        for bad in [
            &b""[..],
            b"has space",
            b"tab\there",
            b"line\nbreak",
            b"del\x7f",
            b"quote\"d",
            b"k=v",
            b"a,b;c",
            b"back\\slash",
            "caf\u{e9}".as_bytes(),
            &[b'x'; MAX_LEN + 1],
        ] {
            assert!(RequestId::from_client(bad).is_none(), "{bad:?} accepted");
        }
    }

    #[test]
    fn generated_ids_are_16_hex_digits_and_distinct() {
        let ids: std::collections::HashSet<String> = (0..10_000)
            .map(|_| RequestId::generate().0)
            .inspect(|id| {
                assert_eq!(id.len(), 16);
                assert!(id
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            })
            .collect();
        assert_eq!(ids.len(), 10_000);
    }

    #[test]
    fn the_header_decides_and_a_bad_header_is_replaced() {
        let mut h = HeaderMap::new();
        assert_eq!(RequestId::for_headers(&h).as_str().len(), 16);
        h.insert(HEADER, HeaderValue::from_static("client-1"));
        assert_eq!(RequestId::for_headers(&h).as_str(), "client-1");
        h.insert(HEADER, HeaderValue::from_static("two words"));
        let id = RequestId::for_headers(&h);
        assert_ne!(id.as_str(), "two words");
        assert_eq!(id.header_value(), id.as_str());
    }

    #[test]
    fn a_panicking_handler_is_a_500_json_error_and_a_logged_line() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let got = crate::http::request_log::tests::lines("info", || {
            let log = RequestLog::new(RequestId::generate(), &hyper::Method::GET, "/p");
            let res = rt.block_on(answer_or_500(
                async {
                    tokio::task::yield_now().await;
                    let v: Vec<u8> = Vec::new();
                    // A request-controlled index past the end.
                    let i = std::hint::black_box(3);
                    error_response(&ApiError::bad_request(format!("{}", v[i])))
                },
                &log,
            ));
            assert_eq!(res.status(), 500);
            log.set_status(res.status().as_u16());
            let super::ResBody::Full(body) = res.into_body() else {
                panic!("not a whole body")
            };
            let body = rt
                .block_on(http_body_util::BodyExt::collect(body))
                .unwrap()
                .to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
        });
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0]["status"], 500);
        assert_eq!(got[0]["error"], "the handler panicked");
    }

    #[test]
    fn the_mix_is_a_bijection_on_a_sample() {
        // Distinct inputs (including adjacent and high-bit ones) never
        // collide: the uniqueness of generated ids rests on this.
        let inputs: Vec<u64> = (0..5000u64).chain((0..64).map(|b| 1u64 << b)).collect();
        let outs: std::collections::HashSet<u64> = inputs.iter().map(|&x| mix(x)).collect();
        let distinct: std::collections::HashSet<u64> = inputs.into_iter().collect();
        assert_eq!(outs.len(), distinct.len());
    }
}
