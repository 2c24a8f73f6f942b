//! The Hermes / Qwen2.5 family: calls as `<tool_call>{json}</tool_call>`
//! blocks in plain text (parsed by [`ToolCallStream`]), no reasoning
//! channel, no template knob for reasoning effort. Today's behaviour,
//! unchanged: the turn is parsed only when tools are active.

use super::{TurnPiece, TurnStream};
use crate::api::tool_calls::{ToolCallStream, ToolOutput};

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

impl TurnStream for HermesStream {
    fn push(&mut self, text: &str) -> Vec<(TurnPiece, usize)> {
        map(self.0.push(text))
    }
    fn finish(&mut self) -> Vec<(TurnPiece, usize)> {
        map(self.0.finish())
    }
    fn calls(&self) -> usize {
        self.0.calls()
    }
}
