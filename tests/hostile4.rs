//! Hostile requests of the fourth round (issue 57) over HTTP, on the tiny
//! generated model: the Responses store as another client would go at it.
//! A stored response's id cannot be guessed from the ids the server hands
//! out (`/health`'s included), a replayed `X-Request-Id` never replaces a
//! stored response, and the by-id routes take ids percent-encoded (as the
//! official SDKs send them) and refuse at once ids of any other shape, in
//! the API's error body.

mod common;

use common::*;
use serde_json::{json, Value};

const JSON: (&str, &str) = ("Content-Type", "application/json");

fn server() -> Server {
    Server::start(config(|_| {}), None)
}

fn responses(extra: Value) -> Value {
    merge(
        json!({"model": MODEL, "max_output_tokens": 4, "temperature": 0, "input": "hello world"}),
        extra,
    )
}

fn json_of(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// A stored response, sent with `headers` besides the JSON type: its body.
fn store(s: &Server, headers: &[(&str, &str)], body: Value) -> Value {
    let mut h = vec![JSON];
    h.extend_from_slice(headers);
    json_of(&request(
        s.addr,
        "POST",
        "/v1/responses",
        &h,
        &body.to_string(),
    ))
}

fn get(s: &Server, method: &str, id_path: &str) -> Resp {
    request(s.addr, method, &format!("/v1/responses/{id_path}"), &[], "")
}

/// splitmix64's finalizer, as request ids were minted before issue 57
/// (a keyed counter through it), and its inverse: what an attacker who has
/// read that code computes.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unmix(mut z: u64) -> u64 {
    let unshift = |z: u64, s: u32| (0..64 / s + 1).fold(z, |x, _| z ^ (x >> s));
    let inverse = |c: u64| {
        (0..6).fold(c, |i, _| {
            i.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(i)))
        })
    };
    z = unshift(z, 31);
    z = unshift(z.wrapping_mul(inverse(0x94d0_49bb_1331_11eb)), 27);
    unshift(z.wrapping_mul(inverse(0xbf58_476d_1ce4_e5b9)), 30)
}

#[test]
fn the_inverse_of_the_old_mix_is_exact() {
    for z in [0u64, 1, 42, u64::MAX, 0x1234_5678_9abc_def0] {
        assert_eq!(unmix(mix(z)), z);
    }
}

/// The attack of issue 57: the `/health` id read just before a victim's
/// request was the counter one below the victim's, so flipping its low
/// run of ones (64 candidates) named the victim's stored response. Tried
/// five times (another test's requests in this process may come between);
/// no candidate is ever a stored response.
#[test]
fn a_stored_id_is_not_guessed_from_the_ids_around_it() {
    let s = server();
    for attempt in 0..5 {
        let health = request(s.addr, "GET", "/health", &[], "");
        assert_eq!(health.status, 200);
        let before = header(&health, "x-request-id").unwrap();
        let victim = store(&s, &[], responses(json!({})));
        let id = victim["id"].as_str().unwrap();
        assert_eq!(json_of(&get(&s, "GET", id))["id"], id, "stored");
        let Ok(n) = u64::from_str_radix(&before, 16) else {
            panic!("a generated id is hex: {before}")
        };
        let x = unmix(n);
        for run in 1..=64u32 {
            let flip = u64::MAX >> (64 - run);
            let guess = format!("resp_{:016x}", mix(x ^ flip));
            let r = get(&s, "GET", &guess);
            assert_eq!(
                r.status, 404,
                "attempt {attempt}: {guess} is {id}: {}",
                r.body
            );
        }
    }
}

/// A second request with the victim's `X-Request-Id` gets its own id and
/// leaves the victim's response as it was, for `GET` and for a
/// continuation.
#[test]
fn a_replayed_request_id_never_replaces_a_stored_response() {
    let s = server();
    let replayed = ("X-Request-Id", "victim-7");
    let victim = store(&s, &[replayed], responses(json!({})));
    let id = victim["id"].as_str().unwrap();
    assert!(!id.contains("victim-7"), "{id}");
    let long = "an attacker's conversation, much longer than the victim's ".repeat(3);
    let attacker = store(
        &s,
        &[replayed],
        responses(json!({"input": long, "max_output_tokens": 6})),
    );
    assert_ne!(attacker["id"], victim["id"]);
    assert_eq!(json_of(&get(&s, "GET", id)), victim);
    // The victim's continuation runs on the victim's conversation, not
    // on the attacker's longer one.
    let next = store(
        &s,
        &[],
        responses(json!({"previous_response_id": id, "input": "more"})),
    );
    let tokens = |v: &Value| v["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        tokens(&next) < tokens(&attacker),
        "continuation {} tokens, the attacker's turn {}",
        tokens(&next),
        tokens(&attacker)
    );
}

/// Every byte of the id percent-encoded, as a client may send it: `GET`
/// and `DELETE` find it. Ids of another shape (the path tricks of issue 57
/// among them) are 404s in OpenAI's error body, as is a
/// `previous_response_id` of another shape.
#[test]
fn by_id_routes_take_encoded_ids_and_refuse_other_shapes() {
    let s = server();
    let v = store(&s, &[], responses(json!({})));
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"), "{id}");
    assert!(
        id[5..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "{id}"
    );
    let encoded: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
    assert_eq!(json_of(&get(&s, "GET", &encoded)), v);
    // The SDKs leave unreserved characters as they are: a mixed form.
    let mixed = format!("resp%5F{}", &id[5..]);
    assert_eq!(json_of(&get(&s, "GET", &mixed)), v);
    let deleted = json_of(&get(&s, "DELETE", &encoded));
    assert_eq!(
        deleted,
        json!({"id": id, "object": "response", "deleted": true})
    );
    for method in ["GET", "DELETE"] {
        let r = get(&s, method, id);
        assert_eq!(r.status, 404, "{method}: {}", r.body);
        assert_eq!(error_of(&r)["code"], "response_not_found");
    }
    let other = store(&s, &[], responses(json!({})));
    let other = other["id"].as_str().unwrap();
    for bad in [
        "resp_x".to_string(),
        format!("{other}%2F..%2F..%2Fv1%2Fmodels"),
        format!("{other}:host%2F7"),
        format!("{other}x"),
        format!("resp_{}", &other[6..]),
        format!("{}%00", &other[..other.len() - 1]),
        format!("{}%FF", &other[..other.len() - 1]),
        format!("{}.", &other[..other.len() - 1]),
        format!("msg_{}", &other[5..]),
    ] {
        for method in ["GET", "DELETE"] {
            let r = get(&s, method, &bad);
            assert_eq!(r.status, 404, "{method} {bad}: {}", r.body);
            let e = error_of(&r);
            assert_eq!(e["code"], "response_not_found", "{bad}");
            assert_eq!(e["type"], "not_found_error", "{bad}");
        }
    }
    // None of that touched the other response.
    assert_eq!(json_of(&get(&s, "GET", other))["id"], other);
    let r = post(
        s.addr,
        "/v1/responses",
        responses(json!({"previous_response_id": format!("{other}/../x")})),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(error_of(&r)["param"], "previous_response_id");
}

/// `count_tokens` takes the limits of the request it counts: 24,003 turns
/// (`server.max_messages` is 2048) are a 400 with the words `/v1/messages`
/// gives, before any message is read (a bad message deep in the list is
/// not what the error names) and so at once: the bound is 0.1 s,
/// asserted here as a generous 2 s.
#[test]
fn count_tokens_refuses_too_many_turns_as_messages_does_before_reading_them() {
    let s = server();
    let turns = |bad_at: Option<usize>| -> Value {
        let msgs: Vec<Value> = (0..24_003)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                if Some(i) == bad_at {
                    json!({"role": "robot", "content": 7})
                } else {
                    json!({"role": role, "content": "t"})
                }
            })
            .collect();
        json!({"model": MODEL, "max_tokens": 8, "system": "be brief", "messages": msgs})
    };
    for bad_at in [None, Some(20_000)] {
        let mut body = turns(bad_at);
        let generation = post(s.addr, "/v1/messages", body.clone());
        body.as_object_mut().unwrap().remove("max_tokens");
        let started = std::time::Instant::now();
        let counted = post(s.addr, "/v1/messages/count_tokens", body);
        let took = started.elapsed();
        assert_eq!(counted.status, 400, "{bad_at:?}: {}", counted.body);
        assert!(took < std::time::Duration::from_secs(2), "{took:?}");
        let v: Value = serde_json::from_str(&counted.body).unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("'messages' holds 24004 messages") && message.contains("2048"),
            "{message}"
        );
        assert_eq!(generation.status, 400, "{}", generation.body);
        let g: Value = serde_json::from_str(&generation.body).unwrap();
        assert_eq!(g, v, "the two routes word the limit alike");
    }
    // Under the bound, counting still works.
    let small = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let r = post(s.addr, "/v1/messages/count_tokens", small);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Matching tool results to their calls comes after the turn bound: a
/// conversation over `server.max_messages` whose first item answers no
/// call is refused for its size (before any matching), on Responses and
/// on Messages.
#[test]
fn tool_results_are_matched_only_under_the_turn_bound() {
    let s = server();
    let mut input = vec![json!({"type": "function_call_output", "call_id": "nope", "output": "x"})];
    input.extend((0..2_100).map(|_| json!({"type": "message", "role": "user", "content": "t"})));
    let r = post(s.addr, "/v1/responses", responses(json!({"input": input})));
    assert_eq!(r.status, 400, "{}", r.body);
    let e = error_of(&r);
    assert_eq!(e["code"], "too_many_messages", "{e}");
    let mut messages = vec![json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]})];
    messages.extend(
        (0..2_100).map(
            |i| json!({"role": if i % 2 == 0 { "assistant" } else { "user" }, "content": "t"}),
        ),
    );
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": messages});
    let r = post(s.addr, "/v1/messages", body);
    assert_eq!(r.status, 400, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("'messages' holds 2101 messages"),
        "{message}"
    );
    // Under the bound the orphan output is what is refused.
    let r = post(
        s.addr,
        "/v1/responses",
        responses(
            json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}),
        ),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(error_of(&r)["param"], "input");
}

/// A `reasoning` item followed by a user turn (nothing of its own
/// assistant turn after it) is a 400 naming the item, as OpenAI answers,
/// not a silent drop.
#[test]
fn a_reasoning_item_that_nothing_of_its_turn_follows_is_a_400_naming_it() {
    let s = server();
    let input = json!([
        {"role": "user", "content": "first"},
        {"type": "reasoning", "id": "rs_7", "summary": [],
         "content": [{"type": "reasoning_text", "text": "a long thought"}]},
        {"role": "user", "content": "second"},
    ]);
    let r = post(s.addr, "/v1/responses", responses(json!({"input": input})));
    assert_eq!(r.status, 400, "{}", r.body);
    let e = error_of(&r);
    assert_eq!(e["param"], "input[1]", "{e}");
    assert!(e["message"].as_str().unwrap().contains("rs_7"), "{e}");
    // With its assistant message after it, the same reasoning is taken.
    let input = json!([
        {"role": "user", "content": "first"},
        {"type": "reasoning", "id": "rs_7", "summary": [],
         "content": [{"type": "reasoning_text", "text": "a long thought"}]},
        {"type": "message", "role": "assistant", "content": "answer"},
        {"role": "user", "content": "second"},
    ]);
    let r = post(s.addr, "/v1/responses", responses(json!({"input": input})));
    assert_eq!(r.status, 200, "{}", r.body);
}
