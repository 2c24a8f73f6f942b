//! Unit tests for the tiktoken reader, the merge derivation (against an in-test copy of
//! tiktoken's encoding algorithm on generated vocabularies) and Kimi's split regex.

use super::*;
use crate::tokenizer::testing::strings;
use crate::tokenizer::{GgufMetadata, TextTokenizer};
use candle_core::quantized::gguf_file::Value as V;
use std::path::PathBuf;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

fn b64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.len();
        let v = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= n {
                out.push(char::from(A[((v >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn base64_decodes_standard_and_rejects_garbage() {
    for bytes in [
        &b""[..],
        b"a",
        b"ab",
        b"abc",
        b"abcd",
        b"\xff\x00\xfe\x80 x",
    ] {
        assert_eq!(decode_base64(b64(bytes).as_bytes()).unwrap(), bytes);
    }
    assert_eq!(decode_base64(b"IQ==").unwrap(), b"!");
    assert_eq!(decode_base64(b"IQ").unwrap(), b"!");
    for bad in [&b"I"[..], b"I$==", b"IR==", b"IQ=", b"A==="] {
        assert!(
            decode_base64(bad).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn parse_reads_ranks_in_any_line_order() {
    let text = format!("{} 1\r\n\n{} 0\n{} 2\n", b64(b"b"), b64(b"a"), b64(b"ab"));
    let tokens = parse_tiktoken(text.as_bytes(), Path::new("t.model")).unwrap();
    assert_eq!(tokens, [b"a".to_vec(), b"b".to_vec(), b"ab".to_vec()]);
}

#[test]
fn malformed_lines_name_the_file_and_line() {
    let good = format!("{} 0\n{} 1\n", b64(b"a"), b64(b"b"));
    let cases: [(String, usize, &str); 8] = [
        (format!("{good}{}\n", b64(b"c")), 3, "fields"),
        (format!("{good}{} 2 9\n", b64(b"c")), 3, "fields"),
        (format!("{good}@@@@ 2\n"), 3, "base64"),
        (format!("{good}{} two\n", b64(b"c")), 3, "rank"),
        (format!("{good}{} 7\n", b64(b"c")), 3, "rank 7"),
        (format!("{good}\n{} 1\n", b64(b"c")), 4, "twice"),
        (format!("{good}{} 2\n", b64(b"a")), 3, "line 1"),
        ("\n \n".to_owned(), 0, "no tokens"),
    ];
    let path = Path::new("/models/kimi/tiktoken.model");
    for (text, line, needle) in cases {
        let err = parse_tiktoken(text.as_bytes(), path).unwrap_err();
        let msg = err.to_string();
        match err {
            TokenizerError::Tiktoken {
                path: p, line: l, ..
            } => {
                assert_eq!((p.as_path(), l), (path, line), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        assert!(
            msg.contains("/models/kimi/tiktoken.model") && msg.contains(needle),
            "{msg}"
        );
        assert!(msg.contains(&format!(":{line}:")), "{msg}");
    }
}

/// A deterministic pseudo-random generator (xorshift), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A BPE-trained vocabulary: all 256 bytes (in a shuffled rank order), then `merges`
/// rounds of "join the most frequent adjacent pair" over pieces of `corpus` split with
/// [`KIMI_PATTERN`], the new token taking the next rank (how tiktoken files are made).
fn trained_vocab(corpus: &str, merges: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed);
    let mut bytes: Vec<u8> = (0..=255).collect();
    for i in (1..bytes.len()).rev() {
        bytes.swap(i, rng.below(i + 1));
    }
    let mut tokens: Vec<Vec<u8>> = bytes.iter().map(|&b| vec![b]).collect();
    let mut words: Vec<Vec<Vec<u8>>> = split(corpus)
        .iter()
        .map(|p| p.bytes().map(|b| vec![b]).collect())
        .collect();
    for _ in 0..merges {
        let mut counts: HashMap<(Vec<u8>, Vec<u8>), usize> = HashMap::new();
        for w in &words {
            for pair in w.windows(2) {
                *counts
                    .entry((pair[0].clone(), pair[1].clone()))
                    .or_default() += 1;
            }
        }
        let Some(((a, b), _)) = counts
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then_with(|| y.0.cmp(&x.0)))
        else {
            break;
        };
        let joined = [a.clone(), b.clone()].concat();
        if !tokens.contains(&joined) {
            tokens.push(joined.clone());
        }
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = joined.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    tokens
}

/// The pieces of `text` under [`KIMI_PATTERN`] (the regex alone, as tiktoken splits).
fn split(text: &str) -> Vec<String> {
    let re = Split::new(
        SplitPattern::Regex(KIMI_PATTERN.into()),
        tokenizers::SplitDelimiterBehavior::Isolated,
        false,
    )
    .unwrap();
    let mut pre = PreTokenizedString::from(text);
    re.pre_tokenize(&mut pre).unwrap();
    pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_owned())
        .collect()
}

/// tiktoken's `CoreBPE::encode_ordinary`, transcribed: each piece is its rank when it is
/// a whole token, else its byte-pair merge with all ranks.
fn tiktoken_encode(tokens: &[Vec<u8>], text: &str) -> Vec<u32> {
    let ranks: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r as u32))
        .collect();
    let mut out = Vec::new();
    for piece in split(text) {
        let piece = piece.as_bytes();
        match ranks.get(piece) {
            Some(&r) => out.push(r),
            None => out.extend(
                bpe_parts(&ranks, piece, u32::MAX)
                    .into_iter()
                    .map(|p| ranks[p]),
            ),
        }
    }
    out
}

const CORPUS: &str = "The quick brown fox jumps over the lazy dog. Don't stop; we'll see! \
    Tokenizers tokenize tokens: 12345 67890 3.14159 -- 'quoted' \"double\"\n\n\tindented \
    CamelCaseWords and snake_case_words HELLO World. 你好世界，这是一个测试。中文分词很有趣。\
    日本語のテキストとカタカナ。Привет, мир! Ελληνικά γράμματα. emoji 🎉🎉 ñandú café\r\n";

const TEXTS: &[&str] = &[
    "",
    "Hello world",
    "the lazy dogs jumped over foxes",
    "Don't you're WE'LL I'M they've",
    "CamelCaseWordsHERE andMixedCASE",
    "你好世界，这是一个测试。",
    "mixed漢字ABC漢字abc",
    "日本語のテキスト and 中文混合English",
    "x = 12345 + 3.14159;\n\n\tfoo()",
    "  leading spaces\n\n\ntrailing   ",
    "emoji 🎉 test ñandú café",
    "Привет мир! Ελληνικά",
    "a\r\nb\r\n\r\nc",
    "1234567890",
    "tokenizerstokenizetokens",
];

/// A tokenizer built from `tokens` the way a Kimi directory is.
fn kimi_tokenizer(tokens: &[Vec<u8>]) -> Tokenizer {
    let (list, types) = kimi_token_list(tokens, &HashMap::new(), tokens.len() as u32 + 258);
    let refs: Vec<&str> = list.iter().map(String::as_str).collect();
    build_byte_level(&refs, &types, derive_merges(tokens), &[KIMI_PATTERN], true)
        .unwrap()
        .0
}

#[test]
fn derived_merges_reproduce_tiktoken_on_trained_vocabularies() {
    for (seed, merges) in [(1u64, 150), (7, 400), (99, 900)] {
        let tokens = trained_vocab(CORPUS, merges, seed);
        let tok = kimi_tokenizer(&tokens);
        let mut rng = Rng(seed);
        let corpus: Vec<char> = CORPUS.chars().collect();
        // Fixed texts plus random windows of the corpus and of shuffled corpus words.
        let mut texts: Vec<String> = TEXTS.iter().map(|s| s.to_string()).collect();
        for _ in 0..200 {
            let start = rng.below(corpus.len());
            let len = rng.below(40);
            texts.push(
                corpus[start..(start + len).min(corpus.len())]
                    .iter()
                    .collect(),
            );
        }
        for text in &texts {
            let want = tiktoken_encode(&tokens, text);
            let got = tok.encode_fast(text.as_str(), false).unwrap();
            assert_eq!(got.get_ids(), want, "seed {seed}, {text:?}");
        }
    }
}

#[test]
fn a_whole_piece_in_the_vocabulary_is_one_token_even_without_a_merge_path() {
    // "abc" has no two-byte sub-token, so no merge makes it: only tiktoken's whole-piece
    // lookup (BPE `ignore_merges`) finds it, in a directory and in a GGUF alike.
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    tokens.push(b"abc".to_vec());
    tokens.push(b"xy".to_vec());
    assert_eq!(derive_merges(&tokens), [("x".to_owned(), "y".to_owned())]);
    let dir = kimi_dir("wholepiece", &tokens, &[]);
    let d = TextTokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let g =
        TextTokenizer::from_gguf_metadata(&gguf_metadata(&tokens, &HashMap::new(), 514)).unwrap();
    for tok in [&d, &g] {
        for text in ["abc", "abc abc", "xabc", "ab", "xyabc"] {
            let want = tiktoken_encode(&tokens, text);
            assert_eq!(tok.encode(text, false).unwrap(), want, "{text}");
        }
    }
    assert_eq!(tiktoken_encode(&tokens, "abc"), [256]);
    assert_eq!(tiktoken_encode(&tokens, "xabc").len(), 4);
}

/// The GGUF metadata llama.cpp's converter writes for a tiktoken vocabulary.
fn gguf_metadata(tokens: &[Vec<u8>], names: &HashMap<u32, String>, total: u32) -> GgufMetadata {
    let (list, types) = kimi_token_list(tokens, names, total);
    let merges: Vec<String> = derive_merges(tokens)
        .into_iter()
        .map(|(a, b)| format!("{a} {b}"))
        .collect();
    let mut md = GgufMetadata::new();
    md.insert("tokenizer.ggml.model".into(), V::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), V::String("kimi-k2".into()));
    md.insert("tokenizer.ggml.tokens".into(), strings(&list));
    md.insert(
        "tokenizer.ggml.token_type".into(),
        V::Array(types.iter().map(|&t| V::I32(t as i32)).collect()),
    );
    md.insert("tokenizer.ggml.merges".into(), strings(&merges));
    md
}

#[test]
fn kimi_pattern_splits_han_runs_kana_case_and_digits() {
    let cases: &[(&str, &[&str])] = &[
        (
            "mixed漢字ABC漢字abc",
            &["mixed", "漢字", "ABC", "漢字", "abc"],
        ),
        ("日本語のテキスト", &["日本語", "のテキスト"]),
        ("你好，世界。", &["你好", "，", "世界", "。"]),
        ("CamelCaseWORDSmore", &["Camel", "Case", "WORDSmore"]),
        ("Don't YOU'RE", &["Don't", " YOU'RE"]),
        ("12345", &["123", "45"]),
        ("a  b\n\n c", &["a", " ", " b", "\n\n", " c"]),
        ("x = (y);\n", &["x", " =", " (", "y", ");\n"]),
        ("中文English", &["中文", "English"]),
    ];
    for (text, want) in cases {
        assert_eq!(split(text), *want, "{text:?}");
    }
}

#[test]
fn model_config_reads_text_config_first() {
    let c = parse_model_config(
        r#"{"model_type": "kimi_k3", "vocab_size": 5, "eos_token_id": 1,
            "text_config": {"vocab_size": 9, "eos_token_id": [7, 8]}}"#,
    )
    .unwrap();
    assert_eq!((c.vocab_size, c.eos_token_ids), (Some(9), vec![7, 8]));
    let c =
        parse_model_config(r#"{"vocab_size": 5, "eos_token_id": 1, "text_config": {}}"#).unwrap();
    assert_eq!((c.vocab_size, c.eos_token_ids), (Some(5), vec![1]));
    assert!(parse_model_config(r#"{"vocab_size": "x"}"#).is_err());
    assert!(parse_model_config("[]").is_err());
}

/// A Kimi-style directory for `tokens` with the given extra files.
fn kimi_dir(name: &str, tokens: &[Vec<u8>], files: &[(&str, String)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specgate-kimi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = String::new();
    for (r, t) in tokens.iter().enumerate() {
        text.push_str(&format!("{} {r}\n", b64(t)));
    }
    std::fs::write(dir.join(TIKTOKEN_MODEL), text).unwrap();
    for (file, body) in files {
        std::fs::write(dir.join(file), body).unwrap();
    }
    dir
}

#[test]
fn directory_and_gguf_metadata_build_the_same_tokenizer() {
    let tokens = trained_vocab(CORPUS, 300, 3);
    let n = tokens.len() as u32;
    let total = n + 258 + 6;
    let config = serde_json::json!({
        "added_tokens_decoder": {
            n.to_string(): {"content": "[BOS]", "special": true},
            (n + 1).to_string(): {"content": "[EOS]", "special": true},
            (n + 13).to_string(): {"content": "<|end_of_msg|>", "special": true},
            (n + 20).to_string(): {"content": "<|open|>", "special": true},
            "3": {"content": "ignored: not a special slot", "special": true},
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|open|>{{ m.content }}<|end_of_msg|>{% endfor %}",
    });
    let model = serde_json::json!({"model_type": "kimi_k3",
        "text_config": {"vocab_size": total, "eos_token_id": n + 13}});
    let dir = kimi_dir(
        "same",
        &tokens,
        &[
            ("tokenizer_config.json", config.to_string()),
            (MODEL_CONFIG, model.to_string()),
        ],
    );
    let d = TextTokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(d.vocab_size(), total as usize);
    assert_eq!(d.token_to_id("[BOS]"), Some(n));
    assert_eq!(d.token_to_id("<|open|>"), Some(n + 20));
    assert_eq!(
        d.token_to_id(&format!("<|reserved_token_{}|>", n + 2)),
        Some(n + 2)
    );
    assert_eq!(d.token_to_id(&format!("[PAD{}]", n + 258)), Some(n + 258));
    assert!(d.is_unused(n + 258) && !d.is_unused(n + 257) && !d.is_unused(0));
    assert_eq!(d.bos_token_id(), Some(n));
    assert!(!d.add_bos_token());
    assert_eq!(d.eos_token_id(), Some(n + 13));
    assert!(d.is_eos(n + 1) && d.is_eos(n + 13));

    // The GGUF llama.cpp's converter writes for the same vocabulary.
    let names: HashMap<u32, String> = [
        (n, "[BOS]"),
        (n + 1, "[EOS]"),
        (n + 13, "<|end_of_msg|>"),
        (n + 20, "<|open|>"),
    ]
    .into_iter()
    .map(|(i, s)| (i, s.to_owned()))
    .collect();
    let mut md = gguf_metadata(&tokens, &names, total);
    md.insert("tokenizer.ggml.bos_token_id".into(), V::U32(n));
    md.insert("tokenizer.ggml.eos_token_id".into(), V::U32(n + 13));
    let g = TextTokenizer::from_gguf_metadata(&md).unwrap();
    assert_eq!(g.vocab_size(), d.vocab_size());
    assert!(g.is_eos(n + 1) && g.is_eos(n + 13));
    for text in TEXTS
        .iter()
        .copied()
        .chain(["[BOS]x<|open|>y<|end_of_msg|>"])
    {
        let ids = d.encode(text, false).unwrap();
        assert_eq!(g.encode(text, false).unwrap(), ids, "{text:?}");
        assert_eq!(d.decode(&ids, false).unwrap(), text);
        if !text.contains('[') {
            assert_eq!(ids, tiktoken_encode(&tokens, text), "{text:?}");
        }
    }
    let ids = d.encode("[BOS]x<|open|>y", false).unwrap();
    assert_eq!((ids[0], ids[2]), (n, n + 20));
    assert_eq!(d.decode(&ids, true).unwrap(), "xy");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_directory_names_the_file() {
    let tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let dir = kimi_dir(
        "badline",
        &tokens,
        &[(MODEL_CONFIG, r#"{"vocab_size": 600}"#.to_owned())],
    );
    let path = dir.join(TIKTOKEN_MODEL);
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("not-base64! 256\n");
    std::fs::write(&path, text).unwrap();
    let err = TextTokenizer::from_hf_dir(&dir).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Tiktoken { line: 257, path: p, .. } if *p == path),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    let dir = kimi_dir(
        "smallvocab",
        &tokens,
        &[(MODEL_CONFIG, r#"{"vocab_size": 100}"#.to_owned())],
    );
    let err = TextTokenizer::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(err.contains(MODEL_CONFIG) && err.contains("100"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
