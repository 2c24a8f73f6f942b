//! The OpenAPI schemas of structured output and agent use: tool
//! declarations and choices, `response_format`, assistant tool calls, and
//! both endpoints' `logprobs` objects.

use serde_json::{json, Map, Value};

use crate::api::{
    MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY, MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS, MAX_TOOLS, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY,
};

fn into_map(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("written as an object"),
    }
}

/// Logits and stopping controls both generation requests take.
pub(super) fn control_fields() -> Map<String, Value> {
    into_map(json!({
        "presence_penalty": {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
        "frequency_penalty": {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
        "repetition_penalty": {"type": "number", "minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY, "description": "vLLM's; 1 is off."},
        "logit_bias": {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
            "description": "Token id (decimal) -> bias added to its logit.",
        },
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "min_tokens": {"type": "integer", "minimum": 0, "description": "At most max_tokens."},
        "stop_token_ids": {
            "type": "array",
            "maxItems": MAX_STOP_TOKEN_IDS,
            "items": {"type": "integer", "minimum": 0, "maximum": u32::MAX},
        },
        "response_format": {"$ref": "#/components/schemas/ResponseFormat"},
    }))
}

/// Fields only the chat request takes: chat logprobs, tools, and OpenAI's
/// bookkeeping fields.
pub(super) fn chat_fields() -> Map<String, Value> {
    into_map(json!({
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "description": "Requires logprobs: true."},
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {"$ref": "#/components/schemas/Tool"}},
        "tool_choice": {"$ref": "#/components/schemas/ToolChoice"},
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 512}, "description": "Kept for the log only."},
        "safety_identifier": {"type": "string", "description": "Kept for the log only."},
        "prompt_cache_key": {"type": "string", "description": "Accepted; prefix caching is automatic."},
        "store": {"const": false, "description": "Nothing is ever stored."},
        "service_tier": {"enum": ["auto", "default"]},
        "modalities": {"type": "array", "items": {"const": "text"}},
    }))
}

/// The schemas, by component name.
pub(super) fn schemas() -> Map<String, Value> {
    let v = json!({
        "ToolCall": {
            "type": "object",
            "required": ["id", "function"],
            "properties": {
                "id": {"type": "string"},
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name", "arguments"],
                    "properties": {
                        "name": {"type": "string"},
                        "arguments": {"type": "string", "description": "JSON text."},
                    },
                },
            },
        },
        "Tool": {
            "type": "object",
            "required": ["type", "function"],
            "additionalProperties": false,
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": false,
                    "properties": {
                        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
        "ToolChoice": {"oneOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        ]},
        "ResponseFormat": {"oneOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": false,
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                            "schema": {"type": "object"},
                            "strict": {"type": "boolean"},
                            "description": {"type": "string"},
                        },
                    },
                },
            },
        ]},
        "ChatLogprobs": {
            "type": "object",
            "required": ["content", "refusal"],
            "properties": {
                "content": {"type": "array", "items": {
                    "type": "object",
                    "required": ["token", "logprob", "bytes", "top_logprobs"],
                    "properties": {
                        "token": {"type": "string"},
                        "logprob": {"type": "number", "maximum": 0},
                        "bytes": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": 255}},
                        "top_logprobs": {"type": "array", "items": {
                            "type": "object",
                            "required": ["token", "logprob", "bytes"],
                            "properties": {
                                "token": {"type": "string"},
                                "logprob": {"type": "number", "maximum": 0},
                                "bytes": {"type": ["array", "null"], "items": {"type": "integer"}},
                            },
                        }},
                    },
                }},
                "refusal": {"type": "null"},
            },
        },
        "CompletionLogprobs": {
            "type": "object",
            "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            "properties": {
                "tokens": {"type": "array", "items": {"type": "string"}},
                "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                "top_logprobs": {"type": "array", "items": {
                    "type": ["object", "null"],
                    "additionalProperties": {"type": "number"},
                }},
                "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            },
        },
    });
    into_map(v)
}
