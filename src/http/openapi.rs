//! `GET /openapi.json`: an OpenAPI 3.1 document of every route in
//! [`ROUTES`](super::ROUTES), with request and response schemas for the
//! bodies and the shared error body, precise enough for a schema-based
//! fuzzer (schemathesis) to drive the API: every status a route can answer
//! is listed, and a body the schema calls valid passes the wire checks
//! (bounds are taken from the parser's own constants).
//!
//! Built once with `serde_json::json!` and served without authentication.

use super::{json_response, AppState, ResBody};
use crate::api::{
    SpecMethod, MAX_SPECULATIVE_TOKENS, MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
};
use hyper::{Response, StatusCode};
use serde_json::{json, Map, Value};

mod agent;
mod wire_apis;

/// What the loaded model bounds, written into the schemas so that a
/// request the document calls valid is not refused for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedLimits {
    /// The context length (`EngineHandle::max_position`).
    pub max_model_len: usize,
    /// The tokenizer's vocabulary size (ids are below it).
    pub vocab_size: usize,
}

/// `GET /openapi.json`: with the model's limits once it is loaded. Built
/// per request (a few microseconds; the route is not hot), so no cache can
/// serve one server's limits for another in the same process.
pub(super) fn response(state: &AppState) -> Response<ResBody> {
    let limits = state.backend.get().map(|b| ServedLimits {
        max_model_len: b.engine.max_request_tokens(),
        vocab_size: b.tokenizer.vocab_size(),
    });
    let doc = document(&state.settings.model_name, limits);
    json_response(StatusCode::OK, doc.to_string())
}

/// The whole document. `model` is the served name, the one value a
/// request's `model` may take (so a fuzzer reaches past the 404); `limits`
/// (when the model is loaded) bound the token ids of `/detokenize` and the
/// generation length.
pub fn document(model: &str, limits: Option<ServedLimits>) -> Value {
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "specgate",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "An OpenAI-compatible LLM server built on speculative decoding. \
                Routes other than /health, /metrics, /version and /openapi.json need \
                `Authorization: Bearer <key>` when the server has API keys.",
        },
        "security": [{"bearerAuth": []}],
        "paths": paths(),
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas(),
        },
    });
    let schemas = &mut doc["components"]["schemas"];
    for request in [
        "ChatCompletionRequest",
        "CompletionRequest",
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
        "DetokenizeRequest",
        "ResponsesRequest",
        "MessagesRequest",
        "CountTokensRequest",
    ] {
        let field = &mut schemas[request]["properties"]["model"];
        // Optional fields are wrapped in `anyOf: [schema, null]`.
        let field = match field.get_mut("anyOf") {
            Some(any) => &mut any[0],
            None => field,
        };
        field["const"] = json!(model);
    }
    if let Some(l) = limits {
        // A prompt has at least one token, so at most max_model_len - 1
        // can be generated.
        let most_new = l.max_model_len.saturating_sub(1).max(1);
        for request in ["ChatCompletionRequest", "CompletionRequest"] {
            for field in ["max_tokens", "max_completion_tokens"] {
                let prop = &mut schemas[request]["properties"][field];
                prop["anyOf"][0]["maximum"] = json!(most_new);
            }
        }
        let ids = &mut schemas["DetokenizeRequest"]["properties"]["tokens"];
        ids["items"]["maximum"] = json!(l.vocab_size.saturating_sub(1));
        let last_id = json!(l.vocab_size.saturating_sub(1));
        let prompt = &mut schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"];
        prompt[2]["items"]["maximum"] = last_id.clone();
        prompt[3]["items"]["items"]["maximum"] = last_id;
    }
    doc
}

/// One operation per route, keyed by path then lowercase method.
fn paths() -> Value {
    let public = json!([]);
    let mut p = Map::new();
    let mut add = |path: &str, method: &str, op: Value| {
        p.insert(path.into(), json!({ method: op }));
    };
    add(
        "/health",
        "get",
        json!({
            "summary": "Readiness: 200 while the model is loaded and the server is not draining.",
            "operationId": "health",
            "security": public,
            "responses": responses(
                ok_json("#/components/schemas/Health"),
                &[503],
            ),
        }),
    );
    add(
        "/metrics",
        "get",
        json!({
            "summary": "Prometheus metrics.",
            "operationId": "metrics",
            "security": public,
            "responses": {"200": {
                "description": "The metrics in Prometheus text format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }},
        }),
    );
    add(
        "/version",
        "get",
        json!({
            "summary": "The server's version.",
            "operationId": "version",
            "security": public,
            "responses": responses(ok_json("#/components/schemas/Version"), &[]),
        }),
    );
    add(
        "/openapi.json",
        "get",
        json!({
            "summary": "This document.",
            "operationId": "openapi",
            "security": public,
            "responses": {"200": {
                "description": "An OpenAPI 3.1 document.",
                "content": {"application/json": {"schema": {"type": "object"}}},
            }},
        }),
    );
    add(
        "/v1/models",
        "get",
        json!({
            "summary": "The served model.",
            "operationId": "listModels",
            "responses": responses(ok_json("#/components/schemas/ModelList"), &[401]),
        }),
    );
    add(
        "/v1/chat/completions",
        "post",
        generation(
            "createChatCompletion",
            "ChatCompletionRequest",
            "ChatCompletion",
            "ChatCompletionChunk",
        ),
    );
    add(
        "/v1/completions",
        "post",
        generation(
            "createCompletion",
            "CompletionRequest",
            "Completion",
            "CompletionChunk",
        ),
    );
    add(
        "/tokenize",
        "post",
        json!({
            "summary": "Token ids of a prompt or of chat turns, encoded as generation encodes them (vLLM's shape).",
            "operationId": "tokenize",
            "requestBody": body("TokenizeRequest"),
            "responses": responses(
                ok_json("#/components/schemas/TokenizeResponse"),
                &[400, 401, 404, 408, 413, 500, 503],
            ),
        }),
    );
    add(
        "/detokenize",
        "post",
        json!({
            "summary": "The text of token ids (vLLM's shape).",
            "operationId": "detokenize",
            "requestBody": body("DetokenizeRequest"),
            "responses": responses(
                ok_json("#/components/schemas/DetokenizeResponse"),
                &[400, 401, 404, 408, 413, 500, 503],
            ),
        }),
    );
    for (path, method, op) in wire_apis::paths(responses) {
        let ops = p.entry(path).or_insert_with(|| json!({}));
        ops[method] = op;
    }
    Value::Object(p)
}

/// A generation route: whole JSON, or Server-Sent Events with `stream`.
fn generation(id: &str, request: &str, whole: &str, chunk: &str) -> Value {
    let ok = json!({
        "description": format!(
            "The whole {whole} as JSON, or with `stream: true` a text/event-stream of \
             `data: <{chunk}>` events ending with `data: [DONE]`."
        ),
        "content": {
            "application/json": {"schema": {"$ref": format!("#/components/schemas/{whole}")}},
            // Each event, as SSE-aware tools (schemathesis) read a stream.
            "text/event-stream": {"schema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "data": {
                        "type": "string",
                        "description": format!(
                            "A {chunk} as JSON, an Error body as JSON, or `[DONE]` (the last event)."
                        ),
                    },
                    "event": {"type": "string"},
                    "id": {"type": "string"},
                },
            }},
        },
    });
    json!({
        "operationId": id,
        "requestBody": body(request),
        "responses": responses(ok, &[400, 401, 404, 408, 413, 429, 500, 503]),
    })
}

/// A required JSON request body of schema `name`.
fn body(name: &str) -> Value {
    json!({
        "required": true,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{name}")}}},
    })
}

/// A 200 JSON answer of the schema at `reference`.
fn ok_json(reference: &str) -> Value {
    json!({"description": "OK", "content": {"application/json": {"schema": {"$ref": reference}}}})
}

/// `ok` as the 200 answer, and each status of `errors` with the error body.
fn responses(ok: Value, errors: &[u16]) -> Value {
    let mut r = Map::new();
    r.insert("200".into(), ok);
    for &status in errors {
        let what = match status {
            400 => "The request is malformed or asks for something unsupported.",
            401 => "Missing or wrong API key.",
            404 => "The model named is not served.",
            408 => "The request body did not arrive in time.",
            413 => "The request body is over the size limit.",
            429 => "Too many requests in flight.",
            503 => {
                "The model is loading, the server is shutting down, or the grammar \
                 compiler is busy (then with Retry-After)."
            }
            _ => "A failure on the server side.",
        };
        r.insert(
            status.to_string(),
            json!({"description": what, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
        );
    }
    Value::Object(r)
}

fn schemas() -> Value {
    let mut s = Map::new();
    s.extend(wire_schemas());
    s.extend(generation_schemas());
    s.extend(response_schemas());
    s.extend(tokenize_schemas());
    s.extend(agent::schemas());
    s.extend(wire_apis::schemas());
    Value::Object(s)
}

/// Small shared pieces: the error body, messages, stop, speculative.
fn wire_schemas() -> Map<String, Value> {
    // A stop sequence's limit is in bytes; a string of this many characters
    // stays within it however wide its characters are.
    let stop_chars = MAX_STOP_BYTES / 4;
    let methods: Vec<&str> = SpecMethod::ALL.iter().map(|m| m.as_str()).collect();
    let nullable_string = json!({"type": ["string", "null"]});
    let v = json!({
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": nullable_string,
                    "code": nullable_string,
                },
            }},
        },
        "TextPart": {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        "ChatMessage": {
            "type": "object",
            "required": ["role"],
            "additionalProperties": false,
            "description": "`content` is required except on assistant turns; `tool_call_id` on (and only on) tool turns; `tool_calls` only on assistant turns.",
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {"oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}},
                    {"type": "null"},
                ]},
                "name": {"type": "string"},
                "tool_call_id": {"type": "string"},
                "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}},
                "refusal": {"type": ["string", "null"]},
                "annotations": {"type": ["array", "null"]},
                "audio": {"type": "null"},
                "function_call": {"type": "null"},
                "reasoning_content": {"type": ["string", "null"], "description": "An assistant turn's reasoning, rendered by templates that replay it (Kimi K3)."},
                "reasoning": {"type": ["string", "null"], "description": "The same as `reasoning_content`."},
            },
        },
        "Messages": {
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/components/schemas/ChatMessage"},
        },
        "Stop": {"oneOf": [
            {"type": "string", "minLength": 1, "maxLength": stop_chars},
            {
                "type": "array",
                "maxItems": MAX_STOP_SEQUENCES,
                "items": {"type": "string", "minLength": 1, "maxLength": stop_chars},
            },
        ]},
        "Speculative": nullable_optionals(json!({
            "type": "object",
            "additionalProperties": false,
            "description": "specgate's extension: the proposer and draft length for this request.",
            "properties": {
                "method": {"enum": methods},
                "num_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_SPECULATIVE_TOKENS},
            },
        })),
        "FinishReason": {"enum": ["stop", "length", "tool_calls"]},
        "Usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "completion_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    });
    into_map(v)
}

/// The fields both generation requests share.
fn common_request_fields() -> Map<String, Value> {
    let v = json!({
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "description": "0 or -1 turn it off."},
        "seed": {"type": "integer", "minimum": 0, "maximum": u64::MAX},
        "n": {"type": "integer", "minimum": 1, "maximum": 1},
        "stop": {"$ref": "#/components/schemas/Stop"},
        "stream": {"type": "boolean"},
        "stream_options": nullable_optionals(json!({
            "type": "object",
            "description": "Only with `stream: true`.",
            "properties": {"include_usage": {"type": "boolean"}},
        })),
        "ignore_eos": {"type": "boolean"},
        "user": {"type": "string", "description": "Kept for the log only."},
        "speculative": {"$ref": "#/components/schemas/Speculative"},
        "cache_salt": {
            "type": "string",
            "minLength": 1,
            "maxLength": crate::api::MAX_CACHE_SALT,
            "description": "vLLM's: the prefix cache is shared only among requests with the same salt (and, with API keys, the same key).",
        },
    });
    let mut m = into_map(v);
    m.extend(agent::control_fields());
    m
}

fn generation_schemas() -> Map<String, Value> {
    let mut chat = common_request_fields();
    chat.insert(
        "messages".into(),
        json!({"$ref": "#/components/schemas/Messages"}),
    );
    chat.extend(agent::chat_fields());
    chat.extend(into_map(json!({
        "chat_template_kwargs": {"type": "object", "description": "Extra chat template variables (Kimi K3: `thinking`, `thinking_effort`). `messages`, `tools`, `add_generation_prompt`, `bos_token` and `eos_token` are the server's."},
        "reasoning_effort": {"enum": crate::api::REASONING_EFFORTS, "description": "Mapped onto the model's own knob (Kimi K3: `thinking_effort`; `none` turns thinking off); a 400 for a model without one."},
    })));
    let mut completion = common_request_fields();
    completion.insert(
        "prompt".into(),
        // An empty prompt encodes to no tokens for a model without BOS.
        // Or token ids, as OpenAI and vLLM take them: `[int]`, `[[int]]` of one.
        json!({"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            {"type": "array", "minItems": 1, "maxItems": 1,
             "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
        ]}),
    );
    completion.insert(
        "logprobs".into(),
        json!({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
    );
    completion.insert("echo".into(), json!({"type": "boolean"}));
    completion.insert("best_of".into(), json!({"const": 1}));
    completion.insert("suffix".into(), json!({"const": ""}));
    // `stream_options` is refused unless the request streams.
    let stream_options_need_stream = json!({
        "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
        "then": {"properties": {"stream": {"const": true}}, "required": ["stream"]},
    });
    let request = |required: [&str; 2], properties: Map<String, Value>| {
        let mut r = into_map(json!({
            "type": "object",
            "required": required,
            "additionalProperties": false,
            "description": "Every field is honoured or refused: an unknown field is a 400 naming it, as OpenAI answers.",
            "properties": properties,
        }));
        r.extend(into_map(stream_options_need_stream.clone()));
        nullable_optionals(Value::Object(r))
    };
    let mut m = Map::new();
    m.insert(
        "ChatCompletionRequest".into(),
        request(["model", "messages"], chat),
    );
    m.insert(
        "CompletionRequest".into(),
        request(["model", "prompt"], completion),
    );
    m
}

/// A response object: `object` is the constant `kind`, then `fields`.
fn reply(kind: &str, required: &[&str], fields: Value) -> Value {
    let mut props = into_map(json!({
        "id": {"type": "string"},
        "object": {"const": kind},
        "created": {"type": "integer"},
        "model": {"type": "string"},
    }));
    props.extend(into_map(fields));
    json!({"type": "object", "required": required, "properties": props})
}

fn response_schemas() -> Map<String, Value> {
    let usage = json!({"$ref": "#/components/schemas/Usage"});
    let finish = json!({"$ref": "#/components/schemas/FinishReason"});
    let finish_or_null = json!({"oneOf": [finish, {"type": "null"}]});
    let base = ["id", "object", "created", "model", "choices"];
    let with_usage = ["id", "object", "created", "model", "choices", "usage"];
    let chat_logprobs =
        json!({"oneOf": [{"$ref": "#/components/schemas/ChatLogprobs"}, {"type": "null"}]});
    let chat_choice = json!({
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    "reasoning_content": {"type": "string"},
                    "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}},
                },
            },
            "logprobs": chat_logprobs,
            "finish_reason": finish,
        },
    });
    let chunk_choice = json!({
        "type": "object",
        "required": ["index", "delta", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "delta": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": "string"},
                    "reasoning_content": {"type": "string"},
                    "tool_calls": {"type": "array", "items": {
                        "type": "object",
                        "required": ["index", "function"],
                        "properties": {
                            "index": {"type": "integer", "minimum": 0},
                            "id": {"type": "string"},
                            "type": {"const": "function"},
                            "function": {"type": "object", "properties": {
                                "name": {"type": "string"},
                                "arguments": {"type": "string"},
                            }},
                        },
                    }},
                },
            },
            "logprobs": chat_logprobs,
            "finish_reason": finish_or_null,
        },
    });
    let text_choice = json!({
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "logprobs": {"oneOf": [{"$ref": "#/components/schemas/CompletionLogprobs"}, {"type": "null"}]},
            "finish_reason": finish_or_null,
        },
    });
    let mut m = Map::new();
    m.insert(
        "ChatCompletion".into(),
        reply(
            "chat.completion",
            &with_usage,
            json!({"choices": {"type": "array", "items": chat_choice}, "usage": usage}),
        ),
    );
    m.insert(
        "ChatCompletionChunk".into(),
        reply(
            "chat.completion.chunk",
            &base,
            json!({"choices": {"type": "array", "items": chunk_choice}, "usage": usage}),
        ),
    );
    let text_reply = json!({"choices": {"type": "array", "items": text_choice}, "usage": usage});
    m.insert(
        "Completion".into(),
        reply("text_completion", &with_usage, text_reply.clone()),
    );
    m.insert(
        "CompletionChunk".into(),
        reply("text_completion", &base, text_reply),
    );
    m.extend(into_map(info_schemas()));
    m
}

/// The small GET bodies: models, version, health.
fn info_schemas() -> Value {
    let methods: Vec<&str> = SpecMethod::ALL.iter().map(|m| m.as_str()).collect();
    json!({
        "ModelCard": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "max_model_len": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "The context length (prompt and output); absent while loading.",
                },
                "speculative": {
                    "type": "object",
                    "required": ["method"],
                    "properties": {"method": {"enum": methods}},
                    "description": "The server's proposer; absent while loading.",
                },
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": {"$ref": "#/components/schemas/ModelCard"}},
            },
        },
        "Version": {
            "type": "object",
            "required": ["version", "build"],
            "properties": {
                "version": {"type": "string"},
                "build": {
                    "type": "object",
                    "required": ["profile", "arch", "os"],
                    "properties": {
                        "profile": {"enum": ["release", "debug"]},
                        "arch": {"type": "string"},
                        "os": {"type": "string"},
                    },
                },
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"const": "ok"}},
        },
    })
}

fn tokenize_schemas() -> Map<String, Value> {
    let model = json!({"type": "string", "description": "If given, the served model's name."});
    let flag = json!({"type": "boolean"});
    let mut v = json!({
        "TokenizeCompletionRequest": {
            "type": "object",
            "additionalProperties": false,
            "required": ["prompt"],
            "properties": {
                "model": model,
                "prompt": {"type": "string"},
                "add_special_tokens": {"type": "boolean", "default": true},
                "return_token_strs": flag,
            },
        },
        "TokenizeChatRequest": {
            "type": "object",
            "additionalProperties": false,
            "required": ["messages"],
            "properties": {
                "model": model,
                "messages": {"$ref": "#/components/schemas/Messages"},
                "add_generation_prompt": {"type": "boolean", "default": true},
                "continue_final_message": {"const": false},
                "add_special_tokens": {"type": "boolean", "default": false},
                "return_token_strs": flag,
            },
        },
        "TokenizeRequest": {"oneOf": [
            {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
            {"$ref": "#/components/schemas/TokenizeChatRequest"},
        ]},
        "TokenizeResponse": {
            "type": "object",
            "required": ["count", "max_model_len", "tokens"],
            "properties": {
                "count": {"type": "integer", "minimum": 0},
                "max_model_len": {"type": "integer", "minimum": 1},
                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "token_strs": {"type": "array", "items": {"type": "string"}},
            },
        },
        "DetokenizeRequest": {
            "type": "object",
            "additionalProperties": false,
            "required": ["tokens"],
            "properties": {
                "model": model,
                "tokens": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": u32::MAX},
                    "description": "Ids outside the model's vocabulary are a 400.",
                },
            },
        },
        "DetokenizeResponse": {
            "type": "object",
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}},
        },
    });
    for name in [
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
        "DetokenizeRequest",
    ] {
        v[name] = nullable_optionals(v[name].take());
    }
    into_map(v)
}

/// `schema` (an object schema) with each optional property also allowing
/// `null`: the parsers treat a `null` field as an absent one.
fn nullable_optionals(mut schema: Value) -> Value {
    let required: Vec<String> = schema["required"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if let Some(props) = schema["properties"].as_object_mut() {
        for (name, prop) in props.iter_mut() {
            if !required.contains(name) {
                *prop = json!({"anyOf": [prop.take(), {"type": "null"}]});
            }
        }
    }
    schema
}

fn into_map(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("every schema group is written as an object"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::ROUTES;

    /// Follows a local `$ref` (`#/components/schemas/X`).
    fn resolve<'a>(doc: &'a Value, reference: &str) -> &'a Value {
        let path = reference.strip_prefix('#').expect("local reference");
        doc.pointer(path)
            .unwrap_or_else(|| panic!("dangling $ref {reference}"))
    }

    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r);
                }
                m.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn documents_exactly_the_route_table() {
        let doc = document("m", None);
        let paths = doc["paths"].as_object().unwrap();
        let mut documented: Vec<(String, String)> = paths
            .iter()
            .flat_map(|(p, ops)| {
                ops.as_object()
                    .unwrap()
                    .keys()
                    .map(move |m| (p.clone(), m.to_uppercase()))
            })
            .collect();
        let mut routes: Vec<(String, String)> = ROUTES
            .iter()
            .chain(crate::http::STORED_RESPONSE_ROUTES.iter())
            .map(|(p, m)| (p.to_string(), m.to_string()))
            .collect();
        documented.sort();
        routes.sort();
        assert_eq!(documented, routes);
    }

    #[test]
    fn every_reference_resolves_and_every_operation_answers() {
        let doc = document("m", None);
        assert_eq!(doc["openapi"], "3.1.0");
        let mut all = Vec::new();
        refs(&doc, &mut all);
        assert!(all.len() > 20);
        for r in all {
            resolve(&doc, r);
        }
        for (path, ops) in doc["paths"].as_object().unwrap() {
            for (method, op) in ops.as_object().unwrap() {
                assert!(op["responses"]["200"].is_object(), "{method} {path}");
                assert!(op["operationId"].is_string(), "{method} {path}");
            }
        }
        // A served body fits its schema's required keys.
        let card = serde_json::to_value(crate::api::ModelCard::new("m", 1, "o")).unwrap();
        for key in doc["components"]["schemas"]["ModelCard"]["required"]
            .as_array()
            .unwrap()
        {
            assert!(card.get(key.as_str().unwrap()).is_some(), "{key}");
        }
    }

    #[test]
    fn the_loaded_model_bounds_ids_and_lengths() {
        let limits = ServedLimits {
            max_model_len: 512,
            vocab_size: 384,
        };
        let (plain, bound) = (document("m", None), document("m", Some(limits)));
        let s = &bound["components"]["schemas"];
        for request in ["ChatCompletionRequest", "CompletionRequest"] {
            let max = &s[request]["properties"]["max_tokens"]["anyOf"][0];
            assert_eq!(
                (max["type"].as_str(), &max["maximum"]),
                (Some("integer"), &json!(511))
            );
        }
        let ids = &s["DetokenizeRequest"]["properties"]["tokens"]["items"];
        assert_eq!(
            (ids["minimum"].as_u64(), ids["maximum"].as_u64()),
            (Some(0), Some(383))
        );
        // Nothing else changes: the same keys everywhere.
        let keys = |d: &Value| d["components"]["schemas"].as_object().unwrap().len();
        assert_eq!(keys(&plain), keys(&bound));
        assert_eq!(plain["paths"], bound["paths"]);
        // The served name is the one `model` documented.
        assert_eq!(
            s["ChatCompletionRequest"]["properties"]["model"]["const"],
            "m"
        );
        let m = &s["DetokenizeRequest"]["properties"]["model"]["anyOf"][0];
        assert_eq!(
            (m["type"].as_str(), m["const"].as_str()),
            (Some("string"), Some("m"))
        );
    }

    /// The documented request fields are exactly the ones the parsers read.
    #[test]
    fn request_schemas_list_exactly_the_known_fields() {
        let doc = document("m", None);
        let s = &doc["components"]["schemas"];
        for (schema, known) in [
            ("ChatCompletionRequest", crate::api::KNOWN_CHAT_FIELDS),
            ("CompletionRequest", crate::api::KNOWN_COMPLETION_FIELDS),
        ] {
            let mut documented: Vec<&str> = s[schema]["properties"]
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            // Fields only ever refused are known but not documented.
            let refused = [
                "audio",
                "function_call",
                "functions",
                "prediction",
                "verbosity",
                "web_search_options",
            ];
            let mut known: Vec<&str> = known
                .iter()
                .copied()
                .filter(|f| !refused.contains(f))
                .collect();
            documented.sort_unstable();
            known.sort_unstable();
            assert_eq!(documented, known, "{schema}");
            assert_eq!(s[schema]["additionalProperties"], json!(false));
        }
    }

    #[test]
    fn bounds_come_from_the_parser() {
        let doc = document("m", None);
        let s = &doc["components"]["schemas"];
        assert_eq!(
            s["Speculative"]["properties"]["num_tokens"]["anyOf"][0]["maximum"],
            MAX_SPECULATIVE_TOKENS
        );
        assert_eq!(s["Stop"]["oneOf"][1]["maxItems"], MAX_STOP_SEQUENCES);
        // The widest character is 4 bytes: the schema's longest stop string
        // always fits the byte limit.
        let chars = s["Stop"]["oneOf"][0]["maxLength"].as_u64().unwrap() as usize;
        assert!(chars * 4 <= MAX_STOP_BYTES);
    }
}
