//! The K3 parser on exact markup, whole and split at every byte; the
//! family choice; the forced-call grammar's shape.

use super::kimi_k3::{escape, unescape, K3Stream, CLOSE, OPEN, SEP};
use super::*;

fn names() -> Vec<String> {
    vec!["get_weather".into(), "add".into(), "note".into()]
}

fn open(tag: &str) -> String {
    format!("{OPEN}{tag}{SEP}")
}

fn close(tag: &str) -> String {
    format!("{CLOSE}{tag}{SEP}")
}

fn arg(key: &str, ty: &str, v: &str) -> String {
    format!(
        "{}{v}{}",
        open(&format!("argument key=\"{}\" type=\"{ty}\"", escape(key))),
        close("argument")
    )
}

fn call(name: &str, index: usize, args: &[String]) -> String {
    format!(
        "{}{}{}",
        open(&format!("call tool=\"{}\" index=\"{index}\"", escape(name))),
        args.concat(),
        close("call")
    )
}

fn tools(calls: &[String]) -> String {
    format!("{}{}{}", open("tools"), calls.concat(), close("tools"))
}

/// What a turn turned into: reasoning, content, calls (adjacent text
/// pieces merged).
#[derive(Debug, PartialEq, Default)]
struct Turn {
    reasoning: String,
    content: String,
    calls: Vec<(String, String)>,
}

fn collect(pieces: Vec<TurnPiece>) -> Turn {
    let mut t = Turn::default();
    for p in pieces {
        match p {
            TurnPiece::Reasoning(r) => t.reasoning.push_str(&r),
            TurnPiece::Content(c) => t.content.push_str(&c),
            TurnPiece::Call(c) => t.calls.push((c.name, c.arguments)),
        }
    }
    t
}

/// Feeds `text` in pieces of `size` bytes (on char boundaries); checks
/// offsets never go back nor past the input, and no piece holds any part
/// of a marker.
fn run(text: &str, size: usize, thinking: bool, parse_calls: bool) -> Turn {
    let mut s = K3Stream::new(thinking, names(), parse_calls);
    let (mut fed, mut last) = (0, 0);
    let mut outs = Vec::new();
    let mut i = 0;
    // A partial marker held at a cut comes out as text only at the end.
    let mut check =
        |o: Vec<(TurnPiece, usize)>, fed: usize, outs: &mut Vec<TurnPiece>, end_: bool| {
            for (p, end) in o {
                assert!(
                    end >= last && end <= fed,
                    "offset {end} after {last}, fed {fed}"
                );
                last = end;
                if let TurnPiece::Reasoning(t) | TurnPiece::Content(t) = &p {
                    let frags: &[&str] = if end_ {
                        &[OPEN, CLOSE, SEP]
                    } else {
                        &["<|", "|>"]
                    };
                    for frag in frags {
                        assert!(!t.contains(frag), "marker fragment {frag:?} in {t:?}");
                    }
                }
                outs.push(p);
            }
        };
    while i < text.len() {
        let mut j = (i + size).min(text.len());
        while !text.is_char_boundary(j) {
            j += 1;
        }
        fed = j;
        check(s.push(&text[i..j]), fed, &mut outs, false);
        i = j;
    }
    check(s.finish(), fed, &mut outs, true);
    collect(outs)
}

/// The same turn whole and split at every size.
fn parse(text: &str, thinking: bool, parse_calls: bool) -> Turn {
    let whole = run(text, text.len().max(1), thinking, parse_calls);
    for size in 1..=12 {
        assert_eq!(run(text, size, thinking, parse_calls), whole, "size {size}");
    }
    whole
}

#[test]
fn reasoning_then_response() {
    let text = format!(
        "Let me think.{}{}Hi there!{}{}",
        close("think"),
        open("response"),
        close("response"),
        close("message")
    );
    let t = parse(&text, true, false);
    assert_eq!(t.reasoning, "Let me think.");
    assert_eq!(t.content, "Hi there!");
    assert!(t.calls.is_empty());
    // Thinking off: the prompt opened the response channel.
    let text = format!("Plain.{}{}", close("response"), close("message"));
    let t = parse(&text, false, false);
    assert_eq!((t.reasoning.as_str(), t.content.as_str()), ("", "Plain."));
}

#[test]
fn a_call_with_string_and_number_arguments() {
    let text = format!(
        "Weather?{}{}Checking.{}{}{}",
        close("think"),
        open("response"),
        close("response"),
        tools(&[call(
            "get_weather",
            1,
            &[arg("city", "string", "Paris"), arg("days", "number", "3")]
        )]),
        close("message")
    );
    let t = parse(&text, true, true);
    assert_eq!(t.reasoning, "Weather?");
    assert_eq!(t.content, "Checking.");
    assert_eq!(
        t.calls,
        vec![("get_weather".into(), r#"{"city":"Paris","days":3}"#.into())]
    );
}

#[test]
fn every_argument_type_and_raw_fallback() {
    let args = [
        arg("s", "string", "42"),
        arg("n", "number", "-1.5"),
        arg("b", "boolean", "true"),
        arg("z", "null", "null"),
        arg("o", "object", r#"{"k": [1, 2]}"#),
        arg("a", "array", r#"["x", {"y": null}]"#),
        // Not JSON for its type: kept as the raw string.
        arg("bad", "number", "many"),
    ];
    let text = format!("{}{}", close("response"), tools(&[call("add", 1, &args)]));
    let t = parse(&text, false, true);
    let v: serde_json::Value = serde_json::from_str(&t.calls[0].1).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"s": "42", "n": -1.5, "b": true, "z": null,
            "o": {"k": [1, 2]}, "a": ["x", {"y": null}], "bad": "many"})
    );
    // The model's order is kept.
    assert!(
        t.calls[0].1.starts_with(r#"{"s":"42","n":-1.5,"#),
        "{}",
        t.calls[0].1
    );
}

#[test]
fn two_calls_and_a_json_block() {
    let json_call = format!(
        "{}{}{}{}{}",
        open("call tool=\"add\" index=\"2\""),
        open("json type=\"object\""),
        r#"{"a": 1, "b": 2}"#,
        close("json"),
        close("call")
    );
    let text = format!(
        "{}{}",
        close("response"),
        tools(&[
            call("get_weather", 1, &[arg("city", "string", "Oslo")]),
            json_call
        ])
    );
    let t = parse(&text, false, true);
    assert_eq!(
        t.calls,
        vec![
            ("get_weather".into(), r#"{"city":"Oslo"}"#.into()),
            ("add".into(), r#"{"a":1,"b":2}"#.into()),
        ]
    );
    assert_eq!(t.content, "");
}

#[test]
fn escaped_attributes_and_raw_strings_with_quotes_and_braces() {
    let key = r#"we"ird & key"#;
    let value = r#"say "hi" {not json} & <b>"#;
    let text = format!(
        "{}{}",
        close("response"),
        tools(&[call("note", 1, &[arg(key, "string", value)])])
    );
    let t = parse(&text, false, true);
    let v: serde_json::Value = serde_json::from_str(&t.calls[0].1).unwrap();
    assert_eq!(v, serde_json::json!({ key: value }));
    assert_eq!(
        unescape(&escape(r#"&quot; " &amp; &"#)),
        r#"&quot; " &amp; &"#
    );
}

#[test]
fn a_cut_inside_the_think_channel_is_all_reasoning() {
    // Cut by max_tokens, even in the middle of a marker's text.
    let text = format!("still thinking {}", &CLOSE[..4]);
    let t = parse(&text, true, true);
    assert_eq!(t.reasoning, text);
    assert_eq!(t.content, "");
    // A call cut before its close is dropped, markup and all.
    let text = format!(
        "{}{}{}",
        close("response"),
        open("tools"),
        open("call tool=\"add\" index=\"1\"")
    );
    assert_eq!(parse(&text, false, true), Turn::default());
    // A tag cut short in a channel: its marker is dropped, its text kept.
    let text = format!("a{OPEN}b c");
    assert_eq!(parse(&text, true, true).reasoning, "ab c");
}

#[test]
fn calls_not_parsed_or_undeclared_are_dropped() {
    let text = format!(
        "A.{}{}",
        close("response"),
        tools(&[call("add", 1, &[arg("a", "number", "1")])])
    );
    let t = parse(&text, false, false);
    assert_eq!((t.content.as_str(), t.calls.len()), ("A.", 0));
    let text = format!(
        "{}{}",
        close("response"),
        tools(&[call("rm_rf", 1, &[]), call("add", 2, &[])])
    );
    assert_eq!(
        parse(&text, false, true).calls,
        vec![("add".into(), "{}".into())]
    );
}

#[test]
fn the_family_comes_from_the_tokenizer() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k3/tiny-hf");
    let tok = TextTokenizer::from_hf_dir(&dir).expect("tiny K3 tokenizer");
    let f = ChatFormat::detect(&tok);
    assert_eq!(
        f,
        ChatFormat::KimiK3(kimi_k3::K3Markers {
            open: 515,
            close: 516,
            sep: 517
        })
    );
    assert_eq!(f.shown_special_ids(), vec![515, 516, 517]);
    assert_eq!(f.call_id("add", 3, || unreachable!()), "functions.add:3");
    assert!(f.thinking(&serde_json::Map::new()));
    let off = serde_json::json!({"thinking": false});
    assert!(!f.thinking(off.as_object().unwrap()));
    assert_eq!(f.reasoning_knob(), Some("thinking_effort"));
    assert_eq!(ChatFormat::Hermes.reasoning_knob(), None);
    assert!(ChatFormat::Hermes.parser(TurnSetup::default()).is_none());
}

#[test]
fn the_forced_grammar_writes_k3_markup_after_thinking() {
    let m = kimi_k3::K3Markers {
        open: 515,
        close: 516,
        sep: 517,
    };
    let tools = vec![("add".to_owned(), serde_json::json!({"type": "object"}))];
    let on = m.forced_calls_lark(&tools, false, true);
    assert!(
        on.starts_with("start: THINK <[516]> \"think\" <[517]> <[515]> \"response\""),
        "{on}"
    );
    assert!(on.contains(r#""call tool=\"add\" index=\"" "1""#), "{on}");
    let off = m.forced_calls_lark(&tools, true, false);
    assert!(
        off.starts_with("start: <[516]> \"response\" <[517]> <[515]> \"tools\""),
        "{off}"
    );
    assert!(off.contains("calls: call+"), "{off}");
    // A plain object schema: typed argument tags, a raw bounded string.
    let plain = serde_json::json!({"type": "object", "required": ["a"],
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "integer"}}});
    let g = m.forced_calls_lark(&[("add".to_owned(), plain)], false, false);
    assert!(
        g.contains(r#""argument key=\"a\" type=\"string\"" <[517]> /(?s:.{0,5})/"#),
        "{g}"
    );
    assert!(
        g.contains(r#""argument key=\"b\" type=\"number\"" <[517]> %json {"type":"integer"}"#),
        "{g}"
    );
    assert!(g.contains("args_0: arg_0_0 (arg_0_1)?"), "{g}");
    // Anything else: one JSON block.
    assert!(
        on.contains(r#""json type=\"object\"" <[517]> %json {"type":"object"}"#),
        "{on}"
    );
}

/// The engine's decoder shows K3's markers whole, and no other control
/// token (`[EOT]`, reserved ids).
#[test]
fn the_decoder_shows_only_the_markers() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k3/tiny-hf");
    let tok = TextTokenizer::from_hf_dir(&dir).expect("tiny K3 tokenizer");
    let f = ChatFormat::detect(&tok);
    let mut ids = tok.encode("Hi é", false).unwrap();
    ids.extend([516, 521, 530]);
    ids.extend(tok.encode("think", false).unwrap());
    ids.push(517);
    let mut dec = crate::tokenizer::IncrementalDecoder::new(true).showing(f.shown_special_ids());
    let mut text = String::new();
    for &id in &ids {
        text.push_str(&dec.push(&tok, id).unwrap());
    }
    text.push_str(&dec.finish());
    assert_eq!(text, format!("Hi é{CLOSE}think{SEP}"));
}
