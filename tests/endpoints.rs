//! The routes around generation, end to end on an in-process server with
//! the tiny model: `/tokenize` and `/detokenize` (vLLM's shapes, the same
//! encoding as generation), `/v1/models` fields, `/version`, CORS on and
//! off, and `/openapi.json` against the router's own route table.

mod common;

use common::*;
use serde_json::{json, Value};
use specgate::tokenizer::ChatMessage;

const KEY: &str = "sk-endpoints";
const AUTH: (&str, &str) = ("Authorization", "Bearer sk-endpoints");
const JSON: (&str, &str) = ("Content-Type", "application/json");

fn json_of(r: &Resp) -> Value {
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body))
}

/// POST with the API key.
fn post_key(s: &Server, path: &str, body: Value) -> Resp {
    request(s.addr, "POST", path, &[AUTH, JSON], &body.to_string())
}

fn keyed(extra: impl FnOnce(&mut specgate::config::Config)) -> Server {
    Server::start(
        config(|c| {
            c.server.api_keys = vec![KEY.into()];
            extra(c);
        }),
        None,
    )
}

fn ids(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn tokenize_then_detokenize_returns_the_text() {
    let s = keyed(|_| {});
    // vLLM's `max_model_len`: what one request may hold (context and pool).
    let ctx = s.engine().max_request_tokens();

    // Prompt form, without BOS: the ids decode back to the text exactly.
    let text = "hello world, the quick brown fox";
    let r = post_key(
        &s,
        "/tokenize",
        json!({"model": MODEL, "prompt": text, "add_special_tokens": false, "return_token_strs": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let t = json_of(&r);
    let tokens = ids(&t);
    assert!(!tokens.is_empty());
    assert_eq!(t["count"], tokens.len());
    assert_eq!(t["max_model_len"], ctx);
    assert_eq!(t["token_strs"].as_array().unwrap().len(), tokens.len());
    let r = post_key(&s, "/detokenize", json!({"tokens": tokens}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(json_of(&r), json!({"prompt": text}));

    // Prompt form with the defaults counts what /v1/completions counts.
    let t = json_of(&post_key(&s, "/tokenize", json!({"prompt": text})));
    assert!(t.get("token_strs").is_none());
    let r = post_key(
        &s,
        "/v1/completions",
        json!({"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let c: Value = json_of(&r);
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{}", r.body);

    // Chat form: the ids are the chat route's (same count as its usage), and
    // they decode to the rendered template.
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]);
    let t = json_of(&post_key(&s, "/tokenize", json!({"messages": messages})));
    let r = post_key(
        &s,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(t["count"], json_of(&r)["usage"]["prompt_tokens"]);
    let tok = specgate::generate::load_tokenizer(&model_files().0).unwrap();
    let turns = [
        ChatMessage::new("system", "be brief"),
        ChatMessage::new("user", "hello world"),
    ];
    let rendered = tok.apply_chat_template(&turns, true).unwrap();
    let d = json_of(&post_key(&s, "/detokenize", json!({"tokens": ids(&t)})));
    assert_eq!(d["prompt"], rendered);
    assert!(rendered.contains("hello world") && rendered.contains("<|im_start|>"));

    // Without the generation prompt the assistant header is not there.
    let bare = json_of(&post_key(
        &s,
        "/tokenize",
        json!({"messages": messages, "add_generation_prompt": false}),
    ));
    assert!(bare["count"].as_u64() < t["count"].as_u64());
    let d = json_of(&post_key(&s, "/detokenize", json!({"tokens": ids(&bare)})));
    assert_eq!(d["prompt"], tok.apply_chat_template(&turns, false).unwrap());
}

#[test]
fn bad_tokenize_and_detokenize_requests_are_refused() {
    let s = keyed(|_| {});
    let vocab = 384; // the tiny model's (tests/common)
    for (path, body, status, param) in [
        ("/detokenize", json!({"tokens": [1, vocab]}), 400, "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), 400, "tokens"),
        ("/detokenize", json!({"tokens": "1 2"}), 400, "tokens"),
        (
            "/detokenize",
            json!({"tokens": [1], "skip_special_tokens": true}),
            400,
            "skip_special_tokens",
        ),
        (
            "/detokenize",
            json!({"model": "other", "tokens": [1]}),
            404,
            "model",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "unknown": 1}),
            400,
            "unknown",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": []}),
            400,
            "messages",
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
            400,
            "tools",
        ),
        (
            "/tokenize",
            json!({"model": "other", "prompt": "a"}),
            404,
            "model",
        ),
        ("/tokenize", json!({}), 400, "prompt"),
    ] {
        let r = post_key(&s, path, body.clone());
        assert_eq!(r.status, status, "{path} {body}: {}", r.body);
        assert_eq!(error_of(&r)["param"], param, "{path} {body}");
    }
    let r = post_key(&s, "/detokenize", json!({"tokens": [1, vocab]}));
    let msg = error_of(&r)["message"].as_str().unwrap().to_string();
    assert!(msg.contains("tokens[1]") && msg.contains("384"), "{msg}");
    // Not JSON, and the wrong method.
    let r = request(s.addr, "POST", "/tokenize", &[AUTH, JSON], "{");
    assert_eq!(r.status, 400);
    let r = request(s.addr, "GET", "/tokenize", &[AUTH], "");
    assert_eq!(r.status, 405);
    assert_eq!(header(&r, "allow").as_deref(), Some("POST"));
}

#[test]
fn the_new_routes_authenticate_like_v1() {
    let s = keyed(|_| {});
    let body = json!({"prompt": "hi"}).to_string();
    let no_key = request(s.addr, "POST", "/tokenize", &[JSON], &body);
    assert_eq!(no_key.status, 401, "{}", no_key.body);
    let r = request(s.addr, "POST", "/detokenize", &[JSON], r#"{"tokens":[1]}"#);
    assert_eq!(r.status, 401);
    assert_eq!(
        request(s.addr, "POST", "/tokenize", &[AUTH, JSON], &body).status,
        200
    );
    assert_eq!(request(s.addr, "GET", "/v1/models", &[], "").status, 401);
    // Version and the API description are public, as /health is.
    assert_eq!(request(s.addr, "GET", "/version", &[], "").status, 200);
    assert_eq!(request(s.addr, "GET", "/openapi.json", &[], "").status, 200);
}

#[test]
fn models_card_carries_the_context_and_method() {
    let s = Server::start(config(|c| c.model.max_model_len = Some(200)), None);
    assert_eq!(s.engine().max_position(), 200);
    let m = json_of(&request(s.addr, "GET", "/v1/models", &[], ""));
    let card = &m["data"][0];
    assert_eq!(card["id"], MODEL);
    assert_eq!(card["object"], "model");
    assert_eq!(card["owned_by"], "specgate");
    assert!(card["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(card["max_model_len"], 200);
    assert_eq!(card["speculative"]["method"], "ngram");
    let t = json_of(&request(
        s.addr,
        "POST",
        "/tokenize",
        &[JSON],
        r#"{"prompt":"hi"}"#,
    ));
    assert_eq!(t["max_model_len"], 200);

    let s = Server::start(
        config(|c| c.speculative.method = specgate::config::SpeculativeMethod::Draft),
        None,
    );
    let m = json_of(&request(s.addr, "GET", "/v1/models", &[], ""));
    assert_eq!(m["data"][0]["speculative"]["method"], "draft");
    // The smaller of the context and what the KV pool holds for one request.
    assert_eq!(
        m["data"][0]["max_model_len"],
        s.engine().max_request_tokens()
    );
}

#[test]
fn version_names_the_crate_version() {
    let s = Server::start(config(|_| {}), None);
    let r = request(s.addr, "GET", "/version", &[], "");
    assert_eq!(r.status, 200);
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("application/json")
    );
    let v = json_of(&r);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["build"]["profile"].is_string() && v["build"]["arch"].is_string());
}

#[test]
fn cors_is_off_by_default() {
    let s = keyed(|_| {});
    let origin = ("Origin", "https://app.example");
    let r = request(
        s.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[origin, ("Access-Control-Request-Method", "POST")],
        "",
    );
    // Off: OPTIONS is a method no route serves.
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(header(&r, "allow").as_deref(), Some("POST"));
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    let r = request(s.addr, "GET", "/v1/models", &[AUTH, origin], "");
    assert_eq!(r.status, 200);
    assert!(
        !r.headers.to_ascii_lowercase().contains("access-control-"),
        "{}",
        r.headers
    );
}

#[test]
fn cors_on_answers_preflights_and_marks_responses() {
    let s = keyed(|c| {
        c.server.cors_allow_origins = vec!["https://app.example".into()];
    });
    let origin = ("Origin", "https://app.example");
    // A preflight needs no key, on every route.
    for (path, method) in specgate::http::ROUTES {
        let r = request(
            s.addr,
            "OPTIONS",
            path,
            &[
                origin,
                ("Access-Control-Request-Method", method.as_str()),
                (
                    "Access-Control-Request-Headers",
                    "authorization,content-type",
                ),
            ],
            "",
        );
        assert_eq!(r.status, 204, "{path}: {}", r.body);
        assert_eq!(
            header(&r, "access-control-allow-origin").as_deref(),
            Some("https://app.example"),
            "{path}"
        );
        let methods = header(&r, "access-control-allow-methods").unwrap();
        assert!(methods.contains(method.as_str()), "{path}: {methods}");
        let allowed = header(&r, "access-control-allow-headers").unwrap();
        for h in ["Authorization", "Content-Type", "X-Request-Id"] {
            assert!(allowed.contains(h), "{path}: {allowed}");
        }
        assert!(header(&r, "access-control-max-age").is_some(), "{path}");
        // The answer depends on the origin and on the headers asked for.
        let vary: Vec<&str> = r
            .headers
            .lines()
            .filter_map(|l| l.split_once(':'))
            .filter(|(k, _)| k.trim().eq_ignore_ascii_case("vary"))
            .flat_map(|(_, v)| v.split(',').map(str::trim))
            .collect();
        assert!(vary.contains(&"Origin"), "{path}: {vary:?}");
    }
    // A real request carries the origin back, and the error of one without
    // a key too (so the page can read why it failed).
    let r = post_key(&s, "/tokenize", json!({"prompt": "hi"}));
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    let r = request(
        s.addr,
        "POST",
        "/tokenize",
        &[AUTH, JSON, origin],
        r#"{"prompt":"hi"}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
    assert!(header(&r, "access-control-expose-headers")
        .unwrap()
        .contains("X-Request-Id"));
    let r = request(s.addr, "GET", "/v1/models", &[origin], "");
    assert_eq!(r.status, 401);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
    // Another origin gets no grant, on a preflight or a request.
    let evil = ("Origin", "https://evil.example");
    let r = request(s.addr, "OPTIONS", "/v1/models", &[evil], "");
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    let r = request(s.addr, "GET", "/v1/models", &[AUTH, evil], "");
    assert_eq!(r.status, 200);
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    // With CORS on, a 405 also names OPTIONS.
    let r = request(s.addr, "DELETE", "/version", &[origin], "");
    assert_eq!(r.status, 405);
    assert_eq!(header(&r, "allow").as_deref(), Some("GET, OPTIONS"));
    // An unknown path stays a 404, preflight or not.
    assert_eq!(
        request(s.addr, "OPTIONS", "/nowhere", &[origin], "").status,
        404
    );

    // "*" grants every origin.
    let s = Server::start(
        config(|c| c.server.cors_allow_origins = vec!["*".into()]),
        None,
    );
    let r = request(s.addr, "GET", "/v1/models", &[evil], "");
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some("*")
    );
}

#[test]
fn cors_origins_are_validated() {
    let check = |origins: &[&str]| {
        let mut c = specgate::config::Config::default();
        c.server.cors_allow_origins = origins.iter().map(|s| s.to_string()).collect();
        c.validate()
    };
    for ok in [
        &[][..],
        &["*"],
        &["https://app.example", "http://localhost:3000/"],
        &["chrome-extension://abcdef"],
    ] {
        assert!(check(ok).is_ok(), "{ok:?}: {:?}", check(ok));
    }
    for bad in [
        &["*", "https://a.example"][..],
        &["app.example"],
        &["https://app.example/path"],
        &["https://*.example"],
        &["https://"],
        &["https://a b"],
        &[""],
    ] {
        let e = check(bad).expect_err(&format!("{bad:?} accepted"));
        assert!(
            e.to_string().contains("server.cors_allow_origins"),
            "{bad:?}: {e}"
        );
    }
    let many: Vec<String> = (0..65).map(|i| format!("https://a{i}.example")).collect();
    let mut c = specgate::config::Config::default();
    c.server.cors_allow_origins = many;
    assert!(c.validate().is_err());
}

#[test]
fn openapi_documents_every_route_the_server_answers() {
    let s = keyed(|_| {});
    let r = request(s.addr, "GET", "/openapi.json", &[], "");
    assert_eq!(r.status, 200);
    let doc = json_of(&r);
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    let paths = doc["paths"].as_object().unwrap();
    let mut documented = 0;
    for (path, method) in specgate::http::ROUTES {
        let op = &paths[path][method.as_str().to_lowercase()];
        assert!(op.is_object(), "{method} {path} is not documented");
        assert!(op["responses"]["200"].is_object(), "{method} {path}");
        documented += 1;
        // The route table is what the server answers: never a 404 there.
        let r = request(s.addr, method.as_str(), path, &[AUTH, JSON], "{}");
        assert_ne!(r.status, 404, "{method} {path}: {}", r.body);
    }
    // A stored response's routes: a path template, answered (an unknown
    // id is a 404 with the error body, never a 405 or a missing route).
    for (path, method) in specgate::http::STORED_RESPONSE_ROUTES {
        let op = &paths[path][method.as_str().to_lowercase()];
        assert!(op.is_object(), "{method} {path} is not documented");
        documented += 1;
        let r = request(s.addr, method.as_str(), "/v1/responses/resp_x", &[AUTH], "");
        assert_eq!(r.status, 404, "{method} {path}: {}", r.body);
        assert!(r.body.contains("resp_x"), "{}", r.body);
    }
    let ops: usize = paths.values().map(|o| o.as_object().unwrap().len()).sum();
    assert_eq!(
        ops, documented,
        "the document lists a route the server lacks"
    );
    // The loaded server writes its own name and limits into the schemas.
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        schemas["ChatCompletionRequest"]["properties"]["model"]["const"],
        MODEL
    );
    let ids = &schemas["DetokenizeRequest"]["properties"]["tokens"]["items"];
    assert_eq!(ids["maximum"], 383, "the tiny vocabulary has 384 ids");
    // The request bodies' references resolve.
    for name in [
        "ChatCompletionRequest",
        "CompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "Error",
    ] {
        assert!(doc["components"]["schemas"][name].is_object(), "{name}");
    }
}
