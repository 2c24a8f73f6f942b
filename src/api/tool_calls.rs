//! Tool calls parsed out of generated text, in the Qwen2.5 / Hermes format
//! the chat templates teach: each call is a block
//! `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`.
//!
//! Text outside blocks is content. A block whose JSON does not parse, has
//! no string `name`, or names a tool the request did not declare stays
//! content, tags included (nothing the model wrote is lost). `arguments`
//! is re-serialized as compact JSON text (a string `arguments` is kept as
//! written); absent, it is `{}`.
//!
//! [`ToolCallStream`] does the same incrementally: content streams as it
//! comes, except a suffix that may still become `<tool_call>` (held, like
//! a partial stop string) and whitespace-only runs (held until more
//! content follows; dropped at the end when the turn made calls, so
//! streamed content equals [`parse_tool_calls`]' trimmed content). A call
//! is emitted once its block closes; a block still open at the end is
//! content.
//!
//! Where the vocabulary has the two tags as tokens of their own (Qwen2.5),
//! a stream built [`with_markers`](ToolCallStream::with_markers) counts a
//! tag only as its token, at the offsets the engine reports: the same
//! characters spelled by other tokens are content (or part of a block's
//! JSON), so text can neither open a call nor close one early.

use serde_json::Value;

/// Opens a call block.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call block.
pub const CALL_CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// What a piece of generated text turned into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    Content(String),
    Call(ParsedCall),
}

/// The call in one block's inner text, or `None` when it is not a call
/// of a declared tool.
fn parse_block(inner: &str, names: &[String]) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(inner.trim()).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if !names.iter().any(|n| n == name) {
        return None;
    }
    let arguments = match obj.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => serde_json::to_string(other).ok()?,
    };
    Some(ParsedCall {
        name: name.to_owned(),
        arguments,
    })
}

/// Splits a whole output into content and calls of the `names` tools.
/// Content is `None` when the turn made calls and the text around them is
/// only whitespace; with calls it is trimmed, without it is the text
/// unchanged.
pub fn parse_tool_calls(text: &str, names: &[String]) -> (Option<String>, Vec<ParsedCall>) {
    let mut s = ToolCallStream::new(names.to_vec());
    let mut outs = s.push(text);
    outs.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for (o, _) in outs {
        match o {
            ToolOutput::Content(c) => content.push_str(&c),
            ToolOutput::Call(c) => calls.push(c),
        }
    }
    if calls.is_empty() {
        return (Some(content), calls);
    }
    let trimmed = content.trim();
    let content = (!trimmed.is_empty()).then(|| trimmed.to_owned());
    (content, calls)
}

/// Incremental tool-call parsing of one response's text (see the module
/// doc). Each output comes with the input offset (bytes fed so far) its
/// text ends at, so what rides along the input (log-probabilities) can be
/// released with it.
#[derive(Debug)]
pub struct ToolCallStream {
    names: Vec<String>,
    /// The tags' token ids (open, close), when a tag counts only as its
    /// token; `None`: tags are found in the text.
    ids: Option<(u32, u32)>,
    /// With `ids`: where tag tokens start (input offset, whether it opens),
    /// at or after `start`, ascending.
    marks: std::collections::VecDeque<(usize, bool)>,
    /// Unresolved input: a possible `<tool_call>` prefix, or an open
    /// block's text after its opening tag.
    buf: String,
    /// Input offset of `buf`'s first byte.
    start: usize,
    in_call: bool,
    /// Whitespace-only content not sent yet.
    held_ws: String,
    calls: usize,
}

impl ToolCallStream {
    /// A parser for calls of the `names` tools.
    pub fn new(names: Vec<String>) -> Self {
        Self {
            names,
            ids: None,
            marks: Default::default(),
            buf: String::new(),
            start: 0,
            in_call: false,
            held_ws: String::new(),
            calls: 0,
        }
    }

    /// This parser counting a tag only as its token: `open` for
    /// `<tool_call>`, `close` for `</tool_call>` (see
    /// [`push_marked`](Self::push_marked)).
    pub fn with_markers(mut self, open: u32, close: u32) -> Self {
        self.ids = Some((open, close));
        self
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds generated text; returns what is settled, in order.
    pub fn push(&mut self, text: &str) -> Vec<(ToolOutput, usize)> {
        self.push_marked(text, &[])
    }

    /// Feeds generated text and where tag tokens start in it (`(offset,
    /// token id)`, ascending; a tag's text may end in a later push). Only
    /// a parser [`with_markers`](Self::with_markers) reads them (other ids
    /// are ignored); one without finds tags in the text.
    pub fn push_marked(
        &mut self,
        text: &str,
        markers: &[(usize, u32)],
    ) -> Vec<(ToolOutput, usize)> {
        if let Some((open, close)) = self.ids {
            let base = self.start + self.buf.len();
            for &(at, id) in markers {
                if (id == open || id == close) && text.as_bytes().get(at) == Some(&b'<') {
                    self.marks.push_back((base + at, id == open));
                }
            }
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Ok(pos) = self.find(CALL_CLOSE, false) else {
                    break;
                };
                let end = pos + CALL_CLOSE.len();
                match parse_block(&self.buf[..pos], &self.names) {
                    Some(call) => {
                        // Whitespace before a call is dropped.
                        self.held_ws.clear();
                        self.calls += 1;
                        out.push((ToolOutput::Call(call), self.start + end));
                    }
                    None => {
                        let raw = format!("{CALL_OPEN}{}", &self.buf[..end]);
                        self.content(&raw, self.start + end, &mut out);
                    }
                }
                self.consume(end);
                self.in_call = false;
            } else {
                match self.find(CALL_OPEN, true) {
                    Ok(pos) => {
                        let before = self.buf[..pos].to_owned();
                        self.content(&before, self.start + pos, &mut out);
                        self.consume(pos + CALL_OPEN.len());
                        self.in_call = true;
                    }
                    Err(keep) => {
                        let cut = self.buf.len() - keep;
                        let settled = self.buf[..cut].to_owned();
                        self.content(&settled, self.start + cut, &mut out);
                        self.consume(cut);
                        break;
                    }
                }
            }
        }
        out
    }

    /// Where the next `tag` (the opening one when `open`) starts in `buf`
    /// with all its text there: `Ok(pos)`; else `Err(held)`, the bytes at
    /// the end of `buf` that may still be (or are) the start of one.
    fn find(&self, tag: &str, open: bool) -> Result<usize, usize> {
        if self.ids.is_none() {
            return self
                .buf
                .find(tag)
                .ok_or_else(|| partial_suffix(&self.buf, tag));
        }
        match self.marks.iter().find(|&&(_, o)| o == open) {
            Some(&(at, _)) => {
                let pos = at - self.start;
                if self.buf.len() >= pos + tag.len() {
                    Ok(pos)
                } else {
                    Err(self.buf.len() - pos)
                }
            }
            None => Err(0),
        }
    }

    /// The text ended: releases what is held (an open block as content;
    /// held whitespace only when no call was made).
    pub fn finish(&mut self) -> Vec<(ToolOutput, usize)> {
        let mut out = Vec::new();
        let end = self.start + self.buf.len();
        let rest = std::mem::take(&mut self.buf);
        let rest = if self.in_call {
            format!("{CALL_OPEN}{rest}")
        } else {
            rest
        };
        self.in_call = false;
        self.marks.clear();
        self.content(&rest, end, &mut out);
        if self.calls == 0 && !self.held_ws.is_empty() {
            out.push((ToolOutput::Content(std::mem::take(&mut self.held_ws)), end));
        }
        self.start = end;
        out
    }

    fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
        self.start += n;
        while self.marks.front().is_some_and(|&(at, _)| at < self.start) {
            self.marks.pop_front();
        }
    }

    /// Emits `s` as content, holding trailing whitespace back.
    fn content(&mut self, s: &str, end: usize, out: &mut Vec<(ToolOutput, usize)>) {
        let body = s.trim_end();
        if body.is_empty() {
            self.held_ws.push_str(s);
            return;
        }
        let mut text = std::mem::take(&mut self.held_ws);
        text.push_str(body);
        self.held_ws.push_str(&s[body.len()..]);
        out.push((ToolOutput::Content(text), end - (s.len() - body.len())));
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of
/// `pattern` (on char boundaries).
pub fn partial_suffix(text: &str, pattern: &str) -> usize {
    let max = text.len().min(pattern.len() - 1);
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && pattern.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "add".into()]
    }

    fn block(name: &str, args: &str) -> String {
        format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
    }

    fn call(name: &str, args: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn whole_text_with_one_and_several_calls() {
        let text = block("get_weather", r#"{"city": "Paris", "unit": "c"}"#);
        let (content, calls) = parse_tool_calls(&text, &names());
        assert_eq!(content, None);
        assert_eq!(
            calls,
            vec![call("get_weather", r#"{"city":"Paris","unit":"c"}"#)]
        );
        let text = format!(
            "Let me check.\n{}\n{}\n",
            block("get_weather", r#"{"city": "Oslo"}"#),
            block("add", r#"{"a": 1, "b": 2}"#)
        );
        let (content, calls) = parse_tool_calls(&text, &names());
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![
                call("get_weather", r#"{"city":"Oslo"}"#),
                call("add", r#"{"a":1,"b":2}"#)
            ]
        );
    }

    #[test]
    fn no_calls_leave_the_text_unchanged() {
        for text in ["plain answer  ", "  x <tool", "a < b <tool_cal", ""] {
            assert_eq!(
                parse_tool_calls(text, &names()),
                (Some(text.to_owned()), vec![])
            );
        }
    }

    #[test]
    fn malformed_or_unknown_blocks_stay_content() {
        let bad = [
            "<tool_call>\n{not json}\n</tool_call>".to_owned(),
            "<tool_call>{\"arguments\": {}}</tool_call>".to_owned(),
            block("rm_rf", "{}"),
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1".to_owned(),
        ];
        for text in &bad {
            let (content, calls) = parse_tool_calls(text, &names());
            assert!(calls.is_empty(), "{text}");
            assert_eq!(content.as_deref(), Some(text.as_str()));
        }
        // A bad block next to a good one: the good one is a call.
        let text = format!("{}{}", bad[0], block("add", "{}"));
        let (content, calls) = parse_tool_calls(&text, &names());
        assert_eq!(content.as_deref(), Some(bad[0].as_str()));
        assert_eq!(calls, vec![call("add", "{}")]);
        // Absent arguments are `{}`; string arguments are kept as written.
        let text = "<tool_call>{\"name\": \"add\"}</tool_call>";
        assert_eq!(parse_tool_calls(text, &names()).1, vec![call("add", "{}")]);
        let text = "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\":1}\"}</tool_call>";
        assert_eq!(
            parse_tool_calls(text, &names()).1,
            vec![call("add", r#"{"a":1}"#)]
        );
    }

    /// Feeds `pieces` one by one; returns the outputs and checks offsets
    /// never go backwards nor past what was fed.
    fn stream(pieces: &[&str]) -> Vec<ToolOutput> {
        let mut s = ToolCallStream::new(names());
        let (mut fed, mut last) = (0, 0);
        let mut outs = Vec::new();
        for p in pieces {
            fed += p.len();
            for (o, end) in s.push(p) {
                assert!(end >= last && end <= fed, "{end} after {last}, fed {fed}");
                last = end;
                outs.push(o);
            }
        }
        for (o, end) in s.finish() {
            assert!(end >= last && end <= fed);
            last = end;
            outs.push(o);
        }
        // Adjacent content pieces read as one.
        let mut merged: Vec<ToolOutput> = Vec::new();
        for o in outs {
            match (merged.last_mut(), o) {
                (Some(ToolOutput::Content(prev)), ToolOutput::Content(c)) => prev.push_str(&c),
                (_, o) => merged.push(o),
            }
        }
        merged
    }

    #[test]
    fn streaming_holds_partial_tags_and_matches_whole() {
        let text = format!(
            "Sure. {}\n{}",
            block("get_weather", r#"{"city": "Rome"}"#),
            block("add", r#"{"a": 2}"#)
        );
        // Every split into 1..=7-byte pieces gives the same result.
        for size in 1..=7 {
            let pieces: Vec<String> = text
                .as_bytes()
                .chunks(size)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let outs = stream(&refs);
            assert_eq!(
                outs,
                vec![
                    ToolOutput::Content("Sure.".into()),
                    ToolOutput::Call(call("get_weather", r#"{"city":"Rome"}"#)),
                    ToolOutput::Call(call("add", r#"{"a":2}"#)),
                ],
                "piece size {size}"
            );
        }
        // Content streams before the tag is complete; the partial tag is held.
        let mut s = ToolCallStream::new(names());
        assert_eq!(
            s.push("Hi <tool_ca"),
            vec![(ToolOutput::Content("Hi".into()), 2)]
        );
        assert_eq!(s.push("ll>\n{\"name\": \"add\"}"), vec![]);
        assert_eq!(
            s.push("</tool_call>"),
            vec![(ToolOutput::Call(call("add", "{}")), 42)]
        );
        assert_eq!(s.calls(), 1);
        assert_eq!(s.finish(), vec![]);
    }

    #[test]
    fn streaming_without_calls_releases_everything() {
        let outs = stream(&["a <", "b ", " <tool", "_c", "x> ", "  "]);
        let text: String = outs
            .iter()
            .map(|o| match o {
                ToolOutput::Content(c) => c.as_str(),
                ToolOutput::Call(_) => panic!("no calls here"),
            })
            .collect();
        assert_eq!(text, "a <b  <tool_cx>   ");
        // An unterminated block is content at the end.
        let outs = stream(&["<tool_call>{\"name\": \"add\""]);
        assert_eq!(
            outs,
            vec![ToolOutput::Content("<tool_call>{\"name\": \"add\"".into())]
        );
    }

    #[test]
    fn partial_suffix_lengths() {
        assert_eq!(partial_suffix("abc<tool_c", CALL_OPEN), 7);
        assert_eq!(partial_suffix("abc<", CALL_OPEN), 1);
        assert_eq!(partial_suffix("abc", CALL_OPEN), 0);
        assert_eq!(partial_suffix("<tool_call>", CALL_OPEN), 0);
        assert_eq!(partial_suffix("é<", CALL_OPEN), 1);
    }
}
