//! Workload files: JSONL, one request per line, either
//! `{"prompt": "...", "max_tokens": N}` (sent to /v1/completions) or
//! `{"messages": [{"role": ..., "content": ...}], "max_tokens": N}`
//! (sent to /v1/chat/completions). Blank lines and lines starting with `#`
//! are skipped; anything else that is not one of those shapes is an error
//! naming the line.

use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub input: Input,
    /// Output length asked for; `None` leaves it to the server.
    pub max_tokens: Option<u32>,
}

/// What is sent: a completion prompt or chat messages (kept as JSON so any
/// message shape the server accepts passes through).
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Prompt(String),
    Messages(Vec<Value>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    max_tokens: Option<u32>,
    /// Free-form label of the line, for people reading the file.
    #[allow(dead_code)]
    id: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("cannot read workload {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("workload line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("workload has no requests")]
    Empty,
}

/// Parses JSONL text (see the module docs).
///
/// Errors: a line that is not JSON, has both or neither of `prompt` and
/// `messages`, has an empty `messages` or `max_tokens` of 0; no entries.
pub fn parse(text: &str) -> Result<Vec<Entry>, WorkloadError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let t = raw.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let bad = |message: String| WorkloadError::Line { line, message };
        let l: Line = serde_json::from_str(t).map_err(|e| bad(e.to_string()))?;
        let input = match (l.prompt, l.messages) {
            (Some(p), None) => Input::Prompt(p),
            (None, Some(m)) if !m.is_empty() => Input::Messages(m),
            (None, Some(_)) => return Err(bad("`messages` is empty".into())),
            _ => return Err(bad("needs exactly one of `prompt` and `messages`".into())),
        };
        if l.max_tokens == Some(0) {
            return Err(bad("`max_tokens` must be at least 1".into()));
        }
        out.push(Entry {
            input,
            max_tokens: l.max_tokens,
        });
    }
    if out.is_empty() {
        return Err(WorkloadError::Empty);
    }
    Ok(out)
}

/// Reads and parses a workload file.
pub fn load(path: &Path) -> Result<Vec<Entry>, WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_shapes_comments_and_errors() {
        let w = parse(
            "# a comment\n{\"prompt\": \"def f(\", \"max_tokens\": 8}\n\n\
             {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"id\": \"x\"}\n",
        )
        .unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].input, Input::Prompt("def f(".into()));
        assert_eq!(w[0].max_tokens, Some(8));
        assert!(matches!(&w[1].input, Input::Messages(m) if m.len() == 1));
        assert_eq!(w[1].max_tokens, None);
        for (bad, line) in [
            ("{\"prompt\": \"a\", \"messages\": []}", 1),
            ("\n{}", 2),
            ("{\"messages\": []}", 1),
            ("{\"prompt\": \"a\", \"max_tokens\": 0}", 1),
            ("{\"prompt\": \"a\", \"temperature\": 1}", 1),
            ("not json", 1),
        ] {
            match parse(bad) {
                Err(WorkloadError::Line { line: l, .. }) => assert_eq!(l, line, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(matches!(parse("# only\n"), Err(WorkloadError::Empty)));
    }

    #[test]
    fn shipped_workloads_parse() {
        // The workloads stay beside the other benchmarks at the workspace root.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/workloads");
        for name in ["chat", "completion", "editing"] {
            let w = load(&dir.join(format!("{name}.jsonl"))).unwrap();
            assert!(w.len() >= 8, "{name}: {} entries", w.len());
        }
    }
}
