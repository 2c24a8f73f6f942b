//! OpenAI's Responses output: one [`ResponsesOut`] turns a turn's parsed
//! pieces into output items (`reasoning` with its `reasoning_text`,
//! `message` with `output_text`, `function_call`), whole (`body`) or as
//! the API's typed stream events, each with its `sequence_number`
//! (`response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta` / `.done`, `response.reasoning_text.delta`
//! / `.done`, `response.function_call_arguments.delta` / `.done`,
//! `response.content_part.done`, `response.output_item.done`,
//! `response.completed` or `response.incomplete`). Both shapes come from
//! the same items, and the finished object is what the store keeps.
//!
//! Whitespace-only text is held until more text follows and dropped when
//! the turn made calls (as in `anthropic_out`).

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::output::{Labels, Shaped};
use super::request_id::RequestId;
use crate::api::responses::Echo;
use crate::api::{ApiError, FinishReason, Usage};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Message,
    Reasoning,
}

/// One response's items as they are built.
pub(super) struct ResponsesOut {
    /// The request fields the response object repeats.
    echo: Echo,
    items: Vec<Value>,
    open: Option<Open>,
    held: String,
    calls: usize,
    seq: u64,
}

/// The string an echoed field stands as in a response object until
/// [`ResponsesOut::text`] puts the field's JSON there: the field's name
/// after 128 random bits drawn once per process (no client text can hold
/// it: it is never shown).
fn echo_mark(field: &str) -> String {
    static SALT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let salt = SALT.get_or_init(|| {
        let mut b = [0u8; 16];
        // Without the OS's generator, the clock and the address of a
        // stack value: still nothing a client sees.
        if getrandom::fill(&mut b).is_err() {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            b = (t ^ (&b as *const _ as u128)).to_le_bytes();
        }
        b.iter().map(|x| format!("{x:02x}")).collect()
    });
    format!("specgate-echo-{salt}-{field}")
}

fn item_id(prefix: &str) -> String {
    format!("{prefix}_{}", RequestId::generate().as_str())
}

impl ResponsesOut {
    pub(super) fn new(echo: Echo) -> Self {
        Self {
            echo,
            items: Vec::new(),
            open: None,
            held: String::new(),
            calls: 0,
            seq: 0,
        }
    }

    fn ev(&mut self, mut data: Value) -> Bytes {
        let name = data["type"].as_str().unwrap_or("error").to_owned();
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Bytes::from(format!("event: {name}\ndata: {}\n\n", self.text(&data)))
    }

    /// `v` serialized, each echoed field's mark replaced by the field's
    /// JSON text as the request gave it. The fields are never decoded
    /// into a tree: a `tools` list can be most of a 1 MB body, and its
    /// tree would cost 30x that for every event that shows the response.
    pub(super) fn text(&self, v: &Value) -> String {
        let mut text = v.to_string();
        // Only the events that show the response object hold marks: a
        // token's delta is passed through after one look.
        if !text.contains(&echo_mark("")) {
            return text;
        }
        for (k, raw) in self.echo.fields() {
            let mark = format!("\"{}\"", echo_mark(k));
            if let Some(at) = text.find(&mark) {
                text.replace_range(at..at + mark.len(), raw.as_str());
            }
        }
        text
    }

    /// The response object with `status` and the items so far.
    fn object(&self, l: &Labels, status: &str) -> Value {
        let mut m = Map::new();
        m.insert("id".into(), json!(l.id));
        m.insert("object".into(), json!("response"));
        m.insert("created_at".into(), json!(l.created));
        m.insert("status".into(), json!(status));
        m.insert("error".into(), Value::Null);
        m.insert("incomplete_details".into(), Value::Null);
        m.insert("model".into(), json!(l.model));
        m.insert("output".into(), Value::Array(self.items.clone()));
        m.insert("usage".into(), Value::Null);
        for (k, _) in self.echo.fields() {
            m.insert(k.into(), Value::String(echo_mark(k)));
        }
        Value::Object(m)
    }

    /// `response.created` and `response.in_progress`.
    pub(super) fn start(&mut self, l: &Labels) -> Vec<Bytes> {
        let r = self.object(l, "in_progress");
        vec![
            self.ev(json!({"type": "response.created", "response": r})),
            self.ev(json!({"type": "response.in_progress", "response": r})),
        ]
    }

    /// Ends the open item: its `.done` events.
    fn close(&mut self, out: &mut Vec<Bytes>) {
        let Some(kind) = self.open.take() else {
            return;
        };
        let index = self.items.len() - 1;
        self.items[index]["status"] = json!("completed");
        let item = self.items[index].clone();
        let id = item["id"].clone();
        let part = item["content"][0].clone();
        let done = match kind {
            Open::Message => json!({"type": "response.output_text.done", "item_id": id,
                "output_index": index, "content_index": 0, "text": part["text"], "logprobs": []}),
            Open::Reasoning => json!({"type": "response.reasoning_text.done", "item_id": id,
                "output_index": index, "content_index": 0, "text": part["text"]}),
        };
        out.push(self.ev(done));
        out.push(
            self.ev(json!({"type": "response.content_part.done", "item_id": id,
            "output_index": index, "content_index": 0, "part": part})),
        );
        out.push(
            self.ev(
                json!({"type": "response.output_item.done", "output_index": index, "item": item}),
            ),
        );
    }

    fn write(&mut self, kind: Open, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let (item, part) = match kind {
                Open::Message => (
                    json!({"type": "message", "id": item_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}),
                    json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
                ),
                Open::Reasoning => (
                    json!({"type": "reasoning", "id": item_id("rs"), "status": "in_progress",
                        "summary": [], "content": []}),
                    json!({"type": "reasoning_text", "text": ""}),
                ),
            };
            let index = self.items.len();
            let id = item["id"].clone();
            out.push(self.ev(
                json!({"type": "response.output_item.added", "output_index": index, "item": item}),
            ));
            out.push(
                self.ev(json!({"type": "response.content_part.added", "item_id": id,
                "output_index": index, "content_index": 0, "part": part})),
            );
            let mut item = item;
            item["content"] = json!([part]);
            self.items.push(item);
            self.open = Some(kind);
        }
        let index = self.items.len() - 1;
        let item = &mut self.items[index];
        let id = item["id"].clone();
        let mut s = item["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        s.push_str(text);
        item["content"][0]["text"] = Value::String(s);
        let name = match kind {
            Open::Message => "response.output_text.delta",
            Open::Reasoning => "response.reasoning_text.delta",
        };
        let mut d = json!({"type": name, "item_id": id, "output_index": index,
            "content_index": 0, "delta": text});
        if kind == Open::Message {
            d["logprobs"] = json!([]);
        }
        out.push(self.ev(d));
    }

    /// The events of released pieces.
    pub(super) fn pieces(&mut self, l: &Labels, shaped: Vec<Shaped>) -> Vec<Bytes> {
        let mut out = Vec::new();
        for s in shaped {
            match s {
                Shaped::Content(t, _) => {
                    if t.trim().is_empty() && self.open != Some(Open::Message) {
                        self.held.push_str(&t);
                        continue;
                    }
                    let text = std::mem::take(&mut self.held) + &t;
                    self.write(Open::Message, &text, &mut out);
                }
                Shaped::Reasoning(t, _) => self.write(Open::Reasoning, &t, &mut out),
                Shaped::Call(c, _) => {
                    self.close(&mut out);
                    self.held.clear();
                    let call_id = l.call_id(&c.name, self.calls);
                    self.calls += 1;
                    let index = self.items.len();
                    let id = item_id("fc");
                    let added = json!({"type": "function_call", "id": id, "call_id": call_id,
                        "name": c.name, "arguments": "", "status": "in_progress"});
                    out.push(self.ev(json!({"type": "response.output_item.added", "output_index": index, "item": added})));
                    out.push(
                        self.ev(json!({"type": "response.function_call_arguments.delta",
                        "item_id": id, "output_index": index, "delta": c.arguments})),
                    );
                    out.push(self.ev(json!({"type": "response.function_call_arguments.done",
                        "item_id": id, "output_index": index, "name": c.name, "arguments": c.arguments})));
                    let item = json!({"type": "function_call", "id": id, "call_id": call_id,
                        "name": c.name, "arguments": c.arguments, "status": "completed"});
                    out.push(self.ev(json!({"type": "response.output_item.done", "output_index": index, "item": item})));
                    self.items.push(item);
                }
            }
        }
        out
    }

    fn settle(&mut self, out: &mut Vec<Bytes>) {
        let held = std::mem::take(&mut self.held);
        if self.calls == 0 && !held.is_empty() {
            self.write(Open::Message, &held, out);
        }
        self.close(out);
    }

    /// The finished response object: `completed`, or `incomplete` with
    /// `incomplete_details` when the token limit cut it.
    fn finished(&self, l: &Labels, reason: FinishReason, usage: Usage, reasoning: usize) -> Value {
        let cut = reason == FinishReason::Length;
        let mut r = self.object(l, if cut { "incomplete" } else { "completed" });
        if cut {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r["usage"] = json!({
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.total_tokens,
        });
        r
    }

    /// The events that end the stream, and the finished object.
    pub(super) fn done(
        &mut self,
        l: &Labels,
        reason: FinishReason,
        usage: Usage,
        reasoning: usize,
    ) -> (Vec<Bytes>, Value) {
        let mut out = Vec::new();
        self.settle(&mut out);
        let r = self.finished(l, reason, usage, reasoning);
        let name = if reason == FinishReason::Length {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.ev(json!({"type": name, "response": r})));
        (out, r)
    }

    /// The error event that ends a failed stream.
    pub(super) fn error(&mut self, e: &ApiError) -> Bytes {
        self.ev(json!({"type": "error", "code": e.code, "message": e.message, "param": e.param}))
    }
}
