//! Chat-template rendering with minijinja, made to behave like Hugging Face
//! `transformers.apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, lenient
//! undefined values, `raise_exception(msg)`, `strftime_now(fmt)` (UTC), a `tojson` filter
//! with Python `json.dumps` formatting (`", "`/`": "` separators, `indent`, `sort_keys`,
//! `ensure_ascii`, `separators`), and Python string/dict methods (`.strip()`,
//! `.startswith()`, `.items()`, ...) from `minijinja-contrib`'s pycompat layer.
//!
//! Every render runs under a fuel limit ([`TEMPLATE_FUEL`] instructions):
//! a template's loops over the request's messages and tools (nested ones
//! included, as Kimi K3's matching of tool results to calls) cannot take
//! unbounded time, whatever a client sends. The message count itself is
//! bounded by the server (`server.max_messages`).

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::TokenizerError;

/// One chat turn as the template sees it (`message.role`, `message.content`, and, when
/// present, `message.tool_calls`, `message.tool_call_id`, `message.name`; absent ones are
/// not serialized, so a template's `is defined` / `if message.tool_calls` tests work).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (templates decide what they accept).
    pub role: String,
    /// The turn's text (empty for an assistant turn that only calls tools).
    pub content: String,
    /// The tool calls an assistant turn made (OpenAI's shape, `arguments` parsed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A participant name (OpenAI's `name` on a message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning (`reasoning_content`, or `reasoning`
    /// on the wire), for templates that replay it (Kimi K3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// Appends a function call (`type: "function"`) to an assistant turn's `tool_calls`.
    pub fn push_tool_call(
        &mut self,
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: serde_json::Value,
    ) {
        self.tool_calls.push(ChatToolCall {
            id: id.into(),
            kind: "function".into(),
            function: ChatFunctionCall {
                name: name.into(),
                arguments,
            },
        });
    }
}

/// Names each `tool` turn without a `name` after the call it answers (the
/// earlier assistant call with its `tool_call_id`). For APIs whose results
/// carry only the call's id (Responses' `function_call_output`,
/// Anthropic's `tool_result`): templates that must name a result's tool
/// (Kimi K3's) otherwise match results to the assistant turn right before
/// them by order, which fails when text or results come between.
///
/// Linear in the turns: the calls so far are a map from id to name (a
/// later call with a reused id replaces the earlier one: the nearest call
/// before a result names it).
pub fn name_tool_results(turns: &mut [ChatMessage]) {
    let mut calls: std::collections::HashMap<String, String> = Default::default();
    for m in turns {
        calls.extend(
            m.tool_calls
                .iter()
                .map(|c| (c.id.clone(), c.function.name.clone())),
        );
        if m.role != "tool" || m.name.is_some() {
            continue;
        }
        if let Some(id) = &m.tool_call_id {
            m.name = calls.get(id).cloned();
        }
    }
}

/// One tool call of an assistant turn, as templates see it:
/// `{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` the
/// parsed JSON value (Qwen's and Hermes' templates write `arguments | tojson`; vLLM passes
/// the parsed object too).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatToolCall {
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ChatFunctionCall,
}

/// The function of a [`ChatToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatFunctionCall {
    pub name: String,
    /// The arguments as a JSON value (normally an object).
    pub arguments: serde_json::Value,
}

const TEMPLATE_NAME: &str = "chat_template";

/// Template instructions one render may execute. Kimi K3's template over
/// 2,048 messages (the default `server.max_messages`) of tool runs takes
/// 0.5 million (75 ms), and 6 million (1.7 s) when each tool result is
/// matched against a turn of 64 calls, its heaviest plausible shape. Simple
/// instructions run at ~18 million a second, K3's at ~4 million: a render
/// stops within about 0.7 s to 3 s whatever the template loops over.
pub const TEMPLATE_FUEL: u64 = 12_000_000;

/// A compiled chat template with the HF-compatible environment around it.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`. Errors: [`TokenizerError::ChatTemplate`] on a syntax error.
    pub(crate) fn compile(source: String) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?;
        Ok(Self { env })
    }

    /// Renders over `messages`; `bos_token`/`eos_token` are defined only when known.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<String, TokenizerError> {
        self.render_with_tools(messages, None, add_generation_prompt, bos_token, eos_token)
    }

    /// As [`render`](Self::render), with the `tools` variable defined when `tools` is
    /// `Some` (OpenAI's shape, `[{"type": "function", "function": {..}}]`, as
    /// `transformers` passes them); undefined otherwise, so `{% if tools %}` is false.
    pub(crate) fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<String, TokenizerError> {
        let none = serde_json::Map::new();
        self.render_with_vars(
            messages,
            tools,
            &none,
            add_generation_prompt,
            bos_token,
            eos_token,
        )
    }

    /// As [`render_with_tools`](Self::render_with_tools), with `vars` (a
    /// request's `chat_template_kwargs`) defined as template variables
    /// too; the server's own variables (`messages`, `tools`, ...) win over
    /// a var of the same name.
    ///
    /// Errors: [`TokenizerError::ChatTemplate`] for a template error, and
    /// for a render that spends [`TEMPLATE_FUEL`] (saying so).
    pub(crate) fn render_with_vars(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        vars: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<String, TokenizerError> {
        let mut ctx: Vec<(&str, Value)> = vars
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from_serialize(v)))
            .collect();
        ctx.extend([
            ("messages", Value::from_serialize(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        ctx.extend(tools.map(|t| ("tools", Value::from_serialize(t))));
        ctx.extend(bos_token.map(|t| ("bos_token", Value::from(t))));
        ctx.extend(eos_token.map(|t| ("eos_token", Value::from(t))));
        let ctx: Value = ctx.into_iter().collect();
        let err = |e: Error| {
            TokenizerError::ChatTemplate(if e.kind() == ErrorKind::OutOfFuel {
                format!(
                    "rendering the chat template took more than {TEMPLATE_FUEL} template \
                     instructions; send fewer messages or tools"
                )
            } else {
                e.to_string()
            })
        };
        self.env
            .get_template(TEMPLATE_NAME)
            .map_err(err)?
            .render(ctx)
            .map_err(err)
    }
}

/// `raise_exception(msg)`: templates call it to reject a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC time formatted like Python's `strftime`.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    format_utc(secs, &format)
}

/// Formats a Unix timestamp (UTC) with the common `strftime` directives:
/// `%Y %y %m %d %e %j %H %I %M %S %p %a %A %b %B %h %%`, and the `-` flag for no padding
/// (`%-d`). Unknown directives are kept verbatim.
pub(crate) fn format_utc(secs: i64, format: &str) -> String {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let weekday = (days.rem_euclid(7) + 4) % 7; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (sod / 3600, sod / 60 % 60, sod % 60);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday as usize];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('a') => out.push_str(&day_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// (year, month, day) -> days since 1970-01-01; inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` with Python `json.dumps(ensure_ascii=False)` output, as transformers renders it.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators.as_deref() {
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&mut out, &json, 0);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, v: &serde_json::Value, depth: usize) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.write_str(out, s),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1);
                }
                self.newline(out, depth);
                out.push(']');
            }
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write_str(out, k);
                    out.push_str(&self.key_sep);
                    self.write(out, item, depth + 1);
                }
                self.newline(out, depth);
                out.push('}');
            }
        }
    }

    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        ChatTemplate::compile(src.to_owned())?.render(messages, true, Some("<s>".into()), None)
    }

    #[test]
    fn hf_environment_semantics() {
        let msgs = [ChatMessage::new("user", "  Hi  ")];
        // trim_blocks + lstrip_blocks, bos defined, eos undefined renders empty.
        let src = "  {% for m in messages %}\n{{ bos_token }}[{{ m.role }}]{{ m.content.strip() }}{{ eos_token }}\n  {% endfor %}\n";
        assert_eq!(render(src, &msgs).unwrap(), "<s>[user]Hi\n");
        let src =
            "{% if messages[0].role == 'user' %}{{ raise_exception('no users here') }}{% endif %}";
        let err = render(src, &msgs).unwrap_err().to_string();
        assert!(err.contains("no users here"), "{err}");
        assert!(matches!(
            ChatTemplate::compile("{% for %}".into()),
            Err(TokenizerError::ChatTemplate(_))
        ));
        let year = render("{{ strftime_now('%Y') }}", &msgs).unwrap();
        assert!(year.len() == 4 && year.as_str() >= "2024", "{year}");
    }

    use crate::tokenizer::tests::k3_template;

    /// `n` messages: an assistant turn calling `calls` tools, then tool
    /// results and user turns alternating (each tool message a run of its
    /// own, as the issue's 10,000-message body).
    fn tool_runs(n: usize, calls: usize) -> Vec<ChatMessage> {
        let mut call = ChatMessage::new("assistant", "");
        for i in 0..calls {
            call.push_tool_call(format!("c{i}"), "f", serde_json::json!({"x": i}));
        }
        let mut msgs = vec![ChatMessage::new("user", "go"), call];
        for i in 0..n.saturating_sub(2) {
            msgs.push(if i % 2 == 0 {
                let mut m = ChatMessage::new("tool", format!("result {i}"));
                m.tool_call_id = Some(format!("c{}", i % calls.max(1)));
                m
            } else {
                ChatMessage::new("user", "more")
            });
        }
        msgs
    }

    /// A template whose loops run past the fuel is stopped with an error
    /// that says so, instead of running on (here: 4 million turns of a
    /// loop nested over the messages).
    #[test]
    fn tool_results_are_named_after_the_call_they_answer() {
        let mut a = ChatMessage::new("assistant", "");
        a.push_tool_call("c1", "get_weather", serde_json::json!({}));
        a.push_tool_call("c2", "get_time", serde_json::json!({}));
        let result = |id: &str| {
            let mut m = ChatMessage::new("tool", "x");
            m.tool_call_id = Some(id.into());
            m
        };
        let mut named = result("c1");
        named.name = Some("kept".into());
        // Text between the calls and their results, results out of order.
        let mut turns = vec![
            ChatMessage::new("user", "go"),
            a,
            ChatMessage::new("assistant", "checking"),
            result("c2"),
            result("c1"),
            named,
            result("c9"),
        ];
        name_tool_results(&mut turns);
        let names: Vec<_> = turns[3..].iter().map(|m| m.name.as_deref()).collect();
        assert_eq!(
            names,
            [Some("get_time"), Some("get_weather"), Some("kept"), None]
        );
    }

    #[test]
    fn a_render_past_its_fuel_is_refused() {
        let msgs = vec![ChatMessage::new("user", "x"); 2048];
        let src = "{% for a in messages %}{% for b in messages %}{{ b.role[:0] }}{% endfor %}{% endfor %}";
        let started = std::time::Instant::now();
        let err = render(src, &msgs).unwrap_err().to_string();
        eprintln!("the fuel ran out after {:?}", started.elapsed());
        assert!(err.contains("template instructions"), "{err}");
    }

    /// The K3 template over as many messages as the default
    /// `server.max_messages` admits, in the issue's worst shape (every
    /// tool result a run of its own, every one matched against all of the
    /// turn's calls, 48 of them), takes under half of the fuel.
    #[test]
    fn k3_tool_runs_at_the_message_bound_take_a_fraction_of_the_fuel() {
        let max = crate::config::ServerConfig::default().max_messages;
        let mut t = ChatTemplate::compile(k3_template() + "|{{ fuel_used() }}").unwrap();
        t.env.add_function("fuel_used", |state: &minijinja::State| {
            state.fuel_levels().map_or(0, |(used, _)| used)
        });
        for calls in [1, 48] {
            let started = std::time::Instant::now();
            let out = t.render(&tool_runs(max, calls), true, None, None).unwrap();
            let took = started.elapsed();
            assert!(out.contains("result 0"), "{}", &out[..out.len().min(400)]);
            let used: u64 = out.rsplit('|').next().unwrap().parse().unwrap();
            eprintln!("{max} messages, {calls} calls: {used} instructions in {took:?}");
            assert!(used < TEMPLATE_FUEL / 2, "{used} instructions");
        }
    }

    /// The K3 template's own quadratic within the message bound: one turn
    /// of 2,046 calls answered by one run of 2,046 tool results matches
    /// each result against every call (8 million loop turns); the fuel
    /// stops it.
    #[test]
    fn k3_calls_times_results_are_stopped_by_the_fuel() {
        let mut call = ChatMessage::new("assistant", "");
        for i in 0..2046 {
            call.push_tool_call(format!("c{i}"), "f", serde_json::json!({}));
        }
        let mut msgs = vec![ChatMessage::new("user", "go"), call];
        for i in 0..2046 {
            let mut m = ChatMessage::new("tool", "r");
            m.tool_call_id = Some(format!("c{i}"));
            msgs.push(m);
        }
        let t = ChatTemplate::compile(k3_template()).unwrap();
        let err = t.render(&msgs, true, None, None).unwrap_err().to_string();
        assert!(err.contains("template instructions"), "{err}");
    }

    #[test]
    fn tojson_matches_python() {
        let src = r#"{{ {"a": [1, "x\"y", none, true], "b": {}, "c": "é\n"} | tojson }}|{{ [1, {"k": "v"}] | tojson(indent=2) }}|{{ "é" | tojson(ensure_ascii=true) }}|{{ [1,2] | tojson(separators=[",", ":"]) }}"#;
        let out = render(src, &[]).unwrap();
        let expected = "{\"a\": [1, \"x\\\"y\", null, true], \"b\": {}, \"c\": \"é\\n\"}|[\n  1,\n  {\n    \"k\": \"v\"\n  }\n]|\"\\u00e9\"|[1,2]";
        assert_eq!(out, expected);
        assert!(render("{{ 1 | tojson(bogus=1) }}", &[]).is_err());
    }

    #[test]
    fn utc_formatting() {
        // 2024-02-29T13:05:09Z, a Thursday (leap day).
        let t = 1_709_211_909;
        assert_eq!(format_utc(t, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            format_utc(t, "%A %B %-d, %y %H:%M:%S %I%p %j %%"),
            "Thursday February 29, 24 13:05:09 01PM 060 %"
        );
        assert_eq!(format_utc(0, "%Y-%m-%d %a %q"), "1970-01-01 Thu %q");
        assert_eq!(format_utc(-1, "%Y-%m-%d %H:%M:%S"), "1969-12-31 23:59:59");
        for days in [-1000, 0, 59, 10_956, 19_782, 100_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
