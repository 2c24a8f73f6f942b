//! Forwarding one client request to a replica: pick (load + prefix
//! affinity for a generation, load alone otherwise), send, and pass the answer through (status, headers less
//! hop-by-hop ones, body bytes as they arrive through a [`Relay`], so SSE
//! streams flow).
//!
//! What is retried on another replica is only what never reached a
//! replica's work, and only while nothing of the answer has reached the
//! client: a failed connect, and a 503 or 429 the replica marks with
//! [`NOT_ADMITTED_HEADER`] (it refused the request before admitting it:
//! loading, draining, over a limit). Anything else is passed through, never
//! replayed: a connection cut after the request was sent (the replica may
//! have died running it), an unmarked 503 (a request timeout, a drain cut,
//! an engine that stopped under it), a 500 or 504 all mean the replica ran
//! (part of) the request, and resending it would multiply what a failing,
//! or poisonous, request costs. A response head that does not come within
//! the head timeout is a 504 to the client, not a retry, for the same
//! reason. Prefix affinity remembers only requests a replica accepted.
//!
//! A store miss (a 404 marked [`STORE_MISS_HEADER`]: the replica does not
//! hold the stored response a request names, and ran nothing) is asked of
//! every other healthy replica in turn, past `max_attempts`: responses are
//! stored on the replica that made them, and only one holds each.

use super::balancer::{prefix_hashes, Reason};
use super::relay::{Ending, Relay, RelayError};
use super::request_log::RouteLog;
use super::RouterState;
use crate::api::ApiError;
use crate::http::{
    error_response, error_response_as, Api, ResBody, NOT_ADMITTED_HEADER, STORE_MISS_HEADER,
};
use crate::metrics as names;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use hyper::{Request, Response, StatusCode, Uri};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;

/// The router's response body: made here (errors, health) or a replica's
/// body relayed.
pub enum RouterBody {
    Local(ResBody),
    Upstream(Relay),
}

/// A failed router body; the server then aborts the client's connection.
/// Boxed because the two sources fail differently ([`RelayError`] and the
/// local body's own error).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl Body for RouterBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            RouterBody::Local(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            RouterBody::Upstream(r) => Pin::new(r)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|e: RelayError| e.into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RouterBody::Local(b) => b.is_end_stream(),
            RouterBody::Upstream(r) => r.is_end_stream(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            RouterBody::Local(b) => b.size_hint(),
            RouterBody::Upstream(r) => r.size_hint(),
        }
    }
}

/// An error answered by the router itself, in OpenAI's shape.
pub fn local_error(e: &ApiError) -> Response<RouterBody> {
    error_response(e).map(RouterBody::Local)
}

/// An error answered by the router itself for a request to `path`: in the
/// shape of that route's wire API (Anthropic's for `/v1/messages`), as the
/// replica's own errors are.
pub fn local_error_for(path: &str, e: &ApiError) -> Response<RouterBody> {
    match Api::of_path(path) {
        Some(api) => error_response_as(api, e).map(RouterBody::Local),
        None => local_error(e),
    }
}

/// Headers that belong to one connection, not to the message (RFC 9110
/// 7.6.1), plus `host` (set from the replica URL). `content-length` stays:
/// the body passes through byte for byte. The headers a message's own
/// `Connection` names are hop-by-hop too (see [`copy_headers`]).
fn hop_by_hop(name: &HeaderName) -> bool {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    HOP.contains(&name.as_str()) || name == HOST
}

/// Copies the end-to-end headers of `from`: neither the fixed hop-by-hop
/// ones nor any that `from`'s `Connection` headers name (RFC 9110 7.6.1).
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    let named: Vec<String> = from
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    for (k, v) in from {
        if !hop_by_hop(k) && !named.iter().any(|n| n == k.as_str()) {
            to.append(k.clone(), v.clone());
        }
    }
}

/// Whether `status` with `headers` is a replica's refusal from before it
/// admitted the request (safe to send elsewhere; see the module doc).
fn refused_before_admission(status: StatusCode, headers: &HeaderMap) -> bool {
    matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    ) && headers.contains_key(NOT_ADMITTED_HEADER)
}

/// What the router reads of a request body: the text whose prefix decides
/// affinity (the messages, each as its JSON, in order, of a chat request,
/// or the prompt of a completion) and whether the answer is streamed. Empty
/// and not streamed for a body that is not such JSON (the replica will
/// refuse it).
#[derive(Debug, Default, PartialEq)]
pub struct Inspected {
    pub prompt: Vec<u8>,
    pub stream: bool,
}

/// Reads `body` as [`Inspected`] says.
pub fn inspect(body: &[u8]) -> Inspected {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Inspected::default();
    };
    let stream = v.get("stream").and_then(|s| s.as_bool()) == Some(true);
    let prompt = if let Some(msgs) = v.get("messages").and_then(|m| m.as_array()) {
        let mut out = Vec::new();
        for m in msgs {
            out.extend_from_slice(m.to_string().as_bytes());
        }
        out
    } else {
        // Completions' `prompt`, or the Responses API's `input`.
        match v.get("prompt").or_else(|| v.get("input")) {
            Some(serde_json::Value::String(s)) => s.clone().into_bytes(),
            Some(p) => p.to_string().into_bytes(),
            None => Vec::new(),
        }
    };
    Inspected { prompt, stream }
}

/// Forwards `req` to a replica, retrying elsewhere only what is safe (see
/// the module doc) and only while nothing has been sent to the client.
/// With `prompt_affinity` (the generation routes) the replica is chosen by
/// load and the prompt's prefix and the head timeout depends on `stream`;
/// without it (tokenize, version: no KV cache to reuse) by load alone, under
/// the non-streamed head timeout. What happened is noted in `log`, which the
/// relay holds until the answer's end.
///
/// Errors (as OpenAI error responses): 413 for a body over the limit, 408
/// for one that does not arrive within the body deadline, 503 when no
/// replica is healthy, 502 when every replica tried failed to connect or
/// one cut the connection after the request was sent, 504 when the chosen
/// replica sent no response head within the head timeout; a replica's own
/// error status is passed through (a refusal before admission only when it
/// was the last try).
pub(crate) async fn forward(
    state: Arc<RouterState>,
    req: Request<Incoming>,
    prompt_affinity: bool,
    log: &RouteLog,
) -> Response<RouterBody> {
    let (parts, body) = req.into_parts();
    let route = parts.uri.path().to_owned();
    let local_error = |e: &ApiError| local_error_for(&route, e);
    let deadline = Duration::from_millis(state.cfg.body_read_timeout_ms);
    let read = Limited::new(body, state.cfg.max_body_bytes).collect();
    let Ok(read) = tokio::time::timeout(deadline, read).await else {
        return local_error(&ApiError::request_timeout(format!(
            "The request body did not arrive within {} s.",
            deadline.as_secs_f64()
        )));
    };
    let body = match read {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return local_error(&ApiError::payload_too_large(state.cfg.max_body_bytes))
        }
        Err(e) => {
            return local_error(&ApiError::bad_request(format!(
                "Could not read the request body: {e}."
            )))
        }
    };
    // Not inspected without affinity: a tokenize body's prompt must not
    // take up affinity entries, nor its `stream` key pick a timeout.
    let seen = if prompt_affinity {
        inspect(&body)
    } else {
        Inspected::default()
    };
    let hashes = prefix_hashes(&seen.prompt, state.cfg.prefix_chunk_bytes);
    let head_limit = Duration::from_millis(if seen.stream {
        state.cfg.stream_head_timeout_ms
    } else {
        state.cfg.head_timeout_ms
    });
    let idle = Duration::from_millis(state.cfg.body_idle_timeout_ms);
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let mut tried: Vec<Arc<str>> = Vec::new();
    let mut last_refusal: Option<Response<RouterBody>> = None;
    let mut last_error = String::new();
    // Store misses ask every healthy replica (`choose` runs out of them).
    let mut attempts = state.cfg.max_attempts;
    while tried.len() < attempts {
        let Some(lease) = state.pool.choose(&hashes, &tried) else {
            break;
        };
        if !tried.is_empty() {
            metrics::counter!(names::ROUTER_RETRIES).increment(1);
        }
        tried.push(lease.url.clone());
        log.tried(tried.len());
        let uri: Uri = match format!("{}{path}", lease.url).parse() {
            Ok(u) => u,
            Err(e) => {
                last_error = format!("bad replica URL {}: {e}", lease.url);
                continue;
            }
        };
        let mut up = Request::new(Full::new(body.clone()));
        *up.method_mut() = parts.method.clone();
        *up.uri_mut() = uri;
        copy_headers(&parts.headers, up.headers_mut());
        let sent = Instant::now();
        let replica = lease.url.to_string();
        let errors = || {
            metrics::counter!(names::ROUTER_UPSTREAM_ERRORS, "replica" => replica.clone())
                .increment(1)
        };
        let resp = match tokio::time::timeout(head_limit, state.client.request(up)).await {
            Err(_) => {
                // Not retried: the replica may be computing the answer.
                errors();
                log.answered_by(&lease.url);
                tracing::warn!(
                    request_id = %log.id(),
                    %replica,
                    limit_ms = head_limit.as_millis() as u64,
                    "replica sent no response head in time"
                );
                return local_error(&ApiError::gateway_timeout(format!(
                    "The replica did not answer within {} ms.",
                    head_limit.as_millis()
                )));
            }
            Ok(Err(e)) if e.is_connect() => {
                // Never connected: the replica saw nothing, safe elsewhere.
                errors();
                state.pool.mark_down(&replica);
                last_error = format!("replica {replica}: {e}");
                continue;
            }
            Ok(Err(e)) => {
                // Sent, and the connection failed before an answer: the
                // replica may have run it (or died running it). Not replayed.
                errors();
                log.answered_by(&lease.url);
                tracing::warn!(
                    request_id = %log.id(),
                    %replica,
                    error = %e,
                    "replica failed after the request was sent; not retried"
                );
                return local_error(&ApiError::bad_gateway(format!(
                    "The replica failed before answering: {e}."
                )));
            }
            Ok(Ok(resp)) => resp,
        };
        metrics::histogram!(names::ROUTER_UPSTREAM_LATENCY).record(sent.elapsed().as_secs_f64());
        // Every answer but a refusal before admission returns below, so the
        // last replica noted is the one whose answer the client gets.
        log.answered_by(&lease.url);
        let status = resp.status();
        let missed =
            status == StatusCode::NOT_FOUND && resp.headers().contains_key(STORE_MISS_HEADER);
        if missed {
            attempts = usize::MAX;
        }
        let refused = missed || refused_before_admission(status, resp.headers());
        if status.is_success() {
            state.pool.remember(&hashes, &lease.url);
        }
        metrics::counter!(names::ROUTER_REQUESTS, "replica" => replica.clone(), "status" => status.as_str().to_string())
            .increment(1);
        if lease.reason == Reason::Affinity {
            metrics::counter!(names::ROUTER_AFFINITY_ROUTED).increment(1);
        }
        let (rparts, rbody) = resp.into_parts();
        let sse = rparts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let mut out = Response::new(RouterBody::Upstream(Relay::new(
            rbody,
            lease,
            idle,
            sse.then(|| Ending::of_path(&route)),
            log.clone(),
        )));
        *out.status_mut() = status;
        copy_headers(&rparts.headers, out.headers_mut());
        if sse {
            // The relay may append an error event to a cut stream.
            out.headers_mut().remove(CONTENT_LENGTH);
        }
        if status.is_server_error() {
            errors();
        }
        if !refused {
            return out;
        }
        last_error = if missed {
            format!("replica {replica} does not store the response it names")
        } else {
            format!("replica {replica} refused it ({status})")
        };
        last_refusal = Some(out);
    }
    if let Some(r) = last_refusal {
        return r;
    }
    metrics::counter!(names::ROUTER_UNROUTABLE).increment(1);
    if tried.is_empty() {
        local_error(&ApiError::unavailable("No healthy replica is available."))
    } else {
        local_error(&ApiError::bad_gateway(format!(
            "No replica answered ({} tried; last: {last_error}).",
            tried.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt_text(body: &[u8]) -> Vec<u8> {
        inspect(body).prompt
    }

    #[test]
    fn streamed_is_only_stream_true() {
        assert!(inspect(br#"{"prompt":"a","stream":true}"#).stream);
        assert!(!inspect(br#"{"prompt":"a","stream":false}"#).stream);
        assert!(!inspect(br#"{"prompt":"a","stream":"yes"}"#).stream);
        assert!(!inspect(b"not json").stream);
    }

    #[test]
    fn affinity_text_is_the_messages_or_the_prompt() {
        let chat = br#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"U"}],"max_tokens":3}"#;
        let t = String::from_utf8(prompt_text(chat)).unwrap();
        // Keys keep the request's order (serde_json `preserve_order`, which
        // llguidance turns on workspace-wide).
        assert_eq!(
            t,
            r#"{"role":"system","content":"S"}{"role":"user","content":"U"}"#
        );
        // Other fields do not change it.
        let chat2 = br#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"U"}],"temperature":1}"#;
        assert_eq!(prompt_text(chat2), prompt_text(chat));
        assert_eq!(prompt_text(br#"{"prompt":"abc"}"#), b"abc");
        assert_eq!(prompt_text(br#"{"prompt":["abc"]}"#), br#"["abc"]"#);
        // The Responses API's `input`.
        assert_eq!(prompt_text(br#"{"input":"abc"}"#), b"abc");
        assert!(prompt_text(b"not json").is_empty());
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close".parse().unwrap());
        h.insert("host", "router".parse().unwrap());
        h.insert("content-length", "3".parse().unwrap());
        h.insert("transfer-encoding", "chunked".parse().unwrap());
        h.insert("authorization", "Bearer k".parse().unwrap());
        h.insert("content-type", "application/json".parse().unwrap());
        let mut out = HeaderMap::new();
        copy_headers(&h, &mut out);
        let mut names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        names.sort();
        assert_eq!(
            names,
            vec!["authorization", "content-length", "content-type"]
        );
    }

    #[test]
    fn headers_named_in_connection_are_dropped() {
        let mut h = HeaderMap::new();
        h.append("connection", "X-Secret, keep-alive".parse().unwrap());
        h.append("connection", "x-other".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("x-other", "2".parse().unwrap());
        h.insert("x-kept", "3".parse().unwrap());
        let mut out = HeaderMap::new();
        copy_headers(&h, &mut out);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["x-kept"]);
    }

    #[test]
    fn only_marked_refusals_are_before_admission() {
        let mut marked = HeaderMap::new();
        marked.insert(NOT_ADMITTED_HEADER, "1".parse().unwrap());
        let none = HeaderMap::new();
        assert!(refused_before_admission(
            StatusCode::SERVICE_UNAVAILABLE,
            &marked
        ));
        assert!(refused_before_admission(
            StatusCode::TOO_MANY_REQUESTS,
            &marked
        ));
        assert!(!refused_before_admission(
            StatusCode::SERVICE_UNAVAILABLE,
            &none
        ));
        assert!(!refused_before_admission(
            StatusCode::INTERNAL_SERVER_ERROR,
            &marked
        ));
    }
}
