//! Unit tests of the error and response bodies: exact OpenAI JSON shapes.

use serde_json::{json, Value};

use super::*;

#[test]
fn error_json_shape() {
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3});
    let e = parse_chat(body.to_string().as_bytes()).unwrap_err();
    let v: Value = serde_json::from_str(&e.to_json()).unwrap();
    assert_eq!(
        v,
        json!({"error": {
            "message": e.message,
            "type": "invalid_request_error",
            "param": "temperature",
            "code": null,
        }})
    );
    // Exact bytes, key order included.
    let e = ApiError::new(ErrorKind::Internal, "boom \"x\"");
    assert_eq!(
        e.to_json(),
        r#"{"error":{"message":"boom \"x\"","type":"server_error","param":null,"code":null}}"#
    );
    let e = ApiError::model_not_found("gpt-x");
    assert_eq!(e.status(), 404);
    let v: Value = serde_json::from_str(&e.to_json()).unwrap();
    assert_eq!(
        v,
        json!({"error": {
            "message": "The model `gpt-x` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }})
    );
}

#[test]
fn error_kinds_statuses_and_types() {
    let cases = [
        (ApiError::bad_request("x"), 400, "invalid_request_error"),
        (ApiError::invalid("p", "x"), 400, "invalid_request_error"),
        (
            ApiError::unsupported("p", "x"),
            400,
            "invalid_request_error",
        ),
        (ApiError::authentication("x"), 401, "authentication_error"),
        (ApiError::not_found("x"), 404, "not_found_error"),
        (
            ApiError::method_not_allowed("GET", "/v1/completions"),
            405,
            "invalid_request_error",
        ),
        (
            ApiError::payload_too_large(1024),
            413,
            "invalid_request_error",
        ),
        (ApiError::rate_limited("x"), 429, "rate_limit_error"),
        (ApiError::unavailable("x"), 503, "server_error"),
        (ApiError::internal("x"), 500, "server_error"),
    ];
    for (e, status, ty) in cases {
        assert_eq!(e.status(), status, "{e:?}");
        let v: Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["error"]["type"], ty, "{e:?}");
        let keys: Vec<&String> = v["error"].as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 4);
    }
    assert_eq!(
        ApiError::authentication("x").code.as_deref(),
        Some("invalid_api_key")
    );
    assert_eq!(ApiError::invalid("p", "msg").to_string(), "msg");
}

fn to_value<T: serde::Serialize>(t: &T) -> Value {
    serde_json::to_value(t).unwrap()
}

#[test]
fn chat_completion_json() {
    let c = ChatCompletion::new(
        "chatcmpl-1",
        10,
        "m",
        "hi".into(),
        FinishReason::Stop,
        Usage::new(3, 2),
    );
    assert_eq!(
        to_value(&c),
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 10, "model": "m",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": null,
                "finish_reason": "stop"
            }],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        })
    );
    // OpenAI's key order.
    let s = serde_json::to_string(&c).unwrap();
    assert!(s.starts_with(r#"{"id":"chatcmpl-1","object":"chat.completion","created":10,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"logprobs":null,"finish_reason":"stop"}],"usage":"#), "{s}");
}

#[test]
fn chat_chunk_json() {
    let head = |choices: Value| {
        json!({
            "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices
        })
    };
    assert_eq!(
        to_value(&ChatCompletionChunk::role("c", 1, "m")),
        head(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        )
    );
    assert_eq!(
        to_value(&ChatCompletionChunk::content("c", 1, "m", "tok".into())),
        head(
            json!([{"index": 0, "delta": {"content": "tok"}, "logprobs": null, "finish_reason": null}])
        )
    );
    assert_eq!(
        to_value(&ChatCompletionChunk::finish(
            "c",
            1,
            "m",
            FinishReason::Length
        )),
        head(json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}]))
    );
    let mut usage = head(json!([]));
    usage["usage"] = json!({"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10});
    assert_eq!(
        to_value(&ChatCompletionChunk::usage("c", 1, "m", Usage::new(4, 6))),
        usage
    );
}

fn entry(token: &str, logprob: f32, top: Vec<TopLogprob>) -> ChatTokenLogprob {
    ChatTokenLogprob {
        token: token.into(),
        logprob,
        bytes: Some(token.as_bytes().to_vec()),
        top_logprobs: top,
    }
}

#[test]
fn chat_logprobs_and_tool_calls_json() {
    let lp = ChatLogprobs::new(vec![entry(
        "Hi",
        -0.5,
        vec![TopLogprob {
            token: "Hi".into(),
            logprob: -0.5,
            bytes: Some(vec![72, 105]),
        }],
    )]);
    let c = ChatCompletion::new(
        "x",
        1,
        "m",
        "Hi".into(),
        FinishReason::Stop,
        Usage::new(1, 1),
    )
    .with_logprobs(Some(lp.clone()));
    let s = serde_json::to_string(&c.choices[0]).unwrap();
    assert_eq!(
        s,
        r#"{"index":0,"message":{"role":"assistant","content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5,"bytes":[72,105],"top_logprobs":[{"token":"Hi","logprob":-0.5,"bytes":[72,105]}]}],"refusal":null},"finish_reason":"stop"}"#
    );
    let call = ToolCall::function("call_1".into(), "add".into(), r#"{"a":1}"#.into());
    let c = ChatCompletion::new(
        "x",
        1,
        "m",
        String::new(),
        FinishReason::ToolCalls,
        Usage::new(1, 1),
    )
    .with_tool_calls(None, vec![call.clone()]);
    assert_eq!(
        to_value(&c.choices[0]),
        json!({
            "index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}
            ]},
            "logprobs": null,
            "finish_reason": "tool_calls"
        })
    );
    // Streaming: one delta carries the whole call; logprobs ride on chunks.
    let chunk = ChatCompletionChunk::tool_call("c", 1, "m", 2, call);
    assert_eq!(
        to_value(&chunk.choices),
        json!([{"index": 0, "delta": {"tool_calls": [{"index": 2, "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\":1}"}}]}, "logprobs": null, "finish_reason": null}])
    );
    let chunk = ChatCompletionChunk::content("c", 1, "m", "Hi".into()).with_logprobs(Some(lp));
    assert_eq!(
        to_value(&chunk.choices[0].logprobs),
        json!({"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}], "refusal": null})
    );
    assert_eq!(to_value(&FinishReason::ToolCalls), json!("tool_calls"));
    assert_eq!(FinishReason::ToolCalls.as_str(), "tool_calls");
    // A partial delta (arguments only) omits what it does not carry.
    let d = ToolCallDelta {
        index: 0,
        id: None,
        kind: None,
        function: FunctionDelta {
            name: None,
            arguments: Some("}".into()),
        },
    };
    assert_eq!(
        to_value(&d),
        json!({"index": 0, "function": {"arguments": "}"}})
    );
}

#[test]
fn completion_logprobs_json() {
    let lp = CompletionLogprobs {
        tokens: vec!["a".into(), "b".into(), "c".into()],
        token_logprobs: vec![None, Some(-1.0), Some(-0.25)],
        top_logprobs: vec![
            None,
            Some(TopMap(vec![("z".into(), -0.5), ("b".into(), -1.0)])),
            Some(TopMap(vec![("c".into(), -0.25)])),
        ],
        text_offset: vec![0, 1, 2],
    };
    let c = Completion::new(
        "k",
        1,
        "m",
        "abc".into(),
        FinishReason::Stop,
        Usage::new(2, 1),
    )
    .with_logprobs(Some(lp));
    // Key order of the top map is the most likely first, as given.
    let s = serde_json::to_string(&c.choices[0]).unwrap();
    assert_eq!(
        s,
        r#"{"index":0,"text":"abc","logprobs":{"tokens":["a","b","c"],"token_logprobs":[null,-1.0,-0.25],"top_logprobs":[null,{"z":-0.5,"b":-1.0},{"c":-0.25}],"text_offset":[0,1,2]},"finish_reason":"stop"}"#
    );
    let chunk = CompletionChunk::text("k", 1, "m", "x".into())
        .with_logprobs(Some(CompletionLogprobs::default()));
    assert_eq!(
        to_value(&chunk.choices[0].logprobs),
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
    );
}

#[test]
fn completion_json() {
    let c = Completion::new(
        "cmpl-1",
        5,
        "m",
        "text".into(),
        FinishReason::Length,
        Usage::new(1, 16),
    );
    assert_eq!(
        to_value(&c),
        json!({
            "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": "text", "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17}
        })
    );
}

#[test]
fn completion_chunk_json() {
    let head = |choices: Value| {
        json!({
            "id": "k", "object": "text_completion", "created": 2, "model": "m", "choices": choices
        })
    };
    assert_eq!(
        to_value(&CompletionChunk::text("k", 2, "m", "ab".into())),
        head(json!([{"index": 0, "text": "ab", "logprobs": null, "finish_reason": null}]))
    );
    assert_eq!(
        to_value(&CompletionChunk::finish("k", 2, "m", FinishReason::Stop)),
        head(json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": "stop"}]))
    );
    let mut usage = head(json!([]));
    usage["usage"] = json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5});
    assert_eq!(
        to_value(&CompletionChunk::usage("k", 2, "m", Usage::new(2, 3))),
        usage
    );
}

#[test]
fn model_list_json() {
    let l = ModelList::new(vec![ModelCard::new("tiny", 7, "specgate")]);
    assert_eq!(
        to_value(&l),
        json!({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 7, "owned_by": "specgate"}]})
    );
    assert_eq!(
        to_value(&ModelList::new(vec![])),
        json!({"object": "list", "data": []})
    );
    // A loaded model adds its context length and method after OpenAI's keys.
    let card = ModelCard::new("tiny", 7, "specgate").serving(2048, SpecMethod::Ngram);
    let text = serde_json::to_string(&card).unwrap();
    assert_eq!(
        text,
        r#"{"id":"tiny","object":"model","created":7,"owned_by":"specgate","max_model_len":2048,"speculative":{"method":"ngram"}}"#
    );
}

#[test]
fn version_json() {
    let v = to_value(&VersionInfo::current());
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["build"]["arch"], std::env::consts::ARCH);
    assert!(["release", "debug"].contains(&v["build"]["profile"].as_str().unwrap()));
}

#[test]
fn spec_method_wire_names_round_trip() {
    for m in SpecMethod::ALL {
        assert_eq!(SpecMethod::from_wire(m.as_str()), Some(m));
        assert_eq!(to_value(&m), json!(m.as_str()));
    }
    assert_eq!(SpecMethod::from_wire("Draft"), None);
}

#[test]
fn helpers() {
    assert!(unix_now() > 1_600_000_000);
    let u = Usage::new(2, 3);
    assert_eq!(u.total_tokens, 5);
}
