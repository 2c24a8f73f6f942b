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
    HeaderMap, HeaderValue, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ORIGIN,
    VARY,
};
use hyper::{Method, Response, StatusCode};

/// Request headers a page may send: the key, the JSON body's type, and its
/// own request id.
pub const ALLOW_HEADERS: &str = "Authorization, Content-Type, X-Request-Id";
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
/// `method`: the methods and request headers allowed, and how long to
/// cache that. The allowed origin is added by [`CorsPolicy::apply`] like
/// on any response. Needs no API key: browsers send preflights without one.
pub(super) fn preflight(method: &Method) -> Response<ResBody> {
    let mut r = Response::new(ResBody::Full(Full::new(Bytes::new())));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    let methods = format!("{method}, OPTIONS");
    h.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_str(&methods).expect("method names are header-safe"),
    );
    h.insert(
        ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(ALLOW_HEADERS),
    );
    h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(MAX_AGE_SECS));
    r
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

    fn policy(list: &[&str]) -> CorsPolicy {
        CorsPolicy::new(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn off_by_default_and_when_empty() {
        assert_eq!(CorsPolicy::default(), policy(&[]));
        let off = CorsPolicy::default();
        assert!(!off.is_enabled());
        assert_eq!(off.allow_origin(&with_origin("https://a.example")), None);
        let mut r = preflight(&Method::GET);
        off.apply(None, &mut r);
        assert!(r.headers().get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
        assert!(r.headers().get(VARY).is_none());
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
        let mut r = preflight(&Method::POST);
        p.apply(p.allow_origin(&h), &mut r);
        assert_eq!(r.headers()[VARY], "Origin");
        assert_eq!(r.headers()[ACCESS_CONTROL_EXPOSE_HEADERS], EXPOSE_HEADERS);
        let mut r = preflight(&Method::POST);
        p.apply(None, &mut r);
        assert_eq!(r.headers()[VARY], "Origin");
        assert!(r.headers().get(ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
    }

    #[test]
    fn preflight_lists_method_headers_and_age() {
        let r = preflight(&Method::POST);
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        let h = r.headers();
        assert_eq!(h[ACCESS_CONTROL_ALLOW_METHODS], "POST, OPTIONS");
        assert_eq!(h[ACCESS_CONTROL_ALLOW_HEADERS], ALLOW_HEADERS);
        assert_eq!(h[ACCESS_CONTROL_MAX_AGE], "7200");
    }
}
