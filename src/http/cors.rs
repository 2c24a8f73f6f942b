//! Cross-origin resource sharing, so a browser page served from another
//! origin can call the API: which origins may (`[server]
//! cors_allow_origins`, off when empty), the `Access-Control-*` headers on
//! responses, and the answer to an `OPTIONS` preflight.
//!
//! Off by default: then no response carries a CORS header and `OPTIONS` is
//! a 405 like any other method a route does not serve. Credentials
//! (cookies) are never allowed: the API authenticates with a bearer key in
//! `Authorization`, which a preflight may permit without them.

use super::ResBody;
use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ORIGIN, VARY,
};
use hyper::{Method, Response, StatusCode};

/// Request headers a page may always send: the key, the JSON body's type,
/// and its own request id. A preflight also allows the headers it asks for
/// (see [`preflight`]).
pub const ALLOW_HEADERS: &str = "Authorization, Content-Type, X-Request-Id";
/// The most headers a preflight's `Access-Control-Request-Headers` may add
/// (the OpenAI JS SDK asks for about ten `x-stainless-*`).
pub const MAX_REQUESTED_HEADERS: usize = 64;
/// Response headers a page may read besides the CORS-safelisted ones.
pub const EXPOSE_HEADERS: &str = "X-Request-Id";
/// How long a browser may reuse a preflight answer, in seconds (Chromium
/// caps it at 7200).
pub const MAX_AGE_SECS: u32 = 7200;

/// Which origins may call the API from a browser.
///
/// Invariant: a listed origin is lowercase with no trailing `/`, as
/// browsers send the `Origin` header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CorsPolicy {
    origins: Origins,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Origins {
    /// No CORS headers at all (the default).
    #[default]
    Off,
    /// Every origin (`"*"`).
    Any,
    /// Exactly these origins; the matching one is echoed back.
    List(Vec<String>),
}

impl CorsPolicy {
    /// The policy of `[server] cors_allow_origins`: empty is off, a `"*"`
    /// entry allows every origin, otherwise each entry is one origin such
    /// as `https://app.example.com` (compared without case and without a
    /// trailing `/`). The config's validation has checked the entries.
    pub fn new(allow_origins: &[String]) -> Self {
        let origins = if allow_origins.is_empty() {
            Origins::Off
        } else if allow_origins.iter().any(|o| o == "*") {
            Origins::Any
        } else {
            Origins::List(allow_origins.iter().map(|o| normalize(o)).collect())
        };
        Self { origins }
    }

    /// Whether CORS is on (any origin allowed).
    pub fn is_enabled(&self) -> bool {
        self.origins != Origins::Off
    }

    /// What a response to a request with `headers` should say in
    /// `Access-Control-Allow-Origin`: `*`, the request's own origin when it
    /// is listed, or nothing (off, no `Origin`, an origin not allowed).
    pub(super) fn allow_origin(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        match &self.origins {
            Origins::Off => None,
            Origins::Any => Some(HeaderValue::from_static("*")),
            Origins::List(list) => {
                let origin = headers.get(ORIGIN)?;
                let text = origin.to_str().ok()?;
                list.contains(&normalize(text)).then(|| origin.clone())
            }
        }
    }

    /// Adds the CORS headers to `resp`: `allow` (from
    /// [`allow_origin`](Self::allow_origin)) and the exposed headers, and
    /// `Vary: Origin` whenever the answer depends on the origin, so a cache
    /// does not serve one origin's answer to another.
    pub(super) fn apply(&self, allow: Option<HeaderValue>, resp: &mut Response<ResBody>) {
        let h = resp.headers_mut();
        if matches!(self.origins, Origins::List(_)) {
            h.append(VARY, HeaderValue::from_static("Origin"));
        }
        if let Some(origin) = allow {
            h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            h.insert(
                ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static(EXPOSE_HEADERS),
            );
        }
    }
}

/// The 204 answer to an `OPTIONS` preflight for a route served with
/// `method`, whose request headers are `request`: the methods and request
/// headers allowed, and how long to cache that. The allowed origin is
/// added by [`CorsPolicy::apply`] like on any response. Needs no API key:
/// browsers send preflights without one.
///
/// The headers allowed are [`ALLOW_HEADERS`] and those the preflight asks
/// for (valid header names, at most [`MAX_REQUESTED_HEADERS`]), as client
/// SDKs send their own (`x-stainless-*`). That grants nothing: the key is
/// still checked on the request itself, and CORS only decides which
/// origins may read the answer.
pub(super) fn preflight(method: &Method, request: &HeaderMap) -> Response<ResBody> {
    let mut r = Response::new(ResBody::Full(Full::new(Bytes::new())));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    let methods = format!("{method}, OPTIONS");
    h.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_str(&methods).expect("method names are header-safe"),
    );
    h.insert(ACCESS_CONTROL_ALLOW_HEADERS, allowed_headers(request));
    h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(MAX_AGE_SECS));
    // The answer depends on what was asked for: a cache must not reuse it
    // for another list.
    h.append(
        VARY,
        HeaderValue::from_static("Access-Control-Request-Headers"),
    );
    r
}

/// [`ALLOW_HEADERS`] and the valid names `request` asks for in
/// `Access-Control-Request-Headers` (lowercase, each once).
fn allowed_headers(request: &HeaderMap) -> HeaderValue {
    let always: Vec<String> = ALLOW_HEADERS
        .split(", ")
        .map(str::to_ascii_lowercase)
        .collect();
    let mut extra: Vec<HeaderName> = Vec::new();
    let asked = request
        .get_all(ACCESS_CONTROL_REQUEST_HEADERS)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    for name in asked {
        // Not a header name (a browser never sends one): left out, so the
        // browser refuses the request.
        let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) else {
            continue;
        };
        if extra.len() == MAX_REQUESTED_HEADERS {
            break;
        }
        if !always.iter().any(|a| a == name.as_str()) && !extra.contains(&name) {
            extra.push(name);
        }
    }
    let mut list = ALLOW_HEADERS.to_owned();
    for name in &extra {
        list.push_str(", ");
        list.push_str(name.as_str());
    }
    // Header names are visible ASCII tokens.
    HeaderValue::from_str(&list).expect("header names make a valid header value")
}

/// An origin as browsers serialize it: lowercase, no trailing `/`.
fn normalize(origin: &str) -> String {
    origin.trim_end_matches('/').to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_origin(origin: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(ORIGIN, HeaderValue::from_str(origin).unwrap());
        h
    }

    fn varies_on_origin(r: &Response<ResBody>) -> bool {
        r.headers().get_all(VARY).iter().any(|v| v == "Origin")
    }

    fn policy(list: &[&str]) -> CorsPolicy {
        CorsPolicy::new(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn off_by_default_and_when_empty() {
        assert_eq!(CorsPolicy::default(), policy(&[]));
        let off = CorsPolicy::default();
        assert!(!off.is_enabled());
        assert_eq!(off.allow_origin(&with_origin("https://a.example")), None);
        let mut r = preflight(&Method::GET, &HeaderMap::new());
        off.apply(None, &mut r);
        assert!(r.headers().get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
        assert!(!varies_on_origin(&r));
    }

    #[test]
    fn a_star_allows_every_origin() {
        let any = policy(&["*"]);
        assert!(any.is_enabled());
        assert_eq!(
            any.allow_origin(&with_origin("https://x.example")).unwrap(),
            "*"
        );
        assert_eq!(any.allow_origin(&HeaderMap::new()).unwrap(), "*");
    }

    #[test]
    fn a_list_echoes_only_its_origins() {
        let p = policy(&["https://App.example/", "http://localhost:3000"]);
        let h = with_origin("https://app.example");
        assert_eq!(p.allow_origin(&h).unwrap(), "https://app.example");
        assert_eq!(
            p.allow_origin(&with_origin("http://localhost:3000"))
                .unwrap(),
            "http://localhost:3000"
        );
        for other in ["https://app.example.evil", "http://app.example", "null"] {
            assert_eq!(p.allow_origin(&with_origin(other)), None, "{other}");
        }
        assert_eq!(p.allow_origin(&HeaderMap::new()), None);
        // The answer depends on the origin, allowed or not: Vary says so.
        let mut r = preflight(&Method::POST, &HeaderMap::new());
        p.apply(p.allow_origin(&h), &mut r);
        assert!(varies_on_origin(&r));
        assert_eq!(r.headers()[ACCESS_CONTROL_EXPOSE_HEADERS], EXPOSE_HEADERS);
        let mut r = preflight(&Method::POST, &HeaderMap::new());
        p.apply(None, &mut r);
        assert!(varies_on_origin(&r));
        assert!(r.headers().get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
    }

    #[test]
    fn preflight_lists_method_headers_and_age() {
        let r = preflight(&Method::POST, &HeaderMap::new());
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        let h = r.headers();
        assert_eq!(h[ACCESS_CONTROL_ALLOW_METHODS], "POST, OPTIONS");
        assert_eq!(h[ACCESS_CONTROL_ALLOW_HEADERS], ALLOW_HEADERS);
        assert_eq!(h[ACCESS_CONTROL_MAX_AGE], "7200");
        assert_eq!(h[VARY], "Access-Control-Request-Headers");
    }

    /// The OpenAI JS SDK's preflight asks for its `x-stainless-*` headers;
    /// a browser refuses the request unless each is allowed.
    #[test]
    fn preflight_allows_the_headers_an_sdk_asks_for() {
        let mut req = HeaderMap::new();
        req.insert(
            ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static(
                "authorization,content-type,x-stainless-arch,x-stainless-lang, \
                 X-Stainless-OS,x-stainless-retry-count,x-stainless-timeout",
            ),
        );
        req.append(
            ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static("x-stainless-package-version, bad header, x-stainless-os"),
        );
        let r = preflight(&Method::POST, &req);
        let allowed: Vec<String> = r.headers()[ACCESS_CONTROL_ALLOW_HEADERS]
            .to_str()
            .unwrap()
            .split(", ")
            .map(str::to_ascii_lowercase)
            .collect();
        for want in [
            "authorization",
            "content-type",
            "x-request-id",
            "x-stainless-arch",
            "x-stainless-lang",
            "x-stainless-os",
            "x-stainless-retry-count",
            "x-stainless-timeout",
            "x-stainless-package-version",
        ] {
            assert_eq!(
                allowed.iter().filter(|a| *a == want).count(),
                1,
                "{want} in {allowed:?}"
            );
        }
        assert!(!allowed.iter().any(|a| a.contains(' ')), "{allowed:?}");
        // A flood of names is capped.
        let many: Vec<String> = (0..500).map(|i| format!("x-h{i}")).collect();
        req.insert(
            ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_str(&many.join(",")).unwrap(),
        );
        let r = preflight(&Method::POST, &req);
        let n = r.headers()[ACCESS_CONTROL_ALLOW_HEADERS]
            .to_str()
            .unwrap()
            .split(", ")
            .count();
        assert_eq!(n, 3 + MAX_REQUESTED_HEADERS);
    }
}
