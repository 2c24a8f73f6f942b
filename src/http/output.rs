//! Between the engine's output and the wire: log-probabilities in OpenAI's
//! two shapes (chat's `{"token","logprob","bytes","top_logprobs"}` list,
//! completions' parallel arrays) and the tool-call stage that turns a chat
//! turn's released text into content and calls.
//!
//! Log-probabilities ride with their text: the stop-string stage releases
//! a token's entry with the chunk that releases the end of its text (and
//! drops the entries of tokens a stop string cut), and the tool-call stage
//! does the same for the content or call its text became, so a chunk's
//! `logprobs` are exactly its tokens'. [`Labels`] says how one response is
//! shaped; [`chat_body`] builds a whole chat answer and [`StreamShape`]
//! turns streamed pieces into SSE chunks.

use std::sync::Arc;

use bytes::Bytes;
use specgate_verify::TokenLogprob;

use super::request_id::RequestId;
use super::stop::OffsetQueue;
use crate::api::tool_calls::ParsedCall;
use crate::api::{
    ChatCompletion, ChatCompletionChunk, ChatLogprobs, ChatTokenLogprob, CompletionChunk,
    CompletionLogprobs, FinishReason, ToolCall, TopLogprob, TopMap, Usage,
};
use crate::chat_format::{ChatFormat, TurnPiece, TurnStream};
use crate::tokenizer::TextTokenizer;

/// What a log-probability is reported as when it is not finite (never
/// expected: the engine's are log-softmax of finite logits), as vLLM does.
const FLOOR: f32 = -9999.0;

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        FLOOR
    }
}

/// Token ids as the wire shows them.
pub(super) struct TokenWire {
    tok: Arc<TextTokenizer>,
    /// Alternatives per token the request asked for.
    top: usize,
}

impl TokenWire {
    pub(super) fn new(tok: Arc<TextTokenizer>, top: usize) -> Self {
        Self { tok, top }
    }

    /// A token's text (lossy UTF-8 of its bytes) and exact bytes.
    fn text(&self, id: u32) -> (String, Option<Vec<u8>>) {
        match self.tok.token_bytes(id) {
            Some(b) => (String::from_utf8_lossy(&b).into_owned(), Some(b)),
            None => (String::new(), None),
        }
    }

    /// Chat's `logprobs.content` entries.
    pub(super) fn chat(&self, lps: &[TokenLogprob]) -> Vec<ChatTokenLogprob> {
        lps.iter()
            .map(|lp| {
                let (token, bytes) = self.text(lp.token);
                let top_logprobs = lp
                    .top
                    .iter()
                    .take(self.top)
                    .map(|&(id, l)| {
                        let (token, bytes) = self.text(id);
                        TopLogprob {
                            token,
                            logprob: finite(l),
                            bytes,
                        }
                    })
                    .collect();
                ChatTokenLogprob {
                    token,
                    logprob: finite(lp.logprob),
                    bytes,
                    top_logprobs,
                }
            })
            .collect()
    }

    /// Appends completions' entries for `lps` to `out`; `offset` is the
    /// character offset of the first token's text, advanced past the last.
    pub(super) fn completion(
        &self,
        lps: &[TokenLogprob],
        offset: &mut usize,
        out: &mut CompletionLogprobs,
    ) {
        for lp in lps {
            let (token, _) = self.text(lp.token);
            let top = lp
                .top
                .iter()
                .take(self.top)
                .map(|&(id, l)| (self.text(id).0, finite(l)))
                .collect();
            self.push_entry(
                out,
                offset,
                token,
                Some(finite(lp.logprob)),
                Some(TopMap(top)),
            );
        }
    }

    /// The entry of a prompt's first token, which nothing predicts:
    /// `null` log-probability and alternatives.
    pub(super) fn completion_first(
        &self,
        id: u32,
        offset: &mut usize,
        out: &mut CompletionLogprobs,
    ) {
        let (token, _) = self.text(id);
        self.push_entry(out, offset, token, None, None);
    }

    fn push_entry(
        &self,
        out: &mut CompletionLogprobs,
        offset: &mut usize,
        token: String,
        logprob: Option<f32>,
        top: Option<TopMap>,
    ) {
        out.text_offset.push(*offset);
        *offset += token.chars().count();
        out.tokens.push(token);
        out.token_logprobs.push(logprob);
        out.top_logprobs.push(top);
    }
}

/// A piece of a turn after the turn parser, with its tokens'
/// log-probabilities.
#[derive(Debug)]
pub(super) enum Shaped {
    Content(String, Vec<TokenLogprob>),
    Reasoning(String, Vec<TokenLogprob>),
    Call(ParsedCall, Vec<TokenLogprob>),
}

/// The turn-parsing stage of one answer: the family's [`TurnStream`]
/// (reasoning, content, each completed call whole), or none (the text is
/// all content). Log-probabilities go out with the piece that releases
/// the end of their token's text.
pub(super) struct TurnStage {
    parser: Option<Box<dyn TurnStream>>,
    queue: OffsetQueue<TokenLogprob>,
    /// One unit per generated token, keyed like `queue`: which piece each
    /// token's text ended in (to count reasoning tokens).
    tokens: OffsetQueue<()>,
    fed: usize,
    /// Tokens whose text ended in reasoning.
    reasoning_tokens: usize,
}

impl TurnStage {
    /// A stage parsing with `parser` (`None`: pass-through).
    pub(super) fn new(parser: Option<Box<dyn TurnStream>>) -> Self {
        Self {
            parser,
            queue: OffsetQueue::default(),
            tokens: OffsetQueue::default(),
            fed: 0,
            reasoning_tokens: 0,
        }
    }

    /// Tokens whose text ended in reasoning (the Responses API's
    /// `output_tokens_details.reasoning_tokens`); counted for text fed
    /// with its token count.
    pub(super) fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Calls made so far.
    pub(super) fn calls(&self) -> usize {
        self.parser.as_ref().map_or(0, |p| p.calls())
    }

    /// Feeds released text, its tokens' log-probabilities, where the
    /// chat format's marker tokens start in it (`(offset, id)`, see
    /// [`TurnStream::push`]), and `tokens`, how many tokens the text ends
    /// (0 when the stop stage released it, which loses the count: only a
    /// family without reasoning does that).
    pub(super) fn push(
        &mut self,
        text: &str,
        lps: Vec<TokenLogprob>,
        markers: &[(usize, u32)],
        tokens: usize,
    ) -> Vec<Shaped> {
        let Some(p) = &mut self.parser else {
            return if text.is_empty() && lps.is_empty() {
                Vec::new()
            } else {
                vec![Shaped::Content(text.to_owned(), lps)]
            };
        };
        self.fed += text.len();
        self.queue.push(self.fed, lps);
        self.tokens.push(self.fed, std::iter::repeat_n((), tokens));
        let outs = p.push(text, markers);
        self.shape(outs, false)
    }

    /// The turn ended: what was held, and any log-probabilities left (on
    /// an empty content piece when nothing else carries them).
    pub(super) fn finish(&mut self) -> Vec<Shaped> {
        let Some(p) = &mut self.parser else {
            return Vec::new();
        };
        let outs = p.finish();
        self.shape(outs, true)
    }

    fn shape(&mut self, outs: Vec<(TurnPiece, usize)>, last: bool) -> Vec<Shaped> {
        let n = outs.len();
        let mut shaped: Vec<Shaped> = outs
            .into_iter()
            .enumerate()
            .map(|(i, (o, end))| {
                let (lps, tokens) = if last && i + 1 == n {
                    (self.queue.take_all(), self.tokens.take_all().len())
                } else {
                    (
                        self.queue.take_until(end),
                        self.tokens.take_until(end).len(),
                    )
                };
                if matches!(o, TurnPiece::Reasoning(_)) {
                    self.reasoning_tokens += tokens;
                }
                match o {
                    TurnPiece::Content(c) => Shaped::Content(c, lps),
                    TurnPiece::Reasoning(r) => Shaped::Reasoning(r, lps),
                    TurnPiece::Call(c) => Shaped::Call(c, lps),
                }
            })
            .collect();
        if last {
            self.tokens.take_all();
            let rest = self.queue.take_all();
            if !rest.is_empty() {
                shaped.push(Shaped::Content(String::new(), rest));
            }
        }
        shaped
    }
}

/// How a chat turn's calls and text are labelled.
#[derive(Debug, Clone, Copy)]
pub(super) struct TurnLabels {
    pub(super) format: ChatFormat,
    /// Whether the output is parsed for calls (tools active).
    pub(super) parse_calls: bool,
    /// Calls already in the conversation (K3's call ids count on from it).
    pub(super) prior_calls: usize,
}

/// What one response needs to label and shape its output.
pub(super) struct Labels {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    /// Chat answers: the family's labelling; `None` for completions.
    pub(super) turn: Option<TurnLabels>,
    /// Log-probabilities asked for: how tokens are shown.
    pub(super) logprobs: Option<TokenWire>,
    /// Completions' `echo`: the prompt text and its first token.
    pub(super) echo: Option<(String, Option<u32>)>,
}

impl Labels {
    fn chat(&self) -> bool {
        self.turn.is_some()
    }

    /// The id of the turn's call number `index` (from 0) named `name`.
    pub(super) fn call_id(&self, name: &str, index: usize) -> String {
        match &self.turn {
            Some(t) => t.format.call_id(name, t.prior_calls + index, call_id),
            None => call_id(),
        }
    }
}

/// A new tool call id: `call_` and 16 random hex digits.
pub(super) fn call_id() -> String {
    format!("call_{}", RequestId::generate().as_str())
}

/// `reason` as the turn reports it: `tool_calls` when it made calls and
/// ended on its own.
pub(super) fn turn_reason(reason: FinishReason, calls: usize) -> FinishReason {
    if calls > 0 && reason == FinishReason::Stop {
        FinishReason::ToolCalls
    } else {
        reason
    }
}

/// A whole chat turn as parsed: content, reasoning, calls.
#[derive(Debug, Default)]
pub(super) struct WholeTurn {
    pub(super) content: String,
    pub(super) reasoning: String,
    pub(super) calls: Vec<ParsedCall>,
}

/// A whole chat answer: content, reasoning and tool calls as the family
/// parsed them, log-probabilities when asked. `content` is `null` when
/// the turn made calls (Hermes: and wrote only whitespace around them;
/// then it is trimmed) or, for a family with reasoning, wrote none.
pub(super) fn chat_body(
    l: &Labels,
    turn: WholeTurn,
    lps: &[TokenLogprob],
    reason: FinishReason,
    usage: Usage,
) -> ChatCompletion {
    let logprobs = l.logprobs.as_ref().map(|w| ChatLogprobs::new(w.chat(lps)));
    let t = l.turn.as_ref();
    let reasoning_family = t.is_some_and(|t| t.format.has_reasoning());
    let content = if reasoning_family {
        (!turn.content.is_empty()).then_some(turn.content)
    } else if turn.calls.is_empty() {
        Some(turn.content)
    } else {
        let trimmed = turn.content.trim();
        (!trimmed.is_empty()).then(|| trimmed.to_owned())
    };
    let calls = turn
        .calls
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCall::function(l.call_id(&c.name, i), c.name, c.arguments))
        .collect();
    ChatCompletion::new(&l.id, l.created, &l.model, String::new(), reason, usage)
        .with_tool_calls(content, calls)
        .with_reasoning((!turn.reasoning.is_empty()).then_some(turn.reasoning))
        .with_logprobs(logprobs)
}

/// The echoed prompt's entries of a completion's `logprobs` (the first
/// token's `null`, then the engine's), when the request asked for
/// log-probabilities.
pub(super) fn echo_logprobs(
    l: &Labels,
    first: Option<u32>,
    prompt_lps: &[TokenLogprob],
    offset: &mut usize,
) -> Option<CompletionLogprobs> {
    let w = l.logprobs.as_ref()?;
    let mut out = CompletionLogprobs::default();
    if let Some(id) = first {
        w.completion_first(id, offset, &mut out);
    }
    w.completion(prompt_lps, offset, &mut out);
    Some(out)
}

/// The state of one streamed answer between pieces and chunks.
pub(super) struct StreamShape {
    /// Index of the next tool call.
    next_call: u32,
    /// The echoed prompt is still to be sent (completions).
    echo_pending: bool,
    /// Character offset of the next completions token (`text_offset`).
    offset: usize,
}

impl StreamShape {
    pub(super) fn new(l: &Labels) -> Self {
        Self {
            next_call: 0,
            echo_pending: l.echo.is_some(),
            offset: 0,
        }
    }

    /// The echoed prompt's chunk, once (with its log-probabilities when
    /// asked: `prompt_lps`, which the engine sends first).
    pub(super) fn echo(&mut self, l: &Labels, prompt_lps: &[TokenLogprob]) -> Option<Bytes> {
        if !std::mem::take(&mut self.echo_pending) {
            return None;
        }
        let (prompt, first) = l.echo.as_ref()?;
        let logprobs = echo_logprobs(l, *first, prompt_lps, &mut self.offset);
        Some(sse(&CompletionChunk::text(
            &l.id,
            l.created,
            &l.model,
            prompt.clone(),
        )
        .with_logprobs(logprobs)))
    }

    /// The chunks of released, parsed pieces.
    pub(super) fn pieces(&mut self, l: &Labels, shaped: Vec<Shaped>) -> Vec<Bytes> {
        if l.chat() {
            return self.chat_chunks(l, shaped);
        }
        let mut out: Vec<Bytes> = self.echo(l, &[]).into_iter().collect();
        for s in shaped {
            let (Shaped::Content(text, lps) | Shaped::Reasoning(text, lps)) = s else {
                continue;
            };
            let logprobs = l.logprobs.as_ref().map(|w| {
                let mut lp = CompletionLogprobs::default();
                w.completion(&lps, &mut self.offset, &mut lp);
                lp
            });
            out.push(sse(&CompletionChunk::text(
                &l.id, l.created, &l.model, text,
            )
            .with_logprobs(logprobs)));
        }
        out
    }

    fn chat_chunks(&mut self, l: &Labels, shaped: Vec<Shaped>) -> Vec<Bytes> {
        let lp = |lps: &[TokenLogprob]| l.logprobs.as_ref().map(|w| ChatLogprobs::new(w.chat(lps)));
        shaped
            .into_iter()
            .map(|s| match s {
                Shaped::Content(c, lps) => {
                    sse(&ChatCompletionChunk::content(&l.id, l.created, &l.model, c)
                        .with_logprobs(lp(&lps)))
                }
                Shaped::Reasoning(r, lps) => sse(&ChatCompletionChunk::reasoning(
                    &l.id, l.created, &l.model, r,
                )
                .with_logprobs(lp(&lps))),
                Shaped::Call(c, lps) => {
                    let index = self.next_call;
                    self.next_call += 1;
                    let id = l.call_id(&c.name, index as usize);
                    let call = ToolCall::function(id, c.name, c.arguments);
                    sse(
                        &ChatCompletionChunk::tool_call(&l.id, l.created, &l.model, index, call)
                            .with_logprobs(lp(&lps)),
                    )
                }
            })
            .collect()
    }

    /// The chunks that end the answer: the finish chunk, the usage chunk
    /// when asked, `[DONE]`.
    pub(super) fn done(
        &mut self,
        l: &Labels,
        reason: FinishReason,
        usage: Usage,
        include_usage: bool,
    ) -> Vec<Bytes> {
        let mut v: Vec<Bytes> = self.echo(l, &[]).into_iter().collect();
        v.push(if l.chat() {
            sse(&ChatCompletionChunk::finish(
                &l.id, l.created, &l.model, reason,
            ))
        } else {
            sse(&CompletionChunk::finish(&l.id, l.created, &l.model, reason))
        });
        if include_usage {
            v.push(if l.chat() {
                sse(&ChatCompletionChunk::usage(
                    &l.id, l.created, &l.model, usage,
                ))
            } else {
                sse(&CompletionChunk::usage(&l.id, l.created, &l.model, usage))
            });
        }
        v.push(Bytes::from_static(b"data: [DONE]\n\n"));
        v
    }
}

pub(super) fn sse<T: serde::Serialize>(v: &T) -> Bytes {
    Bytes::from(format!(
        "data: {}\n\n",
        serde_json::to_string(v).expect("chunks serialize")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: u32) -> TokenLogprob {
        TokenLogprob {
            token,
            logprob: -1.0,
            top: Vec::new(),
        }
    }

    fn ids(lps: &[TokenLogprob]) -> Vec<u32> {
        lps.iter().map(|l| l.token).collect()
    }

    /// Each piece carries exactly the log-probabilities of the tokens
    /// whose text it released; none is lost or duplicated.
    #[test]
    fn tool_stage_carries_each_tokens_logprobs_with_its_text() {
        let parser = crate::chat_format::ChatFormat::Hermes(Default::default()).parser(
            crate::chat_format::TurnSetup {
                names: vec!["add".into()],
                parse_calls: true,
                thinking: false,
            },
        );
        let mut t = TurnStage::new(parser);
        let mut out = Vec::new();
        // Token 1: content; 2-3: a partial tag, then the call; 4: after
        // it. An entry goes with the piece that releases the end of its
        // token's text (the held space of token 2 goes with the call).
        out.extend(t.push("Hi", vec![lp(1)], &[], 1));
        out.extend(t.push(" <tool_", vec![lp(2)], &[], 1));
        out.extend(t.push(
            "call>{\"name\": \"add\", \"arguments\": {}}</tool_call>",
            vec![lp(3)],
            &[],
            1,
        ));
        out.extend(t.push("\n", vec![lp(4)], &[], 1));
        out.extend(t.finish());
        assert_eq!(t.calls(), 1);
        let got: Vec<(String, Vec<u32>)> = out
            .iter()
            .map(|s| match s {
                Shaped::Content(c, l) => (c.clone(), ids(l)),
                Shaped::Reasoning(r, l) => (format!("reasoning {r}"), ids(l)),
                Shaped::Call(c, l) => (format!("call {} {}", c.name, c.arguments), ids(l)),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("Hi".to_owned(), vec![1]),
                ("call add {}".to_owned(), vec![2, 3]),
                // The dropped trailing newline's token still comes out.
                (String::new(), vec![4]),
            ]
        );
    }

    /// A K3 turn fed token by token: each token's log-probability goes
    /// out with the reasoning, content or call its text ends in, and no
    /// piece shows a marker.
    #[test]
    fn k3_stage_carries_logprobs_with_reasoning_content_and_calls() {
        use crate::chat_format::kimi_k3::K3Markers;
        let f = ChatFormat::KimiK3(K3Markers {
            open: 515,
            close: 516,
            sep: 517,
        });
        let mut t = TurnStage::new(f.parser(crate::chat_format::TurnSetup {
            names: vec!["add".into()],
            parse_calls: true,
            thinking: true,
        }));
        let tokens = [
            "Hmm",
            "<|close|>",
            "think",
            "<|sep|>",
            "<|open|>",
            "response",
            "<|sep|>",
            "Ok",
            "<|close|>",
            "response",
            "<|sep|>",
            "<|open|>",
            "tools",
            "<|sep|>",
            "<|open|>",
            "call tool=\"add\" index=\"1\"",
            "<|sep|>",
            "<|open|>",
            "argument key=\"a\" type=\"number\"",
            "<|sep|>",
            "1",
            "<|close|>",
            "argument",
            "<|sep|>",
            "<|close|>",
            "call",
            "<|sep|>",
            "<|close|>",
            "tools",
            "<|sep|>",
        ];
        let mut out = Vec::new();
        // Each marker is its token, at the start of its text.
        for (i, tok) in tokens.iter().enumerate() {
            let id = match *tok {
                "<|open|>" => Some(515),
                "<|close|>" => Some(516),
                "<|sep|>" => Some(517),
                _ => None,
            };
            let markers: Vec<(usize, u32)> = id.map(|id| (0, id)).into_iter().collect();
            out.extend(t.push(tok, vec![lp(i as u32)], &markers, 1));
        }
        out.extend(t.finish());
        let got: Vec<(String, Vec<u32>)> = out
            .iter()
            .map(|s| match s {
                Shaped::Content(c, l) => (format!("content {c}"), ids(l)),
                Shaped::Reasoning(r, l) => (format!("reasoning {r}"), ids(l)),
                Shaped::Call(c, l) => (format!("call {} {}", c.name, c.arguments), ids(l)),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("reasoning Hmm".to_owned(), vec![0]),
                ("content Ok".to_owned(), (1..8).collect()),
                ("call add {\"a\":1}".to_owned(), (8..27).collect()),
                (String::from("content "), (27..30).collect()),
            ]
        );
        assert_eq!(t.calls(), 1);
        // One token of reasoning ("Hmm"; its closing marker ends in content).
        assert_eq!(t.reasoning_tokens(), 1);
    }
}
