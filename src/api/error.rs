//! [`ApiError`]: the one place an HTTP status and an OpenAI error body are
//! produced. Every layer that refuses a request (validation, auth, routing,
//! admission, the engine) turns its reason into an `ApiError`; the HTTP layer
//! only copies [`ApiError::status`] and [`ApiError::to_json`] onto the wire.
//! Engine errors are mapped in the http layer (`http::convert`), so this
//! module knows no engine type.

use serde::Serialize;

/// The class of an error: decides the HTTP status and the OpenAI `type` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// 400: the request is malformed or asks for something unsupported.
    InvalidRequest,
    /// 401: missing or wrong API key.
    Authentication,
    /// 404: unknown route or unknown model.
    NotFound,
    /// 405: known route, wrong method.
    MethodNotAllowed,
    /// 408: the client did not send its request (body) in time.
    RequestTimeout,
    /// 413: the body is over the configured size limit.
    PayloadTooLarge,
    /// 429: the admission queue is full.
    RateLimited,
    /// 503: the engine is stopped or shutting down, or (router) no replica
    /// is healthy.
    Unavailable,
    /// 502: (router) every replica tried failed before answering.
    BadGateway,
    /// 504: (router) a replica did not answer in time.
    GatewayTimeout,
    /// 500: a bug or an unexpected failure on the server side.
    Internal,
}

impl ErrorKind {
    /// The HTTP status code of this kind.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::RateLimited => 429,
            ErrorKind::Unavailable => 503,
            ErrorKind::BadGateway => 502,
            ErrorKind::GatewayTimeout => 504,
            ErrorKind::Internal => 500,
        }
    }

    /// The `error.type` string of the body. 400, 405 and 413 are all
    /// `invalid_request_error` (as OpenAI does); 500, 502 and 503 are
    /// `server_error`.
    pub fn type_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::MethodNotAllowed
            | ErrorKind::RequestTimeout
            | ErrorKind::PayloadTooLarge => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Unavailable
            | ErrorKind::BadGateway
            | ErrorKind::GatewayTimeout
            | ErrorKind::Internal => "server_error",
        }
    }
}

impl ErrorKind {
    /// The `error.type` string of Anthropic's error body.
    pub fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::MethodNotAllowed => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RequestTimeout => "timeout_error",
            ErrorKind::PayloadTooLarge => "request_too_large",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Unavailable => "overloaded_error",
            ErrorKind::BadGateway | ErrorKind::GatewayTimeout | ErrorKind::Internal => "api_error",
        }
    }
}

/// A refused request, ready to be written as an OpenAI error response.
///
/// Invariant: `param`, when set, names the offending request field the way a
/// client wrote it (`temperature`, `messages[2].content`,
/// `stream_options.include_usage`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    /// Human-readable explanation; becomes `error.message`.
    pub message: String,
    /// The request field at fault; becomes `error.param` (null when `None`).
    pub param: Option<String>,
    /// A machine-readable code such as `model_not_found`; becomes
    /// `error.code` (null when `None`).
    pub code: Option<String>,
    /// Seconds the client should wait before it retries; becomes the
    /// `Retry-After` header (none when `None`).
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// An error of any kind with no param and no code.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one request field; `param` names it.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message).with_param(param)
    }

    /// 400 about the request as a whole (body not JSON, not an object).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    /// 400 for a field this server understands but does not implement
    /// (`logprobs`, `n` > 1, ...); code `unsupported_parameter`.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(param, message).with_code("unsupported_parameter")
    }

    /// 401; code `invalid_api_key`.
    pub fn authentication(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Authentication, message).with_code("invalid_api_key")
    }

    /// 404 for anything not found (a route, a resource).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// 404 for a `model` this server does not serve; param `model`, code
    /// `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self::not_found(format!("The model `{model}` does not exist."))
            .with_param("model")
            .with_code("model_not_found")
    }

    /// 405 for a known path called with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            ErrorKind::MethodNotAllowed,
            format!("Method {method} is not allowed for {path}."),
        )
        .with_code("method_not_allowed")
    }

    /// 400 naming `messages` for a request of `n` chat turns when the server
    /// takes at most `max` (`server.max_messages`); code
    /// `too_many_messages`. The same words on every route that takes turns.
    pub fn too_many_messages(n: usize, max: usize) -> Self {
        Self::invalid(
            "messages",
            format!(
                "'messages' holds {n} messages; this server takes at most {max} in one request \
                 (server.max_messages)."
            ),
        )
        .with_code("too_many_messages")
    }

    /// 413 for a body larger than `limit_bytes`; code `request_too_large`.
    pub fn payload_too_large(limit_bytes: usize) -> Self {
        Self::new(
            ErrorKind::PayloadTooLarge,
            format!("The request body is larger than the limit of {limit_bytes} bytes."),
        )
        .with_code("request_too_large")
    }

    /// 408 for a request body that did not arrive in time; code `timeout`.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RequestTimeout, message).with_code("timeout")
    }

    /// 504 for an upstream (replica) that did not answer in time; code
    /// `upstream_timeout`.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::GatewayTimeout, message).with_code("upstream_timeout")
    }

    /// 429; code `rate_limit_exceeded`.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RateLimited, message).with_code("rate_limit_exceeded")
    }

    /// 503.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// 503 for a server that is overloaded for now (a full queue); code
    /// `server_busy`, and `Retry-After: retry_after_secs`.
    pub fn busy(message: impl Into<String>, retry_after_secs: u64) -> Self {
        let mut e = Self::new(ErrorKind::Unavailable, message).with_code("server_busy");
        e.retry_after = Some(retry_after_secs);
        e
    }

    /// 502; code `upstream_failed`.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadGateway, message).with_code("upstream_failed")
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// Sets `param`.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets `code`.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// The HTTP status code (see [`ErrorKind::status`]).
    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The response body in Anthropic's shape:
    /// `{"type":"error","error":{"type":..,"message":..}}`. Anthropic's
    /// body has no `param`, so the message starts with the field at fault
    /// (`max_tokens: ...`, as Anthropic's own messages do) unless it
    /// already names it.
    pub fn to_anthropic_json(&self) -> String {
        let message = match &self.param {
            Some(p) if !self.message.contains(p.as_str()) => format!("{p}: {}", self.message),
            _ => self.message.clone(),
        };
        serde_json::json!({
            "type": "error",
            "error": {"type": self.kind.anthropic_type(), "message": message},
        })
        .to_string()
    }

    /// The response body, exactly OpenAI's shape:
    /// `{"error":{"message":..,"type":..,"param":..,"code":..}}` with `param`
    /// and `code` as JSON null when unset.
    pub fn to_json(&self) -> String {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind.type_str(),
                param: self.param.as_deref(),
                code: self.code.as_deref(),
            },
        };
        serde_json::to_string(&body).expect("serializing strings cannot fail")
    }
}
