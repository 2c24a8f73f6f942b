//! Between the engine's output and the wire: log-probabilities in OpenAI's
//! two shapes (chat's `{"token","logprob","bytes","top_logprobs"}` list,
//! completions' parallel arrays) and the tool-call stage that turns a chat
//! turn's released text into content and calls.
//!
//! Log-probabilities ride with their text: the stop-string stage releases
//! a token's entry with the chunk that releases the end of its text (and
//! drops the entries of tokens a stop string cut), and the tool-call stage
//! does the same for the content or call its text became, so a chunk's
//! `logprobs` are exactly its tokens'.

use std::sync::Arc;

use specgate_verify::TokenLogprob;

use super::stop::OffsetQueue;
use crate::api::tool_calls::{ParsedCall, ToolCallStream, ToolOutput};
use crate::api::{ChatTokenLogprob, CompletionLogprobs, TopLogprob, TopMap};
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

/// A piece of a chat turn after tool-call parsing, with its tokens'
/// log-probabilities.
#[derive(Debug)]
pub(super) enum Shaped {
    Content(String, Vec<TokenLogprob>),
    Call(ParsedCall, Vec<TokenLogprob>),
}

/// The tool-call stage of one streamed chat turn (`tools` active): text
/// before `<tool_call>` streams as content, each completed call comes out
/// whole.
pub(super) struct ToolStage {
    stream: ToolCallStream,
    queue: OffsetQueue<TokenLogprob>,
    fed: usize,
}

impl ToolStage {
    /// A stage for calls of the `names` tools.
    pub(super) fn new(names: Vec<String>) -> Self {
        Self {
            stream: ToolCallStream::new(names),
            queue: OffsetQueue::default(),
            fed: 0,
        }
    }

    /// Calls made so far.
    pub(super) fn calls(&self) -> usize {
        self.stream.calls()
    }

    /// Feeds released text and its tokens' log-probabilities.
    pub(super) fn push(&mut self, text: &str, lps: Vec<TokenLogprob>) -> Vec<Shaped> {
        self.fed += text.len();
        self.queue.push(self.fed, lps);
        let outs = self.stream.push(text);
        self.shape(outs, false)
    }

    /// The turn ended: what was held, and any log-probabilities left (on
    /// an empty content piece when nothing else carries them).
    pub(super) fn finish(&mut self) -> Vec<Shaped> {
        let outs = self.stream.finish();
        self.shape(outs, true)
    }

    fn shape(&mut self, outs: Vec<(ToolOutput, usize)>, last: bool) -> Vec<Shaped> {
        let n = outs.len();
        let mut shaped: Vec<Shaped> = outs
            .into_iter()
            .enumerate()
            .map(|(i, (o, end))| {
                let lps = if last && i + 1 == n {
                    self.queue.take_all()
                } else {
                    self.queue.take_until(end)
                };
                match o {
                    ToolOutput::Content(c) => Shaped::Content(c, lps),
                    ToolOutput::Call(c) => Shaped::Call(c, lps),
                }
            })
            .collect();
        if last {
            let rest = self.queue.take_all();
            if !rest.is_empty() {
                shaped.push(Shaped::Content(String::new(), rest));
            }
        }
        shaped
    }
}
