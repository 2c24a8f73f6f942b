//! The server's own counters, read from its Prometheus /metrics before and
//! after a run: speculative decoding (drafts, drafted and accepted tokens)
//! and the request and generated-token counts. specgate's names come first
//! (src/metrics.rs); vLLM's `vllm:` and llama.cpp's `llamacpp:` names (its
//! llama-server with `--metrics`) are read when ours are absent. A server
//! with none just yields no figures.

use serde::{Deserialize, Serialize};

/// Names of one counter under each server's convention.
const DRAFTS: [&str; 3] = [
    "specgate_spec_decode_num_drafts_total",
    "vllm:spec_decode_num_drafts_total",
    "llamacpp:spec_decode_num_drafts_total",
];
const DRAFT_TOKENS: [&str; 3] = [
    "specgate_spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_draft_tokens_total",
];
const ACCEPTED: [&str; 3] = [
    "specgate_spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total",
];
const SUCCESS: [&str; 2] = [
    "specgate_request_success_total",
    "vllm:request_success_total",
];
const GENERATED: [&str; 3] = [
    "specgate_generation_tokens_total",
    "vllm:generation_tokens_total",
    "llamacpp:tokens_predicted_total",
];

/// Counter values at one moment; `None` where the server has no such metric.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub drafts: Option<f64>,
    pub draft_tokens: Option<f64>,
    pub accepted: Option<f64>,
    pub success: Option<f64>,
    pub generated: Option<f64>,
}

/// Sum over every series (all label sets) of the first name in `names` the
/// text has. Comments, other metrics and unparsable lines are ignored.
pub fn counter(text: &str, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|name| {
        let mut found = None;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            // The name must end here: a label set or the value follows.
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                continue;
            }
            let value = rest
                .rsplit_once('}')
                .map_or(rest, |(_, v)| v)
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok());
            if let Some(v) = value {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    })
}

impl Counters {
    pub fn parse(text: &str) -> Counters {
        Counters {
            drafts: counter(text, &DRAFTS),
            draft_tokens: counter(text, &DRAFT_TOKENS),
            accepted: counter(text, &ACCEPTED),
            success: counter(text, &SUCCESS),
            generated: counter(text, &GENERATED),
        }
    }
}

/// What the server counted during a run (after minus before).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerDelta {
    pub requests_succeeded: Option<f64>,
    pub generated_tokens: Option<f64>,
    pub drafts: Option<f64>,
    pub draft_tokens: Option<f64>,
    pub accepted_tokens: Option<f64>,
    /// accepted / drafted tokens.
    pub acceptance_rate: Option<f64>,
    /// Tokens emitted per verify pass that drafted: 1 + accepted / drafts
    /// (the target's own token is always emitted, the accepted drafts
    /// before it).
    pub mean_accepted_length: Option<f64>,
}

fn diff(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(b? - a?)
}

impl ServerDelta {
    pub fn between(before: &Counters, after: &Counters) -> ServerDelta {
        let drafts = diff(before.drafts, after.drafts);
        let draft_tokens = diff(before.draft_tokens, after.draft_tokens);
        let accepted = diff(before.accepted, after.accepted);
        let ratio = |n: Option<f64>, d: Option<f64>| match (n, d) {
            (Some(n), Some(d)) if d > 0.0 => Some(n / d),
            _ => None,
        };
        ServerDelta {
            requests_succeeded: diff(before.success, after.success),
            generated_tokens: diff(before.generated, after.generated),
            drafts,
            draft_tokens,
            accepted_tokens: accepted,
            acceptance_rate: ratio(accepted, draft_tokens),
            mean_accepted_length: ratio(accepted, drafts).map(|r| 1.0 + r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "\
# TYPE specgate_spec_decode_num_drafts_total counter
specgate_spec_decode_num_drafts_total 10
specgate_spec_decode_num_draft_tokens_total 30
specgate_spec_decode_num_accepted_tokens_total 12
specgate_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 99
specgate_request_success_total{finished_reason=\"length\"} 3
specgate_request_success_total{finished_reason=\"stop\"} 1
specgate_generation_tokens_total 100
";

    #[test]
    fn deltas_and_spec_figures() {
        let after = BEFORE
            .replace("drafts_total 10", "drafts_total 30")
            .replace("draft_tokens_total 30", "draft_tokens_total 90")
            .replace("accepted_tokens_total 12", "accepted_tokens_total 57")
            .replace("\"stop\"} 1", "\"stop\"} 5")
            .replace("tokens_total 100", "tokens_total 250");
        let (b, a) = (Counters::parse(BEFORE), Counters::parse(&after));
        assert_eq!(b.success, Some(4.0));
        let d = ServerDelta::between(&b, &a);
        assert_eq!(d.requests_succeeded, Some(4.0));
        assert_eq!(d.generated_tokens, Some(150.0));
        assert_eq!(d.acceptance_rate, Some(45.0 / 60.0));
        assert_eq!(d.mean_accepted_length, Some(1.0 + 45.0 / 20.0));
    }

    #[test]
    fn vllm_names_and_missing_metrics() {
        let v = "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 4.0\n\
                 vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 8.0\n\
                 vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 6.0\n";
        let c = Counters::parse(v);
        assert_eq!((c.drafts, c.accepted), (Some(4.0), Some(6.0)));
        let l = "llamacpp:spec_decode_num_drafts_total 3\n\
                 llamacpp:spec_decode_num_draft_tokens_total 9\n\
                 llamacpp:spec_decode_num_accepted_tokens_total 7\n\
                 llamacpp:tokens_predicted_total 40\n";
        let c = Counters::parse(l);
        assert_eq!(
            (c.drafts, c.draft_tokens, c.accepted, c.generated),
            (Some(3.0), Some(9.0), Some(7.0), Some(40.0))
        );
        let d = ServerDelta::between(&Counters::default(), &Counters::parse("other 1\n"));
        assert_eq!(d, ServerDelta::default());
        // No drafting during the run: no rate rather than a division by 0.
        let d = ServerDelta::between(&Counters::parse(BEFORE), &Counters::parse(BEFORE));
        assert_eq!((d.drafts, d.acceptance_rate), (Some(0.0), None));
    }
}
