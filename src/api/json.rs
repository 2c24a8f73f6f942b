//! JSON field helpers shared by every wire format's parser: read a field
//! (`null` is absent), check its type, and build the 400 that names it.
//! Parsing flows one way: each wire module (`request`, `messages`,
//! `sampling`, `tools`, `anthropic`, `responses`, ...) depends on this one,
//! never on each other's helpers.

use serde_json::{Map, Value};

use super::error::ApiError;

/// The field's value; `null` counts as absent.
pub(crate) fn get<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

pub(crate) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn type_err(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            kind_of(got)
        ),
    )
}

pub(crate) fn missing(param: &str) -> ApiError {
    ApiError::invalid(param, format!("Missing required parameter: '{param}'."))
}

pub(crate) fn below_min(param: &str, min: i128, got: i128) -> ApiError {
    ApiError::invalid(
        param,
        format!("Invalid '{param}': integer below minimum value. Expected a value >= {min}, but got {got} instead."),
    )
}

pub(crate) fn as_bool(v: &Value, param: &str) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| type_err(param, "a boolean", v))
}

pub(crate) fn as_str<'a>(v: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    v.as_str().ok_or_else(|| type_err(param, "a string", v))
}

pub(crate) fn as_number(v: &Value, param: &str) -> Result<f64, ApiError> {
    v.as_f64()
        .filter(|_| v.is_number())
        .ok_or_else(|| type_err(param, "a number", v))
}

/// An integer (a decimal such as `1.5` or `2.0` is refused).
pub(crate) fn as_int(v: &Value, param: &str) -> Result<i128, ApiError> {
    v.as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
        .ok_or_else(|| type_err(param, "an integer", v))
}

pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}."
        ))
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, but got {} instead.",
            kind_of(&other)
        ))),
    }
}

/// A 400 naming the first field of `map` not in `known`, as OpenAI words it.
pub(crate) fn reject_unknown(map: &Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ApiError::invalid(
            k.as_str(),
            format!("Unrecognized request argument supplied: {k}"),
        )),
    }
}
