//! Kimi K3's chat markup: tags built from three control tokens,
//! `<|open|>TAG ATTRS<|sep|>` and `<|close|>TAG<|sep|>` (the template in
//! `tests/fixtures/kimi_k3/tiny-hf`, llama.cpp's `Kimi-K3.jinja`). An
//! assistant turn is
//! `[<|open|>think<|sep|>R<|close|>think<|sep|>]<|open|>response<|sep|>T<|close|>response<|sep|>`
//! then optionally `<|open|>tools<|sep|>` + calls + `<|close|>tools<|sep|>`,
//! each call `<|open|>call tool="NAME" index="N"<|sep|>` + arguments +
//! `<|close|>call<|sep|>`, an argument either
//! `<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>`
//! (T one of string, number, boolean, null, object, array; a string raw,
//! the others JSON) or one `<|open|>json type="object"<|sep|>{..}<|close|>json<|sep|>`
//! block. Attribute values escape `&` as `&amp;` and `"` as `&quot;`.
//!
//! The generation prompt opens the think channel (thinking on, the
//! default) or the response channel (`thinking: false`), so the parser
//! starts inside one of them. [`K3Stream`] turns generated text (with the
//! three markers visible) and where their control tokens are into
//! reasoning, content and calls as it comes: a marker counts only as its
//! control token, so text that spells one is text where it stands; text
//! streams as it comes, and a call comes out whole once its
//! `<|close|>call<|sep|>` arrives. No marker token ever reaches the client. An unclosed think channel at the end is all
//! reasoning; an unclosed call is dropped (its markup is not content).
//! Calls of undeclared tools, and every call when the turn does not parse
//! calls (`tool_choice: none`), are dropped with their markup.

use serde_json::Value;

use super::{ParsedCall, TurnPiece, TurnStream};

/// Opens a tag.
pub const OPEN: &str = "<|open|>";
/// Closes a tag.
pub const CLOSE: &str = "<|close|>";
/// Ends a tag's head.
pub const SEP: &str = "<|sep|>";
/// A tag head longer than this without its `<|sep|>` is not a tag: its
/// marker is dropped and the text goes on (bounds what is held).
const MAX_TAG_HEAD: usize = 4096;
/// The most calls a turn forced to make parallel calls may make (each
/// position's index is written out in the grammar).
pub const MAX_FORCED_CALLS: usize = 16;

/// Where in a turn the parser is.
#[derive(Debug)]
enum State {
    Think,
    Response,
    /// Between channels, inside the assistant message.
    Top,
    Tools,
    Call(CallAcc),
    Arg(CallAcc, String, String, String),
    Json(CallAcc, String),
    /// After `<|close|>message<|sep|>`: the rest is dropped.
    Done,
}

/// A call being read.
#[derive(Debug, Default)]
struct CallAcc {
    name: String,
    args: Vec<(String, Value)>,
    json: Option<String>,
}

/// One complete tag.
struct Tag {
    close: bool,
    name: String,
    attrs: Vec<(String, String)>,
}

/// One of K3's three markers, as a generated control token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Open,
    Close,
    Sep,
}

impl Mark {
    fn text(self) -> &'static str {
        match self {
            Mark::Open => OPEN,
            Mark::Close => CLOSE,
            Mark::Sep => SEP,
        }
    }
}

/// Incremental parsing of one K3 assistant turn (see the module doc).
/// Each output comes with the input offset its text ends at.
///
/// Markup is told from text by token id: a marker counts only where the
/// engine says its control token is ([`K3Stream::push`]'s `markers`);
/// the same characters spelled by ordinary tokens (a JSON answer whose
/// value is `"<|open|>think<|sep|>"`, thinking about the markup, a raw
/// string argument) are text of whatever holds them.
#[derive(Debug)]
pub struct K3Stream {
    ids: K3Markers,
    names: Vec<String>,
    parse_calls: bool,
    state: State,
    buf: String,
    /// Input offset of `buf`'s first byte.
    start: usize,
    /// The markers at or after `start`, by input offset, ascending.
    marks: std::collections::VecDeque<(usize, Mark)>,
    calls: usize,
}

impl K3Stream {
    /// A parser of markup written with the `ids` control tokens, starting
    /// inside the think channel (`thinking`) or the response channel;
    /// calls of the `names` tools are parsed when `parse_calls`.
    pub fn new(ids: K3Markers, thinking: bool, names: Vec<String>, parse_calls: bool) -> Self {
        Self {
            ids,
            names,
            parse_calls,
            state: if thinking {
                State::Think
            } else {
                State::Response
            },
            buf: String::new(),
            start: 0,
            marks: Default::default(),
            calls: 0,
        }
    }

    fn consume(&mut self, n: usize) -> String {
        self.start += n;
        while self.marks.front().is_some_and(|&(at, _)| at < self.start) {
            self.marks.pop_front();
        }
        self.buf.drain(..n).collect()
    }

    /// Text up to the next marker in `buf`, and whether a marker follows
    /// (else all of `buf` is text: no marker arrives in pieces unknown).
    fn text_run(&self) -> (usize, bool) {
        match self.marks.front() {
            Some(&(at, _)) => (at - self.start, true),
            None => (self.buf.len(), false),
        }
    }

    /// The complete tag at the start of `buf` (which starts with a
    /// marker): `Some(Ok(tag, len))`, `Some(Err(marker_len))` when it is
    /// not a tag (a lone `<|sep|>`, another marker before the head's
    /// `<|sep|>`, a head past the bound), `None` when more text is needed.
    fn tag(&self) -> Option<Result<(Tag, usize), usize>> {
        let &(_, mark) = self.marks.front()?;
        let m = mark.text().len();
        if self.buf.len() < m {
            return None;
        }
        let close = match mark {
            Mark::Open => false,
            Mark::Close => true,
            Mark::Sep => return Some(Err(m)),
        };
        let end = match self.marks.get(1) {
            Some(&(at, Mark::Sep)) => at - self.start,
            Some(_) => return Some(Err(m)),
            None => return (self.buf.len() - m > MAX_TAG_HEAD).then_some(Err(m)),
        };
        if end - m > MAX_TAG_HEAD {
            return Some(Err(m));
        }
        if self.buf.len() < end + SEP.len() {
            return None;
        }
        let (name, attrs) = parse_head(&self.buf[m..end]);
        Some(Ok((Tag { close, name, attrs }, end + SEP.len())))
    }

    /// Feeds generated text and where its markers are: `(offset in
    /// text, token id)` of each marker token of [`K3Markers`] that starts
    /// in it, ascending (a marker's text may end in a later push; other
    /// ids are ignored). Returns what is settled, in order.
    pub fn push(&mut self, text: &str, markers: &[(usize, u32)]) -> Vec<(TurnPiece, usize)> {
        let base = self.start + self.buf.len();
        for &(at, id) in markers {
            let mark = match id {
                id if id == self.ids.open => Mark::Open,
                id if id == self.ids.close => Mark::Close,
                id if id == self.ids.sep => Mark::Sep,
                _ => continue,
            };
            // The engine's offsets: the marker's text starts there.
            if text.as_bytes().get(at) == Some(&b'<') {
                self.marks.push_back((base + at, mark));
            }
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let (run, marker) = self.text_run();
            if run > 0 {
                let t = self.consume(run);
                self.text(t, &mut out);
            }
            if !marker {
                break;
            }
            match self.tag() {
                None => break,
                Some(Err(n)) => {
                    self.consume(n);
                }
                Some(Ok((tag, n))) => {
                    self.consume(n);
                    self.on_tag(tag, &mut out);
                }
            }
        }
        out
    }

    /// The text ended: an open think or response channel releases what
    /// it held (less the markers of a tag cut short); anything else left
    /// is markup and is dropped.
    pub fn finish(&mut self) -> Vec<(TurnPiece, usize)> {
        let mut out = Vec::new();
        let mut rest = String::new();
        let mut from = 0;
        for &(at, mark) in &self.marks {
            let at = at - self.start;
            rest.push_str(&self.buf[from..at]);
            from = (at + mark.text().len()).min(self.buf.len());
        }
        rest.push_str(&self.buf[from..]);
        let n = self.buf.len();
        self.consume(n);
        self.text(rest, &mut out);
        out
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn text(&mut self, t: String, out: &mut Vec<(TurnPiece, usize)>) {
        if t.is_empty() {
            return;
        }
        match &mut self.state {
            State::Think => out.push((TurnPiece::Reasoning(t), self.start)),
            State::Response => out.push((TurnPiece::Content(t), self.start)),
            // Text between channels is not markup: kept as content.
            State::Top if !t.trim().is_empty() => out.push((TurnPiece::Content(t), self.start)),
            State::Arg(_, _, _, v) => v.push_str(&t),
            State::Json(_, v) => v.push_str(&t),
            State::Top | State::Tools | State::Call(_) | State::Done => {}
        }
    }

    fn on_tag(&mut self, tag: Tag, out: &mut Vec<(TurnPiece, usize)>) {
        let state = std::mem::replace(&mut self.state, State::Done);
        self.state = match (state, tag.close, tag.name.as_str()) {
            (State::Think, true, "think") | (State::Response, true, "response") => State::Top,
            // A channel opened without closing the last one: as if closed.
            (State::Think | State::Response | State::Top, false, _) => match tag.name.as_str() {
                "think" => State::Think,
                "response" => State::Response,
                "tools" => State::Tools,
                _ => State::Top,
            },
            (State::Top, true, "message") => State::Done,
            (State::Tools, false, "call") => State::Call(CallAcc {
                name: attr(&tag.attrs, "tool").unwrap_or_default(),
                ..CallAcc::default()
            }),
            (State::Tools, true, "tools") => State::Top,
            (State::Call(acc), false, "argument") => State::Arg(
                acc,
                attr(&tag.attrs, "key").unwrap_or_default(),
                attr(&tag.attrs, "type").unwrap_or_else(|| "string".into()),
                String::new(),
            ),
            (State::Call(acc), false, "json") => State::Json(acc, String::new()),
            (State::Call(acc), true, "call") => {
                self.emit_call(acc, out);
                State::Tools
            }
            (State::Arg(mut acc, key, ty, raw), true, "argument") => {
                let value = typed_value(&ty, raw);
                acc.args.retain(|(k, _)| *k != key);
                acc.args.push((key, value));
                State::Call(acc)
            }
            (State::Json(mut acc, raw), true, "json") => {
                acc.json = Some(raw);
                State::Call(acc)
            }
            // Any other tag leaves the state as it was.
            (s, _, _) => s,
        };
    }

    fn emit_call(&mut self, acc: CallAcc, out: &mut Vec<(TurnPiece, usize)>) {
        if !self.parse_calls || !self.names.contains(&acc.name) {
            return;
        }
        let arguments = match acc.json {
            Some(raw) => match serde_json::from_str::<Value>(raw.trim()) {
                Ok(v) => v.to_string(),
                Err(_) => raw,
            },
            None => object_text(&acc.args),
        };
        self.calls += 1;
        out.push((
            TurnPiece::Call(ParsedCall {
                name: acc.name,
                arguments,
            }),
            self.start,
        ));
    }
}

impl TurnStream for K3Stream {
    fn push(&mut self, text: &str, markers: &[(usize, u32)]) -> Vec<(TurnPiece, usize)> {
        K3Stream::push(self, text, markers)
    }
    fn finish(&mut self) -> Vec<(TurnPiece, usize)> {
        K3Stream::finish(self)
    }
    fn calls(&self) -> usize {
        K3Stream::calls(self)
    }
}

/// `{"k":v,..}` keeping the model's argument order (compact, as the
/// Hermes parser writes arguments).
fn object_text(args: &[(String, Value)]) -> String {
    let fields: Vec<String> = args
        .iter()
        .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), v))
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// An argument's value: a string as written, another type parsed as JSON,
/// falling back to the raw text as a string.
fn typed_value(ty: &str, raw: String) -> Value {
    if ty == "string" {
        return Value::String(raw);
    }
    serde_json::from_str(raw.trim()).unwrap_or(Value::String(raw))
}

/// A tag head `NAME key="v" ..` split into its name and unescaped
/// attributes (a malformed rest ends the attribute list).
fn parse_head(head: &str) -> (String, Vec<(String, String)>) {
    let head = head.trim_start();
    let name_end = head.find(char::is_whitespace).unwrap_or(head.len());
    let mut rest = &head[name_end..];
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start();
        let Some(eq) = rest.find("=\"") else { break };
        let key = rest[..eq].trim().to_owned();
        let after = &rest[eq + 2..];
        let Some(q) = after.find('"') else { break };
        attrs.push((key, unescape(&after[..q])));
        rest = &after[q + 1..];
    }
    (head[..name_end].to_owned(), attrs)
}

fn attr(attrs: &[(String, String)], key: &str) -> Option<String> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// Undoes the template's `escape_attr` (`&` -> `&amp;`, then `"` -> `&quot;`).
pub fn unescape(v: &str) -> String {
    v.replace("&quot;", "\"").replace("&amp;", "&")
}

/// Escapes an attribute value as the template does.
pub fn escape(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// The ids of K3's three markers in one tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct K3Markers {
    pub open: u32,
    pub close: u32,
    pub sep: u32,
}

impl K3Markers {
    /// The Lark grammar (llguidance) for a JSON answer (`schema`, layout
    /// options added) in K3's markup: after the think channel closes
    /// (`thinking`) the response channel opens, or the prompt opened it;
    /// the JSON is the response text, then the channel and the message
    /// close.
    pub fn json_answer_lark(&self, schema: &Value, thinking: bool) -> String {
        let (o, c, s) = (
            format!("<[{}]>", self.open),
            format!("<[{}]>", self.close),
            format!("<[{}]>", self.sep),
        );
        let lit = |t: &str| Value::String(t.to_owned()).to_string();
        let head = if thinking {
            format!(
                "THINK {c} {} {s} {o} {} {s} ",
                lit("think"),
                lit("response")
            )
        } else {
            String::new()
        };
        let mut rules = vec![format!(
            "start: {head}answer {c} {} {s} {c} {} {s}",
            lit("response"),
            lit("message")
        )];
        if thinking {
            rules.push("THINK: /(?s:.*)/".to_owned());
        }
        rules.push(format!("answer: %json {schema}"));
        rules.join("\n") + "\n"
    }

    /// The Lark grammar (llguidance) that forces one call (`parallel`:
    /// one or more, at most [`MAX_FORCED_CALLS`]; call n of the turn, from
    /// 1, says `index="n"`) of `tools` (name, arguments schema with the layout
    /// options already added) in K3's own markup: after the think channel
    /// closes (`thinking`: the prompt left it open, so free reasoning text
    /// comes first) an empty response channel, then the tools section,
    /// each call's arguments as K3's typed `argument` tags when the schema
    /// is a plain object of typed properties (strings raw, other values
    /// JSON valid against their schema), else as one `json` block valid
    /// against the schema, then the message's close. Markers are written as token ids
    /// (`<[id]>`), so no text can spell them.
    pub fn forced_calls_lark(
        &self,
        tools: &[(String, Value)],
        parallel: bool,
        thinking: bool,
    ) -> String {
        let (o, c, s) = (
            format!("<[{}]>", self.open),
            format!("<[{}]>", self.close),
            format!("<[{}]>", self.sep),
        );
        let lit = |t: &str| Value::String(t.to_owned()).to_string();
        let resp = lit("response");
        let mut rules = Vec::new();
        // The prompt left the think channel open (then it closes and an
        // empty response channel follows) or the response channel.
        let head = if thinking {
            format!("THINK {c} {} {s} {o} {resp} {s} ", lit("think"))
        } else {
            String::new()
        };
        rules.push(format!(
            "start: {head}{c} {resp} {s} {o} {tools} {s} calls {c} {tools} {s} {c} {msg} {s}",
            tools = lit("tools"),
            msg = lit("message"),
        ));
        if thinking {
            rules.push("THINK: /(?s:.*)/".to_owned());
        }
        // Call n of the turn (from 1) says `index="n"`, as the template
        // numbers an assistant message's calls: the markup and the id the
        // server gives the call (its position) cannot disagree.
        let most = if parallel { MAX_FORCED_CALLS } else { 1 };
        for n in 1..=most {
            let next = if n < most {
                format!(" (calls_{})?", n + 1)
            } else {
                String::new()
            };
            rules.push(format!("calls_{n}: call_at_{n}{next}"));
            let alternatives: Vec<String> = tools
                .iter()
                .enumerate()
                .map(|(i, (name, _))| {
                    let head = format!("call tool=\"{}\" index=\"{n}\"", escape(name));
                    format!("{} {s} args_{i}", lit(&head))
                })
                .collect();
            rules.push(format!(
                "call_at_{n}: {o} ({}) {c} {} {s}",
                alternatives.join(" | "),
                lit("call"),
            ));
        }
        rules.push("calls: calls_1".to_owned());
        for (i, (_, schema)) in tools.iter().enumerate() {
            match self.argument_rules(i, schema) {
                Some(args) => rules.extend(args),
                None => rules.push(format!(
                    "args_{i}: {o} {json} {s} %json {schema} {c} {jname} {s}",
                    json = lit("json type=\"object\""),
                    jname = lit("json"),
                )),
            }
        }
        rules.join("\n") + "\n"
    }
}

/// The template variables OpenAI's `reasoning_effort` stands for: `none`
/// turns thinking off; the others pick the nearest of K3's
/// `thinking_effort` levels (low, high, max).
pub fn effort_vars(effort: &str) -> Vec<(&'static str, Value)> {
    let level = match effort {
        "none" => return vec![("thinking", Value::Bool(false))],
        "minimal" | "low" => "low",
        "medium" | "high" => "high",
        _ => "max",
    };
    vec![("thinking_effort", Value::String(level.to_owned()))]
}

impl K3Markers {
    /// Rules `args_{i}` writing a call's arguments as typed `argument`
    /// tags, one per property of `schema` in its order (required ones
    /// always, the others optionally), when `schema` is a plain object:
    /// only `type: object`, `properties`, `required`,
    /// `additionalProperties` and annotations, each property of one
    /// JSON type, a string one at most bounded in length. `None`
    /// otherwise (the caller writes a `json` block).
    fn argument_rules(&self, i: usize, schema: &Value) -> Option<Vec<String>> {
        const OBJECT_KEYS: &[&str] = &[
            "type",
            "properties",
            "required",
            "additionalProperties",
            "description",
            "title",
            "x-guidance",
            "$schema",
        ];
        const STRING_KEYS: &[&str] = &["type", "description", "title", "minLength", "maxLength"];
        let obj = schema.as_object()?;
        if obj.get("type")? != "object" || obj.keys().any(|k| !OBJECT_KEYS.contains(&k.as_str())) {
            return None;
        }
        let props = obj.get("properties")?.as_object()?;
        let required: Vec<&str> = match obj.get("required") {
            None => Vec::new(),
            Some(r) => r
                .as_array()?
                .iter()
                .map(Value::as_str)
                .collect::<Option<_>>()?,
        };
        if props.is_empty() || required.iter().any(|r| !props.contains_key(*r)) {
            return None;
        }
        let layout = obj.get("x-guidance").cloned();
        let (o, c, s) = (
            format!("<[{}]>", self.open),
            format!("<[{}]>", self.close),
            format!("<[{}]>", self.sep),
        );
        let lit = |t: &str| Value::String(t.to_owned()).to_string();
        let mut seq = Vec::new();
        let mut rules = Vec::new();
        for (j, (key, prop)) in props.iter().enumerate() {
            let p = prop.as_object()?;
            let ty = p.get("type")?.as_str()?;
            let value = match ty {
                "string" => {
                    if p.keys().any(|k| !STRING_KEYS.contains(&k.as_str())) {
                        return None;
                    }
                    let bound = |k: &str| p.get(k).and_then(Value::as_u64);
                    let min = bound("minLength").unwrap_or(0);
                    let max = bound("maxLength").map_or(String::new(), |m| m.to_string());
                    format!("/(?s:.{{{min},{max}}})/")
                }
                "number" | "integer" | "boolean" | "null" | "object" | "array" => {
                    let mut sub = p.clone();
                    if let Some(l) = &layout {
                        sub.entry("x-guidance").or_insert_with(|| l.clone());
                    }
                    format!("%json {}", Value::Object(sub))
                }
                _ => return None,
            };
            let wire_type = if ty == "integer" { "number" } else { ty };
            let head = format!("argument key=\"{}\" type=\"{wire_type}\"", escape(key));
            rules.push(format!(
                "arg_{i}_{j}: {o} {} {s} {value} {c} {} {s}",
                lit(&head),
                lit("argument")
            ));
            seq.push(if required.contains(&key.as_str()) {
                format!("arg_{i}_{j}")
            } else {
                format!("(arg_{i}_{j})?")
            });
        }
        rules.push(format!("args_{i}: {}", seq.join(" ")));
        Some(rules)
    }
}
