//! The HTTP side: a plain-HTTP/1.1 client (hyper 1 over a tokio TcpStream,
//! one connection per request) that sends one streaming OpenAI request and
//! timestamps every Server-Sent Event carrying text, plus GETs of
//! /v1/models and /metrics. No TLS: the tool measures a server on loopback
//! or on the URL it is given.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

use crate::workload::{Entry, Input};

/// Where the server is: `http://host:port` with an optional path prefix;
/// a trailing `/v1` (as OpenAI clients write it) is accepted and dropped.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` to connect to and send as Host.
    pub authority: String,
    /// Path prefix without a trailing slash ("" for the root).
    pub prefix: String,
    pub api_key: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("base URL {0:?} must start with http:// (TLS is not supported)")]
    Scheme(String),
    #[error("base URL {0:?} has no host")]
    NoHost(String),
    #[error("GET {path}: {message}")]
    Get { path: String, message: String },
}

impl Target {
    /// Parses a base URL. Errors: not `http://`, or no host.
    pub fn parse(url: &str, api_key: Option<String>) -> Result<Target, ClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ClientError::Scheme(url.into()))?;
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        if host.is_empty() {
            return Err(ClientError::NoHost(url.into()));
        }
        let authority = if host.contains(':') && !host.ends_with(']') {
            host.to_string()
        } else {
            format!("{host}:80")
        };
        let path = format!("/{}", path.trim_end_matches('/'));
        let prefix = path
            .strip_suffix("/v1")
            .unwrap_or(&path)
            .trim_end_matches('/')
            .to_string();
        Ok(Target {
            authority,
            prefix,
            api_key,
        })
    }

    fn request(&self, method: Method, path: &str, body: Bytes) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header("host", &self.authority)
            .header("accept", "text/event-stream, application/json, text/plain");
        if !body.is_empty() {
            b = b.header("content-type", "application/json");
        }
        if let Some(k) = &self.api_key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        b.body(Full::new(body)).expect("valid request parts")
    }

    async fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, Failure> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| Failure::new("connect", e))?;
        let _ = stream.set_nodelay(true);
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::new("connect", e))?;
        tokio::spawn(conn);
        tx.send_request(req)
            .await
            .map_err(|e| Failure::new("send", e))
    }

    /// GET `path` (below the prefix) and return the body as text.
    ///
    /// Errors: connection failures and non-200 statuses.
    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let err = |message: String| ClientError::Get {
            path: path.into(),
            message,
        };
        let resp = self
            .send(self.request(Method::GET, path, Bytes::new()))
            .await
            .map_err(|f| err(f.to_string()))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| err(e.to_string()))?
            .to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            return Err(err(format!("status {status}: {text}")));
        }
        Ok(text)
    }

    /// The first model id on /v1/models.
    pub async fn first_model(&self) -> Result<String, ClientError> {
        let text = self.get_text("/v1/models").await?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ClientError::Get {
            path: "/v1/models".into(),
            message: e.to_string(),
        })?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| ClientError::Get {
                path: "/v1/models".into(),
                message: format!("no model listed: {text}"),
            })
    }
}

/// Why a request failed: a short class used to group failures
/// ("connect", "http 429", "stream error", ...) and one message.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub class: String,
    pub message: String,
}

impl Failure {
    fn new(class: &str, e: impl std::fmt::Display) -> Failure {
        Failure {
            class: class.into(),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.class, self.message)
    }
}

/// What one finished request measured. Times are seconds from sending.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timing {
    /// Arrival of each SSE event that carried text (content or reasoning),
    /// in order.
    pub chunks: Vec<f64>,
    /// When the stream ended (`[DONE]` or the body's end).
    pub end: f64,
    /// Output tokens: the usage chunk's `completion_tokens`, else the
    /// number of text events (a lower bound when events carry several).
    pub output_tokens: u64,
    pub prompt_tokens: Option<u64>,
    /// Whether `output_tokens` came from the server's usage chunk.
    pub exact_tokens: bool,
    /// The streamed answer: `delta.content` (chat) or `text` (completions).
    pub content: String,
    /// The streamed `delta.reasoning_content` (or `delta.reasoning`).
    pub reasoning: String,
}

impl Timing {
    /// Time to the first text event.
    pub fn ttft(&self) -> Option<f64> {
        self.chunks.first().copied()
    }

    /// Mean time per output token after the first:
    /// (end of stream - first text) / (tokens - 1).
    pub fn tpot(&self) -> Option<f64> {
        let first = self.ttft()?;
        (self.output_tokens > 1).then(|| (self.end - first) / (self.output_tokens - 1) as f64)
    }

    /// Gaps between consecutive text events. With speculative decoding one
    /// event may carry several tokens, so these are what a reader of the
    /// stream waits, not a per-token figure (see [`Self::tpot`]).
    pub fn gaps(&self) -> impl Iterator<Item = f64> + '_ {
        self.chunks.windows(2).map(|w| w[1] - w[0])
    }
}

/// Options every request of a run shares.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    pub model: String,
    pub temperature: f64,
    /// Overrides each entry's `max_tokens`.
    pub max_tokens: Option<u32>,
    /// vLLM's `ignore_eos` extension: every request generates `max_tokens`.
    pub ignore_eos: bool,
    /// A request still unfinished after this long fails with "timeout".
    pub timeout: Duration,
    /// Sent as `chat_template_kwargs` with chat requests (template
    /// variables such as Kimi K3's `thinking`).
    pub chat_template_kwargs: Option<Value>,
}

/// The JSON body of one streaming request for `entry`, and its path.
pub fn body(entry: &Entry, o: &RequestOptions) -> (&'static str, Value) {
    let mut b = json!({
        "model": o.model,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": o.temperature,
    });
    let path = match &entry.input {
        Input::Prompt(p) => {
            b["prompt"] = json!(p);
            "/v1/completions"
        }
        Input::Messages(m) => {
            b["messages"] = json!(m);
            if let Some(k) = &o.chat_template_kwargs {
                b["chat_template_kwargs"] = k.clone();
            }
            "/v1/chat/completions"
        }
    };
    if let Some(n) = o.max_tokens.or(entry.max_tokens) {
        b["max_tokens"] = json!(n);
    }
    if o.ignore_eos {
        b["ignore_eos"] = json!(true);
    }
    (path, b)
}

/// Sends one streaming request and times its events.
pub async fn stream_request(
    t: &Target,
    entry: &Entry,
    o: &RequestOptions,
) -> Result<Timing, Failure> {
    let start = Instant::now();
    match tokio::time::timeout(o.timeout, stream_inner(t, entry, o, start)).await {
        Ok(r) => r,
        Err(_) => Err(Failure::new(
            "timeout",
            format!("unfinished after {:?}", o.timeout),
        )),
    }
}

async fn stream_inner(
    t: &Target,
    entry: &Entry,
    o: &RequestOptions,
    start: Instant,
) -> Result<Timing, Failure> {
    let (path, b) = body(entry, o);
    let resp = t
        .send(t.request(Method::POST, path, Bytes::from(b.to_string())))
        .await?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let msg = v["error"]["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        return Err(Failure::new(&format!("http {}", status.as_u16()), msg));
    }
    let mut sse = SseParser::default();
    let mut timing = Timing::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Failure::new("stream broken", e))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = start.elapsed().as_secs_f64();
        for ev in sse.push(&data) {
            if on_event(&ev, now, &mut timing)? {
                timing.end = now;
                return Ok(finish(timing));
            }
        }
    }
    Err(Failure::new(
        "truncated stream",
        "body ended without data: [DONE]",
    ))
}

fn finish(mut t: Timing) -> Timing {
    if !t.exact_tokens {
        t.output_tokens = t.chunks.len() as u64;
    }
    t
}

/// Applies one SSE data payload; true at `[DONE]`.
fn on_event(data: &str, now: f64, t: &mut Timing) -> Result<bool, Failure> {
    if data == "[DONE]" {
        return Ok(true);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| Failure::new("bad event", e))?;
    if let Some(e) = v.get("error") {
        let msg = e["message"].as_str().unwrap_or("(no message)");
        return Err(Failure::new("stream error", msg));
    }
    let c = &v["choices"][0];
    let text = c["delta"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .filter(|s| !s.is_empty());
    let reasoning = c["delta"]["reasoning_content"]
        .as_str()
        .or(c["delta"]["reasoning"].as_str())
        .filter(|s| !s.is_empty());
    if text.is_some() || reasoning.is_some() {
        t.chunks.push(now);
    }
    t.content.push_str(text.unwrap_or(""));
    t.reasoning.push_str(reasoning.unwrap_or(""));
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        if let Some(n) = u["completion_tokens"].as_u64() {
            t.output_tokens = n;
            t.exact_tokens = true;
        }
        t.prompt_tokens = u["prompt_tokens"].as_u64();
    }
    Ok(false)
}

/// Splits a byte stream into SSE events and yields each event's `data`
/// (multi-line data joined with `\n`); comments and other fields are
/// dropped. Events may be split anywhere across frames.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let Some((end, sep)) = find_blank_line(&self.buf) else {
                return out;
            };
            let ev: Vec<u8> = self.buf.drain(..end + sep).collect();
            let ev = String::from_utf8_lossy(&ev[..end]);
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
    }
}

fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    (0..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if b[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        let t = Target::parse("http://127.0.0.1:8000/v1/", None).unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("127.0.0.1:8000", "")
        );
        let t = Target::parse("http://localhost/proxy/v1", Some("k".into())).unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("localhost:80", "/proxy")
        );
        let t = Target::parse("http://[::1]:9/apiv1", None).unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("[::1]:9", "/apiv1")
        );
        assert!(matches!(
            Target::parse("https://x:1", None),
            Err(ClientError::Scheme(_))
        ));
        assert!(matches!(
            Target::parse("http:///v1", None),
            Err(ClientError::NoHost(_))
        ));
    }

    #[test]
    fn sse_events_split_across_frames() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            p.push(b":1}\n\n: keep-alive\n\ndata: [DO"),
            vec!["{\"a\":1}"]
        );
        assert_eq!(p.push(b"NE]\r\n\r\n"), vec!["[DONE]"]);
    }

    #[test]
    fn events_build_the_timing() {
        let mut t = Timing::default();
        let role = r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#;
        assert!(!on_event(role, 0.1, &mut t).unwrap());
        on_event(r#"{"choices":[{"delta":{"content":"ab"}}]}"#, 0.5, &mut t).unwrap();
        on_event(r#"{"choices":[{"text":"c"}]}"#, 0.7, &mut t).unwrap();
        // A reasoning delta is a token too (TTFT counts it), kept apart.
        on_event(
            r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
            0.75,
            &mut t,
        )
        .unwrap();
        on_event(
            r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#,
            0.8,
            &mut t,
        )
        .unwrap();
        on_event(
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5}}"#,
            0.8,
            &mut t,
        )
        .unwrap();
        assert!(on_event("[DONE]", 0.9, &mut t).unwrap());
        t.end = 0.9;
        let t = finish(t);
        assert_eq!(t.chunks, vec![0.5, 0.7, 0.75]);
        assert_eq!((t.content.as_str(), t.reasoning.as_str()), ("abc", "hm"));
        assert_eq!(
            (t.output_tokens, t.prompt_tokens, t.exact_tokens),
            (5, Some(9), true)
        );
        assert_eq!(t.ttft(), Some(0.5));
        assert!((t.tpot().unwrap() - 0.1).abs() < 1e-12); // (0.9 - 0.5) / 4
        let gaps: Vec<f64> = t.gaps().collect();
        assert!((gaps[0] - 0.2).abs() < 1e-12);
        // A reasoning-only stream has its first token at the first reasoning delta.
        let mut t = Timing::default();
        on_event(r#"{"choices":[{"delta":{"reasoning":"x"}}]}"#, 0.3, &mut t).unwrap();
        assert_eq!((t.ttft(), t.content.as_str()), (Some(0.3), ""));
        let e = on_event(
            r#"{"error":{"message":"boom"}}"#,
            1.0,
            &mut Timing::default(),
        );
        assert_eq!(e.unwrap_err().class, "stream error");
        // Without a usage chunk the text events are counted.
        let mut t = Timing::default();
        on_event(r#"{"choices":[{"text":"x"}]}"#, 0.1, &mut t).unwrap();
        assert_eq!(finish(t).output_tokens, 1);
    }

    #[test]
    fn request_bodies() {
        let o = RequestOptions {
            model: "m".into(),
            temperature: 0.0,
            max_tokens: None,
            ignore_eos: true,
            timeout: Duration::from_secs(1),
            chat_template_kwargs: Some(json!({"thinking": false})),
        };
        let e = Entry {
            input: Input::Prompt("p".into()),
            max_tokens: Some(7),
        };
        let (path, b) = body(&e, &o);
        assert_eq!(path, "/v1/completions");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        // Template variables go with chat requests only.
        assert!(b.get("chat_template_kwargs").is_none());
        let o = RequestOptions {
            max_tokens: Some(3),
            ignore_eos: false,
            ..o
        };
        let e = Entry {
            input: Input::Messages(vec![json!({"role": "user", "content": "q"})]),
            max_tokens: Some(7),
        };
        let (path, b) = body(&e, &o);
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(b["max_tokens"], 3);
        assert!(b.get("ignore_eos").is_none());
        assert_eq!(b["chat_template_kwargs"]["thinking"], false);
    }
}
