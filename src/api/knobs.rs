//! The chat template knobs of a request (chat completions and `/tokenize`'s
//! chat form): `chat_template_kwargs`, an object of template variables
//! (vLLM's and SGLang's field), and `reasoning_effort` (OpenAI's), which the
//! http layer maps onto the model family's own template variable or
//! refuses with a 400 naming it when the family has none.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::json::Obj;
use super::json::{as_str, get, type_err};

/// Variables the server itself sets in the template: a client may not
/// replace them through `chat_template_kwargs`.
pub const RESERVED_TEMPLATE_VARS: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// `reasoning_effort` values a request may give (OpenAI's, plus `max`).
pub const REASONING_EFFORTS: &[&str] =
    &["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// A chat request's template knobs.
///
/// Invariants: no key of `template_vars` is in [`RESERVED_TEMPLATE_VARS`];
/// `reasoning_effort` is one of [`REASONING_EFFORTS`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatKnobs {
    /// `chat_template_kwargs`: extra template variables.
    pub template_vars: Map<String, Value>,
    pub reasoning_effort: Option<String>,
    /// The wire field `reasoning_effort` came from when another API's
    /// field stands for it (Responses' `reasoning.effort`, Anthropic's
    /// `thinking`): errors name it. `None`: chat's own `reasoning_effort`.
    pub effort_param: Option<&'static str>,
}

/// `chat_template_kwargs` and `reasoning_effort` of `map`.
///
/// Errors (400 naming the field): `chat_template_kwargs` not an object or
/// setting a reserved variable (`chat_template_kwargs.messages`);
/// `reasoning_effort` not one of [`REASONING_EFFORTS`].
pub(super) fn parse_knobs(map: &Obj) -> Result<ChatKnobs, ApiError> {
    let mut knobs = ChatKnobs::default();
    if let Some(v) = get(map, "chat_template_kwargs") {
        let obj = v
            .as_object()
            .ok_or_else(|| type_err("chat_template_kwargs", "an object", v))?;
        if let Some(k) = obj.keys().find(|k| RESERVED_TEMPLATE_VARS.contains(k)) {
            let p = format!("chat_template_kwargs.{k}");
            return Err(ApiError::invalid(
                &p,
                format!("'{p}' is set by the server and cannot be given as a template variable."),
            ));
        }
        knobs.template_vars = obj.to_map();
    }
    if let Some(v) = get(map, "reasoning_effort") {
        let e = as_str(v, "reasoning_effort")?;
        if !REASONING_EFFORTS.contains(&e) {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!(
                    "Invalid value '{e}' for 'reasoning_effort': expected one of {}.",
                    REASONING_EFFORTS.join(", ")
                ),
            ));
        }
        knobs.reasoning_effort = Some(e.to_owned());
    }
    Ok(knobs)
}
