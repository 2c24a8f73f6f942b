//! The routes around generation: `GET /v1/models` (with the context length
//! and speculative method), `POST /tokenize` and `POST /detokenize` (vLLM's
//! shapes), `GET /version`. Tokenizing here uses exactly the encoding the
//! generation routes use, so `/tokenize` counts what a request would cost.

use super::admission::Admit;
use super::{json_response, read_body, AppState, Backend, ResBody};
use crate::api::{
    self, ApiError, DetokenizeResponse, ModelCard, ModelList, TokenizeInput, TokenizeRequest,
    TokenizeResponse, VersionInfo,
};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use std::sync::Arc;

/// `GET /v1/models`: the one served model. Once the model is loaded the
/// card carries the most tokens one request may hold (context and KV pool)
/// and the server's speculative method;
/// while it loads, OpenAI's fields only.
pub(super) fn models(state: &AppState) -> Response<ResBody> {
    let mut card = ModelCard::new(&state.settings.model_name, state.created, "specgate");
    if let Some(b) = state.backend.get() {
        // The real limit of one request: the context, or the KV pool's
        // room when that is smaller (vLLM's `max_model_len`).
        card = card.serving(
            b.engine.max_request_tokens(),
            b.engine.speculative_method().into(),
        );
    }
    ok_json(&ModelList::new(vec![card]))
}

/// `GET /version`: the crate version and how the binary was built.
pub(super) fn version() -> Response<ResBody> {
    ok_json(&VersionInfo::current())
}

/// `POST /tokenize`: a prompt or chat turns -> token ids, encoded as the
/// completion or chat route would encode them.
///
/// Runs under `admit`, as generation does (encoding a long prompt costs
/// the same CPU).
///
/// Errors: 400 (body, fields, a prompt the tokenizer cannot encode), 404 for
/// a `model` that is not the served one, 503 while loading.
pub(super) async fn tokenize(
    state: Arc<AppState>,
    req: Request<Incoming>,
    admit: Admit,
) -> Result<Response<ResBody>, ApiError> {
    state.backend()?;
    let body = read_body(&state, req.into_body()).await?;
    let t = api::parse_tokenize(&body)?;
    drop(body);
    check_model(&state, t.model.as_deref())?;
    if let TokenizeInput::Chat { messages, .. } = &t.input {
        super::check_message_count(&state, messages.len())?;
    }
    let answer = off_runtime(state, admit, move |b| encode(b, &t)).await?;
    Ok(ok_json(&answer))
}

/// `POST /detokenize`: token ids -> text (special tokens included, as
/// vLLM decodes them).
///
/// Runs under `admit`.
///
/// Errors: 400 (body, fields, an id outside the vocabulary, naming its
/// index), 404 for a `model` that is not the served one, 503 while loading.
pub(super) async fn detokenize(
    state: Arc<AppState>,
    req: Request<Incoming>,
    admit: Admit,
) -> Result<Response<ResBody>, ApiError> {
    state.backend()?;
    let body = read_body(&state, req.into_body()).await?;
    let d = api::parse_detokenize(&body)?;
    drop(body);
    check_model(&state, d.model.as_deref())?;
    let answer = off_runtime(state, admit, move |b| {
        let tok = &b.tokenizer;
        let vocab = tok.vocab_size();
        if let Some((i, id)) = d
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            return Err(ApiError::invalid(
                "tokens",
                format!(
                    "Invalid 'tokens[{i}]': token id {id} is outside the vocabulary of {vocab} ids."
                ),
            ));
        }
        let prompt = tok
            .decode(&d.tokens, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(DetokenizeResponse { prompt })
    })
    .await?;
    Ok(ok_json(&answer))
}

/// `POST /v1/messages/count_tokens` (Anthropic's): the prompt tokens a
/// Messages request would cost, `{"input_tokens": n}`, counted on the
/// prompt generation builds (template, tools, thinking switch).
///
/// Takes the limits of the request it counts: the body cap, the message
/// bound (checked before any message is read, and again on the turns the
/// messages became, as generation does), the template's fuel.
///
/// Runs under `admit`. Errors (Anthropic's body): 400 for the body and for
/// more than `server.max_messages` turns, 413 for a body over the cap, 404
/// for a `model` that is not the served one, 503 while loading.
pub(super) async fn count_tokens(
    state: Arc<AppState>,
    req: Request<Incoming>,
    admit: Admit,
) -> Result<Response<ResBody>, ApiError> {
    state.backend()?;
    let body = read_body(&state, req.into_body()).await?;
    let v = api::anthropic::parse_count_tokens(&body, state.settings.max_messages)?;
    drop(body);
    check_model(&state, Some(&v.model))?;
    if let api::Input::Chat(turns) = &v.input {
        super::check_message_count(&state, turns.len())?;
    }
    let n = off_runtime(state, admit, move |b| super::generate::count_prompt(b, &v)).await?;
    Ok(ok_json(&serde_json::json!({ "input_tokens": n })))
}

/// A `model` field, when given, must name the served model (404 otherwise,
/// as on the generation routes).
fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.settings.model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// Runs `work` as a bounded blocking job holding `admit` (see
/// `admission`): encoding a large prompt or rendering a template takes
/// milliseconds of CPU, which the runtime's few threads should spend moving
/// other connections.
async fn off_runtime<T: Send + 'static>(
    state: Arc<AppState>,
    admit: Admit,
    work: impl FnOnce(&Backend) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let st = state.clone();
    let (out, _admit) = state
        .admission
        .run_blocking(admit, move || st.backend().and_then(work))
        .await?;
    out
}

/// The ids of `t`, as generation would build its prompt: a raw prompt gets
/// the model's BOS when `add_special_tokens` (the completion route always
/// asks); chat turns go through `encode_chat_with_vars` with the request's
/// template knobs, as the chat route does,
/// with BOS added on top only when asked (vLLM's semantics).
fn encode(b: &Backend, t: &TokenizeRequest) -> Result<TokenizeResponse, ApiError> {
    let tok = &b.tokenizer;
    let tokens = match &t.input {
        TokenizeInput::Prompt {
            text,
            add_special_tokens,
        } => tok
            .encode(text, *add_special_tokens)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            add_special_tokens,
            knobs,
        } => {
            let vars = crate::chat_format::ChatFormat::detect(tok).template_vars(knobs)?;
            let mut ids = tok
                .encode_chat_with_vars(messages, None, &vars, *add_generation_prompt)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            if *add_special_tokens && tok.add_bos_token() {
                ids.splice(0..0, tok.bos_token_id());
            }
            ids
        }
    };
    let token_strs = t.return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&id| tok.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse::new(
        tokens,
        b.engine.max_request_tokens(),
        token_strs,
    ))
}

fn ok_json<T: serde::Serialize>(body: &T) -> Response<ResBody> {
    match serde_json::to_string(body) {
        Ok(text) => json_response(StatusCode::OK, text),
        Err(e) => super::error_response(&ApiError::internal(e.to_string())),
    }
}
