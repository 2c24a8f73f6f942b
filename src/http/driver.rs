//! Between the engine's events and a response: one request's [`Driver`]
//! reads its events, applies the request timeout, stop strings and the
//! chat family's turn parser (in the family's order, see `generate.rs`),
//! records latency metrics, and hands out [`Piece`]s.

use super::output::{Shaped, TurnStage};
use super::request_log::RequestLog;
use super::stop::{OffsetQueue, StopMatcher};
use crate::api::{FinishReason, Usage};
use crate::engine::Event;
use crate::metrics as names;
use specgate_verify::TokenLogprob;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

/// One step of a response, after stop strings.
pub(super) enum Piece {
    /// Released, parsed pieces with the log-probabilities of the tokens
    /// they complete.
    Shaped(Vec<Shaped>),
    /// The prompt's log-probabilities (`echo` with `logprobs`), first.
    Prompt(Vec<TokenLogprob>),
    Done(FinishReason, Usage),
    Error(String),
}

/// Reads engine events for one request, applies stop strings, the
/// request timeout, and records latency metrics.
pub(super) struct Driver {
    pub(super) rx: Option<UnboundedReceiver<Event>>,
    pub(super) stop: StopMatcher,
    /// Log-probabilities waiting for their text to pass the stop stage,
    /// keyed by the engine-text offset their token ends at.
    pub(super) held: OffsetQueue<TokenLogprob>,
    /// Bytes of engine text fed to the stop stage, and released by it.
    pub(super) pushed: usize,
    pub(super) released: usize,
    /// Marker tokens in the engine text not released yet: the engine-text
    /// offset each starts at, and its id (stop strings first).
    pub(super) marks: std::collections::VecDeque<(usize, u32)>,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) arrived: Instant,
    pub(super) deadline: Instant,
    pub(super) last: Option<Instant>,
    /// A finish that follows text released at the end.
    pub(super) pending: Option<Piece>,
    /// Turns true when the server's drain timeout has passed.
    pub(super) cut: tokio::sync::watch::Receiver<bool>,
    /// The request's log record (TTFT, engine counters, how it ended).
    pub(super) log: RequestLog,
    /// The turn parser (pass-through for completions and plain chat).
    pub(super) stage: TurnStage,
    /// Parse first, then stop strings on content only (a family with a
    /// reasoning channel: its markup and thinking never stop the turn);
    /// else stop strings on the raw text, then parsing.
    pub(super) stop_on_content: bool,
}

impl Driver {
    /// The next piece; `None` after `Done` or `Error`. Cancel-safe: its
    /// only await point is the channel receive.
    pub(super) async fn next(&mut self) -> Option<Piece> {
        let p = self.next_piece().await;
        if let Some(Piece::Error(e)) = &p {
            self.log.failed(e, self.completion_tokens);
        }
        p
    }

    async fn next_piece(&mut self) -> Option<Piece> {
        if let Some(p) = self.pending.take() {
            return Some(p);
        }
        loop {
            let rx = self.rx.as_mut()?;
            let received = tokio::select! {
                r = tokio::time::timeout_at(self.deadline, rx.recv()) => r,
                _ = until_cut(&mut self.cut) => {
                    self.rx = None;
                    return Some(Piece::Error("The server is shutting down.".into()));
                }
            };
            let ev = match received {
                Err(_) => {
                    self.rx = None;
                    return Some(Piece::Error("The request timed out.".into()));
                }
                Ok(None) => {
                    self.rx = None;
                    return Some(Piece::Error("The engine stopped.".into()));
                }
                Ok(Some(ev)) => ev,
            };
            match ev {
                Event::Tokens {
                    ids,
                    text,
                    logprobs,
                    markers,
                } => {
                    self.record_tokens(ids.len());
                    self.completion_tokens += ids.len();
                    if self.stop_on_content {
                        let shaped = self.stage.push(&text, logprobs, &markers, ids.len());
                        let (out, stopped) = self.stop_content(shaped);
                        if stopped {
                            // Dropping the receiver cancels the sequence.
                            self.rx = None;
                            return Some(self.finish_piece(out, FinishReason::Stop));
                        }
                        if !out.is_empty() {
                            return Some(Piece::Shaped(out));
                        }
                        continue;
                    }
                    let base = self.pushed;
                    self.marks
                        .extend(markers.into_iter().map(|(at, id)| (base + at, id)));
                    self.pushed += text.len();
                    self.held.push(self.pushed, logprobs);
                    let m = self.stop.push(&text);
                    let from = self.released;
                    self.released += m.emit.len();
                    if m.stopped {
                        // Dropping the receiver cancels the sequence; the
                        // tokens the stop string cut are dropped with it.
                        self.rx = None;
                        let lps = self.held.take_until(self.released);
                        self.held = OffsetQueue::default();
                        let marks = self.released_marks(from);
                        self.marks.clear();
                        let mut shaped = self.stage.push(&m.emit, lps, &marks, 0);
                        shaped.extend(self.stage.finish());
                        return Some(self.finish_piece(shaped, FinishReason::Stop));
                    }
                    if !m.emit.is_empty() {
                        let lps = self.held.take_until(self.released);
                        let marks = self.released_marks(from);
                        let shaped = self.stage.push(&m.emit, lps, &marks, 0);
                        if !shaped.is_empty() {
                            return Some(Piece::Shaped(shaped));
                        }
                    }
                }
                Event::Finished {
                    reason,
                    usage,
                    drafted,
                    accepted,
                    method,
                    queue_time,
                } => {
                    self.rx = None;
                    self.log
                        .engine_finished(method, drafted, accepted, queue_time);
                    self.completion_tokens = usage.completion_tokens;
                    let mut reason: FinishReason = reason.into();
                    let shaped = if self.stop_on_content {
                        let tail = self.stage.finish();
                        let (mut out, stopped) = self.stop_content(tail);
                        if stopped {
                            reason = FinishReason::Stop;
                        } else {
                            let rest = self.stop.finish();
                            if !rest.is_empty() {
                                out.push(Shaped::Content(rest, Vec::new()));
                            }
                        }
                        out
                    } else {
                        let rest = self.stop.finish();
                        let lps = self.held.take_all();
                        let from = self.released;
                        self.released += rest.len();
                        let marks = self.released_marks(from);
                        let mut out = self.stage.push(&rest, lps, &marks, 0);
                        out.extend(self.stage.finish());
                        out
                    };
                    return Some(self.finish_piece(shaped, reason));
                }
                Event::PromptLogprobs(lps) => return Some(Piece::Prompt(lps)),
                Event::Error(e) => {
                    self.rx = None;
                    return Some(Piece::Error(e));
                }
            }
        }
    }

    /// The pending markers that start in the engine text released last,
    /// `from..self.released`, as offsets into that release (a marker's
    /// text may end in a later one).
    fn released_marks(&mut self, from: usize) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        while let Some(&(at, id)) = self.marks.front() {
            if at >= self.released {
                break;
            }
            self.marks.pop_front();
            if let Some(rel) = at.checked_sub(from) {
                out.push((rel, id));
            }
        }
        out
    }

    /// Stop strings over the content of `shaped` (reasoning and calls
    /// pass): what is released, and whether a stop string ended the turn
    /// (everything after it is dropped). A content piece's
    /// log-probabilities go out with what it released.
    fn stop_content(&mut self, shaped: Vec<Shaped>) -> (Vec<Shaped>, bool) {
        let mut out = Vec::with_capacity(shaped.len());
        for s in shaped {
            match s {
                Shaped::Content(c, lps) => {
                    let m = self.stop.push(&c);
                    if !m.emit.is_empty() || !lps.is_empty() {
                        out.push(Shaped::Content(m.emit, lps));
                    }
                    if m.stopped {
                        return (out, true);
                    }
                }
                other => out.push(other),
            }
        }
        (out, false)
    }

    /// Emits the last pieces first, as their own piece, by queueing the
    /// finish (`tool_calls` when the turn made calls and ended on its own).
    fn finish_piece(&mut self, shaped: Vec<Shaped>, reason: FinishReason) -> Piece {
        let reason = super::output::turn_reason(reason, self.stage.calls());
        let elapsed = self.arrived.elapsed().as_secs_f64();
        metrics::histogram!(names::E2E).record(elapsed);
        let usage = Usage::new(self.prompt_tokens, self.completion_tokens);
        self.log.finished(reason.as_str(), self.completion_tokens);
        if shaped.is_empty() {
            Piece::Done(reason, usage)
        } else {
            self.pending = Some(Piece::Done(reason, usage));
            Piece::Shaped(shaped)
        }
    }

    fn record_tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        self.log.tokens_arrived();
        let now = Instant::now();
        match self.last {
            None => metrics::histogram!(names::TTFT).record((now - self.arrived).as_secs_f64()),
            Some(prev) => {
                let gap = (now - prev).as_secs_f64() / n as f64;
                for _ in 0..n {
                    metrics::histogram!(names::ITL).record(gap);
                }
            }
        }
        self.last = Some(now);
    }
}

/// Resolves once the drain timeout has passed (never if it cannot).
async fn until_cut(cut: &mut tokio::sync::watch::Receiver<bool>) {
    if cut.wait_for(|&c| c).await.is_err() {
        std::future::pending::<()>().await;
    }
}
