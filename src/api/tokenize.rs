//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: parsing and
//! validation of the bodies into [`TokenizeRequest`] / [`DetokenizeRequest`],
//! and the response bodies.
//!
//! Unlike the generation routes, these bodies are strict: an unknown field
//! is a 400 naming it (vLLM's own extras that this server does not
//! implement, such as `chat_template` or `tools`, are refused as
//! unsupported). JSON `null` is the same as an absent field. Token ids are
//! checked against the vocabulary by the caller, who knows the model.

use serde::Serialize;

use super::error::ApiError;
use super::json::Obj;
use super::json::{as_bool, as_int, as_str, get, kind_of, missing, parse_object, type_err};
use super::messages::parse_messages;
use crate::tokenizer::ChatMessage;

/// What `/tokenize` is asked to encode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeInput {
    /// `{"prompt": ..}`: raw text, encoded as `/v1/completions` encodes it.
    Prompt {
        text: String,
        /// Add the model's BOS where it asks for one (vLLM's default: true).
        add_special_tokens: bool,
    },
    /// `{"messages": [..]}`: chat turns rendered with the chat template and
    /// encoded as `/v1/chat/completions` encodes them.
    /// Invariant: `messages` is non-empty with valid roles (as for chat).
    Chat {
        messages: Vec<ChatMessage>,
        /// End with the assistant turn header (vLLM's default: true).
        add_generation_prompt: bool,
        /// Add BOS on top of what the template writes (vLLM's default:
        /// false, which is what generation does).
        add_special_tokens: bool,
        /// `chat_template_kwargs` and `reasoning_effort`, as chat
        /// completions take them.
        knobs: super::knobs::ChatKnobs,
    },
}

/// A valid `POST /tokenize` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeRequest {
    /// The `model` field if given (the caller checks it is the served one).
    pub model: Option<String>,
    pub input: TokenizeInput,
    /// vLLM's `return_token_strs`: also answer each id's vocabulary string.
    pub return_token_strs: bool,
}

/// A valid `POST /detokenize` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetokenizeRequest {
    /// The `model` field if given (the caller checks it is the served one).
    pub model: Option<String>,
    /// Each in `0..=u32::MAX`; not yet checked against the vocabulary.
    pub tokens: Vec<u32>,
}

/// The body of a `/tokenize` answer (vLLM's `TokenizeResponse`).
/// Invariant: `count == tokens.len()`, and `token_strs`, when present, has
/// one entry per token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    /// The model's context length (prompt and output together).
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    /// Present only when the request set `return_token_strs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

impl TokenizeResponse {
    /// The answer for `tokens` (`count` follows from them).
    pub fn new(tokens: Vec<u32>, max_model_len: usize, token_strs: Option<Vec<String>>) -> Self {
        Self {
            count: tokens.len(),
            max_model_len,
            tokens,
            token_strs,
        }
    }
}

/// The body of a `/detokenize` answer (vLLM's `DetokenizeResponse`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// Fields of the prompt form, then of the chat form (`model` and
/// `return_token_strs` belong to both).
const PROMPT_FIELDS: [&str; 4] = ["model", "prompt", "add_special_tokens", "return_token_strs"];
const CHAT_FIELDS: [&str; 8] = [
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
    "chat_template_kwargs",
    "reasoning_effort",
];
/// vLLM's chat-form extras this server does not implement.
const UNSUPPORTED: [&str; 4] = [
    "chat_template",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
];

/// Parses a `POST /tokenize` body: `{"model"?, "prompt", "add_special_tokens"?,
/// "return_token_strs"?}` or `{"model"?, "messages", "add_generation_prompt"?,
/// "continue_final_message"?, "add_special_tokens"?, "return_token_strs"?}`.
///
/// Errors (all 400, `param` naming the field): body not JSON or not an
/// object; neither or both of `prompt` and `messages`; a wrong type; bad
/// `messages` (as for chat completions); an unknown field or one of the
/// other form; `continue_final_message: true` or one of vLLM's template
/// extras (`unsupported_parameter`).
pub fn parse_tokenize(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    let map = parse_object(body)?;
    let chat = match (get(&map, "prompt"), get(&map, "messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "Give either 'prompt' or 'messages', not both.",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "Missing required parameter: 'prompt' (or 'messages' for a chat).",
            ))
        }
        (_, messages) => messages.is_some(),
    };
    let (own, other, form) = if chat {
        (&CHAT_FIELDS[..], &PROMPT_FIELDS[..], "'messages'")
    } else {
        (&PROMPT_FIELDS[..], &CHAT_FIELDS[..], "'prompt'")
    };
    check_fields(&map, own, |k| {
        if UNSUPPORTED.contains(&k) {
            ApiError::unsupported(k, format!("'{k}' is not supported by this server."))
        } else if other.contains(&k) {
            ApiError::invalid(k, format!("Field '{k}' cannot be used with {form}."))
        } else {
            unknown_field(k, own)
        }
    })?;
    let model = opt_str(&map, "model")?;
    let return_token_strs = opt_bool(&map, "return_token_strs")?.unwrap_or(false);
    let input = if chat {
        if opt_bool(&map, "continue_final_message")? == Some(true) {
            return Err(ApiError::unsupported(
                "continue_final_message",
                "continue_final_message is not supported by this server.",
            ));
        }
        TokenizeInput::Chat {
            messages: parse_messages(&map)?,
            add_generation_prompt: opt_bool(&map, "add_generation_prompt")?.unwrap_or(true),
            add_special_tokens: opt_bool(&map, "add_special_tokens")?.unwrap_or(false),
            knobs: super::knobs::parse_knobs(&map)?,
        }
    } else {
        let v = get(&map, "prompt").ok_or_else(|| missing("prompt"))?;
        TokenizeInput::Prompt {
            text: as_str(v, "prompt")?.to_owned(),
            add_special_tokens: opt_bool(&map, "add_special_tokens")?.unwrap_or(true),
        }
    };
    Ok(TokenizeRequest {
        model,
        input,
        return_token_strs,
    })
}

/// Parses a `POST /detokenize` body: `{"model"?, "tokens": [id, ..]}`.
///
/// Errors (all 400): body not JSON or not an object; `tokens` missing, not
/// an array, or holding anything but integers in `0..=4294967295` (param
/// `tokens`); an unknown field (param: its name).
pub fn parse_detokenize(body: &[u8]) -> Result<DetokenizeRequest, ApiError> {
    const FIELDS: [&str; 2] = ["model", "tokens"];
    let map = parse_object(body)?;
    check_fields(&map, &FIELDS, |k| unknown_field(k, &FIELDS))?;
    let model = opt_str(&map, "model")?;
    let v = get(&map, "tokens").ok_or_else(|| missing("tokens"))?;
    let items = v
        .as_array()
        .ok_or_else(|| type_err("tokens", "an array of token ids", v))?;
    let tokens = items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let bad = |what: String| {
                ApiError::invalid("tokens", format!("Invalid 'tokens[{i}]': {what}."))
            };
            let id = as_int(t, "tokens")
                .map_err(|_| bad(format!("expected a token id, but got {}", kind_of(t))))?;
            u32::try_from(id).map_err(|_| bad(format!("{id} is not a token id")))
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    Ok(DetokenizeRequest { model, tokens })
}

/// The 400 for a field outside `known`, which it lists.
fn unknown_field(k: &str, known: &[&str]) -> ApiError {
    ApiError::invalid(
        k,
        format!(
            "Unknown field '{k}': expected {}.",
            known
                .iter()
                .map(|f| format!("'{f}'"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// The first field (in the body's order) outside `known`, as `err` says.
/// A null counts: a misspelt key is a mistake whatever its value.
fn check_fields(map: &Obj, known: &[&str], err: impl Fn(&str) -> ApiError) -> Result<(), ApiError> {
    match map.keys().find(|k| !known.contains(k)) {
        Some(k) => Err(err(k)),
        None => Ok(()),
    }
}

fn opt_str(map: &Obj, key: &str) -> Result<Option<String>, ApiError> {
    get(map, key)
        .map(|v| as_str(v, key).map(str::to_owned))
        .transpose()
}

fn opt_bool(map: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    get(map, key).map(|v| as_bool(v, key)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn tok(v: Value) -> Result<TokenizeRequest, ApiError> {
        parse_tokenize(v.to_string().as_bytes())
    }

    fn detok(v: Value) -> Result<DetokenizeRequest, ApiError> {
        parse_detokenize(v.to_string().as_bytes())
    }

    fn param(r: Result<impl std::fmt::Debug, ApiError>) -> String {
        let e = r.expect_err("should be refused");
        assert_eq!(e.status(), 400, "{e:?}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn prompt_form_defaults_as_vllm() {
        let r = tok(json!({"prompt": "hi"})).unwrap();
        assert_eq!(r.model, None);
        assert!(!r.return_token_strs);
        assert_eq!(
            r.input,
            TokenizeInput::Prompt {
                text: "hi".into(),
                add_special_tokens: true
            }
        );
        let r = tok(json!({"model": "m", "prompt": "", "add_special_tokens": false, "return_token_strs": true}))
            .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.return_token_strs);
        assert!(matches!(
            r.input,
            TokenizeInput::Prompt {
                add_special_tokens: false,
                ..
            }
        ));
    }

    #[test]
    fn chat_form_defaults_as_vllm() {
        let r =
            tok(json!({"messages": [{"role": "user", "content": "hi"}], "model": null})).unwrap();
        assert_eq!(r.model, None);
        assert_eq!(
            r.input,
            TokenizeInput::Chat {
                messages: vec![ChatMessage::new("user", "hi")],
                add_generation_prompt: true,
                add_special_tokens: false,
                knobs: Default::default(),
            }
        );
        let r = tok(json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false, "continue_final_message": false}))
            .unwrap();
        assert!(matches!(
            r.input,
            TokenizeInput::Chat {
                add_generation_prompt: false,
                ..
            }
        ));
    }

    #[test]
    fn tokenize_refusals_name_the_field() {
        let m = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({}), "prompt"),
            (json!({"prompt": "a", "messages": m}), "messages"),
            (json!({"prompt": 3}), "prompt"),
            (json!({"prompt": ["a"]}), "prompt"),
            (json!({"prompt": "a", "model": 1}), "model"),
            (
                json!({"prompt": "a", "add_special_tokens": "yes"}),
                "add_special_tokens",
            ),
            (
                json!({"prompt": "a", "return_token_strs": 1}),
                "return_token_strs",
            ),
            (json!({"prompt": "a", "temperature": 1}), "temperature"),
            (
                json!({"prompt": "a", "add_generation_prompt": true}),
                "add_generation_prompt",
            ),
            (json!({"prompt": "a", "extra": null}), "extra"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (json!({"messages": m, "prompt_extra": 1}), "prompt_extra"),
            (
                json!({"messages": m, "add_generation_prompt": 1}),
                "add_generation_prompt",
            ),
            (
                json!({"messages": m, "chat_template": "x"}),
                "chat_template",
            ),
            (
                json!({"messages": m, "continue_final_message": true}),
                "continue_final_message",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(param(tok(body.clone())), want, "{body}");
        }
        let e = tok(json!({"messages": m, "tools": []})).unwrap_err();
        assert_eq!(e.code.as_deref(), Some("unsupported_parameter"));
        assert_eq!(tok(json!([1])).unwrap_err().status(), 400);
        assert_eq!(parse_tokenize(b"{").unwrap_err().status(), 400);
    }

    #[test]
    fn detokenize_parses_ids_and_refuses_the_rest() {
        let r = detok(json!({"model": "m", "tokens": [0, 5, 4294967295u64]})).unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.tokens, vec![0, 5, u32::MAX]);
        assert!(detok(json!({"tokens": []})).unwrap().tokens.is_empty());
        for body in [
            json!({}),
            json!({"tokens": null}),
            json!({"tokens": "1 2"}),
            json!({"tokens": [1, -1]}),
            json!({"tokens": [4294967296u64]}),
            json!({"tokens": [1.5]}),
            json!({"tokens": ["1"]}),
        ] {
            assert_eq!(param(detok(body.clone())), "tokens", "{body}");
        }
        let e = detok(json!({"tokens": [1, -1]})).unwrap_err();
        assert!(e.message.contains("tokens[1]"), "{}", e.message);
        assert_eq!(param(detok(json!({"tokens": [], "prompt": "x"}))), "prompt");
    }

    #[test]
    fn responses_have_vllm_shapes() {
        let r = TokenizeResponse::new(vec![3, 4], 128, None);
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"count":2,"max_model_len":128,"tokens":[3,4]}"#
        );
        let r = TokenizeResponse::new(vec![3], 128, Some(vec!["a".into()]));
        assert_eq!(
            serde_json::to_value(&r).unwrap()["token_strs"],
            json!(["a"])
        );
        let d = DetokenizeResponse {
            prompt: "hi".into(),
        };
        assert_eq!(serde_json::to_string(&d).unwrap(), r#"{"prompt":"hi"}"#);
    }
}
