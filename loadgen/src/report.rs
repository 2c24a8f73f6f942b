//! What a run reports: the per-run figures (counts, failures by reason,
//! rates, latency percentiles, the server's speculative counters), the JSON
//! results file that holds them, and the table (plain text for a terminal,
//! Markdown for BENCHMARKS.md) made from one or more results files.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::load::{Outcome, Shape};
use crate::scrape::ServerDelta;
use crate::stats::{rate, Summary};

/// Failures of one class, with one message as an example.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureCount {
    pub count: usize,
    pub example: String,
}

/// Every figure of one run. Latencies are in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub shape: Shape,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub failures: BTreeMap<String, FailureCount>,
    /// Wall time from the first send to the end of the last request.
    pub duration_s: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_throughput: f64,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    /// True when every completed request's token count came from the
    /// server's usage chunk (else text events were counted).
    pub exact_token_counts: bool,
    /// Time to first token.
    pub ttft: Summary,
    /// Gaps between consecutive streamed text events.
    pub itl: Summary,
    /// Per request: (end - first token) / (output tokens - 1).
    pub tpot: Summary,
    /// End-to-end request latency.
    pub e2e: Summary,
    /// The server's counters over the run; empty when it has no /metrics.
    pub server: ServerDelta,
}

impl RunReport {
    pub fn new(shape: Shape, o: &Outcome, server: ServerDelta) -> RunReport {
        let mut failures: BTreeMap<String, FailureCount> = BTreeMap::new();
        let (mut ttft, mut itl, mut tpot, mut e2e) = (vec![], vec![], vec![], vec![]);
        let (mut out, mut prompt, mut exact, mut completed) = (0, 0, true, 0);
        for r in &o.records {
            match &r.result {
                Ok(t) => {
                    completed += 1;
                    out += t.output_tokens;
                    prompt += t.prompt_tokens.unwrap_or(0);
                    exact &= t.exact_tokens;
                    ttft.extend(t.ttft());
                    tpot.extend(t.tpot());
                    itl.extend(t.gaps());
                    e2e.push(t.end);
                }
                Err(f) => {
                    failures
                        .entry(f.class.clone())
                        .or_insert_with(|| FailureCount {
                            count: 0,
                            example: f.message.clone(),
                        })
                        .count += 1;
                }
            }
        }
        RunReport {
            shape,
            requests: o.records.len(),
            completed,
            failed: o.records.len() - completed,
            failures,
            duration_s: o.elapsed,
            request_throughput: rate(completed as f64, o.elapsed),
            output_throughput: rate(out as f64, o.elapsed),
            output_tokens: out,
            prompt_tokens: prompt,
            exact_token_counts: exact,
            ttft: Summary::of(&ttft),
            itl: Summary::of(&itl),
            tpot: Summary::of(&tpot),
            e2e: Summary::of(&e2e),
            server,
        }
    }
}

/// The uncounted warm-up before the sweep.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Warmup {
    pub requests: usize,
    pub completed: usize,
    pub output_tokens: u64,
}

/// One results file: a labelled configuration and its sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// Names the configuration in tables and chart legends.
    pub label: String,
    pub base_url: String,
    pub model: String,
    pub workload: String,
    pub temperature: f64,
    pub max_tokens: Option<u32>,
    pub ignore_eos: bool,
    pub warmup: Warmup,
    pub runs: Vec<RunReport>,
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.0}", s * 1000.0))
}

fn trio(s: &Summary, f: fn(Option<f64>) -> String) -> String {
    format!("{} / {} / {}", f(s.p50), f(s.p90), f(s.p99))
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{s:.2}"))
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or("-".into(), f)
}

const HEADER: [&str; 12] = [
    "config",
    "load",
    "ok",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50/p90/p99 ms",
    "ITL p50/p90/p99 ms",
    "TPOT p50 ms",
    "E2E p50/p90/p99 s",
    "accept",
    "acc. len",
];

fn row(label: &str, r: &RunReport) -> Vec<String> {
    let load = match r.shape {
        Shape::Concurrency(c) => format!("c={c}"),
        Shape::Rate(x) => format!("{x} req/s"),
    };
    let failed = if r.failures.is_empty() {
        "0".to_string()
    } else {
        let why: Vec<String> = r
            .failures
            .iter()
            .map(|(k, v)| format!("{k}: {}", v.count))
            .collect();
        format!("{} ({})", r.failed, why.join(", "))
    };
    vec![
        label.to_string(),
        load,
        r.completed.to_string(),
        failed,
        format!("{:.2}", r.request_throughput),
        format!("{:.1}", r.output_throughput),
        trio(&r.ttft, ms),
        trio(&r.itl, ms),
        ms(r.tpot.p50),
        trio(&r.e2e, secs),
        opt(r.server.acceptance_rate, |a| format!("{:.0}%", a * 100.0)),
        opt(r.server.mean_accepted_length, |l| format!("{l:.2}")),
    ]
}

fn rows(all: &[Results]) -> Vec<Vec<String>> {
    all.iter()
        .flat_map(|res| res.runs.iter().map(|r| row(&res.label, r)))
        .collect()
}

/// An aligned plain-text table of every run of every file.
pub fn text_table(all: &[Results]) -> String {
    aligned(&HEADER, &rows(all))
}

/// `header` and `rows` as a plain-text table, each column as wide as its
/// widest cell, two spaces apart.
pub fn aligned(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let padded: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        padded.join("  ").trim_end().to_string() + "\n"
    };
    let mut s = line(header.to_vec());
    for r in rows {
        s += &line(r.iter().map(String::as_str).collect());
    }
    s
}

/// The same table in Markdown.
pub fn markdown_table(all: &[Results]) -> String {
    let mut s = format!("| {} |\n", HEADER.join(" | "));
    s += &format!("|{}\n", "---|".repeat(HEADER.len()));
    for r in rows(all) {
        s += &format!("| {} |\n", r.join(" | "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Failure, Timing};
    use crate::load::Record;

    fn ok(end: f64, chunks: Vec<f64>, tokens: u64) -> Record {
        Record {
            sent: 0.0,
            result: Ok(Timing {
                chunks,
                end,
                output_tokens: tokens,
                prompt_tokens: Some(10),
                exact_tokens: true,
                ..Timing::default()
            }),
        }
    }

    #[test]
    fn a_run_of_known_timings() {
        let fail = |class: &str| Record {
            sent: 0.0,
            result: Err(Failure {
                class: class.into(),
                message: "m".into(),
            }),
        };
        let o = Outcome {
            records: vec![
                ok(1.0, vec![0.2, 0.6, 1.0], 5),
                ok(2.0, vec![0.4, 1.2, 2.0], 9),
                fail("http 429"),
                fail("http 429"),
                fail("timeout"),
            ],
            elapsed: 4.0,
        };
        let r = RunReport::new(Shape::Concurrency(2), &o, ServerDelta::default());
        assert_eq!((r.requests, r.completed, r.failed), (5, 2, 3));
        assert_eq!(r.failures["http 429"].count, 2);
        assert_eq!(r.failures["timeout"].count, 1);
        assert_eq!(r.request_throughput, 0.5);
        assert_eq!(r.output_throughput, 14.0 / 4.0);
        assert_eq!((r.output_tokens, r.prompt_tokens), (14, 20));
        assert!((r.ttft.p50.unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(r.e2e.mean, Some(1.5));
        // TPOT: (1.0 - 0.2) / 4 = 0.2 and (2.0 - 0.4) / 8 = 0.2.
        assert!((r.tpot.p99.unwrap() - 0.2).abs() < 1e-12);
        // Gaps 0.4, 0.4, 0.8, 0.8.
        assert_eq!(r.itl.count, 4);
        assert!((r.itl.p50.unwrap() - 0.6).abs() < 1e-12);
        let res = Results {
            label: "x".into(),
            base_url: "u".into(),
            model: "m".into(),
            workload: "w".into(),
            temperature: 0.0,
            max_tokens: None,
            ignore_eos: false,
            warmup: Warmup::default(),
            runs: vec![r],
        };
        let t = text_table(std::slice::from_ref(&res));
        assert!(
            t.contains("c=2") && t.contains("3 (http 429: 2, timeout: 1)"),
            "{t}"
        );
        let m = markdown_table(&[res]);
        assert_eq!(m.lines().count(), 3);
        assert!(m.lines().all(|l| l.starts_with('|') && l.ends_with('|')));
    }
}
