//! Completions' `prompt`: text (a string, or a list of one string) or
//! token ids (`[int]`, or `[[int]]` of one list), as OpenAI and vLLM take
//! it. Each bad shape is a 400 naming `prompt`.

use super::error::ApiError;
use super::json::{as_int, get, kind_of, missing, type_err};
use super::json::{Json, Obj};
use crate::tokenizer::ChatMessage;

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Chat turns, to be rendered with the model's chat template.
    /// Invariant: non-empty; roles are `system`, `user`, `assistant` or
    /// `tool`; only assistant turns carry `tool_calls` (arguments parsed
    /// JSON), only tool turns carry `tool_call_id`.
    Chat(Vec<ChatMessage>),
    /// Raw prompt text (`/v1/completions`), used as is.
    Prompt(String),
    /// A prompt given as token ids (`/v1/completions`, `[int]` or
    /// `[[int]]` of one), used as is: no BOS added. Invariant: non-empty.
    /// Whether the ids are the model's is the caller's check.
    Tokens(Vec<u32>),
}

/// `prompt`: a string, a list of one string, or token ids (`[int]`, or
/// `[[int]]` of one list), as OpenAI and vLLM take it.
pub(super) fn parse_prompt(map: &Obj) -> Result<Input, ApiError> {
    let one = || {
        ApiError::invalid(
            "prompt",
            "Invalid 'prompt': exactly one prompt is supported (a string, a list of one \
             string, a list of token ids, or a list of one list of token ids).",
        )
    };
    match get(map, "prompt") {
        Some(Json::String(s)) => Ok(Input::Prompt(s.to_string())),
        Some(Json::Array(items)) => match items.items().as_slice() {
            [Json::String(s)] => Ok(Input::Prompt(s.to_string())),
            [Json::Array(ids)] => prompt_ids(&ids.items()),
            items @ [Json::Number(_), ..] => prompt_ids(items),
            [] => Err(ApiError::invalid("prompt", "Invalid 'prompt': the list is empty.")),
            [other] => Err(ApiError::invalid(
                "prompt",
                format!(
                    "Invalid 'prompt': a list prompt must hold one string or token ids, but got {} instead.",
                    kind_of(other)
                ),
            )),
            _ => Err(one()),
        },
        Some(other) => Err(type_err("prompt", "a string or a list of token ids", other)),
        None => Err(missing("prompt")),
    }
}

/// A prompt of token ids: each an integer in `0..2^32` (the vocabulary is
/// checked once the model is known), at least one.
fn prompt_ids(items: &[Json]) -> Result<Input, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "Invalid 'prompt': the list of token ids is empty.",
        ));
    }
    items
        .iter()
        .map(|item| {
            let n = as_int(item, "prompt")?;
            u32::try_from(n).map_err(|_| {
                ApiError::invalid(
                    "prompt",
                    format!("Invalid 'prompt': {n} is not a token id."),
                )
            })
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Input::Tokens)
}
