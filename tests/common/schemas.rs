//! The five JSON schemas of the structured-output test and benchmark
//! (nested objects, arrays, enums, required fields, bounded numbers), each
//! with a short task. tests/structured.rs reaches it through `mod common`;
//! benches/structured.rs includes this file by `#[path]`, so it depends on
//! serde_json only.
#![allow(dead_code)]

use serde_json::{json, Value};

/// (task, schema): nested objects, arrays, enums, required fields, bounded
/// numbers.
pub fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "Describe a person and where they live.",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": false
                    }
                },
                "required": ["name", "address"],
                "additionalProperties": false
            }),
        ),
        (
            "List some tags for a blog post about Rust.",
            json!({
                "type": "object",
                "properties": {
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 12},
                        "minItems": 1,
                        "maxItems": 4
                    }
                },
                "required": ["tags"],
                "additionalProperties": false
            }),
        ),
        (
            "Pick a T-shirt.",
            json!({
                "type": "object",
                "properties": {
                    "color": {"enum": ["red", "green", "blue"]},
                    "size": {"type": "string", "enum": ["S", "M", "L"]}
                },
                "required": ["color", "size"],
                "additionalProperties": false
            }),
        ),
        (
            "Make a to-do item.",
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
                    "title": {"type": "string", "maxLength": 30},
                    "done": {"type": "boolean"},
                    "note": {"type": "string", "maxLength": 20}
                },
                "required": ["id", "title", "done"],
                "additionalProperties": false
            }),
        ),
        (
            "Report the weather.",
            json!({
                "type": "object",
                "properties": {
                    "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                    "humidity": {"type": "integer", "minimum": 0, "maximum": 100}
                },
                "required": ["temperature", "humidity"],
                "additionalProperties": false
            }),
        ),
    ]
}
