//! `specgate route`: one OpenAI-compatible endpoint in front of N engine
//! replicas (other `specgate serve` processes). Owns the router's HTTP
//! server and its routes; the replica set, health and load polling and DNS
//! discovery are in [`replicas`], the choice of replica in [`balancer`]
//! (pure), forwarding, timeouts and retries in [`proxy`], and relaying a
//! replica's response body (idle limit, an error event for a cut stream) in
//! [`relay`].
//!
//! Routes ([`ROUTES`], the same paths and methods as a replica's): the
//! generation routes are forwarded with prefix affinity; `/v1/models`,
//! `/tokenize`, `/detokenize`, `/version` and `/openapi.json` to any healthy
//! replica; a stored response's routes ([`STORED_RESPONSE_ROUTES`]) and a
//! Responses continuation go to the replica that stores the response
//! (asked in turn: one that does not answers a 404 marked
//! [`crate::http::STORE_MISS_HEADER`]); `GET /health` is the router's own (200 while at least one
//! replica is healthy, else 503) and `GET /metrics` its own Prometheus
//! text. Authentication is left to the replicas: the `Authorization` header
//! is passed through. Every request gets an id as on a replica
//! ([`crate::http::request_id`]), which is sent upstream and returned, and
//! one log line when it ends ([`request_log`]). The router's own errors are
//! in the shape of the route's wire API, as a replica's. CORS is not the router's:
//! a preflight through it is a 405.

pub mod balancer;
pub mod config;
pub mod proxy;
pub mod relay;
pub mod replicas;
mod request_log;

pub use config::RouterConfig;

use crate::api::ApiError;
use crate::http::request_id::{self, RequestId};
use crate::http::ResBody;
use anyhow::{Context, Result};
use balancer::Balancer;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use metrics_exporter_prometheus::PrometheusHandle;
use proxy::{forward, local_error, local_error_for, RouterBody};
use replicas::{Hysteresis, Pool};
use request_log::RouteLog;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The HTTP client the router uses for replicas (pooled keep-alive
/// connections, plain HTTP/1.1).
pub type Client = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

/// What the request handlers share.
pub struct RouterState {
    pub cfg: RouterConfig,
    pub pool: Arc<Pool>,
    pub client: Client,
    metrics: PrometheusHandle,
}

/// A started router.
pub struct RunningRouter {
    pub addr: SocketAddr,
    /// The replica set (for inspection).
    pub pool: Arc<Pool>,
    /// Send to stop: the listener closes and open connections get the
    /// drain time to finish.
    pub shutdown: oneshot::Sender<()>,
    /// Ends when the router has stopped.
    pub done: tokio::task::JoinHandle<()>,
}

fn client(cfg: &RouterConfig) -> Client {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(Duration::from_millis(cfg.connect_timeout_ms)));
    conn.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        // Below a replica's idle limit (`server.header_read_timeout_secs`,
        // 10 s by default): a pooled socket the replica closed could fail a
        // request after sending it, which is never retried.
        .pool_idle_timeout(Duration::from_secs(5))
        .build(conn)
}

/// Binds, resolves and polls the replicas once (so a healthy set is known
/// before the first request), starts the pollers and serves.
///
/// Errors: the config has no replicas (see
/// [`RouterConfig::validate_for_routing`]) or the address cannot be bound.
pub async fn start(cfg: RouterConfig) -> Result<RunningRouter> {
    cfg.validate_for_routing()?;
    let metrics = crate::metrics::install();
    let balancer = Balancer::new(
        NonZeroUsize::new(cfg.affinity_entries).context("router.affinity_entries is 0")?,
        cfg.affinity_slack,
    );
    let hysteresis = Hysteresis {
        fall: cfg.health_failure_threshold,
        rise: cfg.health_success_threshold,
    };
    let pool = Arc::new(
        Pool::new(&cfg.replicas, balancer, hysteresis)
            .with_metrics_key(cfg.replica_metrics_key.as_deref()),
    );
    let client = client(&cfg);
    let timeout = Duration::from_millis(cfg.health_timeout_ms);
    if let Some(dns) = &cfg.discovery_dns {
        if let Some(urls) = replicas::resolve(dns).await {
            pool.set_discovered(&urls);
        }
    }
    replicas::poll_all(&pool, &client, timeout).await;
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
    let addr = listener.local_addr()?;
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(replicas::poll_loop(
        pool.clone(),
        client.clone(),
        Duration::from_millis(cfg.health_interval_ms),
        timeout,
    ));
    if let Some(dns) = cfg.discovery_dns.clone() {
        tasks.spawn(replicas::discovery_loop(
            pool.clone(),
            dns,
            Duration::from_millis(cfg.discovery_interval_ms),
        ));
    }
    let state = Arc::new(RouterState {
        cfg,
        pool: pool.clone(),
        client,
        metrics,
    });
    let (tx, rx) = oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        serve(listener, state, async {
            let _ = rx.await;
        })
        .await;
        tasks.abort_all();
    });
    Ok(RunningRouter {
        addr,
        pool,
        shutdown: tx,
        done,
    })
}

/// How long open connections may finish after a shutdown.
const DRAIN: Duration = Duration::from_secs(30);

async fn serve(
    listener: TcpListener,
    state: Arc<RouterState>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let graceful = crate::http::accept_with(
        &listener,
        state,
        handle,
        shutdown,
        crate::http::ConnLimits::default(),
    )
    .await;
    drop(listener);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
}

/// How the router answers one of its [`ROUTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handling {
    /// The router's own health: 200 while a replica is healthy.
    Health,
    /// The router's own Prometheus text.
    Metrics,
    /// Forwarded to a replica chosen by load and the prompt's prefix (its
    /// KV cache may hold it), under the generation head timeouts.
    Generation,
    /// Forwarded to the least loaded healthy replica: nothing to keep
    /// together, and the answer is the same from any replica of one model
    /// (503 with an OpenAI error body when none is healthy).
    AnyReplica,
    /// A stored response (Responses API): forwarded to replicas in turn
    /// until one holds it (see [`proxy`]'s store misses).
    StoredResponse,
}

/// The routes of one stored response: a path under
/// [`crate::http::RESPONSE_PREFIX`] with the id after it, as a replica's
/// [`crate::http::STORED_RESPONSE_ROUTES`].
pub const STORED_RESPONSE_ROUTES: [(&str, Method, Handling); 2] = [
    (
        "/v1/responses/{response_id}",
        Method::GET,
        Handling::StoredResponse,
    ),
    (
        "/v1/responses/{response_id}",
        Method::DELETE,
        Handling::StoredResponse,
    ),
];

/// Every route the router answers: path, method, and how. The paths and
/// methods are exactly those of [`crate::http::ROUTES`] (a test holds
/// them equal), so whatever a replica serves is reachable through the
/// router; `/health` and `/metrics` are the router's own.
pub const ROUTES: [(&str, Method, Handling); 12] = [
    ("/health", Method::GET, Handling::Health),
    ("/metrics", Method::GET, Handling::Metrics),
    ("/version", Method::GET, Handling::AnyReplica),
    ("/openapi.json", Method::GET, Handling::AnyReplica),
    ("/v1/models", Method::GET, Handling::AnyReplica),
    ("/v1/chat/completions", Method::POST, Handling::Generation),
    ("/v1/completions", Method::POST, Handling::Generation),
    ("/v1/responses", Method::POST, Handling::Generation),
    ("/v1/messages", Method::POST, Handling::Generation),
    (
        "/v1/messages/count_tokens",
        Method::POST,
        Handling::AnyReplica,
    ),
    ("/tokenize", Method::POST, Handling::AnyReplica),
    ("/detokenize", Method::POST, Handling::AnyReplica),
];

/// The router's request handler: [`handle_with`] the router's routes.
async fn handle(state: Arc<RouterState>, req: Request<Incoming>) -> Response<RouterBody> {
    handle_with(state, req, route).await
}

/// Assigns the request its id (the client's `X-Request-Id` when
/// acceptable, else a new one, as the server does), sends that id upstream
/// in place of whatever came in, so the replica's log line and response
/// ids carry it, stamps it on every response (local errors included), and
/// keeps the request's log record (written when the answer ends).
///
/// A `route` that panics is answered with a 500 OpenAI error body (with
/// the id), not a reset connection, and its line says so; the panic itself
/// is the process's one panic line ([`crate::logging::log_panics`]). The
/// connection and every other request go on. `route` is a parameter so a
/// test can hand in one that panics.
async fn handle_with<S, R, Fut>(
    state: Arc<S>,
    mut req: Request<Incoming>,
    route: R,
) -> Response<RouterBody>
where
    R: FnOnce(Arc<S>, Request<Incoming>, RouteLog) -> Fut,
    Fut: std::future::Future<Output = Response<RouterBody>>,
{
    let id = RequestId::for_headers(req.headers());
    req.headers_mut()
        .insert(request_id::HEADER, id.header_value());
    let log = RouteLog::new(id, req.method(), req.uri().path());
    let path = req.uri().path().to_owned();
    let mut res = match request_id::caught(route(state, req, log.clone())).await {
        Some(res) => res,
        None => {
            log.failed(crate::http::request_log::PANICKED);
            local_error_for(&path, &request_id::panicked_error())
        }
    };
    log.set_status(res.status().as_u16());
    res.headers_mut()
        .insert(request_id::HEADER, log.id().header_value());
    res
}

async fn route(
    state: Arc<RouterState>,
    req: Request<Incoming>,
    log: RouteLog,
) -> Response<RouterBody> {
    let log = &log;
    let path = req.uri().path().to_string();
    if path.starts_with(crate::http::RESPONSE_PREFIX) {
        if !STORED_RESPONSE_ROUTES
            .iter()
            .any(|(_, m, _)| m == req.method())
        {
            let mut r = local_error_for(
                &path,
                &ApiError::method_not_allowed(req.method().as_str(), &path),
            );
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, DELETE"));
            return r;
        }
        return forward(state, req, false, log).await;
    }
    let Some((_, want, handling)) = ROUTES.iter().find(|(p, ..)| *p == path) else {
        return local_error_for(&path, &ApiError::not_found(format!("No route for {path}.")));
    };
    if req.method() != want {
        let mut r = local_error_for(
            &path,
            &ApiError::method_not_allowed(req.method().as_str(), &path),
        );
        // A 405 names what the route does serve (RFC 9110), as a replica's does.
        if let Ok(v) = HeaderValue::from_str(want.as_str()) {
            r.headers_mut().insert(ALLOW, v);
        }
        return r;
    }
    match handling {
        Handling::Health => health(&state),
        Handling::Metrics => {
            let mut r = Response::new(RouterBody::Local(ResBody::Full(Full::new(Bytes::from(
                state.metrics.render(),
            )))));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        Handling::Generation => forward(state, req, true, log).await,
        Handling::AnyReplica | Handling::StoredResponse => forward(state, req, false, log).await,
    }
}

fn health(state: &RouterState) -> Response<RouterBody> {
    let n = state.pool.healthy();
    if n == 0 {
        return local_error(&ApiError::unavailable("No healthy replica is available."));
    }
    let mut r = Response::new(RouterBody::Local(ResBody::Full(Full::new(Bytes::from(
        format!(r#"{{"status":"ok","healthy_replicas":{n}}}"#),
    )))));
    *r.status_mut() = StatusCode::OK;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Panics on `/boom` (as a bug on request-controlled bytes would),
    /// answers 204 otherwise.
    async fn boom_route(_: Arc<()>, req: Request<Incoming>, _: RouteLog) -> Response<RouterBody> {
        tokio::task::yield_now().await;
        if req.uri().path() == "/boom" {
            let empty: Vec<u8> = Vec::new();
            let _ = empty[std::hint::black_box(3)];
        }
        let mut r = Response::new(RouterBody::Local(ResBody::Full(Full::new(Bytes::new()))));
        *r.status_mut() = StatusCode::NO_CONTENT;
        r
    }

    /// A panic in one request through the router's accept loop: that
    /// request is a 500 with an OpenAI error body and its id, the same
    /// keep-alive connection then serves the next request, and the request
    /// is one log line saying it panicked.
    #[test]
    fn a_panicking_request_is_a_500_and_one_line_and_the_connection_goes_on() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut answer = String::new();
        let lines = crate::http::request_log::tests::lines("info", || {
            rt.block_on(async {
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let (stop, stopped) = oneshot::channel::<()>();
                let server = tokio::spawn(async move {
                    let graceful = crate::http::accept_with(
                        &listener,
                        Arc::new(()),
                        |s, r| handle_with(s, r, boom_route),
                        async {
                            let _ = stopped.await;
                        },
                        crate::http::ConnLimits::default(),
                    )
                    .await;
                    graceful.shutdown().await;
                });
                let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
                c.write_all(
                    b"GET /boom HTTP/1.1\r\nHost: x\r\nX-Request-Id: boom-1\r\n\r\n\
                      GET /fine HTTP/1.1\r\nHost: x\r\nX-Request-Id: fine-1\r\n\
                      Connection: close\r\n\r\n",
                )
                .await
                .unwrap();
                let mut got = Vec::new();
                let read = c.read_to_end(&mut got);
                tokio::time::timeout(Duration::from_secs(10), read)
                    .await
                    .expect("no answer within 10 s")
                    .unwrap();
                answer = String::from_utf8(got).unwrap();
                let _ = stop.send(());
                server.await.unwrap();
            })
        });
        let (first, second) = answer
            .split_once("HTTP/1.1 204")
            .unwrap_or_else(|| panic!("no second answer on the connection: {answer}"));
        assert!(first.starts_with("HTTP/1.1 500"), "{answer}");
        let first = first.to_ascii_lowercase();
        assert!(first.contains("\r\nx-request-id: boom-1\r\n"), "{answer}");
        // The body, whether chunked or not: the one JSON object in it.
        let body = &first[first.find('{').unwrap_or(0)..first.rfind('}').map_or(0, |i| i + 1)];
        let v: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert!(v["error"]["message"].is_string(), "{v}");
        assert_eq!(v["error"]["type"], "server_error", "{v}");
        assert!(second.to_ascii_lowercase().contains("x-request-id: fine-1"));
        let mine: Vec<_> = lines
            .iter()
            .filter(|l| l["target"] == request_log::TARGET)
            .collect();
        assert_eq!(mine.len(), 2, "{lines:#?}");
        assert_eq!(mine[0]["request_id"], "boom-1");
        assert_eq!(mine[0]["status"], 500);
        assert_eq!(mine[0]["error"], crate::http::request_log::PANICKED);
        assert_eq!(mine[1]["request_id"], "fine-1");
        assert_eq!(mine[1]["status"], 204);
    }
}
