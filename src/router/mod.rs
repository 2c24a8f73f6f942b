//! `specgate route`: one OpenAI-compatible endpoint in front of N engine
//! replicas (other `specgate serve` processes). Owns the router's HTTP
//! server and its routes; the replica set, health and load polling and DNS
//! discovery are in [`replicas`], the choice of replica in [`balancer`]
//! (pure), forwarding, timeouts and retries in [`proxy`], and relaying a
//! replica's response body (idle limit, an error event for a cut stream) in
//! [`relay`].
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` and
//! `GET /v1/models` are forwarded; `GET /health` is the router's own (200
//! while at least one replica is healthy, else 503) and `GET /metrics` its
//! own Prometheus text. Authentication is left to the replicas: the
//! `Authorization` header is passed through.

pub mod balancer;
pub mod config;
pub mod proxy;
pub mod relay;
pub mod replicas;

pub use config::RouterConfig;

use crate::api::ApiError;
use crate::http::ResBody;
use anyhow::{Context, Result};
use balancer::Balancer;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use metrics_exporter_prometheus::PrometheusHandle;
use proxy::{forward, local_error, RouterBody};
use replicas::{Hysteresis, Pool};
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
        .pool_idle_timeout(Duration::from_secs(30))
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
    let pool = Arc::new(Pool::new(&cfg.replicas, balancer, hysteresis));
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
        route,
        shutdown,
        crate::http::ConnLimits::default(),
    )
    .await;
    drop(listener);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
}

async fn route(state: Arc<RouterState>, req: Request<Incoming>) -> Response<RouterBody> {
    let path = req.uri().path().to_string();
    const ROUTES: [(&str, Method); 5] = [
        ("/health", Method::GET),
        ("/metrics", Method::GET),
        ("/v1/models", Method::GET),
        ("/v1/chat/completions", Method::POST),
        ("/v1/completions", Method::POST),
    ];
    let Some((_, want)) = ROUTES.iter().find(|(p, _)| *p == path) else {
        return local_error(&ApiError::not_found(format!("no route for {path}")));
    };
    if req.method() != want {
        return local_error(&ApiError::method_not_allowed(req.method().as_str(), &path));
    }
    match path.as_str() {
        "/health" => health(&state),
        "/metrics" => {
            let mut r = Response::new(RouterBody::Local(ResBody::Full(Full::new(Bytes::from(
                state.metrics.render(),
            )))));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        _ => forward(state, req).await,
    }
}

fn health(state: &RouterState) -> Response<RouterBody> {
    let n = state.pool.healthy();
    if n == 0 {
        return local_error(&ApiError::unavailable("no healthy replica"));
    }
    let mut r = Response::new(RouterBody::Local(ResBody::Full(Full::new(Bytes::from(
        format!(r#"{{"status":"ok","healthy_replicas":{n}}}"#),
    )))));
    *r.status_mut() = StatusCode::OK;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}
