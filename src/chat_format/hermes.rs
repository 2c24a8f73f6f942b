//! The Hermes / Qwen2.5 family: calls as `<tool_call>{json}</tool_call>`
//! blocks (parsed by [`ToolCallStream`]), no reasoning channel, no
//! template knob for reasoning effort; the turn is parsed only when tools
//! are active. Where the vocabulary has both tags as tokens of their own
//! ([`HermesMarkers`]), a tag counts only as its token: spelled in text it
//! is text, and forced calls write the tokens.

use super::{TurnPiece, TurnStream};
use crate::api::tool_calls::{ToolCallStream, ToolOutput};

/// The tag opening a call.
pub const OPEN: &str = "<tool_call>";
/// The tag closing a call.
pub const CLOSE: &str = "</tool_call>";

/// Hermes call parsing as a [`TurnStream`].
pub struct HermesStream(pub ToolCallStream);

fn map(outs: Vec<(ToolOutput, usize)>) -> Vec<(TurnPiece, usize)> {
    outs.into_iter()
        .map(|(o, end)| match o {
            ToolOutput::Content(c) => (TurnPiece::Content(c), end),
            ToolOutput::Call(c) => (TurnPiece::Call(c), end),
        })
        .collect()
}

/// The ids of the Hermes tags in one tokenizer, where both are tokens of
/// their own (`None`: tags are only text, found in the text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HermesMarkers {
    /// `<tool_call>` and `</tool_call>`.
    pub call: Option<(u32, u32)>,
}

impl TurnStream for HermesStream {
    fn push(&mut self, text: &str, markers: &[(usize, u32)]) -> Vec<(TurnPiece, usize)> {
        map(self.0.push_marked(text, markers))
    }
    fn finish(&mut self) -> Vec<(TurnPiece, usize)> {
        map(self.0.finish())
    }
    fn calls(&self) -> usize {
        self.0.calls()
    }
}
