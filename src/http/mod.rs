//! The HTTP front: a hyper 1 accept loop, routing, authentication, body
//! limits, admission control, CORS, and the routes of [`ROUTES`]: the
//! generation endpoints (chat completions, completions, OpenAI's Responses,
//! Anthropic's Messages) in both response shapes (whole JSON or Server-Sent
//! Events), the Responses store's routes ([`STORED_RESPONSE_ROUTES`]),
//! models, tokenize/detokenize, count_tokens, version and the OpenAPI
//! document. Errors become HTTP responses in exactly one place,
//! [`error_response_as`] (OpenAI's body, or Anthropic's on its routes), from
//! `api::ApiError`.

pub mod admission;
mod anthropic_out;
mod convert;
pub mod cors;
mod driver;
mod endpoints;
mod generate;
pub mod openapi;
mod output;
pub(crate) mod request_id;
pub(crate) mod request_log;
pub mod response_id;
pub mod response_store;
mod responses_out;
pub mod stop;
mod timed_io;

use crate::api::ApiError;
use crate::engine::EngineHandle;
use crate::tokenizer::TextTokenizer;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

/// Server settings the handlers need.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    pub model_name: String,
    pub api_keys: Vec<String>,
    pub max_body_bytes: usize,
    pub max_concurrent_requests: usize,
    /// Requests admitted at once per client address and per API key.
    pub max_requests_per_client: usize,
    /// Blocking jobs (templating, tokenizing) at once.
    pub max_blocking_jobs: usize,
    /// Messages in one chat request (400 beyond).
    pub max_messages: usize,
    /// Require an API key on `/metrics` (when there are keys).
    pub metrics_auth: bool,
    /// With keys, one prefix cache for all of them (else one per key).
    pub share_prefix_cache: bool,
    pub request_timeout: Duration,
    pub drain_timeout: Duration,
    pub keep_alive: Duration,
    /// A request body must arrive whole within this long (408 beyond).
    pub body_read_timeout: Duration,
    /// Per-connection bounds; `conn.write_stall` also bounds each SSE event
    /// the client does not take (the stream then ends, and its request).
    pub conn: ConnLimits,
    /// Which browser origins may call the API (`[server]
    /// cors_allow_origins`); off by default.
    pub cors: cors::CorsPolicy,
    /// The Responses store's bounds per API key: responses, bytes.
    pub stored_responses: usize,
    pub stored_response_bytes: usize,
}

/// Bounds on one connection's life, so no client holds a socket, a task or
/// memory without a limit in time or count.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// The whole head of each request, including the wait for it on an
    /// idle keep-alive connection (hyper arms this timer as soon as it
    /// starts reading a head).
    pub header_read: Duration,
    /// A write the peer has not taken for this long fails, which closes
    /// the connection (and, for a stream, ends its request).
    pub write_stall: Duration,
    /// Connections open at once; further ones wait in the OS backlog.
    pub max_connections: usize,
    /// Connections open at once from one client address; more are closed
    /// at once (so one client cannot hold every slot).
    pub max_per_client: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            write_stall: Duration::from_secs(30),
            max_connections: 1024,
            max_per_client: 256,
        }
    }
}

/// The loaded model side: set once loading is done.
pub struct Backend {
    pub engine: EngineHandle,
    pub tokenizer: Arc<TextTokenizer>,
    /// The grammar engine for `tokenizer`, built once at startup; `None`
    /// when it could not be built (then requests that need constrained
    /// decoding, `response_format` JSON or a forced `tool_choice`, are
    /// refused with a 400 naming the field).
    pub grammars: Option<crate::grammar::Grammars>,
}

/// Everything a request handler reads.
pub struct AppState {
    backend: OnceLock<Backend>,
    pub settings: HttpSettings,
    pub metrics: PrometheusHandle,
    pub created: u64,
    draining: AtomicBool,
    admission: admission::Admission,
    /// Turns true when the drain timeout has passed: open responses end
    /// with an error event instead of being cut mid-stream.
    cut: tokio::sync::watch::Sender<bool>,
    /// Responses kept for the Responses API (bounded per key).
    responses: response_store::ResponseStore,
}

impl AppState {
    /// A state that answers 503 on /health and generation routes until
    /// [`AppState::set_ready`] hands it the loaded backend.
    pub fn new(settings: HttpSettings, metrics: PrometheusHandle) -> Arc<Self> {
        Arc::new(Self {
            admission: admission::Admission::new(
                settings.max_concurrent_requests,
                settings.max_requests_per_client,
                settings.max_blocking_jobs,
            ),
            backend: OnceLock::new(),
            responses: response_store::ResponseStore::new(
                settings.stored_responses,
                settings.stored_response_bytes,
            ),
            settings,
            metrics,
            created: crate::api::unix_now(),
            draining: AtomicBool::new(false),
            cut: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Marks the server ready with its engine and tokenizer (once).
    pub fn set_ready(&self, backend: Backend) {
        let _ = self.backend.set(backend);
    }

    fn backend(&self) -> Result<&Backend, ApiError> {
        self.backend.get().ok_or_else(|| {
            ApiError::unavailable("The model is still loading; retry when /health answers 200.")
        })
    }
}

/// A response body: whole, or frames fed from a channel (streaming).
pub enum ResBody {
    Full(Full<Bytes>),
    /// Frames from a producer task. `StreamFrame::End` marks a complete
    /// stream; a channel that closes without it (the producer gave up on a
    /// stalled client) is an error, so hyper aborts the connection instead
    /// of ending the chunked body as if the answer were whole.
    Stream(mpsc::Receiver<StreamFrame>),
}

/// What a streaming producer sends its body.
pub enum StreamFrame {
    Data(Bytes),
    End,
}

/// A stream whose producer stopped before its end.
#[derive(Debug, thiserror::Error)]
#[error("the response stream was abandoned before its end")]
pub struct StreamAbandoned;

impl Body for ResBody {
    type Data = Bytes;
    type Error = StreamAbandoned;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamAbandoned>>> {
        match self.get_mut() {
            ResBody::Full(f) => Pin::new(f)
                .poll_frame(cx)
                .map_err(|e: Infallible| match e {}),
            ResBody::Stream(rx) => rx.poll_recv(cx).map(|f| match f {
                Some(StreamFrame::Data(b)) => Some(Ok(Frame::data(b))),
                Some(StreamFrame::End) => {
                    rx.close();
                    None
                }
                None => Some(Err(StreamAbandoned)),
            }),
        }
    }
}

fn json_response(status: StatusCode, body: String) -> Response<ResBody> {
    let mut r = Response::new(ResBody::Full(Full::new(Bytes::from(body))));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// The one place an error becomes an HTTP response (OpenAI's body).
pub fn error_response(e: &ApiError) -> Response<ResBody> {
    error_response_as(Api::Chat, e)
}

/// The one place an error becomes an HTTP response in `api`'s own body:
/// Anthropic's for the Messages routes, OpenAI's for every other.
pub(crate) fn error_response_as(api: Api, e: &ApiError) -> Response<ResBody> {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match api {
        Api::Messages | Api::CountTokens => e.to_anthropic_json(),
        _ => e.to_json(),
    };
    let mut r = json_response(status, body);
    if let Some(secs) = e.retry_after {
        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if e.code
        .as_deref()
        .is_some_and(|c| STORE_MISS_CODES.contains(&c))
    {
        r.headers_mut()
            .insert(STORE_MISS_HEADER, HeaderValue::from_static("1"));
    }
    r
}

/// Marks a 404 for a stored response this server does not hold (`GET` /
/// `DELETE /v1/responses/{id}`, or a `previous_response_id`): nothing ran
/// for it, and the response may be stored on another replica, so a router
/// asks the others.
pub const STORE_MISS_HEADER: &str = "x-specgate-store-miss";

/// The error codes of the 404s [`STORE_MISS_HEADER`] marks.
const STORE_MISS_CODES: [&str; 2] = ["response_not_found", "previous_response_not_found"];

/// The wire API a route speaks: decides the error body's shape, and
/// labels the request in `/metrics` and the request log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `/v1/chat/completions`, and every route that is not generation.
    Chat,
    Completions,
    /// `/v1/messages` (Anthropic).
    Messages,
    /// `/v1/messages/count_tokens` (Anthropic).
    CountTokens,
    /// `/v1/responses` and `/v1/responses/{id}` (OpenAI).
    Responses,
}

impl Api {
    /// The API of a route path, `None` for routes of no wire API.
    pub fn of_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/v1/messages" => Some(Api::Messages),
            "/v1/messages/count_tokens" => Some(Api::CountTokens),
            p if p == "/v1/responses" || p.starts_with(RESPONSE_PREFIX) => Some(Api::Responses),
            _ => None,
        }
    }

    /// The label of `/metrics` and the request log (`api=`).
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat_completions",
            Api::Completions => "completions",
            Api::Messages => "messages",
            Api::CountTokens => "count_tokens",
            Api::Responses => "responses",
        }
    }

    /// The prefix of a generation's response id (then the request id).
    fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl-",
            Api::Completions => "cmpl-",
            Api::Messages | Api::CountTokens => "msg_",
            Api::Responses => "resp_",
        }
    }
}

/// Paths under this prefix name one stored response
/// (`GET` / `DELETE /v1/responses/{id}`).
pub const RESPONSE_PREFIX: &str = "/v1/responses/";

/// Serves connections from `listener` until `shutdown` resolves, then
/// stops accepting, marks the server draining (health 503, new generation
/// requests 503) and waits up to the drain timeout for open connections.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
) {
    let limits = state.settings.conn;
    // Every request goes through the request-id wrapper, which calls `route`.
    let graceful = accept_with(
        &listener,
        state.clone(),
        request_id::handle,
        shutdown,
        limits,
    )
    .await;
    state.draining.store(true, Ordering::SeqCst);
    drop(listener);
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    if tokio::time::timeout(state.settings.drain_timeout, &mut drained)
        .await
        .is_err()
    {
        // Past the drain timeout: responses still open end with an error
        // event and `[DONE]` (or a 503), then the connections close.
        state.cut.send_replace(true);
        let _ = tokio::time::timeout(Duration::from_secs(2), drained).await;
    }
}

/// Accepts HTTP/1 connections on `listener`, each served by `handle` with
/// `state`, until `shutdown` resolves. Returns the watcher of the
/// connections still open, for the caller's drain. Shared by the engine's
/// server and the router.
///
/// Every connection is bounded by `limits`: at most `max_connections` at
/// once (the rest wait in the OS backlog), at most `max_per_client` of
/// them from one address (more are closed at once), a deadline for each
/// request head (slowloris, idle keep-alive sockets) and for each stalled
/// write. Each request carries its connection's [`admission::ClientAddr`].
/// An accept error (EMFILE, ENFILE) pauses accepting briefly instead of
/// spinning.
pub(crate) async fn accept_with<S, H, Fut, B>(
    listener: &TcpListener,
    state: Arc<S>,
    handle: H,
    shutdown: impl Future<Output = ()>,
    limits: ConnLimits,
) -> hyper_util::server::graceful::GracefulShutdown
where
    S: Send + Sync + 'static,
    H: Fn(Arc<S>, Request<Incoming>) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let per_client = admission::ClientConns::new(limits.max_per_client);
    let mut logged_accept_error = false;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            a = async {
                let permit = slots.clone().acquire_owned().await;
                (permit, listener.accept().await)
            } => a,
            _ = &mut shutdown => break,
        };
        let (Ok(permit), accepted) = accepted else {
            break;
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                if !std::mem::replace(&mut logged_accept_error, true) {
                    tracing::warn!(error = %e, "accept failed; pausing accepts briefly");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        logged_accept_error = false;
        // Over its address's limit: closed at once, freeing the global slot.
        let client = admission::ClientAddr::of(peer.ip());
        let Some(client_slot) = per_client.open(client) else {
            drop(stream);
            continue;
        };
        // Streams are many small writes (one SSE event per token).
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let state = state.clone();
            req.extensions_mut().insert(client);
            async move { Ok::<_, Infallible>(handle(state, req).await) }
        });
        let io =
            timed_io::WriteDeadline::new(hyper_util::rt::TokioIo::new(stream), limits.write_stall);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.header_read)
            .serve_connection(io, svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _permit = (permit, client_slot);
            let _ = conn.await;
        });
    }
    graceful
}

fn authorized(state: &AppState, req: &Request<Incoming>) -> bool {
    use subtle::ConstantTimeEq;
    if state.settings.api_keys.is_empty() {
        return true;
    }
    let Some(given) = api_key(req) else {
        return false;
    };
    // Every key is compared in full, so timing says nothing about which
    // prefix matched.
    state.settings.api_keys.iter().fold(false, |ok, k| {
        ok | bool::from(k.as_bytes().ct_eq(given.as_bytes()))
    })
}

/// Who sent `req`, as the cross-request proposer's scope: a keyed hash
/// of its bearer key (the key is checked already), 0 when the server has
/// no keys. The hash key is random per process, so scopes say nothing
/// about keys outside it.
fn tenant(state: &AppState, req: &Request<Incoming>) -> u64 {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    if state.settings.api_keys.is_empty() {
        return 0;
    }
    let given = api_key(req).unwrap_or_default();
    KEY.get_or_init(Default::default).hash_one(given).max(1)
}

/// Errors: 400 naming `messages` when a chat request holds more than
/// `server.max_messages` of them (a template's time grows with them,
/// quadratically for some: refused before any rendering).
fn check_message_count(state: &AppState, n: usize) -> Result<(), ApiError> {
    let max = state.settings.max_messages;
    if n > max {
        return Err(ApiError::too_many_messages(n, max));
    }
    Ok(())
}

/// The prefix-cache scope of a request (see `kv::BlockManager::allocate_scoped`):
/// its sender's `tenant` unless the server shares its cache across keys,
/// mixed with its `cache_salt` when it sends one; 0 (shared) when neither
/// applies. Keyed per process like [`tenant`].
fn cache_scope(state: &AppState, tenant: u64, salt: Option<&str>) -> u64 {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let tenant = if state.settings.share_prefix_cache {
        0
    } else {
        tenant
    };
    match salt {
        None => tenant,
        Some(salt) => KEY
            .get_or_init(Default::default)
            .hash_one((tenant, salt))
            .max(1),
    }
}

/// The API key a request sends: its `Authorization: Bearer <key>`, else
/// its `x-api-key` header (Anthropic's), the same keys either way.
fn api_key(req: &Request<Incoming>) -> Option<&str> {
    bearer(req).or_else(|| {
        let k = req
            .headers()
            .get("x-api-key")?
            .to_str()
            .ok()?
            .trim_matches(' ');
        (!k.is_empty()).then_some(k)
    })
}

/// The key of an `Authorization: Bearer <key>` header, if there is one.
/// The scheme is matched without case and may be followed by more than
/// one space (RFC 9110 11.4), as clients differ there.
fn bearer(req: &Request<Incoming>) -> Option<&str> {
    bearer_key(req.headers().get(AUTHORIZATION)?.to_str().ok()?)
}

/// The key of an `Authorization` value of the `Bearer` scheme.
fn bearer_key(value: &str) -> Option<&str> {
    let (scheme, key) = value.split_once(' ')?;
    let key = key.trim_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// The whole body within the size limit (413) and the body deadline (408:
/// a Content-Length larger than what the client sends, a trickling body).
async fn read_body(state: &AppState, body: Incoming) -> Result<Bytes, ApiError> {
    let limit = state.settings.body_read_timeout;
    // Appended into one buffer as frames arrive, so the body is never held
    // twice (collecting then concatenating does, for every large body).
    // The buffer takes the Content-Length (within the limit) only once
    // 64 KiB have come: a client that declares a large body and trickles
    // it costs what it sent.
    let max = state.settings.max_body_bytes;
    let hint = usize::try_from(Body::size_hint(&body).lower()).map_or(max, |h| h.min(max));
    let read = async move {
        let mut body = Limited::new(body, max);
        let mut buf = bytes::BytesMut::with_capacity(hint.min(64 << 10));
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                if buf.len() + data.len() > buf.capacity() {
                    buf.reserve(data.len().max(hint.saturating_sub(buf.len())));
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(buf.freeze())
    };
    let Ok(read) = tokio::time::timeout(limit, read).await else {
        return Err(ApiError::request_timeout(format!(
            "The request body did not arrive within {} s.",
            limit.as_secs_f64()
        )));
    };
    match read {
        Ok(b) => Ok(b),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::payload_too_large(state.settings.max_body_bytes))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "Could not read the request body: {e}."
        ))),
    }
}

/// Every route the server answers: its path and method. `/openapi.json`
/// documents exactly these; with CORS on, each also answers an `OPTIONS`
/// preflight.
pub const ROUTES: [(&str, Method); 12] = [
    ("/health", Method::GET),
    ("/metrics", Method::GET),
    ("/version", Method::GET),
    ("/openapi.json", Method::GET),
    ("/v1/models", Method::GET),
    ("/v1/chat/completions", Method::POST),
    ("/v1/completions", Method::POST),
    ("/v1/responses", Method::POST),
    ("/v1/messages", Method::POST),
    ("/v1/messages/count_tokens", Method::POST),
    ("/tokenize", Method::POST),
    ("/detokenize", Method::POST),
];

/// The routes of one stored response (the Responses API's): a path under
/// [`RESPONSE_PREFIX`] names it. Documented in `/openapi.json` beside
/// [`ROUTES`].
pub const STORED_RESPONSE_ROUTES: [(&str, Method); 2] = [
    ("/v1/responses/{response_id}", Method::GET),
    ("/v1/responses/{response_id}", Method::DELETE),
];

/// Routes `req` and adds the CORS headers (when on) to whatever answers it.
async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<ResBody> {
    let allow = state.settings.cors.allow_origin(req.headers());
    let mut res = dispatch(state.clone(), req).await;
    state.settings.cors.apply(allow, &mut res);
    res
}

async fn dispatch(state: Arc<AppState>, req: Request<Incoming>) -> Response<ResBody> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let wire_api = Api::of_path(&path);
    if let Some(a) = wire_api {
        // Labels the request's log line and `specgate_api_requests_total`,
        // refusals included.
        request_log::RequestLog::of(&req).set_api(a.as_str());
    }
    let api = wire_api.unwrap_or(Api::Chat);
    let fail = |e: &ApiError| error_response_as(api, e);
    if let Some(id) = path.strip_prefix(RESPONSE_PREFIX) {
        return stored_response(&state, &req, id).unwrap_or_else(|e| fail(&e));
    }
    let Some((_, want)) = ROUTES.iter().find(|(p, _)| *p == path) else {
        return fail(&ApiError::not_found(format!("No route for {path}.")));
    };
    if method == Method::OPTIONS && state.settings.cors.is_enabled() {
        return cors::preflight(want, req.headers());
    }
    if method != *want {
        let mut r = fail(&ApiError::method_not_allowed(method.as_str(), &path));
        // A 405 names what the route does serve (RFC 9110).
        let allow = if state.settings.cors.is_enabled() {
            format!("{want}, OPTIONS")
        } else {
            want.to_string()
        };
        if let Ok(v) = HeaderValue::from_str(&allow) {
            r.headers_mut().insert(ALLOW, v);
        }
        return r;
    }
    let metrics_open = !state.settings.metrics_auth;
    let result = match path.as_str() {
        "/health" => Ok(health(&state)),
        "/metrics" if metrics_open => Ok(metrics(&state)),
        "/version" => Ok(endpoints::version()),
        "/openapi.json" => Ok(openapi::response(&state)),
        _ if !authorized(&state, &req) => Err(unauthorized()),
        "/metrics" => Ok(metrics(&state)),
        "/v1/models" => Ok(endpoints::models(&state)),
        _ => {
            // Every route that works for a request is admitted first; a
            // refusal here comes before the replica did anything for it.
            let admit = match admit(&state, &req, path.starts_with("/v1/")) {
                Ok(a) => a,
                Err(e) => return not_admitted(api, &e),
            };
            match path.as_str() {
                "/tokenize" => endpoints::tokenize(state.clone(), req, admit).await,
                "/detokenize" => endpoints::detokenize(state.clone(), req, admit).await,
                "/v1/messages/count_tokens" => {
                    endpoints::count_tokens(state.clone(), req, admit).await
                }
                _ => generate::handle(state.clone(), req, api, admit).await,
            }
        }
    };
    result.unwrap_or_else(|e| fail(&e))
}

fn unauthorized() -> ApiError {
    ApiError::authentication(
        "Missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>').",
    )
}

/// `GET` / `DELETE /v1/responses/{id}` (with CORS preflight): a stored
/// response of the sender's scope.
///
/// Errors: 401 without a valid key; 405 for another method; 404 for an
/// id the sender's scope does not hold.
fn stored_response(
    state: &AppState,
    req: &Request<Incoming>,
    id: &str,
) -> Result<Response<ResBody>, ApiError> {
    let method = req.method();
    let allowed = "GET, DELETE";
    if method == Method::OPTIONS && state.settings.cors.is_enabled() {
        return Ok(cors::preflight(&Method::GET, req.headers()));
    }
    if method != Method::GET && method != Method::DELETE {
        let mut r = error_response(&ApiError::method_not_allowed(
            method.as_str(),
            req.uri().path(),
        ));
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static(allowed));
        return Ok(r);
    }
    if !authorized(state, req) {
        return Err(unauthorized());
    }
    // Decoded as the SDKs encode it; an id of another shape was never
    // minted, so it is unknown without a look at the store.
    let id = response_id::from_path(id);
    if !response_id::is_minted(&id) {
        return Err(response_id::not_stored(&id));
    }
    let scope = tenant(state, req);
    if method == Method::DELETE {
        if !state.responses.delete(scope, &id) {
            return Err(response_id::not_stored(&id));
        }
        let body = serde_json::json!({"id": id, "object": "response", "deleted": true});
        return Ok(json_response(StatusCode::OK, body.to_string()));
    }
    let stored = state
        .responses
        .get(scope, &id)
        .ok_or_else(|| response_id::not_stored(&id))?;
    Ok(json_response(StatusCode::OK, stored.body.to_string()))
}

/// Marks a response as sent before the request was admitted (refused while
/// loading or draining, or over an admission limit): nothing ran for it,
/// so a router may send it to another replica. A refusal without the mark
/// may come after the work began, and is never replayed.
pub const NOT_ADMITTED_HEADER: &str = "x-specgate-not-admitted";

/// `e` as a response carrying [`NOT_ADMITTED_HEADER`].
fn not_admitted(api: Api, e: &ApiError) -> Response<ResBody> {
    let mut r = error_response_as(api, e);
    r.headers_mut()
        .insert(NOT_ADMITTED_HEADER, HeaderValue::from_static("1"));
    r
}

/// Admits `req` (see [`admission`]): 503 while loading, and for a
/// generation (`generation`) while draining; 429 over a limit.
fn admit(
    state: &AppState,
    req: &Request<Incoming>,
    generation: bool,
) -> Result<admission::Admit, ApiError> {
    if generation && state.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("The server is shutting down."));
    }
    state.backend()?;
    let addr = req.extensions().get::<admission::ClientAddr>().map(|c| c.0);
    state.admission.admit(addr, tenant(state, req))
}

/// 200 only while the model is loaded, the engine thread is alive and the
/// server is not draining: a liveness probe restarts a server whose engine
/// died.
fn health(state: &AppState) -> Response<ResBody> {
    let alive = state.backend.get().is_some_and(|b| b.engine.is_alive());
    if alive && !state.draining.load(Ordering::SeqCst) {
        json_response(StatusCode::OK, r#"{"status":"ok"}"#.into())
    } else {
        error_response(&ApiError::unavailable(
            "The server is not ready or is shutting down.",
        ))
    }
}

fn metrics(state: &AppState) -> Response<ResBody> {
    let mut r = Response::new(ResBody::Full(Full::new(Bytes::from(
        state.metrics.render(),
    ))));
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}
