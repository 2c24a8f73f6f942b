//! Relaying a replica's response body to the client once its head has been
//! passed on: bytes flow through as they arrive, with a limit on the wait
//! for each next frame (a stalled replica must not hold the client and the
//! lease forever; the total time is not limited, a long generation is fine).
//!
//! When the body fails (a connection reset, the idle limit) or ends early,
//! the status is already on the wire, so what the client is told depends on
//! the body:
//! - an SSE stream (`text/event-stream`) that has not sent `data: [DONE]`
//!   gets an OpenAI error event and then `data: [DONE]`, so a client sees a
//!   failure, never a silently truncated answer. To keep that event well
//!   formed, bytes are forwarded only up to the last complete event (a
//!   blank line); the part of an event cut by the failure is dropped.
//! - any other body fails, which makes the server abort the connection: a
//!   client reading a `content-length` or chunked body sees it incomplete.

use super::replicas::Lease;
use super::request_log::RouteLog;
use crate::api::ApiError;
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

/// Whether the stream's last data line is the `[DONE]` sentinel, after
/// `events` (whole events) following a stream for which that was `done`.
/// Comment lines (keep-alives) change nothing.
fn done_after(done: bool, events: &[u8]) -> bool {
    events
        .rsplit(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .find(|l| !l.is_empty() && !l.starts_with(b":"))
        .map_or(done, |l| l == b"data: [DONE]" || l == b"data:[DONE]")
}

/// The SSE side of a relay: the start of an event not yet complete, and
/// whether the stream's last complete event was `[DONE]`.
#[derive(Default)]
struct Sse {
    partial: BytesMut,
    done: bool,
}

/// Above this many bytes an unterminated "event" is forwarded as it is: no
/// real event is that large, and holding more would let a replica that never
/// sends a blank line grow the router's memory.
const MAX_PARTIAL_EVENT: usize = 1 << 20;

impl Sse {
    /// The whole events that `data` completes (empty when it completes
    /// none); the rest is held.
    fn push(&mut self, data: Bytes) -> Bytes {
        // The usual case: nothing held and `data` is whole events.
        if self.partial.is_empty() && data.ends_with(b"\n\n") {
            self.done = done_after(self.done, &data);
            return data;
        }
        self.partial.extend_from_slice(&data);
        let cut = match last_event_end(&self.partial) {
            Some(end) => end,
            None if self.partial.len() > MAX_PARTIAL_EVENT => self.partial.len(),
            None => return Bytes::new(),
        };
        let out = self.partial.split_to(cut).freeze();
        self.done = done_after(self.done, &out);
        out
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
    /// for `idle`; `sse` marks a `text/event-stream` response. A cut is
    /// noted in `log`.
    pub(crate) fn new(
        body: Incoming,
        lease: Lease,
        idle: Duration,
        sse: bool,
        log: RouteLog,
    ) -> Self {
        Self {
            body,
            replica: lease.url.clone(),
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            sse: sse.then(Sse::default),
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
            // A failure after [DONE] cost the client nothing.
            (Some(sse), _) if sse.done => Poll::Ready(None),
            (Some(_), failure) => {
                let why = match failure {
                    Some(e) => e.to_string(),
                    None => format!(
                        "replica {}: the stream ended before data: [DONE]",
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
                let e = ApiError::bad_gateway(format!("The answer was cut off: {why}."));
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
                    "data: {}\n\ndata: [DONE]\n\n",
                    e.to_json()
                ))))))
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
        let mut s = Sse::default();
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
        let mut crlf = Sse::default();
        let done = b(b"data: [DONE]\r\n\r\n");
        assert_eq!(crlf.push(done.clone()), done);
        assert!(crlf.done);
        // [DONE] inside a data payload is not the sentinel.
        let mut k = Sse::default();
        k.push(b(b"data: [DONE]\n\ndata: {\"t\":\"data: [DONE]\"}\n\n"));
        assert!(!k.done);
    }

    #[test]
    fn a_never_ending_event_is_not_held_without_bound() {
        let mut s = Sse::default();
        let big = Bytes::from(vec![b'x'; MAX_PARTIAL_EVENT + 1]);
        assert_eq!(s.push(big).len(), MAX_PARTIAL_EVENT + 1);
        assert!(s.partial.is_empty());
    }
}
