//! The `conversation` workload: C chats run side by side, each a growing
//! multi-turn conversation. A chat opens with a long system prompt and
//! then sends T short user turns one after another; every answer is
//! streamed (greedy by default) and appended to the history as an
//! assistant message before the next user turn, so each request's prompt
//! is the previous request's prompt plus its answer plus one new turn —
//! the case a server's prefix cache is for. Reported per turn: prompt
//! tokens (from the usage chunk), time to the first token (first content or
//! reasoning delta), total time and output tokens.
//!
//! The text is generated, deterministic English from a seeded generator:
//! the same seed gives every server the same prompts.

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;
use tokio::task::JoinSet;

use crate::client::{stream_request, RequestOptions, Target};
use crate::stats::Summary;
use crate::workload::{Entry, Input};

/// The shape of the conversations (what is sent, not how).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    pub conversations: usize,
    pub turns: usize,
    pub system_words: usize,
    pub turn_words: usize,
    pub seed: u64,
    /// Every conversation gets the same system prompt (conversation 0's).
    pub shared_system: bool,
    /// Replays each answer's reasoning as the assistant message's
    /// `reasoning_content` (by default only its content is kept, as most
    /// clients do).
    pub replay_reasoning: bool,
}

/// Plain, common English words; sentences are drawn from them.
const WORDS: &[&str] = &[
    "the",
    "a",
    "small",
    "large",
    "old",
    "new",
    "quiet",
    "busy",
    "bright",
    "dark",
    "river",
    "city",
    "garden",
    "market",
    "station",
    "library",
    "kitchen",
    "window",
    "road",
    "bridge",
    "mountain",
    "village",
    "harbor",
    "forest",
    "field",
    "morning",
    "evening",
    "winter",
    "summer",
    "teacher",
    "doctor",
    "farmer",
    "engineer",
    "writer",
    "child",
    "neighbor",
    "friend",
    "family",
    "team",
    "report",
    "letter",
    "story",
    "question",
    "answer",
    "plan",
    "problem",
    "reason",
    "result",
    "change",
    "system",
    "machine",
    "program",
    "number",
    "table",
    "chapter",
    "picture",
    "music",
    "weather",
    "journey",
    "history",
    "language",
    "water",
    "bread",
    "coffee",
    "paper",
    "walks",
    "reads",
    "writes",
    "builds",
    "carries",
    "opens",
    "closes",
    "finds",
    "keeps",
    "leaves",
    "brings",
    "explains",
    "describes",
    "remembers",
    "notices",
    "follows",
    "moves",
    "turns",
    "changes",
    "helps",
    "asks",
    "answers",
    "measures",
    "counts",
    "checks",
    "shows",
    "makes",
    "with",
    "without",
    "near",
    "under",
    "over",
    "across",
    "through",
    "before",
    "after",
    "during",
    "between",
    "behind",
    "beside",
    "toward",
    "from",
    "into",
    "about",
    "along",
    "and",
    "but",
    "because",
    "while",
    "when",
    "although",
    "so",
    "then",
    "every",
    "each",
    "some",
    "many",
    "few",
    "several",
    "careful",
    "simple",
    "slow",
    "quick",
    "warm",
    "cold",
    "green",
    "blue",
    "red",
    "early",
    "late",
    "long",
    "short",
    "clear",
    "heavy",
    "light",
    "strong",
    "gentle",
    "useful",
    "often",
    "rarely",
    "always",
    "never",
    "again",
    "almost",
    "together",
    "slowly",
    "quickly",
    "today",
    "tomorrow",
    "yesterday",
    "there",
    "here",
    "now",
    "once",
    "still",
];

/// SplitMix64: mixes a seed with a stream's indices into one seed.
fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut z = seed
        .wrapping_add(a.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(b.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Exactly `words` words of English-looking text from `seed`: sentences of
/// 6 to 14 words, capitalised, ending in a full stop — or, with
/// `question`, the last one in a question mark. Empty for 0 words.
pub fn text(seed: u64, words: usize, question: bool) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = String::new();
    let mut left_in_sentence = 0;
    for i in 0..words {
        let start = left_in_sentence == 0;
        if start {
            left_in_sentence = rng.random_range(6..=14).min(words - i);
            // Never leave a last sentence of one or two words.
            if words - i - left_in_sentence < 3 {
                left_in_sentence = words - i;
            }
        }
        let w = WORDS[rng.random_range(0..WORDS.len())];
        if !out.is_empty() {
            out.push(' ');
        }
        if start {
            let mut c = w.chars();
            out.extend(c.next().map(|f| f.to_ascii_uppercase()));
            out.push_str(c.as_str());
        } else {
            out.push_str(w);
        }
        left_in_sentence -= 1;
        if left_in_sentence == 0 {
            out.push(if question && i + 1 == words { '?' } else { '.' });
        }
    }
    out
}

impl Spec {
    /// Conversation `c`'s system prompt.
    pub fn system_prompt(&self, c: usize) -> String {
        let c = if self.shared_system { 0 } else { c };
        text(mix(self.seed, c as u64, 0), self.system_words, false)
    }

    /// Conversation `c`'s user turn `t` (1-based), a question.
    pub fn user_turn(&self, c: usize, t: usize) -> String {
        text(mix(self.seed, c as u64, t as u64), self.turn_words, true)
    }
}

/// What one turn measured. Times are seconds from sending its request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub conversation: usize,
    /// 1-based.
    pub turn: usize,
    pub prompt_tokens: Option<u64>,
    pub ttft_s: Option<f64>,
    pub total_s: Option<f64>,
    pub output_tokens: Option<u64>,
    /// Characters of the answer's content appended to the history.
    pub answer_chars: usize,
    /// Why the turn failed (or was skipped after an earlier failure).
    pub error: Option<String>,
}

/// One turn's figures over every conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnSummary {
    pub turn: usize,
    pub completed: usize,
    pub failed: usize,
    pub prompt_tokens_mean: Option<f64>,
    pub output_tokens_mean: Option<f64>,
    pub ttft: Summary,
    pub total: Summary,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Aggregates the records turn by turn (turns 1..=`turns`); a failed turn
/// counts in `failed` and in no figure.
pub fn per_turn(records: &[TurnRecord], turns: usize) -> Vec<TurnSummary> {
    (1..=turns)
        .map(|turn| {
            let of: Vec<&TurnRecord> = records.iter().filter(|r| r.turn == turn).collect();
            let ok: Vec<&TurnRecord> = of.iter().copied().filter(|r| r.error.is_none()).collect();
            let collect = |f: fn(&TurnRecord) -> Option<f64>| -> Vec<f64> {
                ok.iter().filter_map(|r| f(r)).collect()
            };
            TurnSummary {
                turn,
                completed: ok.len(),
                failed: of.len() - ok.len(),
                prompt_tokens_mean: mean(&collect(|r| r.prompt_tokens.map(|n| n as f64))),
                output_tokens_mean: mean(&collect(|r| r.output_tokens.map(|n| n as f64))),
                ttft: Summary::of(&collect(|r| r.ttft_s)),
                total: Summary::of(&collect(|r| r.total_s)),
            }
        })
        .collect()
}

/// The JSON results file of one conversation run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConversationResults {
    pub label: String,
    pub url: String,
    pub model: String,
    pub spec: Spec,
    pub max_tokens: u32,
    pub temperature: f64,
    pub ignore_eos: bool,
    pub chat_template_kwargs: Option<Value>,
    /// Wall time from the first request to the end of the last.
    pub duration_s: f64,
    pub per_turn: Vec<TurnSummary>,
    /// Every turn of every conversation, in (conversation, turn) order.
    pub records: Vec<TurnRecord>,
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.0}", s * 1000.0))
}

fn num(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.0}"))
}

const HEADER: [&str; 9] = [
    "turn",
    "ok",
    "failed",
    "prompt tok",
    "TTFT mean ms",
    "TTFT p50/max ms",
    "total mean ms",
    "total p50/max ms",
    "out tok",
];

/// An aligned plain-text table, one row per turn.
pub fn text_table(r: &ConversationResults) -> String {
    let rows: Vec<Vec<String>> = r
        .per_turn
        .iter()
        .map(|t| {
            vec![
                t.turn.to_string(),
                t.completed.to_string(),
                t.failed.to_string(),
                num(t.prompt_tokens_mean),
                ms(t.ttft.mean),
                format!("{} / {}", ms(t.ttft.p50), ms(t.ttft.max)),
                ms(t.total.mean),
                format!("{} / {}", ms(t.total.p50), ms(t.total.max)),
                num(t.output_tokens_mean),
            ]
        })
        .collect();
    crate::report::aligned(&HEADER, &rows)
}

/// Runs conversation `c` turn by turn; after a failed turn the rest are
/// recorded as skipped.
async fn one_conversation(
    target: Arc<Target>,
    options: Arc<RequestOptions>,
    spec: Arc<Spec>,
    c: usize,
) -> Vec<TurnRecord> {
    let mut history: Vec<Value> = Vec::new();
    if spec.system_words > 0 {
        history.push(json!({"role": "system", "content": spec.system_prompt(c)}));
    }
    let mut out = Vec::new();
    let mut failed_at = None;
    for turn in 1..=spec.turns {
        let mut rec = TurnRecord {
            conversation: c,
            turn,
            ..TurnRecord::default()
        };
        if let Some(k) = failed_at {
            rec.error = Some(format!("skipped: turn {k} failed"));
            out.push(rec);
            continue;
        }
        history.push(json!({"role": "user", "content": spec.user_turn(c, turn)}));
        let entry = Entry {
            input: Input::Messages(history.clone()),
            max_tokens: None,
        };
        match stream_request(&target, &entry, &options).await {
            Ok(t) => {
                rec.prompt_tokens = t.prompt_tokens;
                rec.ttft_s = t.ttft();
                rec.total_s = Some(t.end);
                rec.output_tokens = Some(t.output_tokens);
                rec.answer_chars = t.content.len();
                let mut msg = json!({"role": "assistant", "content": t.content});
                if spec.replay_reasoning && !t.reasoning.is_empty() {
                    msg["reasoning_content"] = json!(t.reasoning);
                }
                history.push(msg);
            }
            Err(f) => {
                rec.error = Some(f.to_string());
                failed_at = Some(turn);
            }
        }
        out.push(rec);
    }
    out
}

/// Runs every conversation at once; returns the records in (conversation,
/// turn) order and the wall time.
pub async fn run(
    target: Arc<Target>,
    options: Arc<RequestOptions>,
    spec: Arc<Spec>,
) -> (Vec<TurnRecord>, f64) {
    let start = Instant::now();
    let mut set = JoinSet::new();
    for c in 0..spec.conversations {
        set.spawn(one_conversation(
            target.clone(),
            options.clone(),
            spec.clone(),
            c,
        ));
    }
    let mut records = Vec::new();
    while let Some(r) = set.join_next().await {
        records.extend(r.expect("conversation tasks do not panic"));
    }
    records.sort_by_key(|r| (r.conversation, r.turn));
    (records, start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        Spec {
            conversations: 3,
            turns: 4,
            system_words: 600,
            turn_words: 30,
            seed: 7,
            shared_system: false,
            replay_reasoning: false,
        }
    }

    #[test]
    fn generated_text_has_the_asked_words_and_is_seeded() {
        for n in [0, 1, 2, 3, 7, 15, 16, 30, 600] {
            let t = text(11, n, false);
            assert_eq!(t.split_whitespace().count(), n, "{n}: {t}");
        }
        assert_eq!(text(11, 50, false), text(11, 50, false));
        assert_ne!(text(11, 50, false), text(12, 50, false));
        let t = text(3, 600, false);
        assert!(t.ends_with('.') && t.starts_with(|c: char| c.is_ascii_uppercase()));
        // Sentences: every one capitalised, at least 3 words (the last may
        // be up to 14 + 2).
        let sentences: Vec<&str> = t.split_terminator('.').map(str::trim).collect();
        assert!(sentences.len() >= 600 / 16, "{}", sentences.len());
        for s in &sentences {
            let n = s.split_whitespace().count();
            assert!((3..=16).contains(&n), "{n} words: {s}");
            assert!(s.starts_with(|c: char| c.is_ascii_uppercase()), "{s}");
        }
        let q = text(3, 30, true);
        assert!(q.ends_with('?') && q.matches('?').count() == 1, "{q}");
        assert!(q.is_ascii());
    }

    #[test]
    fn prompts_differ_per_conversation_unless_shared() {
        let s = spec();
        assert_eq!(s.system_prompt(1).split_whitespace().count(), 600);
        assert_ne!(s.system_prompt(0), s.system_prompt(1));
        assert_eq!(s.system_prompt(2), spec().system_prompt(2));
        assert_eq!(s.user_turn(1, 2).split_whitespace().count(), 30);
        assert_ne!(s.user_turn(1, 2), s.user_turn(1, 3));
        assert_ne!(s.user_turn(1, 2), s.user_turn(2, 2));
        assert_ne!(s.user_turn(0, 1), s.system_prompt(0));
        let shared = Spec {
            shared_system: true,
            ..spec()
        };
        assert_eq!(shared.system_prompt(0), shared.system_prompt(2));
        assert_eq!(shared.system_prompt(0), s.system_prompt(0));
        // The user turns stay per conversation.
        assert_ne!(shared.user_turn(0, 1), shared.user_turn(2, 1));
        let other_seed = Spec { seed: 8, ..spec() };
        assert_ne!(other_seed.system_prompt(0), s.system_prompt(0));
    }

    fn ok(c: usize, turn: usize, prompt: u64, ttft: f64, total: f64, out: u64) -> TurnRecord {
        TurnRecord {
            conversation: c,
            turn,
            prompt_tokens: Some(prompt),
            ttft_s: Some(ttft),
            total_s: Some(total),
            output_tokens: Some(out),
            answer_chars: 10,
            error: None,
        }
    }

    #[test]
    fn per_turn_aggregation() {
        let failed = |c, turn, e: &str| TurnRecord {
            conversation: c,
            turn,
            error: Some(e.into()),
            ..TurnRecord::default()
        };
        let records = vec![
            ok(0, 1, 1000, 0.5, 1.5, 64),
            ok(0, 2, 1100, 0.1, 1.1, 60),
            ok(1, 1, 1010, 0.7, 1.7, 64),
            failed(1, 2, "http 500: boom"),
            ok(2, 1, 1020, 0.9, 1.9, 62),
            ok(2, 2, 1130, 0.3, 1.3, 64),
        ];
        let s = per_turn(&records, 3);
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].turn, s[0].completed, s[0].failed), (1, 3, 0));
        assert_eq!(s[0].prompt_tokens_mean, Some(1010.0));
        assert!((s[0].ttft.mean.unwrap() - 0.7).abs() < 1e-12);
        assert_eq!((s[0].ttft.p50, s[0].ttft.max), (Some(0.7), Some(0.9)));
        assert!((s[0].total.mean.unwrap() - 1.7).abs() < 1e-12);
        assert!((s[0].output_tokens_mean.unwrap() - 190.0 / 3.0).abs() < 1e-12);
        // Turn 2: the failure counts, but in no figure.
        assert_eq!((s[1].completed, s[1].failed), (2, 1));
        assert_eq!(s[1].prompt_tokens_mean, Some(1115.0));
        assert!((s[1].ttft.mean.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(s[1].ttft.count, 2);
        // Turn 3 ran nowhere.
        assert_eq!((s[2].completed, s[2].failed), (0, 0));
        assert_eq!(
            (s[2].prompt_tokens_mean, s[2].ttft),
            (None, Summary::default())
        );

        let res = ConversationResults {
            label: "x".into(),
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            spec: spec(),
            max_tokens: 64,
            temperature: 0.0,
            ignore_eos: false,
            chat_template_kwargs: None,
            duration_s: 3.0,
            per_turn: s,
            records,
        };
        let t = text_table(&res);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].starts_with("turn") && lines[0].contains("TTFT mean ms"));
        // turn 1: 3 ok, 0 failed, 1010 prompt tokens, TTFT mean 700 ms, p50 700 / max 900.
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(&cells[..5], ["1", "3", "0", "1010", "700"], "{t}");
        assert!(lines[1].contains("700 / 900"), "{t}");
        assert!(
            lines[3].starts_with("3 ") && lines[3].contains("- / -"),
            "{t}"
        );
        // The results file reads back (its computed figures to the last
        // bit or so: serde_json's parser is not exact on 17 digits).
        let back: ConversationResults =
            serde_json::from_str(&serde_json::to_string(&res).unwrap()).unwrap();
        assert_eq!((&back.spec, &back.records), (&res.spec, &res.records));
        assert_eq!(back.per_turn.len(), 3);
        assert!((back.per_turn[0].total.p90.unwrap() - 1.86).abs() < 1e-12);
    }
}
