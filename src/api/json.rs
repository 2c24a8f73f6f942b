//! The JSON of a request body, read lazily, and the field helpers every
//! wire format's parser shares: read a field (`null` is absent), check its
//! type, and build the 400 that names it. Parsing flows one way: each wire
//! module (`request`, `messages`, `sampling`, `tools`, `anthropic`,
//! `responses`, ...) depends on this one, never on each other's helpers.
//!
//! Why lazy: a `serde_json::Value` tree costs 27-50x the text it holds
//! (a heap string, a map node and a 32-byte value per token of JSON), so a
//! 1 MB body became ~40 MB. [`parse_object`] instead checks the whole body
//! once with serde_json's own parser (no allocation; the same errors, at
//! the same line and column, as parsing it into a tree) and then reads it
//! one level at a time: an object is its keys and the text of their values
//! ([`Obj`]), an array the text of its items, and a value is decoded only
//! when a parser asks for it ([`Json`]). Strings borrow from the body
//! unless they hold escapes. What a request keeps (message text, a tool's
//! schema as text, [`RawJson`]) is copied out once; nothing else outlives
//! the parse.

use std::borrow::Cow;
use std::collections::hash_map::{Entry, HashMap};
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::error::ApiError;

/// One JSON value of a checked body, decoded one level deep: a scalar or
/// string as itself, an array or object as its text (split by
/// [`Json::as_array`] / [`Json::as_object`] when a parser reads into it).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Text<'a>),
    Object(Text<'a>),
}

/// The text of an array or object inside a checked body.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Text<'a>(&'a str);

/// An object of a checked body, one level deep: its keys, in the order
/// they first appear, each with the text of its value. A key given twice
/// keeps its first place and its last value (as `serde_json::Map` with
/// `preserve_order` does).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Obj<'a> {
    entries: Vec<(Cow<'a, str>, Json<'a>)>,
}

impl<'a> Json<'a> {
    /// Decodes the value whose text is `s` (a checked body's slice).
    fn decode(s: &'a str) -> Self {
        match s.as_bytes()[0] {
            b'n' => Json::Null,
            b't' => Json::Bool(true),
            b'f' => Json::Bool(false),
            b'"' => Json::String(decode_str(s)),
            b'[' => Json::Array(Text(s)),
            b'{' => Json::Object(Text(s)),
            // The check parsed it as a number already.
            _ => Json::Number(serde_json::from_str(s).unwrap_or_else(|_| Number::from(0))),
        }
    }

    pub(crate) fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }
    pub(crate) fn is_array(&self) -> bool {
        matches!(self, Json::Array(_))
    }
    pub(crate) fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }
    pub(crate) fn is_number(&self) -> bool {
        matches!(self, Json::Number(_))
    }
    pub(crate) fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }
    pub(crate) fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Number(n) => n.as_f64(),
            _ => None,
        }
    }
    pub(crate) fn as_i64(&self) -> Option<i64> {
        match self {
            Json::Number(n) => n.as_i64(),
            _ => None,
        }
    }
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Number(n) => n.as_u64(),
            _ => None,
        }
    }
    /// The items of an array, each decoded one level deep.
    pub(crate) fn as_array(&self) -> Option<Vec<Json<'a>>> {
        match self {
            Json::Array(t) => Some(t.items()),
            _ => None,
        }
    }
    /// The entries of an object.
    pub(crate) fn as_object(&self) -> Option<Obj<'a>> {
        match self {
            Json::Object(t) => Some(t.entries()),
            _ => None,
        }
    }
    /// The value as a `serde_json::Value` tree, for what a request keeps
    /// as JSON (template variables, a tool call's arguments) and for small
    /// values; never for a whole body.
    pub(crate) fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Number(n) => Value::Number(n.clone()),
            Json::String(s) => Value::String(s.to_string()),
            Json::Array(t) | Json::Object(t) => serde_json::from_str(t.0).unwrap_or(Value::Null),
        }
    }
    /// The value's text as the body gave it (arrays and objects), or
    /// re-encoded (scalars).
    pub(crate) fn raw(&self) -> RawJson {
        match self {
            Json::Array(t) | Json::Object(t) => RawJson(t.0.into()),
            other => RawJson(other.to_value().to_string().into()),
        }
    }
}

impl<'a> Text<'a> {
    pub(crate) fn items(self) -> Vec<Json<'a>> {
        let s = self.0;
        let mut out = Vec::new();
        let mut i = skip_ws(s, 1);
        while s.as_bytes()[i] != b']' {
            let end = value_end(s, i);
            out.push(Json::decode(&s[i..end]));
            i = skip_ws(s, end);
            if s.as_bytes()[i] == b',' {
                i = skip_ws(s, i + 1);
            }
        }
        out
    }

    pub(crate) fn entries(self) -> Obj<'a> {
        let s = self.0;
        let mut obj = Obj::default();
        // Where each key first came, so a repeated key is found in one
        // step: an object of any size splits in linear time.
        let mut first: HashMap<Cow<'a, str>, usize> = HashMap::new();
        let mut i = skip_ws(s, 1);
        while s.as_bytes()[i] != b'}' {
            let kend = value_end(s, i);
            let key = decode_str(&s[i..kend]);
            i = skip_ws(s, kend);
            // The ':'.
            i = skip_ws(s, i + 1);
            let end = value_end(s, i);
            let v = Json::decode(&s[i..end]);
            match first.entry(key) {
                Entry::Occupied(e) => obj.entries[*e.get()].1 = v,
                Entry::Vacant(e) => {
                    obj.entries.push((e.key().clone(), v));
                    e.insert(obj.entries.len() - 1);
                }
            }
            i = skip_ws(s, end);
            if s.as_bytes()[i] == b',' {
                i = skip_ws(s, i + 1);
            }
        }
        obj
    }
}

impl<'a> Obj<'a> {
    /// The value of `key`, `null` included.
    pub(crate) fn get(&self, key: &str) -> Option<&Json<'a>> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }
    pub(crate) fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_ref())
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &Json<'a>)> {
        self.entries.iter().map(|(k, v)| (k.as_ref(), v))
    }
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
    /// The object as a `serde_json::Map` (see [`Json::to_value`]).
    pub(crate) fn to_map(&self) -> Map<String, Value> {
        self.iter()
            .map(|(k, v)| (k.to_owned(), v.to_value()))
            .collect()
    }
}

/// A JSON value kept as its text (a tool's `parameters`): as compact as
/// the client sent it, decoded when a template or grammar needs it.
/// Invariant: valid JSON (a checked body's slice or an encoded value).
#[derive(Clone, PartialEq, Eq)]
pub struct RawJson(Box<str>);

impl RawJson {
    /// The value as a tree (built per use, dropped after it).
    pub fn to_value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }
    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&Value> for RawJson {
    fn from(v: &Value) -> Self {
        RawJson(v.to_string().into())
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_value(), f)
    }
}

/// A string's text (quotes included) decoded: borrowed unless it holds
/// escapes.
fn decode_str(s: &str) -> Cow<'_, str> {
    let inner = &s[1..s.len() - 1];
    if inner.contains('\\') {
        Cow::Owned(serde_json::from_str(s).unwrap_or_default())
    } else {
        Cow::Borrowed(inner)
    }
}

fn skip_ws(s: &str, mut i: usize) -> usize {
    let b = s.as_bytes();
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// The end of the value starting at `i` of checked JSON text `s`.
fn value_end(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    match b[i] {
        b'"' => string_end(b, i),
        b'[' | b'{' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j);
                        continue;
                    }
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return j + 1;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            j
        }
    }
}

/// The end (one past the closing quote) of the string opening at `i`.
fn string_end(b: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    loop {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return j + 1,
            _ => j += 1,
        }
    }
}

/// serde_json's parser walking a body as its `Value` would, allocating
/// nothing: the same syntax, number-range, UTF-8 and depth checks at the
/// same positions, so the same error for every malformed body.
struct Check;

impl<'de> de::Deserialize<'de> for Check {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Check)
    }
}

/// A map key, read as `Value` reads one (`deserialize_str`).
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(IgnoredAny).map(drop)
    }
}

impl<'de> Visitor<'de> for Check {
    type Value = Check;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any valid JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_str<E>(self, _: &str) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_unit<E>(self) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_none<E>(self) -> Result<Check, E> {
        Ok(Check)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Check, A::Error> {
        while seq.next_element::<Check>()?.is_some() {}
        Ok(Check)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Check, A::Error> {
        while map.next_key_seed(Key)?.is_some() {
            map.next_value::<Check>()?;
        }
        Ok(Check)
    }
}

/// `f` over `v` read as a request's JSON is (a value this server built,
/// such as a response's own output items, read back by a request parser).
pub(crate) fn read_value<R>(v: &Value, f: impl FnOnce(&Json) -> R) -> R {
    let text = v.to_string();
    f(&Json::decode(&text))
}

/// The field's value; `null` counts as absent.
pub(crate) fn get<'m, 'a>(map: &'m Obj<'a>, key: &str) -> Option<&'m Json<'a>> {
    map.get(key).filter(|v| !v.is_null())
}

pub(crate) fn kind_of(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(n) if n.is_f64() => "a decimal number",
        Json::Number(_) => "an integer",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

pub(crate) fn type_err(param: &str, expected: &str, got: &Json) -> ApiError {
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

pub(crate) fn as_bool(v: &Json, param: &str) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| type_err(param, "a boolean", v))
}

pub(crate) fn as_str<'v>(v: &'v Json, param: &str) -> Result<&'v str, ApiError> {
    v.as_str().ok_or_else(|| type_err(param, "a string", v))
}

/// A string that outlives the object it was read from: borrowed from the
/// body unless it held escapes.
pub(crate) fn as_text<'a>(v: &Json<'a>, param: &str) -> Result<Cow<'a, str>, ApiError> {
    match v {
        Json::String(s) => Ok(s.clone()),
        other => Err(type_err(param, "a string", other)),
    }
}

pub(crate) fn as_number(v: &Json, param: &str) -> Result<f64, ApiError> {
    v.as_f64()
        .filter(|_| v.is_number())
        .ok_or_else(|| type_err(param, "a number", v))
}

/// An integer (a decimal such as `1.5` or `2.0` is refused).
pub(crate) fn as_int(v: &Json, param: &str) -> Result<i128, ApiError> {
    v.as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
        .ok_or_else(|| type_err(param, "an integer", v))
}

/// The body checked as JSON and read as an object, one level deep.
///
/// Errors: 400 with serde_json's own message (line and column) when the
/// body is not JSON, and one naming what it is when it is not an object.
pub(crate) fn parse_object(body: &[u8]) -> Result<Obj<'_>, ApiError> {
    let not_json = |e: serde_json::Error| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}."
        ))
    };
    serde_json::from_slice::<Check>(body).map_err(not_json)?;
    // Checked: strings are UTF-8 and everything else is ASCII.
    let text = std::str::from_utf8(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let start = skip_ws(text, 0);
    let end = value_end(text, start);
    match Json::decode(&text[start..end]) {
        Json::Object(t) => Ok(t.entries()),
        other => Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, but got {} instead.",
            kind_of(&other)
        ))),
    }
}

/// A 400 naming the first field of `map` not in `known`, as OpenAI words it.
pub(crate) fn reject_unknown(map: &Obj, known: &[&str]) -> Result<(), ApiError> {
    match map.keys().find(|k| !known.contains(k)) {
        None => Ok(()),
        Some(k) => Err(ApiError::invalid(
            k,
            format!("Unrecognized request argument supplied: {k}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_reading_gives_what_a_tree_does() {
        let body =
            br#" {"a": [1, -2.5e3, "x\"y", {"k": [true, null]}], "b": {"c": "d\u00e9", "c": 2},
            "e": "plain", "f": 18446744073709551615, "g": -0 } "#;
        let tree: Value = serde_json::from_slice(body).unwrap();
        let obj = parse_object(body).unwrap();
        assert_eq!(Value::Object(obj.to_map()), tree);
        let a = obj.get("a").unwrap().as_array().unwrap();
        assert_eq!(a.len(), 4);
        assert_eq!(a[2].as_str(), Some("x\"y"));
        assert!(matches!(
            obj.get("e"),
            Some(Json::String(Cow::Borrowed("plain")))
        ));
        assert_eq!(obj.keys().collect::<Vec<_>>(), ["a", "b", "e", "f", "g"]);
        assert_eq!(
            obj.get("b")
                .unwrap()
                .as_object()
                .unwrap()
                .get("c")
                .unwrap()
                .as_i64(),
            Some(2)
        );
    }

    #[test]
    fn a_large_object_splits_in_linear_time_keeping_first_places_and_last_values() {
        let mut body = String::from("{");
        for i in 0..200_000 {
            body.push_str(&format!("\"k{}\":{i},", i % 150_000));
        }
        body.push_str("\"end\":true}");
        let obj = parse_object(body.as_bytes()).unwrap();
        assert_eq!(obj.len(), 150_001);
        assert_eq!(obj.keys().next(), Some("k0"));
        assert_eq!(obj.get("k0").unwrap().as_i64(), Some(150_000));
        assert_eq!(obj.get("k149999").unwrap().as_i64(), Some(149_999));
    }

    #[test]
    fn malformed_bodies_fail_as_a_tree_parse_does() {
        for body in [
            &b"{"[..],
            b"[1,]",
            b"{\"a\":1e400}",
            b"{\"a\":\"\\ud800\"}",
            b"\xef\xbb\xbf{}",
        ] {
            let want = serde_json::from_slice::<Value>(body)
                .unwrap_err()
                .to_string();
            let got = parse_object(body).unwrap_err().to_json();
            assert!(got.contains(&want), "{got} / {want}");
        }
    }
}
