//! Structured output on the wire: `tools`, `tool_choice`,
//! `parallel_tool_calls` and `response_format`, parsed into
//! [`ToolSetup`] and [`ResponseFormat`]. What the server does with them
//! (render tools into the chat template, constrain the output with a
//! grammar, parse tool calls out of the text) is the http layer's; these
//! types say what the request asked.

use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::json::{as_bool, as_str, get, missing, type_err};
use super::json::{Json, Obj, RawJson};

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Longest tool or schema name (OpenAI's `^[a-zA-Z0-9_-]{1,64}$`).
pub const MAX_NAME_LEN: usize = 64;

/// The request's `response_format`.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ResponseFormat {
    /// `{"type": "text"}` or absent: free text.
    #[default]
    Text,
    /// `{"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
    /// "description"}}`: JSON matching `schema` (an object; `{}` when
    /// absent). The output follows the schema whether `strict` is set or
    /// not (the grammar enforces it either way).
    JsonSchema {
        name: String,
        schema: Value,
        strict: bool,
    },
}

/// One declared function tool.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Invariant: matches `^[a-zA-Z0-9_-]{1,64}$`, unique in the request.
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (an object) when given.
    pub parameters: Option<RawJson>,
    pub strict: bool,
}

impl Tool {
    /// The tool as chat templates receive it (OpenAI's shape):
    /// `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
    pub fn template_value(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.description {
            f.insert("description".into(), Value::String(d.clone()));
        }
        if let Some(p) = &self.parameters {
            f.insert("parameters".into(), p.to_value());
        }
        json!({"type": "function", "function": f})
    }

    /// The arguments' schema for a grammar: `parameters`, or any object
    /// when the tool declares none.
    pub fn arguments_schema(&self) -> Value {
        self.parameters
            .as_ref()
            .map(RawJson::to_value)
            .unwrap_or_else(|| json!({"type": "object"}))
    }
}

/// The request's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// `"none"` (the default without tools): tools are not shown to the
    /// model and its output is not parsed for calls.
    #[default]
    None,
    /// `"auto"` (the default with tools): the model may call tools; calls
    /// are parsed out of its text.
    Auto,
    /// `"required"`: the output is constrained to one or more calls.
    Required,
    /// `{"type": "function", "function": {"name": ..}}`: constrained to
    /// calls of this declared tool.
    Function(String),
}

/// `tools`, `tool_choice` and `parallel_tool_calls` together.
///
/// Invariants: a `Required` or `Function` choice comes with tools, and a
/// `Function` names one of them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolSetup {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): whether several calls may be
    /// made in one turn.
    pub parallel: bool,
}

impl ToolSetup {
    /// Whether the template gets the tools and the output is parsed for
    /// calls (any tools and a choice other than `none`).
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// Whether the output must be tool calls (`required` or a named one).
    pub fn forces_a_call(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The tools the output is constrained to, as `(name, arguments
    /// schema)`: all of them for `required`, the named one for a function
    /// choice, none otherwise.
    pub fn forced_tools(&self) -> Vec<(String, Value)> {
        let keep = |t: &&Tool| match &self.choice {
            ToolChoice::Required => true,
            ToolChoice::Function(n) => &t.name == n,
            ToolChoice::None | ToolChoice::Auto => false,
        };
        self.tools
            .iter()
            .filter(keep)
            .map(|t| (t.name.clone(), t.arguments_schema()))
            .collect()
    }

    /// The names calls may use.
    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }
}

/// Whether `name` matches `^[a-zA-Z0-9_-]{1,64}$`.
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A 400 for an unknown key `k` inside the object at `at`.
fn unknown_key(at: &str, k: &str) -> ApiError {
    let p = format!("{at}.{k}");
    ApiError::invalid(&p, format!("Unrecognized argument supplied: '{p}'."))
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.
///
/// Errors (400 naming the field, e.g. `tools[1].function.name`): `tools`
/// not an array of `{"type": "function", "function": {"name",
/// "description"?, "parameters"?, "strict"?}}`, more than 128, a bad or
/// repeated name, `parameters` not an object, an unknown key; `tool_choice`
/// not `"none"`/`"auto"`/`"required"`/`{"type": "function", "function":
/// {"name"}}`, `required` or a function without tools, a function that is
/// not declared; `parallel_tool_calls` not a boolean.
pub(super) fn parse_tools(map: &Obj) -> Result<ToolSetup, ApiError> {
    let mut setup = ToolSetup {
        parallel: true,
        ..ToolSetup::default()
    };
    if let Some(v) = get(map, "tools") {
        let items = v
            .as_array()
            .ok_or_else(|| type_err("tools", "an array", v))?;
        if items.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                "tools",
                format!(
                    "Invalid 'tools': at most {MAX_TOOLS} tools, but got {}.",
                    items.len()
                ),
            ));
        }
        for (i, item) in items.iter().enumerate() {
            let tool = parse_tool(i, item)?;
            if setup.tools.iter().any(|t| t.name == tool.name) {
                let p = format!("tools[{i}].function.name");
                return Err(ApiError::invalid(
                    &p,
                    format!(
                        "Invalid '{p}': the tool name '{}' is declared twice.",
                        tool.name
                    ),
                ));
            }
            setup.tools.push(tool);
        }
    }
    if let Some(v) = get(map, "parallel_tool_calls") {
        setup.parallel = as_bool(v, "parallel_tool_calls")?;
    }
    setup.choice = match get(map, "tool_choice") {
        None if setup.tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(v) => parse_tool_choice(v, &setup.tools)?,
    };
    Ok(setup)
}

fn parse_tool(i: usize, v: &Json) -> Result<Tool, ApiError> {
    let at = format!("tools[{i}]");
    let obj = v.as_object().ok_or_else(|| type_err(&at, "an object", v))?;
    if let Some(k) = obj.keys().find(|k| *k != "type" && *k != "function") {
        return Err(unknown_key(&at, k));
    }
    let type_p = format!("{at}.type");
    let t = as_str(get(&obj, "type").ok_or_else(|| missing(&type_p))?, &type_p)?;
    if t != "function" {
        return Err(ApiError::invalid(
            &type_p,
            format!("Invalid value '{t}' for '{type_p}': only 'function' tools are supported."),
        ));
    }
    let fn_p = format!("{at}.function");
    let f = get(&obj, "function").ok_or_else(|| missing(&fn_p))?;
    let f = f
        .as_object()
        .ok_or_else(|| type_err(&fn_p, "an object", f))?;
    if let Some(k) = f
        .keys()
        .find(|k| !["name", "description", "parameters", "strict"].contains(k))
    {
        return Err(unknown_key(&fn_p, k));
    }
    let name_p = format!("{fn_p}.name");
    let name = as_str(get(&f, "name").ok_or_else(|| missing(&name_p))?, &name_p)?;
    if !valid_name(name) {
        return Err(ApiError::invalid(
            &name_p,
            format!("Invalid '{name_p}': '{name}' does not match '^[a-zA-Z0-9_-]{{1,64}}$'."),
        ));
    }
    let description = get(&f, "description")
        .map(|d| as_str(d, &format!("{fn_p}.description")).map(str::to_owned))
        .transpose()?;
    let parameters = match get(&f, "parameters") {
        None => None,
        Some(p) if p.is_object() => Some(p.raw()),
        Some(p) => {
            return Err(type_err(
                &format!("{fn_p}.parameters"),
                "an object (a JSON schema)",
                p,
            ))
        }
    };
    let strict = match get(&f, "strict") {
        Some(s) => as_bool(s, &format!("{fn_p}.strict"))?,
        None => false,
    };
    Ok(Tool {
        name: name.to_owned(),
        description,
        parameters,
        strict,
    })
}

fn parse_tool_choice(v: &Json, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    const P: &str = "tool_choice";
    let needs_tools = |what: &str| {
        ApiError::invalid(
            P,
            format!("Invalid '{P}': {what} requires 'tools' to declare at least one tool."),
        )
    };
    match v {
        Json::String(s) => match s.as_ref() {
            "none" => Ok(ToolChoice::None),
            "auto" if tools.is_empty() => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" if tools.is_empty() => Err(needs_tools("'required'")),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid(
                P,
                format!("Invalid value '{other}' for '{P}': expected 'none', 'auto', 'required' or a function object."),
            )),
        },
        Json::Object(obj) => {
            let obj = obj.entries();
            if let Some(k) = obj.keys().find(|k| *k != "type" && *k != "function") {
                return Err(unknown_key(P, k));
            }
            match get(&obj, "type") {
                Some(Json::String(t)) if t == "function" => {}
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "Invalid 'tool_choice.type': expected 'function'.",
                    ))
                }
            }
            let f = get(&obj, "function").ok_or_else(|| missing("tool_choice.function"))?;
            let f = f
                .as_object()
                .ok_or_else(|| type_err("tool_choice.function", "an object", f))?;
            if let Some(k) = f.keys().find(|k| *k != "name") {
                return Err(unknown_key("tool_choice.function", k));
            }
            let name_p = "tool_choice.function.name";
            let name = as_str(get(&f, "name").ok_or_else(|| missing(name_p))?, name_p)?;
            if tools.is_empty() {
                return Err(needs_tools("a function choice"));
            }
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    name_p,
                    format!("Invalid '{name_p}': no tool named '{name}' is declared in 'tools'."),
                ));
            }
            Ok(ToolChoice::Function(name.to_owned()))
        }
        other => Err(type_err(P, "a string or an object", other)),
    }
}

/// The request's `response_format` (both endpoints).
///
/// Errors (400 naming `response_format` or the inner field): not an
/// object; `type` not `text` / `json_object` / `json_schema`; a
/// `json_schema` without the `json_schema` object, with a bad `name`, a
/// `schema` that is not an object, a non-boolean `strict`, a non-string
/// `description`, or an unknown key.
pub(super) fn parse_response_format(map: &Obj) -> Result<ResponseFormat, ApiError> {
    const P: &str = "response_format";
    let Some(v) = get(map, P) else {
        return Ok(ResponseFormat::Text);
    };
    let obj = v.as_object().ok_or_else(|| type_err(P, "an object", v))?;
    let t = as_str(
        get(&obj, "type").ok_or_else(|| missing("response_format.type"))?,
        "response_format.type",
    )?;
    let allowed: &[&str] = match t {
        "json_schema" => &["type", "json_schema"],
        _ => &["type"],
    };
    if let Some(k) = obj.keys().find(|k| !allowed.contains(k)) {
        return Err(unknown_key(P, k));
    }
    match t {
        "text" => Ok(ResponseFormat::Text),
        "json_object" => Ok(ResponseFormat::JsonObject),
        "json_schema" => {
            const JS: &str = "response_format.json_schema";
            let js = get(&obj, "json_schema").ok_or_else(|| missing(JS))?;
            let js = js.as_object().ok_or_else(|| type_err(JS, "an object", js))?;
            if let Some(k) = js
                .keys()
                .find(|k| !["name", "schema", "strict", "description"].contains(k))
            {
                return Err(unknown_key(JS, k));
            }
            let name_p = "response_format.json_schema.name";
            let name = as_str(get(&js, "name").ok_or_else(|| missing(name_p))?, name_p)?;
            if !valid_name(name) {
                return Err(ApiError::invalid(
                    name_p,
                    format!("Invalid '{name_p}': '{name}' does not match '^[a-zA-Z0-9_-]{{1,64}}$'."),
                ));
            }
            let schema = match get(&js, "schema") {
                None => json!({}),
                Some(s) if s.is_object() => s.to_value(),
                Some(s) => return Err(type_err("response_format.json_schema.schema", "an object", s)),
            };
            let strict = match get(&js, "strict") {
                Some(s) => as_bool(s, "response_format.json_schema.strict")?,
                None => false,
            };
            if let Some(d) = get(&js, "description") {
                as_str(d, "response_format.json_schema.description")?;
            }
            Ok(ResponseFormat::JsonSchema {
                name: name.to_owned(),
                schema,
                strict,
            })
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("Invalid value '{other}' for 'response_format.type': expected 'text', 'json_object' or 'json_schema'."),
        )),
    }
}
