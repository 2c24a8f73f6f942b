//! The generation routes, `POST /v1/chat/completions`, `POST /v1/completions`,
//! `POST /v1/responses` and `POST /v1/messages` (each body parsed into the
//! one [`ValidRequest`]; the output shaped per API: `output.rs`,
//! `responses_out.rs`, `anthropic_out.rs`): validate, apply
//! the chat template, tokenize, check the context length, take an admission
//! permit (429 when none is left), submit to the engine, and answer whole or
//! as Server-Sent Events. Stop strings are applied to the text here; when
//! one appears the engine receiver is dropped, which cancels the sequence.
//!
//! Structured output: `response_format` (JSON object / schema) and a
//! `tool_choice` that forces calls (`required`, a named function) become a
//! grammar the engine decodes under, compiled in the grammar compiler's
//! own bounded queue (never on the blocking pool that templates and
//! tokenizes; a full queue is a 503 with `Retry-After`); forced calls are
//! written in the model family's own markup ([`crate::chat_format`]). A
//! chat turn is parsed by its family: for calls when tools are active (a
//! choice other than `none`), and always for a family with a reasoning
//! channel (Kimi K3), whose markers the engine then decodes as text for
//! the parser only. Order of the stages:
//! for Hermes, stop strings first, on the raw text (a stop string inside a
//! call block cuts it, and the unterminated block is then content), then
//! call parsing; for a family with reasoning, parsing first, then stop
//! strings on the content alone (markup and thinking never stop a turn).
//! `finish_reason` is `tool_calls` when the turn made calls and ended on
//! its own (EOS, stop token or stop string); `length` stays `length`.

use super::admission::Admit;
use super::anthropic_out::{self, MessagesOut};
use super::convert::EngineFailure;
use super::driver::{Driver, Piece};
use super::output::{
    chat_body, echo_logprobs, sse, Labels, Shaped, StreamShape, TokenWire, TurnLabels, TurnStage,
    WholeTurn,
};
use super::request_log::RequestLog;
use super::response_id;
use super::response_store::Conversation;
use super::responses_out::ResponsesOut;
use super::stop::{OffsetQueue, StopMatcher};
use super::Api;
use super::{json_response, read_body, AppState, Backend, ResBody, StreamFrame};
use crate::api::{
    self, ApiError, ChatCompletionChunk, Completion, CompletionLogprobs, Input, ResponseFormat,
    ValidRequest,
};
use crate::chat_format::{ChatFormat, TurnSetup};
use crate::engine::{GenRequest, SpecMethod};
use crate::grammar::{worker, GrammarError, GrammarSpec, Grammars};
use crate::tokenizer::ChatMessage;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use specgate_verify::TokenLogprob;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Handles a generation request end to end, under `admit` (taken before
/// the body is read, parsed, templated and tokenized: load is shed before
/// any work), which it holds until the answer ends.
pub(super) async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
    api: Api,
    admit: Admit,
) -> Result<Response<ResBody>, ApiError> {
    let arrived = Instant::now();
    let log = RequestLog::of(&req);
    let backend = state.backend()?;
    let tenant = super::tenant(&state, &req);
    let body = read_body(&state, req.into_body()).await?;
    // A large body is parsed (and its tool results matched to calls) on
    // the blocking pool, so it never stalls the runtime's threads.
    let (mut v, wire) = if body.len() >= BLOCKING_PARSE_BYTES {
        // As many large parses at once as there are cores: parsing is all
        // CPU, and each holds its transient memory only while it runs.
        let _slot = large_parse_slots()
            .acquire()
            .await
            .map_err(|_| ApiError::internal("The parse slots closed."))?;
        let st = state.clone();
        tokio::task::spawn_blocking(move || parse_wire(&st, api, &body, tenant))
            .await
            .map_err(|e| ApiError::internal(format!("Parsing the request failed: {e}.")))??
    } else {
        let parsed = parse_wire(&state, api, &body, tenant);
        drop(body);
        parsed?
    };
    // Tools the turn does not offer (`tool_choice: "none"`) are neither
    // rendered nor constrained to: their schemas are not kept while it runs.
    if !v.tools.active() {
        v.tools.tools.iter_mut().for_each(|t| t.parameters = None);
    }
    let chat = api != Api::Completions;
    log.set_model(&v.model);
    // Who sent it (`user`, `safety_identifier`, `metadata`): for the log
    // only, never shown to the model.
    if v.meta != api::RequestMeta::default() {
        tracing::debug!(
            request_id = log.id().as_str(),
            user = ?v.meta.user,
            safety_identifier = ?v.meta.safety_identifier,
            metadata = ?v.meta.metadata,
            "request client fields"
        );
    }
    if v.model != state.settings.model_name {
        return Err(ApiError::model_not_found(&v.model));
    }
    if let Input::Chat(msgs) = &v.input {
        super::check_message_count(&state, msgs.len())?;
    }
    let id = match api {
        // A stored response's id guards it (the only guard without keys):
        // random, never the client's `X-Request-Id` (which could name
        // another's response and replace it) nor a counter. Minted before
        // the engine is asked for anything.
        Api::Responses => response_id::mint().map_err(|e| {
            ApiError::internal(format!("The OS gave no randomness for a response id: {e}."))
        })?,
        // The request id, so a client's response id names its log line.
        _ => format!("{}{}", api.id_prefix(), log.id()),
    };
    // Templating and tokenizing take CPU: off the runtime's few threads,
    // so other connections keep moving. The job holds the admission: a
    // client hanging up meanwhile frees nothing while the job still runs.
    let st = state.clone();
    let ((v, built), permit) = state
        .admission
        .run_blocking(admit, move || {
            let built = st.backend().and_then(|b| build_request(b, &v));
            (v, built)
        })
        .await?;
    let (mut gen, param, turn, spec) = built?;
    // The grammar waits in the compiler's own queue, holding no blocking
    // place: grammars never keep other requests from templating.
    if let Some((spec, grammar_param)) = spec {
        gen.grammar = Some(compile_grammar(backend, &spec, grammar_param, tenant).await?);
    }
    gen.tenant = tenant;
    gen.cache_scope = super::cache_scope(&state, tenant, v.cache_salt.as_deref());
    let prompt_tokens = gen.prompt.len();
    let first_prompt_token = gen.prompt.first().copied();
    let method = gen.method;
    let rx = backend.engine.submit(gen).map_err(|error| EngineFailure {
        error,
        prompt_param: param,
    })?;
    log.submitted(prompt_tokens, method);
    // A chat turn is parsed by its family: for calls when tools are
    // active, and always for a family with a reasoning channel.
    let labels_turn = chat.then(|| TurnLabels {
        format: turn.format,
        parse_calls: v.tools.active(),
        prior_calls: match &v.input {
            Input::Chat(msgs) => msgs.iter().map(|m| m.tool_calls.len()).sum(),
            _ => 0,
        },
    });
    let parser = labels_turn.and_then(|t| {
        t.format.parser(TurnSetup {
            names: v.tools.names(),
            parse_calls: t.parse_calls,
            thinking: turn.thinking,
        })
    });
    let driver = Driver {
        rx: Some(rx),
        stop: StopMatcher::new(&v.stop),
        held: OffsetQueue::default(),
        pushed: 0,
        released: 0,
        marks: Default::default(),
        prompt_tokens,
        completion_tokens: 0,
        arrived,
        deadline: arrived + state.settings.request_timeout,
        last: None,
        pending: None,
        cut: state.cut.subscribe(),
        log: log.clone(),
        stage: TurnStage::new(parser),
        stop_on_content: chat && turn.format.has_reasoning(),
    };
    let labels = Labels {
        id,
        created: api::unix_now(),
        model: state.settings.model_name.clone(),
        turn: labels_turn,
        logprobs: v
            .logprobs
            .map(|n| TokenWire::new(backend.tokenizer.clone(), n)),
        echo: match &v.input {
            Input::Prompt(p) if v.echo => Some((p.clone(), first_prompt_token)),
            // Ids are echoed as their text, special tokens shown (as
            // `/detokenize` decodes them).
            Input::Tokens(ids) if v.echo => Some((
                backend.tokenizer.decode(ids, false).unwrap_or_default(),
                first_prompt_token,
            )),
            _ => None,
        },
    };
    if v.stream {
        Ok(stream(state, driver, labels, v.include_usage, permit, wire))
    } else {
        whole(state, driver, labels, permit, wire).await
    }
}

/// How one API's output is shaped, and what it needs besides [`Labels`].
pub(super) enum Wire {
    /// Chat completions and completions (`output.rs`).
    OpenAi,
    /// Anthropic Messages (`anthropic_out.rs`).
    Messages(MessagesOut),
    /// OpenAI Responses (`responses_out.rs`), and what the store keeps.
    Responses(Box<ResponsesWire>),
}

/// Bodies from this size on are parsed on the blocking pool.
const BLOCKING_PARSE_BYTES: usize = 256 << 10;

/// The slots large bodies are parsed in, one per core.
fn large_parse_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
    })
}

/// A Responses request's output side.
pub(super) struct ResponsesWire {
    out: ResponsesOut,
    /// Keep the finished response (`store`).
    store: bool,
    /// The store scope (the sender's key).
    scope: u64,
    /// The stored conversation this turn continues (shared, not copied).
    prior: Option<Arc<Conversation>>,
    /// This turn's new input turns (no `instructions`).
    new_turns: Vec<crate::tokenizer::ChatMessage>,
}

/// Parses `body` as `api`'s request into the one request type, and the
/// output side it needs. A Responses request's `previous_response_id` is
/// resolved here, in the sender's scope of the store.
///
/// Errors: the API's 400s; a 404 naming `previous_response_id` for an id
/// the sender's scope does not hold (never stored, deleted or evicted).
fn parse_wire(
    state: &AppState,
    api: Api,
    body: &[u8],
    tenant: u64,
) -> Result<(ValidRequest, Wire), ApiError> {
    Ok(match api {
        Api::Chat => (api::parse_chat(body)?, Wire::OpenAi),
        Api::Completions => (api::parse_completion(body)?, Wire::OpenAi),
        Api::Messages => (
            api::anthropic::parse_messages_request(body, state.settings.max_messages)?.valid,
            Wire::Messages(MessagesOut::default()),
        ),
        Api::Responses => {
            let r = api::responses::parse_responses_request(body)?;
            let prior = match &r.previous_response_id {
                None => None,
                // An id of another shape was never minted: unknown without
                // a look at the store.
                Some(id) if !response_id::is_minted(id) => {
                    return Err(response_id::previous_not_stored(id))
                }
                Some(id) => Some(
                    state
                        .responses
                        .get(tenant, id)
                        .ok_or_else(|| response_id::previous_not_stored(id))?,
                ),
            };
            let echo = api::responses::echoed_fields(&r);
            let mut v = r.valid;
            let Input::Chat(new) = std::mem::replace(&mut v.input, Input::Chat(Vec::new())) else {
                unreachable!("a Responses request is chat turns")
            };
            let prior = prior.map(|p| p.conversation.clone());
            let prior_turns = prior.as_deref().map_or_else(Vec::new, Conversation::turns);
            // The turn bound before the outputs are matched to their calls
            // (and before the prompt's turns are copied): the count the
            // handler checks again on the assembled turns.
            let turns = usize::from(r.instructions.is_some()) + prior_turns.len() + new.len();
            super::check_message_count(state, turns)?;
            let new = api::responses::continue_turns(&prior_turns, new)?;
            let shown = reasoning_shown(state, &v, prior_turns.iter().copied().chain(&new));
            v.input = Input::Chat(api::responses::prompt_turns(
                r.instructions.as_deref(),
                &prior_turns,
                &new,
                |i, last_user| shown.keeps(i, last_user),
            ));
            let wire = ResponsesWire {
                out: ResponsesOut::new(echo),
                store: r.store,
                scope: tenant,
                prior,
                new_turns: new,
            };
            (v, Wire::Responses(Box::new(wire)))
        }
        Api::CountTokens => return Err(ApiError::internal("count_tokens does not generate")),
    })
}

/// Which of `turns`' reasoning the served model's template writes for
/// request `v`'s template variables; all of it when the variables are
/// refused (the request fails on them later, as before).
fn reasoning_shown<'m>(
    state: &AppState,
    v: &ValidRequest,
    turns: impl IntoIterator<Item = &'m crate::tokenizer::ChatMessage>,
) -> crate::tokenizer::ReasoningShown {
    let Ok(backend) = state.backend() else {
        return crate::tokenizer::ReasoningShown::All;
    };
    if !crate::tokenizer::ReasoningShown::worth_probing(turns) {
        return crate::tokenizer::ReasoningShown::All;
    }
    match ChatFormat::detect(&backend.tokenizer).template_vars(&v.knobs) {
        Ok(vars) => backend.tokenizer.reasoning_shown(&vars),
        Err(_) => crate::tokenizer::ReasoningShown::All,
    }
}

/// The model family a chat turn is written in, and whether its prompt
/// opened the thinking channel.
#[derive(Debug, Clone, Copy)]
struct TurnPlan {
    format: ChatFormat,
    thinking: bool,
}

/// A grammar still to compile, and the request field it comes from.
type PendingGrammar = Option<(GrammarSpec, &'static str)>;

/// Template, tokenize, and check the context length and the grammar's
/// bounds. Returns the engine request (without its grammar), the name of
/// the field that holds the prompt, the turn's family, and the grammar to
/// compile ([`compile_grammar`]).
fn build_request(
    backend: &Backend,
    v: &ValidRequest,
) -> Result<(GenRequest, &'static str, TurnPlan, PendingGrammar), ApiError> {
    let tok = &backend.tokenizer;
    let chat = matches!(v.input, Input::Chat(_));
    let format = ChatFormat::detect(tok);
    let vars = if chat {
        format.template_vars(&v.knobs)?
    } else {
        serde_json::Map::new()
    };
    let plan = TurnPlan {
        format,
        thinking: format.thinking(&vars),
    };
    // First: a spec over the grammar bounds is refused before its tools
    // are rendered into a prompt (which a huge schema would also make huge).
    let grammar = grammar_spec(backend, v, plan)?;
    // Chat: only the template's own markup becomes control tokens; special
    // token text inside a message is encoded as plain text (no role
    // injection). A chat template writes its own BOS where the model wants
    // one; a raw prompt gets the model's BOS.
    let (prompt, param) = match &v.input {
        Input::Chat(msgs) => (encode_chat(tok, v, msgs, &vars)?, "messages"),
        Input::Prompt(p) => (
            tok.encode(p, true)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
            "prompt",
        ),
        Input::Tokens(ids) => (ids.clone(), "prompt"),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(param, "The prompt encodes to no tokens."));
    }
    let ctx = backend.engine.max_position();
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(
            param,
            format!(
                "The prompt has {} tokens; this model's context length is {ctx}.",
                prompt.len()
            ),
        ));
    }
    // The pool may hold less than one context: a request must fit both.
    let limit = backend.engine.max_request_tokens();
    if prompt.len() >= limit {
        return Err(ApiError::invalid(
            param,
            format!(
                "The prompt has {} tokens; one request may hold at most {limit} (the KV \
                 cache is smaller than the context length {ctx}).",
                prompt.len()
            ),
        ));
    }
    // Compared by subtraction: `max_tokens` is the client's number and may
    // be near usize::MAX, where a sum would wrap and pass. A request that
    // gives none gets all the room there is (vLLM's default), not a 400.
    let room = limit - prompt.len();
    let max_tokens = v.max_new_tokens(room);
    if max_tokens > room {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "'max_tokens' is {max_tokens}, but the prompt has {} tokens and one request may \
                 hold {limit} (context length {ctx}, KV cache {} tokens): at most {room} tokens \
                 can be generated.",
                prompt.len(),
                backend.engine.kv_slots()
            ),
        ));
    }
    // `echo` with `logprobs` scores every prompt token in the forward: a
    // cost the server bounds (`[scheduler] max_echo_prompt_tokens`).
    let max_echo = backend.engine.max_prompt_logprobs();
    if v.echo && v.logprobs.is_some() && prompt.len() > max_echo {
        return Err(ApiError::invalid(
            "echo",
            format!(
                "'echo' with 'logprobs' scores every prompt token, and this server does that for \
                 prompts of at most {max_echo} tokens (scheduler.max_echo_prompt_tokens); this \
                 prompt has {}.",
                prompt.len()
            ),
        ));
    }
    if v.controls.min_tokens > max_tokens {
        return Err(ApiError::invalid(
            "min_tokens",
            format!(
                "'min_tokens' is {}, but at most {max_tokens} tokens can be generated.",
                v.controls.min_tokens
            ),
        ));
    }
    // Token ids the client names must be the model's.
    let vocab = tok.vocab_size();
    let out_of_vocab = |param: &str, id: u32| {
        ApiError::invalid(
            param,
            format!("Invalid '{param}': token id {id} is outside the vocabulary (size {vocab})."),
        )
    };
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(out_of_vocab("prompt", id));
    }
    if let Some(&(id, _)) = v
        .controls
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab)
    {
        return Err(out_of_vocab("logit_bias", id));
    }
    if let Some(&id) = v.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(out_of_vocab("stop_token_ids", id));
    }
    let spec = v.speculative.as_ref();
    let method = spec.and_then(|s| s.method).map(SpecMethod::from);
    Ok((
        GenRequest {
            prompt,
            max_new_tokens: max_tokens,
            sampling: v.sampling,
            stop_token_ids: v.stop_token_ids.clone(),
            ignore_eos: v.ignore_eos,
            method,
            num_speculative_tokens: spec.and_then(|s| s.num_speculative_tokens()),
            controls: v.controls.clone(),
            logprobs: v.logprobs,
            // Only `echo` shows the prompt's log-probabilities.
            prompt_logprobs: v.logprobs.filter(|_| v.echo),
            // Compiled by the caller, off the blocking pool.
            grammar: None,
            // Set by the caller, which has the request's headers.
            tenant: 0,
            cache_scope: 0,
            // The family's markers, for its parser (chat only).
            shown_special_ids: if chat {
                format.shown_special_ids()
            } else {
                Vec::new()
            },
        },
        param,
        plan,
        grammar,
    ))
}

/// The prompt of chat turns `msgs`: the template rendered with the
/// request's active tools (`tool_choice: "none"` shows none) and template
/// variables `vars`, then encoded.
fn encode_chat(
    tok: &crate::tokenizer::TextTokenizer,
    v: &ValidRequest,
    msgs: &[ChatMessage],
    vars: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<u32>, ApiError> {
    let tools: Option<Vec<serde_json::Value>> = v
        .tools
        .active()
        .then(|| v.tools.tools.iter().map(|t| t.template_value()).collect());
    tok.encode_chat_with_vars(msgs, tools.as_deref(), vars, true)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

/// How many tokens the chat request `v` would send the model: exactly the
/// prompt generation would build (Anthropic's `count_tokens`).
///
/// Errors: a 400 for a template knob the model lacks or a conversation
/// the template refuses.
pub(super) fn count_prompt(backend: &Backend, v: &ValidRequest) -> Result<usize, ApiError> {
    let Input::Chat(msgs) = &v.input else {
        return Err(ApiError::internal("only chat turns are counted"));
    };
    let vars = ChatFormat::detect(&backend.tokenizer).template_vars(&v.knobs)?;
    Ok(encode_chat(&backend.tokenizer, v, msgs, &vars)?.len())
}

/// The grammar the output must follow: from `response_format`, or from a
/// `tool_choice` that forces calls; `None` for free text. Checked against
/// the grammar bounds here (cheap); compiled by [`compile_grammar`].
///
/// Errors: 400 naming `response_format` or `tools` when the spec breaks a
/// bound, or when this server has no grammar engine (no tokenizer it could
/// be built for).
fn grammar_spec(
    backend: &Backend,
    v: &ValidRequest,
    plan: TurnPlan,
) -> Result<PendingGrammar, ApiError> {
    let (spec, param) = match &v.response_format {
        // A chat answer in a family that wraps its answers (K3's response
        // channel) is JSON inside that markup; completions are bare JSON.
        ResponseFormat::JsonObject | ResponseFormat::JsonSchema { .. } => {
            let schema = match &v.response_format {
                ResponseFormat::JsonSchema { schema, .. } => Some(schema.clone()),
                _ => None,
            };
            let format = match v.input {
                Input::Chat(_) => plan.format,
                _ => ChatFormat::Hermes(Default::default()),
            };
            (
                GrammarSpec::json_answer(format, schema, plan.thinking),
                "response_format",
            )
        }
        ResponseFormat::Text if v.tools.forces_a_call() => (
            GrammarSpec::forced_calls(
                plan.format,
                v.tools.forced_tools(),
                v.tools.parallel,
                plan.thinking,
            ),
            "tools",
        ),
        ResponseFormat::Text => return Ok(None),
    };
    if backend.grammars.is_none() {
        return Err(ApiError::invalid(
            param,
            format!(
                "'{param}' needs constrained decoding, which this server cannot do for its model."
            ),
        )
        .with_code("unsupported_value"));
    }
    Grammars::check(&spec).map_err(|e| grammar_error(e, param))?;
    Ok(Some((spec, param)))
}

/// Compiles `spec` (from the request field `param`) for `tenant`'s
/// request, waiting in the grammar compiler's own bounded queue.
///
/// Errors: 400 naming `param` when the spec cannot be compiled; 503 with
/// `Retry-After` when the compiler is busy (its queue full, or no slot
/// free within its budget).
async fn compile_grammar(
    backend: &Backend,
    spec: &GrammarSpec,
    param: &'static str,
    tenant: u64,
) -> Result<Arc<dyn specgate_verify::ConstraintSource>, ApiError> {
    let grammars = backend
        .grammars
        .as_ref()
        .ok_or_else(|| ApiError::internal("The grammar engine went away."))?;
    grammars
        .compile_async(spec, tenant)
        .await
        .map_err(|e| grammar_error(e, param))
}

/// A grammar error as the API answers it.
fn grammar_error(e: GrammarError, param: &str) -> ApiError {
    match e {
        GrammarError::Invalid(e) => ApiError::invalid(param, format!("Invalid '{param}': {e}.")),
        GrammarError::Busy(e) => ApiError::busy(format!("{e}."), worker::RETRY_AFTER_SECS),
        GrammarError::Setup(e) => ApiError::internal(format!("Building the grammar failed: {e}.")),
    }
}

impl ResponsesWire {
    /// Keeps the finished response when the request asked (`store`). The
    /// stored conversation continues with the turns the response's output
    /// items read back as, so a continuation by `previous_response_id`
    /// runs on exactly what a client resending those items would.
    fn keep(&mut self, state: &AppState, id: &str, body: &serde_json::Value, text: &str) {
        if !self.store {
            return;
        }
        let mut turns = std::mem::take(&mut self.new_turns);
        turns.extend(crate::api::responses::output_turns(&body["output"]));
        let conversation = Arc::new(Conversation::new(self.prior.take(), turns));
        state.responses.put(
            self.scope,
            id.to_owned(),
            super::response_store::Stored::new(text, conversation),
        );
    }
}

/// Collects the whole answer into one JSON response.
async fn whole(
    state: Arc<AppState>,
    mut driver: Driver,
    l: Labels,
    _permit: Admit,
    mut wire: Wire,
) -> Result<Response<ResBody>, ApiError> {
    let mut turn = WholeTurn::default();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    let mut prompt_lps: Vec<TokenLogprob> = Vec::new();
    while let Some(piece) = driver.next().await {
        match piece {
            Piece::Shaped(shaped) => match &mut wire {
                Wire::Messages(m) => drop(m.pieces(&l, shaped)),
                Wire::Responses(r) => drop(r.out.pieces(&l, shaped)),
                Wire::OpenAi => {
                    for s in shaped {
                        match s {
                            Shaped::Content(t, lp) => {
                                turn.content.push_str(&t);
                                lps.extend(lp);
                            }
                            Shaped::Reasoning(t, lp) => {
                                turn.reasoning.push_str(&t);
                                lps.extend(lp);
                            }
                            Shaped::Call(c, lp) => {
                                turn.calls.push(c);
                                lps.extend(lp);
                            }
                        }
                    }
                }
            },
            Piece::Prompt(lp) => prompt_lps = lp,
            Piece::Done(reason, usage) => {
                let body = match wire {
                    Wire::Messages(m) => {
                        Ok(m.body(&l, reason, usage, driver.stop.matched()).to_string())
                    }
                    Wire::Responses(mut r) => {
                        let reasoning = driver.stage.reasoning_tokens();
                        let (_, body) = r.out.done(&l, reason, usage, reasoning);
                        let text = r.out.text(&body);
                        r.keep(&state, &l.id, &body, &text);
                        Ok(text)
                    }
                    Wire::OpenAi if l.turn.is_some() => {
                        serde_json::to_string(&chat_body(&l, turn, &lps, reason, usage))
                    }
                    Wire::OpenAi => {
                        let mut text = turn.content;
                        let mut offset = 0;
                        let mut logprobs = l.echo.as_ref().and_then(|(_, first)| {
                            echo_logprobs(&l, *first, &prompt_lps, &mut offset)
                        });
                        if let Some(w) = &l.logprobs {
                            let out = logprobs.get_or_insert_with(CompletionLogprobs::default);
                            w.completion(&lps, &mut offset, out);
                        }
                        if let Some((prompt, _)) = &l.echo {
                            text.insert_str(0, prompt);
                        }
                        serde_json::to_string(
                            &Completion::new(&l.id, l.created, &l.model, text, reason, usage)
                                .with_logprobs(logprobs),
                        )
                    }
                }
                .map_err(|e| ApiError::internal(e.to_string()))?;
                return Ok(json_response(StatusCode::OK, body));
            }
            Piece::Error(e) => return Err(ApiError::unavailable(e)),
        }
    }
    Err(ApiError::internal("The response ended without a finish."))
}

/// Streams the answer as Server-Sent Events from a task; the client going
/// away ends the task, which drops the engine receiver (cancellation). So
/// does a client that takes no event for the stream write timeout: the
/// engine never waits on a client, and a stalled one holds its admission
/// slot and sequence for a bounded time only.
fn stream(
    state: Arc<AppState>,
    mut driver: Driver,
    l: Labels,
    include_usage: bool,
    permit: impl Send + 'static,
    mut wire: Wire,
) -> Response<ResBody> {
    let (tx, rx) = mpsc::channel::<StreamFrame>(32);
    let keep_alive = state.settings.keep_alive;
    let limit = state.settings.conn.write_stall;
    tokio::spawn(async move {
        let _permit = permit;
        // Whether the client took the frame in time; `false` ends the stream.
        let deliver = |f: StreamFrame| {
            let tx = &tx;
            async move { matches!(tokio::time::timeout(limit, tx.send(f)).await, Ok(Ok(()))) }
        };
        let send = |b: Bytes| deliver(StreamFrame::Data(b));
        let opening: Vec<Bytes> = match &mut wire {
            Wire::Messages(m) => vec![m.start(&l, driver.prompt_tokens)],
            Wire::Responses(r) => r.out.start(&l),
            Wire::OpenAi if l.turn.is_some() => {
                vec![sse(&ChatCompletionChunk::role(&l.id, l.created, &l.model))]
            }
            Wire::OpenAi => Vec::new(),
        };
        for b in opening {
            if !send(b).await {
                return;
            }
        }
        let mut shape = StreamShape::new(&l);
        // Without log-probabilities the echoed prompt goes first; with them
        // it waits for the engine's prompt log-probabilities.
        if l.logprobs.is_none() {
            if let Some(b) = shape.echo(&l, &[]) {
                if !send(b).await {
                    return;
                }
            }
        }
        let mut tick = tokio::time::interval_at(Instant::now() + keep_alive, keep_alive);
        loop {
            let piece = tokio::select! {
                p = driver.next() => p,
                _ = tick.tick() => {
                    let ping = match wire {
                        Wire::Messages(_) => anthropic_out::ping(),
                        _ => Bytes::from_static(b": keep-alive\n\n"),
                    };
                    if !send(ping).await {
                        return;
                    }
                    continue;
                }
            };
            let out = match (piece, &mut wire) {
                (None, _) => break,
                (Some(Piece::Shaped(shaped)), Wire::Messages(m)) => m.pieces(&l, shaped),
                (Some(Piece::Shaped(shaped)), Wire::Responses(r)) => r.out.pieces(&l, shaped),
                (Some(Piece::Shaped(shaped)), Wire::OpenAi) => shape.pieces(&l, shaped),
                (Some(Piece::Prompt(lps)), _) => shape.echo(&l, &lps).into_iter().collect(),
                (Some(Piece::Done(reason, usage)), Wire::Messages(m)) => {
                    m.done(reason, usage, driver.stop.matched())
                }
                (Some(Piece::Done(reason, usage)), Wire::Responses(r)) => {
                    let reasoning = driver.stage.reasoning_tokens();
                    let (events, body) = r.out.done(&l, reason, usage, reasoning);
                    if r.store {
                        let text = r.out.text(&body);
                        r.keep(&state, &l.id, &body, &text);
                    }
                    events
                }
                (Some(Piece::Done(reason, usage)), Wire::OpenAi) => {
                    shape.done(&l, reason, usage, include_usage)
                }
                (Some(Piece::Error(e)), Wire::Messages(_)) => {
                    vec![anthropic_out::error_event(&ApiError::unavailable(e))]
                }
                (Some(Piece::Error(e)), Wire::Responses(r)) => {
                    vec![r.out.error(&ApiError::unavailable(e))]
                }
                (Some(Piece::Error(e)), Wire::OpenAi) => vec![
                    Bytes::from(format!("data: {}\n\n", ApiError::unavailable(e).to_json())),
                    Bytes::from_static(b"data: [DONE]\n\n"),
                ],
            };
            for b in out {
                if !send(b).await {
                    return;
                }
            }
        }
        deliver(StreamFrame::End).await;
    });
    let mut r = Response::new(ResBody::Stream(rx));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Event;
    use crate::http::{ConnLimits, HttpSettings};
    use std::time::Duration;
    use tokio::sync::Semaphore;

    fn state(write_timeout: Duration) -> Arc<AppState> {
        let settings = HttpSettings {
            model_name: "m".into(),
            api_keys: Vec::new(),
            max_body_bytes: 1 << 20,
            max_concurrent_requests: 1,
            max_requests_per_client: 1,
            max_blocking_jobs: 1,
            max_messages: 8,
            metrics_auth: false,
            share_prefix_cache: false,
            request_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(15),
            body_read_timeout: Duration::from_secs(30),
            conn: ConnLimits {
                write_stall: write_timeout,
                ..ConnLimits::default()
            },
            cors: Default::default(),
            stored_responses: 4,
            stored_response_bytes: 1 << 20,
        };
        AppState::new(settings, crate::metrics::install())
    }

    /// A client that takes no events (hyper stops polling the body when
    /// the socket is full) must not hold its sequence and admission slot
    /// forever: past the write timeout the stream task ends, which drops
    /// the engine receiver (cancelling the sequence) and the permit.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_reader_frees_its_sequence_and_slot() {
        let state = state(Duration::from_secs(2));
        let (engine_tx, engine_rx) = tokio::sync::mpsc::unbounded_channel();
        let slots = Arc::new(Semaphore::new(1));
        let permit = slots.clone().try_acquire_owned().unwrap();
        let now = Instant::now();
        let driver = Driver {
            rx: Some(engine_rx),
            stop: StopMatcher::new(&[]),
            held: OffsetQueue::default(),
            pushed: 0,
            released: 0,
            marks: Default::default(),
            prompt_tokens: 1,
            completion_tokens: 0,
            arrived: now,
            deadline: now + Duration::from_secs(600),
            last: None,
            pending: None,
            cut: state.cut.subscribe(),
            log: RequestLog::new(
                crate::http::request_id::RequestId::generate(),
                &hyper::Method::POST,
                "/v1/completions",
            ),
            stage: TurnStage::new(None),
            stop_on_content: false,
        };
        let labels = Labels {
            id: "x".into(),
            created: 0,
            model: "m".into(),
            turn: None,
            logprobs: None,
            echo: None,
        };
        // The body is never polled, as when the client stops reading.
        let _body = stream(state, driver, labels, false, permit, Wire::OpenAi);
        for i in 0..200 {
            let ev = Event::Tokens {
                ids: vec![i],
                text: "t".into(),
                logprobs: Vec::new(),
                markers: Vec::new(),
            };
            if engine_tx.send(ev).is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            engine_tx.is_closed(),
            "the stalled stream still holds the engine receiver"
        );
        assert_eq!(slots.available_permits(), 1, "the admission slot is held");
    }
}
