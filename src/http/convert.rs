//! Where the wire types (`crate::api`) and the engine's types meet: the
//! api module knows no engine type and the engine knows no wire name, so
//! every mapping between the two lives here, once. In particular an
//! [`EngineError`] becomes an HTTP error only through the `From` impl
//! below.

use crate::api::{self, ApiError};
use crate::engine::{self, EngineError, RequestPart};

// The wire's cap on `speculative.num_tokens` and the engine's must agree,
// or a request the parser accepts would be refused by the engine.
const _: () = assert!(api::MAX_SPECULATIVE_TOKENS == engine::MAX_SPECULATIVE_TOKENS);

impl From<api::SpecMethod> for engine::SpecMethod {
    fn from(m: api::SpecMethod) -> Self {
        match m {
            api::SpecMethod::Off => engine::SpecMethod::Off,
            api::SpecMethod::Ngram => engine::SpecMethod::Ngram,
            api::SpecMethod::Draft => engine::SpecMethod::Draft,
        }
    }
}

impl From<engine::SpecMethod> for api::SpecMethod {
    fn from(m: engine::SpecMethod) -> Self {
        match m {
            engine::SpecMethod::Off => api::SpecMethod::Off,
            engine::SpecMethod::Ngram => api::SpecMethod::Ngram,
            engine::SpecMethod::Draft => api::SpecMethod::Draft,
        }
    }
}

impl From<engine::FinishReason> for api::FinishReason {
    fn from(r: engine::FinishReason) -> Self {
        match r {
            engine::FinishReason::Stop => api::FinishReason::Stop,
            engine::FinishReason::Length => api::FinishReason::Length,
        }
    }
}

impl From<engine::Usage> for api::Usage {
    fn from(u: engine::Usage) -> Self {
        Self::new(u.prompt_tokens, u.completion_tokens)
    }
}

/// An engine error as one request met it. The engine names the part of its
/// request at fault ([`RequestPart`]); which wire field held the prompt
/// depends on the route (`messages` for a chat, `prompt` otherwise), so the
/// handler says it here.
#[derive(Debug)]
pub(super) struct EngineFailure {
    pub error: EngineError,
    /// The wire name of the field the prompt came from.
    pub prompt_param: &'static str,
}

impl From<EngineFailure> for ApiError {
    /// `Rejected` is a 400 naming the wire field of the part at fault;
    /// `Stopped` is a 503; `Invalid` (a setting, never a request's fault)
    /// is a 500.
    fn from(f: EngineFailure) -> Self {
        match f.error {
            EngineError::Rejected { part, message } => {
                let param = match part {
                    RequestPart::Prompt => f.prompt_param,
                    RequestPart::MaxNewTokens => "max_tokens",
                    RequestPart::Method => "speculative.method",
                    RequestPart::NumSpeculativeTokens => "speculative.num_tokens",
                    RequestPart::LogitBias => "logit_bias",
                    RequestPart::Logprobs => "logprobs",
                    RequestPart::PromptLogprobs => "prompt_logprobs",
                    RequestPart::Grammar => "response_format",
                };
                ApiError::invalid(param, sentence(&message))
            }
            EngineError::Stopped => ApiError::unavailable("The engine has stopped."),
            EngineError::Invalid(message) => ApiError::internal(sentence(&message)),
        }
    }
}

/// An engine message (a lowercase clause, as Rust errors are written) in
/// the style of the API's own messages (OpenAI's): capitalized, ending with
/// a period.
fn sentence(message: &str) -> String {
    let mut chars = message.chars();
    let mut out: String = match chars.next() {
        Some(c) => c.to_uppercase().chain(chars).collect(),
        None => return String::new(),
    };
    if !out.ends_with(['.', '!', '?']) {
        out.push('.');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(error: EngineError) -> ApiError {
        EngineFailure {
            error,
            prompt_param: "messages",
        }
        .into()
    }

    #[test]
    fn engine_errors_become_one_http_error_each() {
        let rejected = |part| EngineError::Rejected {
            part,
            message: "too long".into(),
        };
        for (part, param) in [
            (RequestPart::Prompt, "messages"),
            (RequestPart::MaxNewTokens, "max_tokens"),
            (RequestPart::Method, "speculative.method"),
            (RequestPart::NumSpeculativeTokens, "speculative.num_tokens"),
            (RequestPart::LogitBias, "logit_bias"),
            (RequestPart::Logprobs, "logprobs"),
            (RequestPart::PromptLogprobs, "prompt_logprobs"),
            (RequestPart::Grammar, "response_format"),
        ] {
            let e = failure(rejected(part));
            assert_eq!(e.status(), 400);
            assert_eq!(e.param.as_deref(), Some(param), "{part:?}");
            assert_eq!(e.message, "Too long.", "engine text in the API's style");
        }
        assert_eq!(failure(EngineError::Stopped).status(), 503);
        assert_eq!(failure(EngineError::Invalid("x".into())).status(), 500);
    }

    #[test]
    fn wire_and_engine_types_map_both_ways() {
        for m in api::SpecMethod::ALL {
            let e: engine::SpecMethod = m.into();
            assert_eq!(api::SpecMethod::from(e), m);
        }
        let u: api::Usage = engine::Usage {
            prompt_tokens: 2,
            completion_tokens: 3,
        }
        .into();
        assert_eq!(u, api::Usage::new(2, 3));
        assert_eq!(
            api::FinishReason::from(engine::FinishReason::Length),
            api::FinishReason::Length
        );
        assert_eq!(
            api::FinishReason::from(engine::FinishReason::Stop),
            api::FinishReason::Stop
        );
    }
}
