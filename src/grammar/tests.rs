//! Tests of grammar-constrained decoding on the real Qwen2.5 tokenizer (read
//! from the GGUF in `models/`; skipped with a note when it is absent, as the
//! other real-model tests are) and on the tiny in-code tokenizer (always).
//! Random walks draw tokens from the masks alone, so they check the grammar
//! side independently of any model: every walk must decode to JSON that a
//! JSON Schema validator accepts.

#[path = "../../tests/common/models.rs"]
mod models;

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use specgate_verify::{ConstraintSource, TokenConstraint, TokenMask};

use super::{GrammarError, GrammarSpec, Grammars};
use crate::tokenizer::testing::tiny_metadata;
use crate::tokenizer::{byte_level_char, TextTokenizer};

const QWEN_GGUF: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
/// The tiny tokenizer's masks are padded past its 269 ids, like a model
/// whose logits are wider than its vocabulary.
const TINY_LOGITS: usize = 300;

struct Model {
    tok: Arc<TextTokenizer>,
    grammars: Grammars,
}

impl Model {
    fn compile(&self, spec: &GrammarSpec) -> Arc<dyn ConstraintSource> {
        self.grammars.compile(spec).expect("spec compiles")
    }

    fn start(&self, spec: &GrammarSpec) -> Box<dyn TokenConstraint> {
        self.compile(spec).start().expect("constraint starts")
    }

    fn enc(&self, text: &str) -> Vec<u32> {
        self.tok.encode(text, false).expect("encodes")
    }

    fn id(&self, token: &str) -> u32 {
        self.tok.token_to_id(token).expect("token in vocabulary")
    }

    fn text(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .filter(|&&t| !self.tok.is_eos(t))
            .flat_map(|&t| self.tok.token_bytes(t).expect("id in vocabulary"))
            .collect();
        String::from_utf8(bytes).expect("grammar output is UTF-8")
    }

    fn eos_only(&self, mask: &TokenMask) -> bool {
        let eos = self.tok.eos_token_ids();
        mask.count() == eos.len() && eos.iter().all(|&t| mask.is_allowed(t))
    }
}

/// The Qwen2.5 tokenizer and its grammars, built once for all tests.
fn qwen() -> Option<&'static Model> {
    static QWEN: OnceLock<Option<Model>> = OnceLock::new();
    QWEN.get_or_init(|| {
        let path = models::real_model(QWEN_GGUF)?;
        let tok = Arc::new(TextTokenizer::from_gguf_file(&path).expect("Qwen tokenizer loads"));
        let t0 = Instant::now();
        let grammars =
            Grammars::from_shared(tok.clone(), tok.vocab_size()).expect("grammars build");
        eprintln!("Grammars for {} ids: {:?}", tok.vocab_size(), t0.elapsed());
        Some(Model { tok, grammars })
    })
    .as_ref()
}

fn tiny() -> &'static Model {
    static TINY: OnceLock<Model> = OnceLock::new();
    TINY.get_or_init(|| {
        let tok = Arc::new(TextTokenizer::from_gguf_metadata(&tiny_metadata()).expect("tiny"));
        let grammars = Grammars::new(&tok, TINY_LOGITS).expect("grammars build");
        Model { tok, grammars }
    })
}

/// Both tokenizers when the Qwen one is present, else the tiny one.
fn models() -> Vec<(&'static str, &'static Model)> {
    let mut v = vec![("tiny", tiny())];
    v.extend(qwen().map(|m| ("qwen", m)));
    v
}

fn allowed_ids(mask: &TokenMask) -> Vec<u32> {
    (0..mask.len() as u32)
        .filter(|&t| mask.is_allowed(t))
        .collect()
}

/// Draws one token from `allowed(&[])` and commits it, until only
/// end-of-sequence ids are allowed (one is committed then). Tokens made only
/// of closing bytes (`"`, `}`, `]`) and EOS are preferred more and more as
/// the walk grows, so walks end. Returns the committed tokens.
fn walk(m: &Model, c: &mut dyn TokenConstraint, rng: &mut StdRng) -> Vec<u32> {
    let mut out = Vec::new();
    for step in 0..400 {
        let mask = c.allowed(&[]).expect("mask");
        let ids = allowed_ids(&mask);
        assert!(!ids.is_empty(), "no token allowed after {:?}", m.text(&out));
        let eos: Vec<u32> = ids.iter().copied().filter(|&t| m.tok.is_eos(t)).collect();
        let t = if eos.len() == ids.len() {
            eos[rng.random_range(0..eos.len())]
        } else {
            let p_close = if step < 8 {
                0.15
            } else {
                (step as f64 / 40.0).min(0.95)
            };
            let closing: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|&t| {
                    m.tok.is_eos(t)
                        || m.tok
                            .token_bytes(t)
                            .is_some_and(|b| !b.is_empty() && b.iter().all(|c| b"\"}]".contains(c)))
                })
                .collect();
            if !closing.is_empty() && rng.random_bool(p_close) {
                closing[rng.random_range(0..closing.len())]
            } else {
                ids[rng.random_range(0..ids.len())]
            }
        };
        c.commit(&[t]).expect("a token from the mask commits");
        out.push(t);
        if m.tok.is_eos(t) {
            return out;
        }
    }
    panic!("walk did not end: {:?}", m.text(&out));
}

fn validate(schema: &Value, text: &str) {
    let value: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).expect("test schema is valid");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{text:?} violates the schema: {errors:?}"
    );
}

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "nested objects",
            json!({
                "type": "object",
                "properties": {
                    "user": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 12},
                            "address": {
                                "type": "object",
                                "properties": {
                                    "city": {"type": "string", "maxLength": 10},
                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                                },
                                "required": ["city", "zip"],
                                "additionalProperties": false
                            }
                        },
                        "required": ["name", "address"],
                        "additionalProperties": false
                    },
                    "active": {"type": "boolean"}
                },
                "required": ["user", "active"],
                "additionalProperties": false
            }),
        ),
        (
            "arrays",
            json!({
                "type": "object",
                "properties": {
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 8},
                        "minItems": 1,
                        "maxItems": 4
                    },
                    "matrix": {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                        "minItems": 2,
                        "maxItems": 2
                    }
                },
                "required": ["tags", "matrix"],
                "additionalProperties": false
            }),
        ),
        (
            "enums",
            json!({
                "type": "object",
                "properties": {
                    "color": {"enum": ["red", "green", "blue"]},
                    "size": {"type": "string", "enum": ["S", "M", "XL"]},
                    "n": {"enum": [1, 2, 3, null]}
                },
                "required": ["color", "size", "n"],
                "additionalProperties": false
            }),
        ),
        (
            "required and optional",
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "note": {"type": "string", "maxLength": 16},
                    "score": {"type": "number"},
                    "flag": {"type": "boolean"}
                },
                "required": ["id"],
                "additionalProperties": false
            }),
        ),
        (
            "bounded numbers",
            json!({
                "type": "object",
                "properties": {
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "temp": {"type": "number", "minimum": -50.5, "maximum": 60},
                    "pct": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}
                },
                "required": ["age", "temp", "pct"],
                "additionalProperties": false
            }),
        ),
    ]
}

#[test]
fn token_bytes_invert_the_byte_table_and_give_added_tokens_their_text() {
    let m = tiny();
    for b in 0..=255u8 {
        let id = m.id(&byte_level_char(b).to_string());
        assert_eq!(m.tok.token_bytes(id), Some(vec![b]), "byte {b:#04x}");
    }
    assert_eq!(
        m.tok.token_bytes(m.id("Ġworld")).as_deref(),
        Some(&b" world"[..])
    );
    assert_eq!(
        m.tok.token_bytes(m.id("<|im_end|>")).as_deref(),
        Some(&b"<|im_end|>"[..])
    );
    assert_eq!(
        m.tok.token_bytes(m.id("<tool_call>")).as_deref(),
        Some(&b"<tool_call>"[..])
    );
    assert_eq!(m.tok.token_bytes(m.tok.vocab_size() as u32), None);
    if let Some(q) = qwen() {
        let text = "héllo wörld 日本語 {\"a\": [1, 2.5]}\n\t🦀";
        let ids = q.enc(text);
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&t| q.tok.token_bytes(t).unwrap())
            .collect();
        assert_eq!(bytes, text.as_bytes());
        // Tokens holding part of a character give their raw bytes.
        let rare = "𓀀𓁐";
        let ids = q.enc(rare);
        assert!(ids.len() > 2, "{ids:?}");
        let parts: Vec<Vec<u8>> = ids.iter().map(|&t| q.tok.token_bytes(t).unwrap()).collect();
        assert!(
            parts.iter().any(|p| std::str::from_utf8(p).is_err()),
            "{parts:?}"
        );
        assert_eq!(parts.concat(), rare.as_bytes());
    }
}

#[test]
fn masks_follow_the_schema_and_allow_eos_only_when_complete() {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": false
    });
    for (name, m) in models() {
        let mut c = m.start(&GrammarSpec::JsonSchema(schema.clone()));
        let start = c.allowed(&[]).unwrap();
        assert_eq!(start.len(), m.grammars.vocab_size(), "{name}");
        assert!(
            m.tok.eos_token_ids().iter().all(|&t| !start.is_allowed(t)),
            "{name}"
        );
        c.commit(&m.enc("{\"a\": ")).unwrap();
        let mask = c.allowed(&[]).unwrap();
        for ok in ["1", "7", "-"] {
            assert!(
                mask.is_allowed(m.enc(ok)[0]),
                "{name}: {ok:?} after {{\"a\": "
            );
        }
        for bad in ["x", "\"", "}", " ", "<|im_end|>", "<tool_call>"] {
            let t = m.enc(bad)[0];
            assert!(!mask.is_allowed(t), "{name}: {bad:?} after {{\"a\": ");
        }
        assert!(
            m.tok.eos_token_ids().iter().all(|&t| !mask.is_allowed(t)),
            "{name}"
        );
        // Padded logits are never allowed.
        assert!((m.tok.vocab_size()..mask.len()).all(|t| !mask.is_allowed(t as u32)));
        c.commit(&m.enc("12")).unwrap();
        let mask = c.allowed(&[]).unwrap();
        assert!(
            mask.is_allowed(m.enc("}")[0]) && mask.is_allowed(m.enc("3")[0]),
            "{name}"
        );
        assert!(
            !mask.is_allowed(m.enc(",")[0]),
            "{name}: no other key exists"
        );
        assert!(
            m.tok.eos_token_ids().iter().all(|&t| !mask.is_allowed(t)),
            "{name}"
        );
        c.commit(&m.enc("}")).unwrap();
        assert!(m.eos_only(&c.allowed(&[]).unwrap()), "{name}: complete");
        assert!(c.forced(&[]).is_empty(), "{name}");
        let eos = m.tok.eos_token_ids()[0];
        assert_eq!(
            c.valid_prefix(&[eos, eos]),
            2,
            "{name}: EOS after EOS stays allowed"
        );
        c.commit(&[eos]).unwrap();
        assert!(m.eos_only(&c.allowed(&[]).unwrap()), "{name}: after EOS");
        assert!(
            c.commit(&m.enc(" ")).is_err(),
            "{name}: nothing but EOS after the end"
        );
    }
}

fn random_walks(m: &Model, per_schema: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for (label, schema) in schemas() {
        let source = m.compile(&GrammarSpec::JsonSchema(schema.clone()));
        let mut lengths = Vec::new();
        for _ in 0..per_schema {
            let mut c = source.start().unwrap();
            let toks = walk(m, c.as_mut(), &mut rng);
            let text = m.text(&toks);
            validate(&schema, &text);
            if lengths.is_empty() {
                eprintln!("{label}: e.g. {text}");
            }
            lengths.push(toks.len());
        }
        let mean = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
        eprintln!("{label}: {per_schema} walks, mean {mean:.1} tokens");
    }
}

#[test]
fn random_walks_on_qwen_produce_json_valid_against_the_schema() {
    let Some(m) = qwen() else { return };
    random_walks(m, 40, 17);
}

#[test]
fn random_walks_on_the_tiny_tokenizer_produce_json_valid_against_the_schema() {
    random_walks(tiny(), 10, 5);
}

#[test]
fn json_object_walks_produce_objects() {
    for (name, m) in models() {
        let mut rng = StdRng::seed_from_u64(3);
        let source = m.compile(&GrammarSpec::JsonObject);
        for _ in 0..10 {
            let mut c = source.start().unwrap();
            let text = m.text(&walk(m, c.as_mut(), &mut rng));
            let v: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}: {text:?}"));
            assert!(v.is_object(), "{name}: {text:?}");
        }
        let mut c = source.start().unwrap();
        assert_eq!(
            c.valid_prefix(&m.enc("[1]")),
            0,
            "{name}: an array is not an object"
        );
    }
}

/// Masks after `t[..j]`, computed by committing one token at a time.
fn reference_masks(source: &Arc<dyn ConstraintSource>, t: &[u32]) -> Vec<TokenMask> {
    let mut c = source.start().unwrap();
    let mut masks = Vec::with_capacity(t.len() + 1);
    for &tok in t {
        masks.push(c.allowed(&[]).unwrap());
        c.commit(&[tok]).unwrap();
    }
    masks.push(c.allowed(&[]).unwrap());
    masks
}

#[test]
fn pending_tokens_give_the_masks_of_committing_them() {
    for (name, m) in models() {
        let mut rng = StdRng::seed_from_u64(11);
        for (label, schema) in schemas().into_iter().take(3) {
            let source = m.compile(&GrammarSpec::JsonSchema(schema));
            for _ in 0..2 {
                let mut w = source.start().unwrap();
                let t = walk(m, w.as_mut(), &mut rng);
                let refs = reference_masks(&source, &t);
                let mut c = source.start().unwrap();
                let mut at = 0;
                while at < t.len() {
                    // Drafts of up to 6 tokens, asked in a jumbled order
                    // (longer, shorter, again) as drafting and verifying do.
                    let k = rng.random_range(0..=6).min(t.len() - at);
                    let draft = &t[at..at + k];
                    for len in [k, k / 2, k, 0, k.saturating_sub(1)] {
                        let got = c.allowed(&draft[..len]).unwrap();
                        assert!(got == refs[at + len], "{name}/{label}: mask at {at}+{len}");
                    }
                    assert_eq!(
                        c.valid_prefix(draft),
                        k,
                        "{name}/{label}: a walk's own draft"
                    );
                    // A forbidden token cuts the draft there.
                    if k > 0 {
                        let j = rng.random_range(0..k);
                        let bad = (0..refs[at + j].len() as u32)
                            .find(|&x| !refs[at + j].is_allowed(x))
                            .unwrap();
                        let mut cut = draft.to_vec();
                        cut[j] = bad;
                        assert_eq!(c.valid_prefix(&cut), j, "{name}/{label}: cut at {at}+{j}");
                        let got = c.allowed(&cut[..j]).unwrap();
                        assert!(got == refs[at + j], "{name}/{label}: mask after a cut");
                    }
                    let accept = if k == 0 { 1 } else { rng.random_range(1..=k) };
                    c.commit(&t[at..at + accept]).unwrap();
                    at += accept;
                }
                assert!(m.eos_only(&c.allowed(&[]).unwrap()), "{name}/{label}");
            }
        }
    }
}

#[test]
fn forced_tokens_are_the_canonical_tokens_of_the_forced_text() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": false
    });
    let forced_text = "{\"name\": \"";
    for (name, m) in models() {
        let source = m.compile(&GrammarSpec::JsonSchema(schema.clone()));
        let mut c = source.start().unwrap();
        let open = m.enc("{\"");
        c.commit(&open).unwrap();
        let ff = c.forced(&[]);
        let text = m.text(&ff);
        eprintln!("{name}: forced after {{\": {ff:?} = {text:?}");
        assert!(!ff.is_empty(), "{name}");
        assert!(forced_text[2..].starts_with(&text), "{name}: {text:?}");
        assert_eq!(
            ff,
            m.enc(&text),
            "{name}: canonical tokenization of {text:?}"
        );
        // The mask offers exactly the first forced token.
        let mask = c.allowed(&[]).unwrap();
        assert_eq!(allowed_ids(&mask), vec![ff[0]], "{name}");
        // Forced tokens asked with pending equal those after committing.
        let mut d = source.start().unwrap();
        assert_eq!(d.forced(&open), ff, "{name}: forced with pending");
        c.commit(&ff).unwrap();
        let rest = c.forced(&[]);
        assert!(
            forced_text[2 + text.len()..].starts_with(&m.text(&rest)),
            "{name}"
        );
        // Inside the string value nothing is forced.
        c.commit(&rest).unwrap();
        let mut done = m.text(&open) + &text + &m.text(&rest);
        loop {
            let more = c.forced(&[]);
            if more.is_empty() {
                break;
            }
            c.commit(&more).unwrap();
            done += &m.text(&more);
        }
        // What is forced but not yet a whole token fits every token the
        // mask offers (a longer token may begin with it, or spell part of it).
        let left = forced_text
            .strip_prefix(done.as_str())
            .unwrap_or_else(|| panic!("{name}: {done:?} overshoots"));
        let offered = allowed_ids(&c.allowed(&[]).unwrap());
        eprintln!(
            "{name}: after {done:?}, {} tokens start with {left:?}",
            offered.len()
        );
        for t in offered {
            let bytes = m.tok.token_bytes(t).unwrap();
            assert!(
                bytes.starts_with(left.as_bytes()) || left.as_bytes().starts_with(&bytes),
                "{name}: {bytes:?}"
            );
        }
        c.commit(&m.enc(&format!("{left}x"))).unwrap();
        assert!(c.forced(&[]).is_empty(), "{name}: string content is free");
        // At the start the whole head of the object is forced.
        let mut s = source.start().unwrap();
        let head = s.forced(&[]);
        assert!(
            forced_text.starts_with(&m.text(&head)) && !head.is_empty(),
            "{name}"
        );
    }
}

#[test]
fn valid_prefix_stops_at_the_first_forbidden_token_and_bad_commits_change_nothing() {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
        "additionalProperties": false
    });
    for (name, m) in models() {
        let mut c = m.start(&GrammarSpec::JsonSchema(schema.clone()));
        let good = m.enc("{\"a\": 4");
        let mut draft = good.clone();
        draft.push(m.enc("x")[0]);
        draft.extend(m.enc("2, "));
        assert_eq!(c.valid_prefix(&draft), good.len(), "{name}");
        assert_eq!(c.valid_prefix(&[]), 0, "{name}");
        c.commit(&good).unwrap();
        let before = c.allowed(&[]).unwrap();
        let err = c.commit(&[m.enc("2")[0], m.enc("x")[0]]).unwrap_err();
        assert!(err.0.contains("position 1"), "{name}: {err}");
        assert!(
            c.allowed(&[]).unwrap() == before,
            "{name}: a failed commit changes nothing"
        );
        assert!(c.allowed(&m.enc("x")).is_err(), "{name}: forbidden pending");
        assert!(c.allowed(&[]).unwrap() == before, "{name}: still usable");
        assert!(c.forced(&m.enc("x")).is_empty(), "{name}");
        c.commit(&m.enc("2")).unwrap();
        assert_eq!(
            c.valid_prefix(&m.enc(", \"b\": \"hi\"}")),
            m.enc(", \"b\": \"hi\"}").len(),
            "{name}"
        );
        c.commit(&m.enc(", \"b\": \"hi\"}")).unwrap();
        assert!(m.eos_only(&c.allowed(&[]).unwrap()), "{name}");
        let eos = m.tok.eos_token_ids()[0];
        assert_eq!(c.valid_prefix(&[eos]), 1, "{name}");
        // Out-of-range ids are simply not allowed.
        assert_eq!(c.valid_prefix(&[u32::MAX]), 0, "{name}");
        assert!(c.commit(&[u32::MAX]).is_err(), "{name}");
        c.commit(&[eos]).unwrap();
    }
}

fn weather_tools() -> Vec<(String, Value)> {
    vec![
        (
            "get_weather".into(),
            json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city"],
                "additionalProperties": false
            }),
        ),
        (
            "add".into(),
            json!({
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -100, "maximum": 100},
                    "b": {"type": "integer", "minimum": -100, "maximum": 100}
                },
                "required": ["a", "b"],
                "additionalProperties": false
            }),
        ),
        ("no_args".into(), Value::Null),
        ("we\"ird\\na\nme".into(), json!({})),
    ]
}

/// Splits tool-call output into (name, arguments) per block.
fn parse_tool_calls(text: &str) -> Vec<(String, Value)> {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest
            .strip_prefix("<tool_call>\n")
            .unwrap_or_else(|| panic!("no block start in {text:?}"));
        let end = rest
            .find("\n</tool_call>")
            .unwrap_or_else(|| panic!("no block end in {text:?}"));
        let call: Value =
            serde_json::from_str(&rest[..end]).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let obj = call.as_object().expect("a call is an object");
        assert_eq!(
            obj.keys().collect::<Vec<_>>(),
            ["name", "arguments"],
            "{text:?}"
        );
        calls.push((
            obj["name"].as_str().expect("name").to_owned(),
            obj["arguments"].clone(),
        ));
        rest = &rest[end + "\n</tool_call>".len()..];
        // A trailing newline may end the calls (Qwen2.5's own habit).
        if rest.is_empty() || rest == "\n" {
            return calls;
        }
        rest = rest
            .strip_prefix('\n')
            .unwrap_or_else(|| panic!("bad separator in {text:?}"));
    }
}

#[test]
fn tool_call_walks_name_a_tool_and_match_its_parameters() {
    let tools = weather_tools();
    for (name, m) in models() {
        for parallel in [false, true] {
            let mut rng = StdRng::seed_from_u64(23);
            let source = m.compile(&GrammarSpec::ToolCalls {
                tools: tools.clone(),
                parallel,
            });
            let mut blocks = 0;
            for _ in 0..12 {
                let mut c = source.start().unwrap();
                let text = m.text(&walk(m, c.as_mut(), &mut rng));
                let calls = parse_tool_calls(&text);
                if !parallel {
                    assert_eq!(calls.len(), 1, "{name}: {text:?}");
                }
                blocks += calls.len();
                for (tool, args) in calls {
                    let (_, schema) = tools
                        .iter()
                        .find(|(n, _)| *n == tool)
                        .unwrap_or_else(|| panic!("{name}: unknown tool {tool:?}"));
                    let schema = if schema.is_null() {
                        json!({"type": "object"})
                    } else {
                        schema.clone()
                    };
                    assert!(args.is_object(), "{name}: {text:?}");
                    validate(&schema, &args.to_string());
                }
            }
            eprintln!("{name}: parallel={parallel}: {blocks} blocks in 12 walks");
            // After one complete block: EOS or a newline; after the
            // newline EOS only, or (parallel) another block.
            let mut c = source.start().unwrap();
            let one = m.enc("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>");
            c.commit(&one).unwrap();
            let mask = c.allowed(&[]).unwrap();
            assert!(mask.is_allowed(m.enc("\n")[0]), "{name}");
            assert!(
                m.tok.eos_token_ids().iter().all(|&t| mask.is_allowed(t)),
                "{name}"
            );
            if parallel {
                let two = "\n<tool_call>\n{\"name\": \"no_args\", \"arguments\": {}}\n</tool_call>";
                c.commit(&m.enc(two)).unwrap();
            } else {
                c.commit(&m.enc("\n")).unwrap();
                assert!(
                    m.eos_only(&c.allowed(&[]).unwrap()),
                    "{name}: exactly one block"
                );
            }
        }
    }
}

#[test]
fn tool_call_tags_are_reachable_as_single_tokens_and_forced() {
    let Some(m) = qwen() else { return };
    let tc = m.id("<tool_call>");
    let end = m.id("</tool_call>");
    let tools = weather_tools()[..1].to_vec();
    let source = m.compile(&GrammarSpec::ToolCalls {
        tools,
        parallel: false,
    });
    let mut c = source.start().unwrap();
    let ff = c.forced(&[]);
    eprintln!("forced at the start of one tool: {:?}", m.text(&ff));
    assert_eq!(
        ff.first(),
        Some(&tc),
        "the tag's own token is the canonical one"
    );
    assert!(m
        .text(&ff)
        .starts_with("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "));
    // The tag counts only as its token (issue 49): spelled in pieces it
    // is not the tag, so the grammar refuses it.
    assert_eq!(c.valid_prefix(&[tc]), 1);
    assert!(!c.allowed(&[]).unwrap().is_allowed(m.enc("<")[0]));
    c.commit(&[tc]).unwrap();
    // A string may spell the closing tag (as text: it closes nothing;
    // twelve characters, the city's bound).
    c.commit(&m.enc("\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</"))
        .unwrap();
    c.commit(&m.enc("tool_call>\"}}\n")).unwrap();
    let mask = c.allowed(&[]).unwrap();
    assert!(mask.is_allowed(end), "</tool_call> as one token");
    assert!(!mask.is_allowed(m.enc("<")[0]), "and only so");
    c.commit(&[end]).unwrap();
    c.commit(&m.enc("\n")).unwrap();
    assert!(m.eos_only(&c.allowed(&[]).unwrap()));
}

#[test]
fn bad_specs_are_invalid_not_panics() {
    let m = tiny();
    let cases: Vec<(&str, GrammarSpec)> = vec![
        ("not a schema", GrammarSpec::JsonSchema(json!("string"))),
        ("false schema", GrammarSpec::JsonSchema(json!(false))),
        (
            "unsatisfiable",
            GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 3})),
        ),
        (
            "remote ref",
            GrammarSpec::JsonSchema(json!({"$ref": "https://example.com/s.json"})),
        ),
        (
            "bad type",
            GrammarSpec::JsonSchema(json!({"type": "integr"})),
        ),
        (
            "bad pattern",
            GrammarSpec::JsonSchema(json!({"type": "string", "pattern": "(["})),
        ),
        (
            "no tools",
            GrammarSpec::ToolCalls {
                tools: vec![],
                parallel: false,
            },
        ),
        (
            "empty name",
            GrammarSpec::ToolCalls {
                tools: vec![(String::new(), Value::Null)],
                parallel: false,
            },
        ),
        (
            "duplicate name",
            GrammarSpec::ToolCalls {
                tools: vec![("f".into(), Value::Null), ("f".into(), json!({}))],
                parallel: true,
            },
        ),
        (
            "bad parameters",
            GrammarSpec::ToolCalls {
                tools: vec![("f".into(), json!(3))],
                parallel: false,
            },
        ),
        (
            "bad parameter schema",
            GrammarSpec::ToolCalls {
                tools: vec![("f".into(), json!({"type": "nope"}))],
                parallel: false,
            },
        ),
    ];
    for (label, spec) in cases {
        match m.grammars.compile(&spec) {
            Err(GrammarError::Invalid(msg)) => eprintln!("{label}: {msg}"),
            Err(e) => panic!("{label}: not Invalid: {e:?}"),
            Ok(s) => panic!("{label}: compiled: {s:?}"),
        }
    }
    // `true` takes any JSON value.
    let mut c = m.start(&GrammarSpec::JsonSchema(json!(true)));
    assert_eq!(c.valid_prefix(&m.enc("[1]")), 3);
}

#[test]
fn grammars_are_shareable_and_copies_tokenize_like_the_original() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Grammars>();
    let m = tiny();
    let shared = Grammars::from_shared(m.tok.clone(), TINY_LOGITS).unwrap();
    let spec = GrammarSpec::JsonSchema(schemas()[0].1.clone());
    let (mut a, mut b) = (
        m.start(&spec),
        shared.compile(&spec).unwrap().start().unwrap(),
    );
    assert_eq!(a.forced(&[]), b.forced(&[]));
    assert!(a.allowed(&[]).unwrap() == b.allowed(&[]).unwrap());
    assert!(matches!(
        Grammars::new(&m.tok, m.tok.vocab_size() - 1),
        Err(GrammarError::Setup(_))
    ));
}

/// Prints compile and mask costs on the Qwen vocabulary (not asserted):
/// `cargo test --release --lib grammar::tests::costs -- --ignored --nocapture`.
#[test]
#[ignore]
fn costs() {
    let Some(m) = qwen() else { return };
    let t0 = Instant::now();
    let _copy = Grammars::new(&m.tok, m.tok.vocab_size()).unwrap();
    eprintln!("Grammars::new (with tokenizer copy): {:?}", t0.elapsed());
    let mut rng = StdRng::seed_from_u64(1);
    for (label, schema) in schemas() {
        let spec = GrammarSpec::JsonSchema(schema);
        let t0 = Instant::now();
        let source = m.compile(&spec);
        let compile = t0.elapsed();
        let t0 = Instant::now();
        let mut c = source.start().unwrap();
        let start = t0.elapsed();
        let toks = walk(m, c.as_mut(), &mut rng);
        let mut c = source.start().unwrap();
        let mut times = Vec::new();
        for &t in &toks {
            let t0 = Instant::now();
            c.allowed(&[]).unwrap();
            times.push(t0.elapsed().as_micros());
            c.commit(&[t]).unwrap();
        }
        times.sort_unstable();
        eprintln!(
            "{label}: compile {compile:?}, start {start:?}, {} masks: p50 {} µs, p90 {} µs, max {} µs",
            times.len(),
            times[times.len() / 2],
            times[times.len() * 9 / 10],
            times[times.len() - 1]
        );
    }
}

/// Padding ids (GGUF type "unused", Qwen's `[PAD151665]`…) are never
/// allowed: their text would otherwise be a legal way to fill a JSON string.
#[test]
fn unused_padding_ids_are_never_allowed() {
    let md: crate::tokenizer::GgufMetadata = crate::tokenizer::testing::tiny_chatml_metadata(300)
        .into_iter()
        .collect();
    let tok = Arc::new(TextTokenizer::from_gguf_metadata(&md).expect("tiny chatml"));
    let first_pad = (0..300u32)
        .find(|&t| tok.is_unused(t))
        .expect("padded vocabulary");
    assert!(!tok.is_unused(u32::from(b'a')));
    let grammars = Grammars::new(&tok, 300).expect("grammars build");
    let schema = json!({
        "type": "object",
        "properties": {"s": {"type": "string"}},
        "required": ["s"]
    });
    let mut c = grammars
        .compile(&GrammarSpec::JsonSchema(schema))
        .expect("compiles")
        .start()
        .expect("starts");
    let prefix = tok.encode("{\"s\": \"", false).expect("encodes");
    let mask = c.allowed(&prefix).expect("prefix allowed");
    let a = tok.encode("a", false).expect("encodes")[0];
    assert!(mask.is_allowed(a), "a string takes letters");
    for t in first_pad..300 {
        assert!(
            !mask.is_allowed(t),
            "padding id {t} allowed inside a string"
        );
    }
}

/// A failed tool-call grammar is blamed on one tool by compiling each
/// again; none of those compiles starts past the deadline (the slot is
/// back when the budget ends, and the whole grammar's error stands).
#[test]
fn blaming_a_tool_stops_at_the_deadline() {
    let m = tiny();
    let spec = GrammarSpec::ToolCalls {
        tools: vec![
            ("a".into(), json!({"type": "object"})),
            ("b".into(), json!({"type": "nope"})),
        ],
        parallel: false,
    };
    let named = |r: Result<Arc<dyn ConstraintSource>, GrammarError>| match r {
        Err(GrammarError::Invalid(msg)) => msg.contains("tool \"b\""),
        other => panic!("not Invalid: {other:?}"),
    };
    let later = Instant::now() + std::time::Duration::from_secs(60);
    assert!(named(m.grammars.compile_here(&spec, later)));
    assert!(!named(m.grammars.compile_here(&spec, Instant::now())));
}
