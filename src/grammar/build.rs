//! From a [`GrammarSpec`] to llguidance's `TopLevelGrammar`: JSON schemas get
//! the deterministic layout options, tool calls become a Lark grammar whose
//! literal text is JSON-escaped (so no tool name can break out of it) and
//! whose arguments are embedded JSON schemas (`%json`).

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

use super::{GrammarError, GrammarSpec};

/// The layout of generated JSON (llguidance `x-guidance` options): no free
/// whitespace, so separators and keys can be forced.
fn layout_options() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// `schema` with the layout options added (unless it has its own), checked
/// to be an object or `true`; `what` names it in errors.
fn with_layout(schema: &Value, what: &str) -> Result<Value, GrammarError> {
    let mut map = match schema {
        Value::Object(map) => map.clone(),
        Value::Bool(true) => Map::new(),
        Value::Bool(false) => {
            return Err(GrammarError::Invalid(format!(
                "{what}: the schema `false` matches nothing"
            )))
        }
        other => {
            return Err(GrammarError::Invalid(format!(
                "{what}: a JSON schema must be an object or a boolean, not {}",
                kind(other)
            )))
        }
    };
    map.entry("x-guidance").or_insert_with(layout_options);
    Ok(Value::Object(map))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A tool's argument schema: none (`null`, `true`, `{}`) means any object.
pub(super) fn arguments_schema(name: &str, schema: &Value) -> Result<Value, GrammarError> {
    let any = match schema {
        Value::Null | Value::Bool(true) => true,
        Value::Object(map) => map.is_empty(),
        _ => false,
    };
    let schema = if any {
        json!({"type": "object"})
    } else {
        schema.clone()
    };
    with_layout(&schema, &tool_label(name))
}

/// A Lark string literal matching exactly `text` (Lark literals are JSON
/// strings in llguidance).
fn lark_literal(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// The Lark grammar for tool calls (see [`GrammarSpec::ToolCalls`]).
///
/// Errors: [`GrammarError::Invalid`] for no tools, an empty or repeated
/// name, or an argument schema that is not an object or boolean.
///
/// `tags`: the ids of `<tool_call>` and `</tool_call>` where they are tokens
/// of their own; the grammar then writes the tags as those tokens (never as
/// text spelled by others, which a parser takes for text).
pub(super) fn tool_calls_lark(
    tools: &[(String, Value)],
    parallel: bool,
    tags: Option<(u32, u32)>,
) -> Result<String, GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError::Invalid(format!(
            "{TOOLS}: at least one tool is needed"
        )));
    }
    let mut rules = Vec::with_capacity(2 * tools.len() + 2);
    // A trailing newline may end the calls: Qwen2.5 writes
    // `</tool_call>\n<|im_end|>`, and a grammar that read that newline as
    // the start of another call made the model repeat its calls.
    let nl = lark_literal("\n");
    rules.push(if parallel {
        format!("start: call ({nl} call)* {nl}?")
    } else {
        format!("start: call {nl}?")
    });
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("tool_{i}")).collect();
    let (open, close) = match tags {
        Some((open, close)) => (
            format!("<[{open}]> {}", lark_literal("\n")),
            format!("{} <[{close}]>", lark_literal("\n")),
        ),
        None => (
            lark_literal("<tool_call>\n"),
            lark_literal("\n</tool_call>"),
        ),
    };
    rules.push(format!(
        "call: {open} ({}) {close}",
        alternatives.join(" | "),
    ));
    for (i, (name, schema)) in tools.iter().enumerate() {
        if name.is_empty() {
            return Err(GrammarError::Invalid(format!(
                "{TOOLS}: a tool name is empty"
            )));
        }
        if tools[..i].iter().any(|(n, _)| n == name) {
            return Err(GrammarError::Invalid(format!(
                "{TOOLS}: tool name {name:?} is given twice"
            )));
        }
        let head = format!(
            "{{\"name\": {}, \"arguments\": ",
            Value::String(name.clone())
        );
        rules.push(format!(
            "tool_{i}: {} args_{i} {}",
            lark_literal(&head),
            lark_literal("}")
        ));
        rules.push(format!(
            "args_{i}: %json {}",
            arguments_schema(name, schema)?
        ));
    }
    Ok(rules.join("\n") + "\n")
}

/// Errors as [`tool_calls_lark`] for no tools, an empty or repeated name.
fn check_names(tools: &[(String, Value)]) -> Result<(), GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError::Invalid(format!(
            "{TOOLS}: at least one tool is needed"
        )));
    }
    for (i, (name, _)) in tools.iter().enumerate() {
        if name.is_empty() || tools[..i].iter().any(|(n, _)| n == name) {
            return Err(GrammarError::Invalid(format!(
                "{TOOLS}: tool name {name:?} is empty or given twice"
            )));
        }
    }
    Ok(())
}

/// How errors name the parts of a spec.
pub(super) const JSON_OBJECT: &str = "response_format json_object";
pub(super) const JSON_SCHEMA: &str = "response_format json_schema";
pub(super) const TOOLS: &str = "tools";

/// How errors name `spec`.
pub(super) fn label(spec: &GrammarSpec) -> &'static str {
    match spec {
        GrammarSpec::JsonObject => JSON_OBJECT,
        GrammarSpec::JsonSchema(_) | GrammarSpec::MarkupJson { .. } => JSON_SCHEMA,
        GrammarSpec::ToolCalls { .. } | GrammarSpec::MarkupCalls { .. } => TOOLS,
    }
}

/// How errors name a tool's argument schema.
pub(super) fn tool_label(name: &str) -> String {
    format!("{TOOLS}: parameters of tool {name:?}")
}

/// The llguidance grammar for `spec` and the label its errors carry.
///
/// Errors: [`GrammarError::Invalid`] as [`with_layout`] and
/// [`tool_calls_lark`]; llguidance's own checks run when the grammar is
/// compiled for the tokenizer.
/// `tags` as for [`tool_calls_lark`].
pub(super) fn top_level(
    spec: &GrammarSpec,
    tags: Option<(u32, u32)>,
) -> Result<(TopLevelGrammar, String), GrammarError> {
    let label = label(spec).to_owned();
    Ok(match spec {
        GrammarSpec::JsonObject => (
            TopLevelGrammar::from_json_schema(with_layout(
                &json!({"type": "object"}),
                JSON_OBJECT,
            )?),
            label,
        ),
        GrammarSpec::JsonSchema(schema) => (
            TopLevelGrammar::from_json_schema(with_layout(schema, JSON_SCHEMA)?),
            label,
        ),
        GrammarSpec::ToolCalls { tools, parallel } => (
            TopLevelGrammar::from_lark(tool_calls_lark(tools, *parallel, tags)?),
            label,
        ),
        GrammarSpec::MarkupJson {
            format,
            schema,
            thinking,
        } => {
            let schema = with_layout(schema, JSON_SCHEMA)?;
            let lark = format.json_answer_lark(&schema, *thinking).ok_or_else(|| {
                GrammarError::Invalid(format!("{JSON_SCHEMA}: no markup of its own"))
            })?;
            (TopLevelGrammar::from_lark(lark), label)
        }
        GrammarSpec::MarkupCalls {
            format,
            tools,
            parallel,
            thinking,
        } => {
            check_names(tools)?;
            let schemas = tools
                .iter()
                .map(|(n, s)| Ok((n.clone(), arguments_schema(n, s)?)))
                .collect::<Result<Vec<_>, GrammarError>>()?;
            let lark = format
                .forced_calls_lark(&schemas, *parallel, *thinking)
                .ok_or_else(|| GrammarError::Invalid(format!("{TOOLS}: no markup of its own")))?;
            (TopLevelGrammar::from_lark(lark), label)
        }
    })
}
