//! The OpenAPI operations and schemas of the two agent APIs: OpenAI's
//! Responses API (`/v1/responses`, and a stored response by id) and
//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`).
//! Bounds come from the parsers' own constants.

use serde_json::{json, Map, Value};

use crate::api::anthropic::MIN_THINKING_BUDGET;
use crate::api::{MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TOOLS, REASONING_EFFORTS};

/// The operations, as `(path, method, operation)`.
pub(super) fn paths(
    responses: impl Fn(Value, &[u16]) -> Value,
) -> Vec<(&'static str, &'static str, Value)> {
    let stream_ok = |whole: &str, events: &str| {
        json!({
            "description": format!("The whole {whole} as JSON, or with `stream: true` a text/event-stream of {events} (`event: <type>` and `data: <JSON>` lines)."),
            "content": {
                "application/json": {"schema": {"$ref": format!("#/components/schemas/{whole}")}},
                "text/event-stream": {"schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                }},
            },
        })
    };
    let body = |name: &str| json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{name}")}}}});
    let errors = [400, 401, 404, 408, 413, 429, 500, 503];
    let id_param = json!([{"name": "response_id", "in": "path", "required": true, "schema": {"type": "string"}}]);
    vec![
        (
            "/v1/responses",
            "post",
            json!({
                "summary": "OpenAI's Responses API: one turn from `input` items, on the chat pipeline; `store` (default true) keeps it for `previous_response_id` and GET/DELETE (bounded per API key, oldest evicted first).",
                "operationId": "createResponse",
                "requestBody": body("ResponsesRequest"),
                "responses": responses(stream_ok("Response", "typed events with `sequence_number` (response.created ... response.completed)"), &errors),
            }),
        ),
        (
            "/v1/responses/{response_id}",
            "get",
            json!({
                "summary": "A stored response of the caller's API key (404 when unknown, deleted or evicted).",
                "operationId": "getResponse",
                "parameters": id_param,
                "responses": responses(json!({"description": "OK", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Response"}}}}), &[401, 404]),
            }),
        ),
        (
            "/v1/responses/{response_id}",
            "delete",
            json!({
                "summary": "Deletes a stored response of the caller's API key.",
                "operationId": "deleteResponse",
                "parameters": id_param,
                "responses": responses(json!({"description": "Deleted", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["id", "object", "deleted"],
                    "properties": {"id": {"type": "string"}, "object": {"const": "response"}, "deleted": {"const": true}},
                }}}}), &[401, 404]),
            }),
        ),
        (
            "/v1/messages",
            "post",
            json!({
                "summary": "Anthropic's Messages API on the chat pipeline. Errors use Anthropic's body (`{\"type\":\"error\",\"error\":{\"type\",\"message\"}}`); `x-api-key` authenticates like the bearer key.",
                "operationId": "createMessage",
                "requestBody": body("MessagesRequest"),
                "responses": anthropic_errors(responses(stream_ok("Message", "Anthropic's events (message_start, content_block_start/delta/stop, message_delta, message_stop, ping)"), &errors)),
            }),
        ),
        (
            "/v1/messages/count_tokens",
            "post",
            json!({
                "summary": "The prompt tokens a Messages request would cost (Anthropic's shape).",
                "operationId": "countMessageTokens",
                "requestBody": body("CountTokensRequest"),
                "responses": anthropic_errors(responses(json!({"description": "OK", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["input_tokens"],
                    "properties": {"input_tokens": {"type": "integer", "minimum": 1}},
                }}}}), &[400, 401, 404, 408, 413, 429, 500, 503])),
            }),
        ),
    ]
}

/// `responses` with every error answer in Anthropic's body.
fn anthropic_errors(mut responses: Value) -> Value {
    if let Some(m) = responses.as_object_mut() {
        for (status, r) in m.iter_mut() {
            if status != "200" {
                r["content"]["application/json"]["schema"] =
                    json!({"$ref": "#/components/schemas/AnthropicError"});
            }
        }
    }
    responses
}

/// The schemas the operations refer to.
pub(super) fn schemas() -> Map<String, Value> {
    let text = json!({"type": "string"});
    let stop = json!({"type": "string", "minLength": 1, "maxLength": MAX_STOP_BYTES / 4});
    let v = json!({
        "AnthropicError": {
            "type": "object",
            "required": ["type", "error"],
            "properties": {
                "type": {"const": "error"},
                "error": {"type": "object", "required": ["type", "message"], "properties": {
                    "type": {"type": "string"}, "message": {"type": "string"}}},
            },
        },
        "ResponsesRequest": {
            "type": "object",
            "required": ["model", "input"],
            "additionalProperties": false,
            "properties": {
                "model": {"type": "string"},
                "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ResponsesInputItem"}}]},
                "instructions": {"type": ["string", "null"]},
                "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
                "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
                "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
                "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {
                    "type": "object", "required": ["type", "name"], "additionalProperties": false,
                    "properties": {"type": {"const": "function"}, "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                        "description": text, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
                "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]},
                "parallel_tool_calls": {"type": "boolean"},
                "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["text", "json_object", "json_schema"]}, "name": text, "schema": {"type": "object"},
                    "strict": {"type": "boolean"}, "description": text}}}},
                "reasoning": {"type": "object", "additionalProperties": false, "properties": {
                    "effort": {"enum": REASONING_EFFORTS, "description": "Mapped onto the model's thinking switch (Kimi K3: `thinking_effort`; `none` turns thinking off); a 400 for a model without one (except `none`)."},
                    "summary": {"const": "auto"}}},
                "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 512}},
                "user": text,
                "safety_identifier": text,
                "stream": {"type": "boolean"},
                "store": {"type": "boolean", "description": "Keep the response (default true): bounded per API key, oldest evicted first."},
                "previous_response_id": {"type": ["string", "null"], "description": "Continue a stored response's conversation (404 when it is not stored)."},
                "truncation": {"const": "disabled"},
                "include": {"type": "array", "maxItems": 0},
                "prompt_cache_key": text,
                "service_tier": {"enum": ["auto", "default"]},
            },
        },
        "ResponsesInputItem": {
            "type": "object",
            "description": "A message (`role`, `content`: a string or input_text/output_text parts), a `function_call` (`call_id`, `name`, `arguments`), a `function_call_output` (`call_id`, `output`, answering an earlier call) or a `reasoning` item (its `content` reasoning_text fed back). Other item and part types are refused with a 400 naming them.",
            "properties": {
                "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
            },
        },
        "Response": {
            "type": "object",
            "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
            "properties": {
                "id": text,
                "object": {"const": "response"},
                "created_at": {"type": "integer"},
                "status": {"enum": ["completed", "incomplete", "in_progress"]},
                "incomplete_details": {"type": ["object", "null"]},
                "model": text,
                "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"], "properties": {
                    "type": {"enum": ["message", "function_call", "reasoning"]}}}},
                "usage": {"type": ["object", "null"], "properties": {
                    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                    "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {"type": "integer"}}},
                    "total_tokens": {"type": "integer"}}},
            },
        },
        "MessagesRequest": {
            "type": "object",
            "required": ["model", "messages", "max_tokens"],
            "additionalProperties": false,
            "properties": {
                "model": {"type": "string"},
                "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/AnthropicMessage"}},
                "max_tokens": {"type": "integer", "minimum": 1},
                "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
                "stop_sequences": {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": stop},
                "stream": {"type": "boolean"},
                "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "top_k": {"type": "integer", "minimum": 0},
                "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {
                    "type": "object", "required": ["name", "input_schema"],
                    "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "description": text,
                        "input_schema": {"type": "object"}}}},
                "tool_choice": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["auto", "any", "tool", "none"]}, "name": text,
                    "disable_parallel_tool_use": {"type": "boolean"}}},
                "thinking": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["enabled", "disabled"]},
                    "budget_tokens": {"type": "integer", "minimum": MIN_THINKING_BUDGET}},
                    "description": "Mapped onto the model's thinking switch (Kimi K3: on, with the budget's tier as `thinking_effort`); `enabled` is a 400 for a model without one."},
                "metadata": {"type": "object", "properties": {"user_id": text}, "additionalProperties": false},
                "service_tier": {"enum": ["auto", "standard_only"]},
            },
        },
        "CountTokensRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                "model": {"type": "string"},
                "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/AnthropicMessage"}},
                "system": {},
                "tools": {"type": "array"},
                "tool_choice": {"type": "object"},
                "thinking": {"type": "object"},
            },
        },
        "AnthropicMessage": {
            "type": "object",
            "required": ["role", "content"],
            "additionalProperties": false,
            "description": "`content`: a string or blocks: `text`; `tool_use` and `thinking` (assistant); `tool_result` answering an earlier `tool_use` (user). Images and documents are refused by name.",
            "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type"]}}]},
            },
        },
        "Message": {
            "type": "object",
            "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {
                "id": text,
                "type": {"const": "message"},
                "role": {"const": "assistant"},
                "model": text,
                "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["text", "thinking", "tool_use"]}}}},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                "stop_sequence": {"type": ["string", "null"]},
                "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
                    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}},
            },
        },
    });
    match v {
        Value::Object(m) => m,
        _ => unreachable!("written as an object"),
    }
}
