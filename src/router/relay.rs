//! Relaying a replica's response body to the client once its head has been
//! passed on: bytes flow through as they arrive, with a limit on the wait
//! for each next frame (a stalled replica must not hold the client and the
//! lease forever; the total time is not limited, a long generation is fine).
//!
//! When the body fails (a connection reset, the idle limit) or ends early,
//! the status is already on the wire, so what the client is told depends on
//! the body:
//! - an SSE stream (`text/event-stream`) that has not sent its API's last
//!   event ([`Ending`]: `data: [DONE]` for chat completions and
//!   completions, `message_stop` for Messages, `response.completed` /
//!   `.incomplete` / `.failed` for Responses, or the replica's own `error`
//!   event) gets an error in that API's shape (OpenAI's error event and
//!   `[DONE]`; Anthropic's `event: error`; a `response.failed` event), so a
//!   client sees a failure, never a silently truncated answer. A stream
//!   that did end as its API ends streams passes through untouched, with no
//!   warning and no upstream error counted. To keep the appended event well
//!   formed, bytes are forwarded only up to the last complete event (a
//!   blank line); the part of an event cut by the failure is dropped.
//! - any other body fails, which makes the server abort the connection: a
//!   client reading a `content-length` or chunked body sees it incomplete.

use super::replicas::Lease;
use super::request_log::RouteLog;
use crate::api::ApiError;
use crate::http::Api;
use crate::metrics as names;
use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// How a replica's body failed after its head was sent on.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Reading the body failed (the replica reset or closed the connection
    /// mid-body, or sent malformed framing).
    #[error("replica {replica}: the response body failed: {source}")]
    Body {
        replica: Arc<str>,
        #[source]
        source: hyper::Error,
    },
    /// No frame arrived within the idle limit.
    #[error("replica {replica}: no response bytes for {idle_ms} ms")]
    Idle { replica: Arc<str>, idle_ms: u64 },
}

/// An SSE event ends with a blank line; `\n\n` also ends the `\r\n\r\n`
/// form's last line, so this finds the end of both (the CR-only form is not
/// used by any OpenAI-compatible server).
fn last_event_end(bytes: &[u8]) -> Option<usize> {
    let lf = bytes.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = bytes
        .windows(3)
        .rposition(|w| w == b"\n\r\n")
        .map(|i| i + 3);
    lf.max(crlf)
}

/// How a route's stream ends, and how the relay ends one that was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Chat completions and completions: a `data: [DONE]` line.
    Done,
    /// Anthropic's Messages: a `message_stop` (or `error`) event.
    Messages,
    /// OpenAI's Responses: `response.completed`, `response.incomplete` or
    /// `response.failed` (or `error`).
    Responses,
}

impl Ending {
    /// The ending of the stream a route answers (OpenAI's for a path of no
    /// wire API).
    pub fn of_path(path: &str) -> Ending {
        match Api::of_path(path) {
            Some(Api::Messages) => Ending::Messages,
            Some(Api::Responses) => Ending::Responses,
            _ => Ending::Done,
        }
    }

    /// Whether `ev`, when it is the last event, ends the stream. A
    /// replica's `error` event ends a Messages or Responses stream (the
    /// client was told); on chat completions `[DONE]` follows it.
    fn ends(self, ev: &Event<'_>) -> bool {
        match self {
            Ending::Done => ev.data == Some(b"[DONE]"),
            Ending::Messages => matches!(ev.name, Some(b"message_stop" | b"error")),
            Ending::Responses => matches!(
                ev.name,
                Some(
                    b"response.completed" | b"response.incomplete" | b"response.failed" | b"error"
                )
            ),
        }
    }
}

/// The fields of one SSE event that tell where a stream ends: its
/// `event:` name and its first `data:` line (one optional space after the
/// colon dropped, as the SSE spec says).
#[derive(Debug, Default, PartialEq)]
struct Event<'a> {
    name: Option<&'a [u8]>,
    data: Option<&'a [u8]>,
}

/// The events of `bytes` (whole events), in order; comment-only blocks
/// (keep-alives) are none. Linear in `bytes`.
fn events_of(bytes: &[u8]) -> impl Iterator<Item = Event<'_>> {
    let mut lines = bytes
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    std::iter::from_fn(move || {
        let mut ev = Event::default();
        let mut fields = false;
        for line in lines.by_ref() {
            if line.is_empty() {
                if fields {
                    return Some(ev);
                }
                continue;
            }
            if line.starts_with(b":") {
                continue;
            }
            fields = true;
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => (&line[..i], &line[i + 1..]),
                None => (line, &b""[..]),
            };
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match field {
                b"event" => ev.name = Some(value),
                b"data" if ev.data.is_none() => ev.data = Some(value),
                _ => {}
            }
        }
        fields.then_some(ev)
    })
}

/// What a Responses stream's `response.created` event says of the
/// response, for the `response.failed` event of a cut stream.
#[derive(Debug, Default, serde::Deserialize)]
struct ResponseHead {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    created_at: Option<u64>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(serde::Deserialize)]
struct Created {
    response: ResponseHead,
}

/// The SSE side of a relay: the start of an event not yet complete,
/// whether the stream's last complete event ended it, and for a Responses
/// stream its events so far (the next `sequence_number`) and its head.
struct Sse {
    ending: Ending,
    partial: BytesMut,
    done: bool,
    events: u64,
    head: Option<ResponseHead>,
}

/// Above this many bytes an unterminated "event" is forwarded as it is: no
/// real event is that large, and holding more would let a replica that never
/// sends a blank line grow the router's memory.
const MAX_PARTIAL_EVENT: usize = 1 << 20;

impl Sse {
    fn new(ending: Ending) -> Self {
        Self {
            ending,
            partial: BytesMut::new(),
            done: false,
            events: 0,
            head: None,
        }
    }

    /// The whole events that `data` completes (empty when it completes
    /// none); the rest is held.
    fn push(&mut self, data: Bytes) -> Bytes {
        // The usual case: nothing held and `data` is whole events.
        if self.partial.is_empty() && data.ends_with(b"\n\n") {
            self.note(&data);
            return data;
        }
        self.partial.extend_from_slice(&data);
        let cut = match last_event_end(&self.partial) {
            Some(end) => end,
            None if self.partial.len() > MAX_PARTIAL_EVENT => self.partial.len(),
            None => return Bytes::new(),
        };
        let out = self.partial.split_to(cut).freeze();
        self.note(&out);
        out
    }

    /// Notes the events of `whole` (whole events) as passed on: whether
    /// the last one ends the stream; for Responses, their count and the
    /// response's head.
    fn note(&mut self, whole: &[u8]) {
        for ev in events_of(whole) {
            self.done = self.ending.ends(&ev);
            if self.ending == Ending::Responses {
                self.events += 1;
                if self.head.is_none() && ev.name == Some(b"response.created") {
                    let created = ev
                        .data
                        .and_then(|d| serde_json::from_slice::<Created>(d).ok());
                    self.head = Some(created.map(|c| c.response).unwrap_or_default());
                }
            }
        }
    }

    /// The events that tell the client its cut stream failed, in its API's
    /// shape, `why` in the message.
    fn cut_events(&self, why: &str) -> Bytes {
        let e = ApiError::bad_gateway(format!("The answer was cut off: {why}."));
        Bytes::from(match self.ending {
            Ending::Done => format!("data: {}\n\ndata: [DONE]\n\n", e.to_json()),
            Ending::Messages => format!("event: error\ndata: {}\n\n", e.to_anthropic_json()),
            Ending::Responses => {
                let head = self.head.as_ref();
                let failed = serde_json::json!({
                    "type": "response.failed",
                    "sequence_number": self.events,
                    "response": {
                        "id": head.and_then(|h| h.id.as_deref()),
                        "object": "response",
                        "created_at": head.and_then(|h| h.created_at),
                        "status": "failed",
                        "error": {"code": "server_error", "message": e.message},
                        "incomplete_details": null,
                        "model": head.and_then(|h| h.model.as_deref()),
                        "output": [],
                        "usage": null,
                    },
                });
                format!("event: response.failed\ndata: {failed}\n\n")
            }
        })
    }
}

/// A replica's response body on its way to the client; keeps the replica's
/// [`Lease`] (counted in flight) and the request's log record (its line is
/// written when the relay is dropped) until it ends or the client goes away.
pub struct Relay {
    body: Incoming,
    replica: Arc<str>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    /// `Some` for an SSE response.
    sse: Option<Sse>,
    /// Nothing more goes to the client.
    ended: bool,
    log: RouteLog,
    _lease: Lease,
}

impl Relay {
    /// Relays `body` from `lease`'s replica, failing it when no frame comes
    /// for `idle`; `sse` is `Some` for a `text/event-stream` response, with
    /// how its route's streams end. A cut is noted in `log`.
    pub(crate) fn new(
        body: Incoming,
        lease: Lease,
        idle: Duration,
        sse: Option<Ending>,
        log: RouteLog,
    ) -> Self {
        Self {
            body,
            replica: lease.url.clone(),
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            sse: sse.map(Sse::new),
            ended: false,
            log,
            _lease: lease,
        }
    }

    /// The replica's body ended (`failure` is `None`) or failed: the last
    /// thing the client gets.
    fn finish(
        &mut self,
        failure: Option<RelayError>,
    ) -> Poll<Option<Result<Frame<Bytes>, RelayError>>> {
        self.ended = true;
        let count = |replica: &str| {
            metrics::counter!(names::ROUTER_UPSTREAM_ERRORS, "replica" => replica.to_string())
                .increment(1)
        };
        match (&self.sse, failure) {
            (None, None) => Poll::Ready(None),
            (None, Some(e)) => {
                tracing::warn!(
                    request_id = %self.log.id(),
                    error = %e,
                    "relay failed; closing the client's connection"
                );
                self.log.failed(&e.to_string());
                count(&self.replica);
                Poll::Ready(Some(Err(e)))
            }
            // A failure after the stream's last event cost the client
            // nothing.
            (Some(sse), _) if sse.done => Poll::Ready(None),
            (Some(sse), failure) => {
                let why = match failure {
                    Some(e) => e.to_string(),
                    None => format!(
                        "replica {}: the stream ended before its last event",
                        self.replica
                    ),
                };
                tracing::warn!(
                    request_id = %self.log.id(),
                    error = %why,
                    "relay cut off; the client gets an error event"
                );
                self.log.failed(&why);
                count(&self.replica);
                Poll::Ready(Some(Ok(Frame::data(sse.cut_events(&why)))))
            }
        }
    }
}

impl Body for Relay {
    type Data = Bytes;
    type Error = RelayError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RelayError>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let deadline = Instant::now() + this.idle;
                    this.timer.as_mut().reset(deadline);
                    let frame = match (frame.into_data(), &mut this.sse) {
                        (Ok(data), Some(sse)) => {
                            let out = sse.push(data);
                            if out.is_empty() {
                                continue;
                            }
                            Frame::data(out)
                        }
                        (Ok(data), None) => Frame::data(data),
                        // Trailers cannot follow the events this relay may
                        // append; specgate replicas send none.
                        (Err(_), Some(_)) => continue,
                        (Err(trailers), None) => trailers,
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => return this.finish(None),
                Poll::Ready(Some(Err(source))) => {
                    let e = RelayError::Body {
                        replica: this.replica.clone(),
                        source,
                    };
                    return this.finish(Some(e));
                }
                Poll::Pending => {
                    if this.timer.as_mut().poll(cx).is_ready() {
                        let e = RelayError::Idle {
                            replica: this.replica.clone(),
                            idle_ms: this.idle.as_millis() as u64,
                        };
                        return this.finish(Some(e));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        // An SSE relay may add bytes; a plain one is the replica's body.
        match self.sse {
            Some(_) => SizeHint::default(),
            None => self.body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_events_pass_and_done_is_tracked() {
        let b = Bytes::from_static;
        let mut s = Sse::new(Ending::Done);
        let whole = b(b"data: {\"a\":1}\n\n");
        assert_eq!(s.push(whole.clone()), whole);
        assert!(!s.done);
        // An event split across frames waits for its end.
        assert!(s.push(b(b"data: {\"b\"")).is_empty());
        assert_eq!(s.push(b(b":2}\n\ndata: {\"c")), b(b"data: {\"b\":2}\n\n"));
        assert_eq!(
            s.push(b(b"\":3}\n\ndata: [DONE]\n\n")),
            b(b"data: {\"c\":3}\n\ndata: [DONE]\n\n")
        );
        assert!(s.done);
        // A keep-alive comment after [DONE] does not undo it.
        s.push(b(b": keep-alive\n\n"));
        assert!(s.done);
        let mut crlf = Sse::new(Ending::Done);
        let done = b(b"data: [DONE]\r\n\r\n");
        assert_eq!(crlf.push(done.clone()), done);
        assert!(crlf.done);
        // [DONE] inside a data payload is not the sentinel.
        let mut k = Sse::new(Ending::Done);
        k.push(b(b"data: [DONE]\n\ndata: {\"t\":\"data: [DONE]\"}\n\n"));
        assert!(!k.done);
    }

    #[test]
    fn each_api_ends_with_its_own_last_event() {
        let b = Bytes::from_static;
        let mut m = Sse::new(Ending::Messages);
        m.push(b(
            b"event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
        ));
        assert!(!m.done);
        // [DONE] means nothing to Messages; message_stop ends it, split or
        // not, and a ping after it changes nothing.
        m.push(b(b"data: [DONE]\n\nevent: message_st"));
        assert!(!m.done);
        m.push(b(b"op\ndata: {\"type\":\"message_stop\"}\n\n"));
        assert!(m.done);
        m.push(b(b": keep-alive\n\n"));
        assert!(m.done);
        let mut r = Sse::new(Ending::Responses);
        r.push(b(
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"created_at\":7,\"model\":\"m\",\"output\":[]},\"sequence_number\":0}\n\n",
        ));
        r.push(b(b"event: response.output_text.delta\ndata: {}\n\n"));
        assert!(!r.done);
        assert_eq!(r.events, 2);
        let failed = r.cut_events("gone");
        let text = std::str::from_utf8(&failed).unwrap();
        let data = text.strip_prefix("event: response.failed\ndata: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(data.trim_end()).unwrap();
        assert_eq!(v["type"], "response.failed");
        assert_eq!(v["sequence_number"], 2);
        assert_eq!(v["response"]["id"], "resp_1");
        assert_eq!(v["response"]["created_at"], 7);
        assert_eq!(v["response"]["status"], "failed");
        assert!(v["response"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gone"));
        for last in [
            &b"event: response.completed\ndata: {}\n\n"[..],
            b"event: response.incomplete\ndata: {}\n\n",
            b"event:response.failed\r\ndata: {}\r\n\r\n",
            b"event: error\ndata: {}\n\n",
        ] {
            let mut r = Sse::new(Ending::Responses);
            r.push(Bytes::copy_from_slice(last));
            assert!(r.done, "{:?}", String::from_utf8_lossy(last));
        }
        // Chat's [DONE] is not a Responses ending.
        let mut r = Sse::new(Ending::Responses);
        r.push(b(b"data: [DONE]\n\n"));
        assert!(!r.done);
        let cut = Sse::new(Ending::Messages).cut_events("x");
        let text = std::str::from_utf8(&cut).unwrap();
        let data = text.strip_prefix("event: error\ndata: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(data.trim_end()).unwrap();
        assert_eq!(v["type"], "error");
        assert!(v["error"]["type"].is_string(), "{v}");
    }

    #[test]
    fn a_never_ending_event_is_not_held_without_bound() {
        let mut s = Sse::new(Ending::Done);
        let big = Bytes::from(vec![b'x'; MAX_PARTIAL_EVENT + 1]);
        assert_eq!(s.push(big).len(), MAX_PARTIAL_EVENT + 1);
        assert!(s.partial.is_empty());
    }
}
