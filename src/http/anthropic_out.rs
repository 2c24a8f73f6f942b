//! Anthropic's Messages output: one [`MessagesOut`] turns a turn's parsed
//! pieces into content blocks (`thinking`, `text`, `tool_use` with its
//! parsed `input`), whole (`body`) or as Anthropic's stream events
//! (`message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta`, `message_stop`, `ping`, `error`), so both shapes come
//! from the same blocks.
//!
//! Text that is only whitespace is held until more text follows: after a
//! tool call it would be an empty-looking block (Hermes writes a newline
//! between calls), and it is dropped when the turn made calls.

use bytes::Bytes;
use serde_json::{json, Value};

use super::output::{Labels, Shaped};
use crate::api::{ApiError, FinishReason, Usage};

/// The kind of the block being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
}

/// One answer's blocks as they are built.
#[derive(Default)]
pub(super) struct MessagesOut {
    blocks: Vec<Value>,
    open: Option<Open>,
    /// Whitespace-only text not yet placed.
    held: String,
    calls: usize,
}

/// One SSE event of Anthropic's stream.
pub(super) fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The `ping` event (keep-alive).
pub(super) fn ping() -> Bytes {
    event("ping", &json!({"type": "ping"}))
}

/// An error event in Anthropic's shape (the stream then ends).
pub(super) fn error_event(e: &ApiError) -> Bytes {
    Bytes::from(format!("event: error\ndata: {}\n\n", e.to_anthropic_json()))
}

/// Anthropic's `stop_reason` for how the turn ended; `stop_sequence` is the
/// stop string that ended it, if one did.
pub(super) fn stop_reason(reason: FinishReason, stop_sequence: Option<&str>) -> &'static str {
    match reason {
        FinishReason::Stop if stop_sequence.is_some() => "stop_sequence",
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
    }
}

impl MessagesOut {
    /// The `message_start` event.
    pub(super) fn start(&self, l: &Labels, prompt_tokens: usize) -> Bytes {
        event(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": l.id, "type": "message", "role": "assistant", "model": l.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }}),
        )
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        if self.open.take().is_some() {
            let index = self.blocks.len() - 1;
            out.push(event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    /// Appends `text` to an open block of kind `kind` (opening one).
    fn write(&mut self, kind: Open, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let block = match kind {
                Open::Text => json!({"type": "text", "text": ""}),
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            out.push(event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": self.blocks.len(), "content_block": block}),
            ));
            self.blocks.push(block);
            self.open = Some(kind);
        }
        let index = self.blocks.len() - 1;
        let (key, delta) = match kind {
            Open::Text => ("text", json!({"type": "text_delta", "text": text})),
            Open::Thinking => (
                "thinking",
                json!({"type": "thinking_delta", "thinking": text}),
            ),
        };
        let b = self.blocks.last_mut().expect("opened");
        let mut s = b[key].as_str().unwrap_or_default().to_owned();
        s.push_str(text);
        b[key] = Value::String(s);
        out.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    /// The events of released pieces (whole answers drop them and read
    /// [`MessagesOut::body`] at the end).
    pub(super) fn pieces(&mut self, l: &Labels, shaped: Vec<Shaped>) -> Vec<Bytes> {
        let mut out = Vec::new();
        for s in shaped {
            match s {
                Shaped::Content(t, _) => {
                    if t.trim().is_empty() && self.open != Some(Open::Text) {
                        self.held.push_str(&t);
                        continue;
                    }
                    let text = std::mem::take(&mut self.held) + &t;
                    self.write(Open::Text, &text, &mut out);
                }
                Shaped::Reasoning(t, _) => self.write(Open::Thinking, &t, &mut out),
                Shaped::Call(c, _) => {
                    self.close(&mut out);
                    self.held.clear();
                    let id = l.call_id(&c.name, self.calls);
                    self.calls += 1;
                    let input: Value =
                        serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
                    let index = self.blocks.len();
                    out.push(event(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": index,
                            "content_block": {"type": "tool_use", "id": id, "name": c.name, "input": {}}}),
                    ));
                    out.push(event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
                    ));
                    out.push(event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": index}),
                    ));
                    self.blocks.push(
                        json!({"type": "tool_use", "id": id, "name": c.name, "input": input}),
                    );
                }
            }
        }
        out
    }

    /// Places held whitespace (kept only when the turn made no calls) and
    /// closes the open block.
    fn settle(&mut self, out: &mut Vec<Bytes>) {
        let held = std::mem::take(&mut self.held);
        if self.calls == 0 && !held.is_empty() {
            self.write(Open::Text, &held, out);
        }
        self.close(out);
    }

    /// The events that end the stream: the last block's stop,
    /// `message_delta` (stop reason, output tokens), `message_stop`.
    pub(super) fn done(
        &mut self,
        reason: FinishReason,
        usage: Usage,
        stop_sequence: Option<&str>,
    ) -> Vec<Bytes> {
        let mut out = Vec::new();
        self.settle(&mut out);
        out.push(event(
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(reason, stop_sequence), "stop_sequence": stop_sequence},
                "usage": {"output_tokens": usage.completion_tokens}}),
        ));
        out.push(event("message_stop", &json!({"type": "message_stop"})));
        out
    }

    /// The whole message.
    pub(super) fn body(
        mut self,
        l: &Labels,
        reason: FinishReason,
        usage: Usage,
        stop_sequence: Option<&str>,
    ) -> Value {
        self.settle(&mut Vec::new());
        json!({
            "id": l.id, "type": "message", "role": "assistant", "model": l.model,
            "content": self.blocks,
            "stop_reason": stop_reason(reason, stop_sequence),
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
        })
    }
}
