//! One place per model family's chat markup: how tool calls and reasoning
//! look in generated text, how to parse them incrementally, how to force a
//! call through the grammar in the family's own markup, and which template
//! variable holds the family's reasoning knob. [`ChatFormat::detect`]
//! picks the family from the tokenizer's special tokens. Adding a family
//! is adding a module and a variant here.
//!
//! Parsing sees the family's markers (the engine decodes exactly
//! [`ChatFormat::shown_special_ids`] as text for a chat turn) and where
//! their tokens are: a marker counts only as its token, and the same text
//! spelled by ordinary tokens stays text (vLLM's Kimi K2 parser detects by
//! token id likewise). The pieces a parser returns never hold a marker
//! token's text, so the client never sees one.

pub mod hermes;
pub mod kimi_k3;
#[cfg(test)]
mod tests;

use serde_json::Value;

pub use crate::api::tool_calls::ParsedCall;
use crate::api::tool_calls::ToolCallStream;
use crate::api::{ApiError, ChatKnobs};
use crate::tokenizer::TextTokenizer;
use hermes::HermesMarkers;
use kimi_k3::{K3Markers, K3Stream};

/// A settled piece of an assistant turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnPiece {
    /// Response text (`content`).
    Content(String),
    /// Thinking text (`reasoning_content`).
    Reasoning(String),
    /// A complete call.
    Call(ParsedCall),
}

/// Incremental parsing of one generated turn. Each output carries the
/// input offset (bytes fed so far) its text ends at, non-decreasing, so
/// what rides along the input (log-probabilities) goes out with it.
pub trait TurnStream: Send {
    /// Feeds generated text and where the family's marker tokens start in
    /// it (`(byte offset in text, token id)`, ascending; a marker's text
    /// may end in a later push); returns what is settled, in order.
    fn push(&mut self, text: &str, markers: &[(usize, u32)]) -> Vec<(TurnPiece, usize)>;
    /// The text ended: releases what is held.
    fn finish(&mut self) -> Vec<(TurnPiece, usize)>;
    /// Calls emitted so far.
    fn calls(&self) -> usize;
}

/// A model family's chat protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<tool_call>` JSON blocks (Qwen2.5, Hermes, and any model without
    /// a markup of its own), with the tags' ids where they are tokens.
    Hermes(HermesMarkers),
    /// Kimi K3's `<|open|>tag<|sep|>` markup.
    KimiK3(K3Markers),
}

/// What one chat turn is parsed with.
#[derive(Debug, Clone, Default)]
pub struct TurnSetup {
    /// Declared tool names; calls of other names are not calls.
    pub names: Vec<String>,
    /// Whether calls are parsed (tools active).
    pub parse_calls: bool,
    /// Whether the prompt opened the thinking channel.
    pub thinking: bool,
}

impl ChatFormat {
    /// The family of the model behind `tok`: K3 when its vocabulary has
    /// K3's three markers as tokens, else Hermes (with its tags' ids when
    /// both are tokens).
    pub fn detect(tok: &TextTokenizer) -> Self {
        let id = |t: &str| tok.token_to_id(t);
        match (id(kimi_k3::OPEN), id(kimi_k3::CLOSE), id(kimi_k3::SEP)) {
            (Some(open), Some(close), Some(sep)) => Self::KimiK3(K3Markers { open, close, sep }),
            _ => Self::Hermes(HermesMarkers {
                call: id(hermes::OPEN).zip(id(hermes::CLOSE)),
            }),
        }
    }

    /// The tokens that are the family's markers: the engine decodes them
    /// as text for the parser (control tokens included) and reports where
    /// each one is.
    pub fn shown_special_ids(&self) -> Vec<u32> {
        match self {
            Self::Hermes(m) => m.call.map_or_else(Vec::new, |(o, c)| vec![o, c]),
            Self::KimiK3(m) => vec![m.open, m.close, m.sep],
        }
    }

    /// Whether the family separates reasoning from content (then every
    /// chat turn is parsed, tools or not).
    pub fn has_reasoning(&self) -> bool {
        matches!(self, Self::KimiK3(_))
    }

    /// The template variable `reasoning_effort` maps onto, when the
    /// family's template has one.
    pub fn reasoning_knob(&self) -> Option<&'static str> {
        match self {
            Self::Hermes(_) => None,
            Self::KimiK3(_) => Some("thinking_effort"),
        }
    }

    /// Whether the template opens the thinking channel, given the
    /// template variables the request sets (K3: `thinking`, true unless
    /// set to a false value).
    pub fn thinking(&self, vars: &serde_json::Map<String, Value>) -> bool {
        match self {
            Self::Hermes(_) => false,
            Self::KimiK3(_) => vars.get("thinking").is_none_or(truthy),
        }
    }

    /// The parser for one turn, or `None` when the text goes out as it is
    /// (Hermes without active tools).
    pub fn parser(&self, setup: TurnSetup) -> Option<Box<dyn TurnStream>> {
        match self {
            Self::Hermes(_) if !setup.parse_calls => None,
            Self::Hermes(m) => {
                let mut s = ToolCallStream::new(setup.names);
                if let Some((open, close)) = m.call {
                    s = s.with_markers(open, close);
                }
                Some(Box::new(hermes::HermesStream(s)))
            }
            Self::KimiK3(m) => Some(Box::new(K3Stream::new(
                *m,
                setup.thinking,
                setup.names,
                setup.parse_calls,
            ))),
        }
    }

    /// The id of a call: K3 (Moonshot's form) `functions.NAME:IDX` with
    /// IDX counting the calls before it in the conversation; Hermes a
    /// random `call_` id.
    pub fn call_id(&self, name: &str, index: usize, random: impl FnOnce() -> String) -> String {
        match self {
            Self::Hermes(_) => random(),
            Self::KimiK3(_) => format!("functions.{name}:{index}"),
        }
    }

    /// The Lark grammar forcing a call in the family's own markup, or
    /// `None` for Hermes (whose grammar is [`crate::grammar::GrammarSpec::ToolCalls`]).
    /// `tools` carry argument schemas with the grammar layout added.
    pub fn forced_calls_lark(
        &self,
        tools: &[(String, Value)],
        parallel: bool,
        thinking: bool,
    ) -> Option<String> {
        match self {
            Self::Hermes(_) => None,
            Self::KimiK3(m) => Some(m.forced_calls_lark(tools, parallel, thinking)),
        }
    }
}

impl ChatFormat {
    /// The template variables of a request: its `chat_template_kwargs`,
    /// plus what its `reasoning_effort` maps to in the family's own knob
    /// (a variable the kwargs set themselves wins).
    ///
    /// Errors: a 400 naming `reasoning_effort` (or the field it came from,
    /// `knobs.effort_param`) when the family's template has no reasoning
    /// knob; another API's `none` is honoured there (no thinking).
    pub fn template_vars(
        &self,
        knobs: &ChatKnobs,
    ) -> Result<serde_json::Map<String, Value>, ApiError> {
        let mut vars = knobs.template_vars.clone();
        let Some(effort) = &knobs.reasoning_effort else {
            return Ok(vars);
        };
        let mapped = match self {
            // Another API's explicit "no thinking" (Anthropic's `thinking:
            // disabled`, Responses' `reasoning.effort: none`) is what a
            // family without a reasoning channel does anyway.
            Self::Hermes(_) if effort == "none" && knobs.effort_param.is_some() => return Ok(vars),
            Self::Hermes(_) => {
                let param = knobs.effort_param.unwrap_or("reasoning_effort");
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "'{param}' is not supported: the served model's chat template has no \
                         reasoning-effort knob."
                    ),
                )
                .with_code("unsupported_parameter"));
            }
            Self::KimiK3(_) => kimi_k3::effort_vars(effort),
        };
        for (k, v) in mapped {
            vars.entry(k.to_owned()).or_insert(v);
        }
        Ok(vars)
    }
}

impl ChatFormat {
    /// The Lark grammar for a JSON answer (`schema` with the grammar
    /// layout added) in the family's markup, or `None` when the answer is
    /// the bare JSON (Hermes).
    pub fn json_answer_lark(&self, schema: &Value, thinking: bool) -> Option<String> {
        match self {
            Self::Hermes(_) => None,
            Self::KimiK3(m) => Some(m.json_answer_lark(schema, thinking)),
        }
    }
}

/// Jinja truthiness of a template variable.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}
