//! Request numbers that mean what they say, end to end on the tiny model:
//! a temperature too small to divide by is greedy; penalties and biases
//! stay where the arithmetic is finite; a missing `max_tokens` takes the
//! room there is (context and KV pool), and `/v1/models` shows that room;
//! `/v1/completions` takes its prompt as token ids; and `echo` with
//! `logprobs` is bounded by `[scheduler] max_echo_prompt_tokens`.

mod common;

use common::*;
use serde_json::{json, Value};

fn json_of(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// A greedy-unless-told completion of `prompt`, 8 tokens past any EOS.
fn completion(prompt: Value, extra: Value) -> Value {
    merge(
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
               "ignore_eos": true}),
        extra,
    )
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// The 400's `param`, after checking the status.
fn refused(r: &Resp) -> String {
    assert_eq!(r.status, 400, "{}", r.body);
    error_of(r)["param"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn a_temperature_below_epsilon_is_greedy() {
    let s = Server::start(config(|_| {}), None);
    let greedy = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(json!("hello world"), json!({"logprobs": 0})),
    ));
    // `1/t` of a subnormal is infinite; the warp would be NaN everywhere.
    for t in [1e-39, 1e-30, 1e-6] {
        let tiny = json_of(&post(
            s.addr,
            "/v1/completions",
            completion(
                json!("hello world"),
                json!({"temperature": t, "logprobs": 0}),
            ),
        ));
        assert_eq!(text_of(&tiny), text_of(&greedy), "temperature {t}");
        assert_eq!(
            tiny["choices"][0]["logprobs"]["tokens"], greedy["choices"][0]["logprobs"]["tokens"],
            "temperature {t}"
        );
    }
    s.wait_idle();
}

#[test]
fn penalties_and_biases_stay_finite() {
    let s = Server::start(config(|_| {}), None);
    let body = |extra: Value| chat(merge(extra, json!({"max_tokens": 4})));
    for (extra, param) in [
        (json!({"repetition_penalty": 1e-39}), "repetition_penalty"),
        (json!({"repetition_penalty": 0.001}), "repetition_penalty"),
        (json!({"repetition_penalty": 1e30}), "repetition_penalty"),
        (json!({"logit_bias": {"5": 100, "05": 100}}), "logit_bias"),
        (json!({"logit_bias": {"7": 1, "0007": -1}}), "logit_bias"),
    ] {
        let r = post(s.addr, "/v1/chat/completions", body(extra.clone()));
        assert_eq!(refused(&r), param, "{extra}");
    }
    // The ends of the ranges are served.
    for extra in [
        json!({"repetition_penalty": 0.01}),
        json!({"repetition_penalty": 100}),
        json!({"logit_bias": {"5": 100, "6": -100}}),
    ] {
        let r = post(s.addr, "/v1/chat/completions", body(extra.clone()));
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
    s.wait_idle();
}

/// 8 blocks of 16: a pool of 128 token slots under a context of 1024.
fn small_pool() -> Server {
    Server::start(
        config(|c| {
            c.kv.num_blocks = 8;
            c.kv.block_size = 16;
        }),
        None,
    )
}

#[test]
fn a_missing_max_tokens_takes_the_room_the_pool_has() {
    let log = captured_log("specgate=warn");
    let s = small_pool();
    assert!(s.engine().pool_below_context());
    assert!(
        log.contents().contains("less than one full context"),
        "startup warns: {}",
        log.contents()
    );
    let limit = s.engine().max_request_tokens();
    assert_eq!(limit, 127, "128 slots, one kept for the verify row");
    let card = json_of(&request(s.addr, "GET", "/v1/models", &[], ""));
    assert_eq!(card["data"][0]["max_model_len"], limit);
    let tok = json_of(&post(s.addr, "/tokenize", json!({"prompt": "hello world"})));
    assert_eq!(tok["max_model_len"], limit);

    // Neither endpoint's default is a 400; chat fills the room.
    for stream in [false, true] {
        let mut body = chat(json!({"ignore_eos": true, "stream": stream}));
        body.as_object_mut().unwrap().remove("max_tokens");
        let r = post(s.addr, "/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.body);
        if !stream {
            let v = json_of(&r);
            let u = &v["usage"];
            let total = u["total_tokens"].as_u64().unwrap();
            assert_eq!(total, limit as u64, "{u}");
            assert_eq!(v["choices"][0]["finish_reason"], "length");
        } else {
            let (evs, done) = events(&r.body);
            assert!(done && !evs.is_empty());
        }
    }
    let mut body = completion(json!("hello world"), json!({}));
    body.as_object_mut().unwrap().remove("max_tokens");
    let v = json_of(&post(s.addr, "/v1/completions", body));
    assert_eq!(v["usage"]["completion_tokens"], 16, "OpenAI's default");

    // An explicit limit past the room is still a clear 400.
    for field in ["max_tokens", "max_completion_tokens"] {
        let mut body = chat(json!({}));
        body[field] = json!(500);
        let r = post(s.addr, "/v1/chat/completions", body);
        assert_eq!(refused(&r), "max_tokens");
        let msg = error_of(&r)["message"].as_str().unwrap().to_owned();
        assert!(msg.contains("KV cache"), "{msg}");
    }
    // A prompt the pool cannot hold names the prompt.
    let long = "hello world ".repeat(80);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!(refused(&r), "messages");
    s.wait_idle();
}

#[test]
fn a_completion_prompt_may_be_token_ids() {
    let s = Server::start(config(|_| {}), None);
    let tok = json_of(&post(s.addr, "/tokenize", json!({"prompt": "hello world"})));
    let ids = tok["tokens"].clone();
    let as_text = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(json!("hello world"), json!({})),
    ));
    for prompt in [ids.clone(), json!([ids.clone()])] {
        let v = json_of(&post(
            s.addr,
            "/v1/completions",
            completion(prompt.clone(), json!({})),
        ));
        assert_eq!(text_of(&v), text_of(&as_text), "{prompt}");
        assert_eq!(v["usage"], as_text["usage"], "{prompt}");
    }
    // Echoed as their text.
    let v = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(ids.clone(), json!({"echo": true})),
    ));
    assert!(text_of(&v).ends_with(&format!("hello world{}", text_of(&as_text))));

    for bad in [
        json!([-1]),
        json!([384]),
        json!([4_294_967_296u64]),
        json!([1, "a"]),
        json!([1.5]),
        json!([]),
        json!([[]]),
        json!([[1], [2]]),
        json!(["a", "b"]),
    ] {
        let r = post(
            s.addr,
            "/v1/completions",
            completion(bad.clone(), json!({})),
        );
        assert_eq!(refused(&r), "prompt", "{bad}");
    }
    s.wait_idle();
}

#[test]
fn echoed_logprobs_are_bounded_by_the_config() {
    let s = Server::start(config(|c| c.scheduler.max_echo_prompt_tokens = 6), None);
    assert_eq!(s.engine().max_prompt_logprobs(), 6);
    let short = json!([1, 2, 3, 4, 5, 6]);
    let long = json!([1, 2, 3, 4, 5, 6, 7]);
    let v = json_of(&post(
        s.addr,
        "/v1/completions",
        completion(short, json!({"echo": true, "logprobs": 1})),
    ));
    let lps = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(lps.len(), 6 + 8);
    let r = post(
        s.addr,
        "/v1/completions",
        completion(long.clone(), json!({"echo": true, "logprobs": 1})),
    );
    assert_eq!(refused(&r), "echo");
    assert!(error_of(&r)["message"]
        .as_str()
        .unwrap()
        .contains("max_echo_prompt_tokens"));
    // The engine holds the same bound for any caller.
    let e = s
        .engine()
        .submit(specgate::engine::GenRequest {
            prompt: vec![1, 2, 3, 4, 5, 6, 7],
            max_new_tokens: 2,
            prompt_logprobs: Some(1),
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            specgate::engine::EngineError::Rejected {
                part: specgate::engine::RequestPart::PromptLogprobs,
                ..
            }
        ),
        "{e:?}"
    );
    // Echo alone and logprobs alone cost nothing per prompt token.
    for extra in [json!({"echo": true}), json!({"logprobs": 1})] {
        let r = post(s.addr, "/v1/completions", completion(long.clone(), extra));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    s.wait_idle();
}
