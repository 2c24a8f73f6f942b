//! Metric names (one constant each, following vLLM's names with our
//! prefix so existing dashboards fit), their descriptions, and the
//! Prometheus recorder. Everything that records a metric uses these names.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

pub const SPEC_DRAFTS: &str = "specgate_spec_decode_num_drafts_total";
pub const SPEC_DRAFT_TOKENS: &str = "specgate_spec_decode_num_draft_tokens_total";
pub const SPEC_ACCEPTED_TOKENS: &str = "specgate_spec_decode_num_accepted_tokens_total";
pub const SPEC_ACCEPTED_PER_POS: &str = "specgate_spec_decode_num_accepted_tokens_per_pos_total";
pub const SPEC_DRAFT_LENGTH: &str = "specgate_spec_decode_draft_length";
/// The cost model (label `rows`): seconds of a target forward (verify
/// pass, acceptance included) and of a draft-model step by row count.
pub const COST_VERIFY_SECONDS: &str = "specgate_cost_model_verify_seconds";
pub const COST_DRAFT_STEP_SECONDS: &str = "specgate_cost_model_draft_step_seconds";
/// What one prompt row costs in the verify curve's rows (decode rows).
pub const COST_PROMPT_ROW_WEIGHT: &str = "specgate_cost_model_prompt_row_weight";
/// Measured / predicted step time of goodput plans (EMA; label `plan`:
/// `draft_model` for plans that ran the draft model, `other`).
pub const COST_PREDICTION_RATIO: &str = "specgate_cost_model_prediction_ratio";
/// The draft model's realized gain (EMA of work per second of the steps it
/// drafted in, over the same steps without its drafts) and whether it is
/// vetoed (1) at that batch size; label `batch`: a range of decoding
/// sequences per step, `1`, `2-3`, `4-7`, ...
pub const SPEC_MODEL_GAIN: &str = "specgate_spec_decode_draft_model_gain";
pub const SPEC_MODEL_VETOED: &str = "specgate_spec_decode_draft_model_vetoed";
pub const SPEC_GRAMMAR_DRAFT_TOKENS: &str = "specgate_spec_decode_grammar_num_draft_tokens_total";
pub const SPEC_GRAMMAR_ACCEPTED_TOKENS: &str =
    "specgate_spec_decode_grammar_num_accepted_tokens_total";
pub const SPEC_GRAMMAR_FORCED_TOKENS: &str = "specgate_spec_decode_grammar_forced_tokens_total";
/// Token trees: verify rounds whose proposal branched, the branch nodes
/// among the drafted tokens, and the rounds whose accepted path took a
/// branch rather than the chain.
pub const SPEC_TREE_ROUNDS: &str = "specgate_spec_decode_tree_verifications_total";
pub const SPEC_BRANCH_TOKENS: &str = "specgate_spec_decode_num_branch_tokens_total";
pub const SPEC_BRANCH_WINS: &str = "specgate_spec_decode_branch_wins_total";
/// Drafted tokens that came from lookups chained before the method's
/// proposer: in the sequence's own context, and in the cross-request pool.
pub const SPEC_CONTEXT_DRAFT_TOKENS: &str = "specgate_spec_decode_context_num_draft_tokens_total";
pub const SPEC_POOL_DRAFT_TOKENS: &str = "specgate_spec_decode_pool_num_draft_tokens_total";
pub const SPEC_POOL_ACCEPTED_TOKENS: &str = "specgate_spec_decode_pool_num_accepted_tokens_total";
pub const TTFT: &str = "specgate_time_to_first_token_seconds";
pub const ITL: &str = "specgate_inter_token_latency_seconds";
pub const E2E: &str = "specgate_e2e_request_latency_seconds";
pub const QUEUE_TIME: &str = "specgate_request_queue_time_seconds";
pub const KV_USAGE: &str = "specgate_kv_cache_usage_ratio";
pub const RUNNING: &str = "specgate_num_requests_running";
pub const WAITING: &str = "specgate_num_requests_waiting";
pub const PREEMPTIONS: &str = "specgate_num_preemptions_total";
pub const PREFIX_HITS: &str = "specgate_prefix_cache_hits_total";
pub const PREFIX_QUERIES: &str = "specgate_prefix_cache_queries_total";
pub const PREFIX_ENABLED: &str = "specgate_prefix_cache_enabled";
/// A hybrid target's recurrent-state checkpoints (prefix caching).
pub const CHECKPOINT_HITS: &str = "specgate_state_checkpoint_hits_total";
pub const CHECKPOINT_MISSES: &str = "specgate_state_checkpoint_misses_total";
pub const CHECKPOINT_SAVES: &str = "specgate_state_checkpoint_saves_total";
pub const CHECKPOINT_EVICTIONS: &str = "specgate_state_checkpoint_evictions_total";
pub const CHECKPOINT_RESTORED_TOKENS: &str = "specgate_state_checkpoint_restored_tokens_total";
pub const CHECKPOINTS_HELD: &str = "specgate_state_checkpoints";
pub const CHECKPOINT_BYTES: &str = "specgate_state_checkpoint_bytes";
pub const CHECKPOINT_BUDGET_BYTES: &str = "specgate_state_checkpoint_budget_bytes";
pub const STATE_SLOTS_USED: &str = "specgate_state_slots_used";
pub const STATE_SLOTS: &str = "specgate_state_slots";
pub const PROMPT_TOKENS: &str = "specgate_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "specgate_generation_tokens_total";
pub const REQUEST_SUCCESS: &str = "specgate_request_success_total";
/// Requests per wire API (`api`: `chat_completions`, `completions`,
/// `responses`, `messages`, `count_tokens`) and HTTP status.
pub const API_REQUESTS: &str = "specgate_api_requests_total";

// `specgate route` (the router process's own /metrics).
pub const ROUTER_REQUESTS: &str = "specgate_router_requests_total";
pub const ROUTER_RETRIES: &str = "specgate_router_retries_total";
pub const ROUTER_UPSTREAM_ERRORS: &str = "specgate_router_upstream_errors_total";
pub const ROUTER_AFFINITY_ROUTED: &str = "specgate_router_affinity_routed_total";
pub const ROUTER_UNROUTABLE: &str = "specgate_router_unroutable_total";
pub const ROUTER_HEALTHY_REPLICAS: &str = "specgate_router_healthy_replicas";
pub const ROUTER_REPLICAS: &str = "specgate_router_replicas";
pub const ROUTER_UPSTREAM_LATENCY: &str = "specgate_router_upstream_header_latency_seconds";

/// Latency buckets (seconds) for the request histograms.
const LATENCY_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (once; later calls return
/// the same handle) and describes every metric.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(&LATENCY_BUCKETS)
                .expect("static buckets are valid")
                .install_recorder()
                .expect("no other metrics recorder is installed");
            describe();
            handle
        })
        .clone()
}

fn describe() {
    describe_counter!(
        SPEC_DRAFTS,
        "Verify passes in which at least one token was drafted"
    );
    describe_counter!(SPEC_DRAFT_TOKENS, "Tokens proposed by the drafter");
    describe_counter!(SPEC_ACCEPTED_TOKENS, "Drafted tokens the verifier accepted");
    describe_counter!(
        SPEC_ACCEPTED_PER_POS,
        "Accepted drafted tokens by position in the draft"
    );
    describe_counter!(
        SPEC_GRAMMAR_DRAFT_TOKENS,
        "Tokens proposed for sequences under a grammar (forced ones included)"
    );
    describe_counter!(
        SPEC_GRAMMAR_ACCEPTED_TOKENS,
        "Proposed tokens of sequences under a grammar that the verifier accepted"
    );
    describe_counter!(
        SPEC_GRAMMAR_FORCED_TOKENS,
        "Tokens a grammar forced into proposals (jump-forward)"
    );
    describe_counter!(
        SPEC_TREE_ROUNDS,
        "Verify rounds whose proposal was a token tree (it branched)"
    );
    describe_counter!(
        SPEC_BRANCH_TOKENS,
        "Of the drafted tokens, branch nodes verified besides the chains"
    );
    describe_counter!(
        SPEC_BRANCH_WINS,
        "Token-tree rounds whose accepted path took a branch, not the chain"
    );
    describe_counter!(
        SPEC_CONTEXT_DRAFT_TOKENS,
        "Drafted tokens found by lookup in the sequence's own context"
    );
    describe_counter!(
        SPEC_POOL_DRAFT_TOKENS,
        "Drafted tokens found in the cross-request pool (the tenant's finished requests)"
    );
    describe_counter!(
        SPEC_POOL_ACCEPTED_TOKENS,
        "Drafted tokens from the cross-request pool that the verifier accepted"
    );
    describe_gauge!(
        SPEC_DRAFT_LENGTH,
        "Mean draft length (k) the policy chose for the decoding sequences of the last step"
    );
    describe_gauge!(
        COST_VERIFY_SECONDS,
        Unit::Seconds,
        "Cost model: seconds of a target forward carrying `rows` rows (measured at start, kept current)"
    );
    describe_gauge!(
        COST_PROMPT_ROW_WEIGHT,
        "Cost model: what one prompt row costs in decode rows (a prompt row skips the vocabulary projection and sampling)"
    );
    describe_gauge!(
        SPEC_MODEL_GAIN,
        "Realized gain of steps that drafted with the draft model over the same steps without it (EMA), by batch size"
    );
    describe_gauge!(
        SPEC_MODEL_VETOED,
        "1 where the draft model is off at this batch size because it was measured losing (goodput policy)"
    );
    describe_gauge!(
        COST_PREDICTION_RATIO,
        "Measured / predicted step time of the goodput policy's plans (EMA), by plan kind"
    );
    describe_gauge!(
        COST_DRAFT_STEP_SECONDS,
        Unit::Seconds,
        "Cost model: seconds of a draft-model step over `rows` sequences (measured at start, kept current)"
    );
    describe_histogram!(
        TTFT,
        Unit::Seconds,
        "Time from request arrival to its first token"
    );
    describe_histogram!(ITL, Unit::Seconds, "Time between consecutive output tokens");
    describe_histogram!(E2E, Unit::Seconds, "Time from request arrival to its end");
    describe_histogram!(
        QUEUE_TIME,
        Unit::Seconds,
        "Time a request waited for admission"
    );
    describe_gauge!(
        KV_USAGE,
        "Fraction of the cache in use: KV blocks, and for hybrid models \
         recurrent-state slots too, weighted by their bytes"
    );
    describe_gauge!(
        PREFIX_ENABLED,
        "1 when prefix caching is on ([kv] prefix_caching)"
    );
    describe_counter!(
        CHECKPOINT_HITS,
        "Admissions that restored a recurrent-state checkpoint (hybrid models)"
    );
    describe_counter!(
        CHECKPOINT_MISSES,
        "Admissions that looked a prefix up and restored no state checkpoint (hybrid models)"
    );
    describe_counter!(
        CHECKPOINT_SAVES,
        "Recurrent-state checkpoints saved at prompt ends, branch points and request ends"
    );
    describe_counter!(
        CHECKPOINT_EVICTIONS,
        "Recurrent-state checkpoints dropped for room or with their block"
    );
    describe_counter!(
        CHECKPOINT_RESTORED_TOKENS,
        "Prompt tokens whose prefill a restored state checkpoint skipped"
    );
    describe_gauge!(
        CHECKPOINTS_HELD,
        "Recurrent-state checkpoints held (hybrid models)"
    );
    describe_gauge!(
        CHECKPOINT_BYTES,
        Unit::Bytes,
        "Bytes of the recurrent-state checkpoints held"
    );
    describe_gauge!(
        CHECKPOINT_BUDGET_BYTES,
        Unit::Bytes,
        "Bytes the state checkpoint budget holds ([kv] state_checkpoint_mib, whole checkpoints)"
    );
    describe_gauge!(
        STATE_SLOTS_USED,
        "Recurrent-state slots held by running sequences (hybrid models)"
    );
    describe_gauge!(
        STATE_SLOTS,
        "Recurrent-state slots in the pool (hybrid models)"
    );
    describe_gauge!(RUNNING, "Requests being decoded");
    describe_gauge!(WAITING, "Requests waiting to be scheduled");
    describe_counter!(PREEMPTIONS, "Sequences preempted for lack of KV blocks");
    describe_counter!(PREFIX_HITS, "Prompt tokens found in the prefix cache");
    describe_counter!(
        PREFIX_QUERIES,
        "Prompt tokens looked up in the prefix cache"
    );
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of requests received");
    describe_counter!(GENERATION_TOKENS, "Tokens generated");
    describe_counter!(REQUEST_SUCCESS, "Requests finished, by finish reason");
    describe_counter!(
        API_REQUESTS,
        "Requests answered per wire API (chat_completions, completions, responses, messages, count_tokens) and HTTP status"
    );
    describe_router();
}

fn describe_router() {
    describe_counter!(
        ROUTER_REQUESTS,
        "Requests answered by a replica, by replica and HTTP status"
    );
    describe_counter!(
        ROUTER_RETRIES,
        "Requests sent again to another replica before anything was streamed"
    );
    describe_counter!(
        ROUTER_UPSTREAM_ERRORS,
        "Failed attempts on a replica (connection error or 5xx), by replica"
    );
    describe_counter!(
        ROUTER_AFFINITY_ROUTED,
        "Requests sent to the replica that served their prompt prefix"
    );
    describe_counter!(
        ROUTER_UNROUTABLE,
        "Requests refused because no healthy replica was left to try"
    );
    describe_gauge!(ROUTER_HEALTHY_REPLICAS, "Replicas passing health checks");
    describe_gauge!(ROUTER_REPLICAS, "Replicas known (static and discovered)");
    describe_histogram!(
        ROUTER_UPSTREAM_LATENCY,
        Unit::Seconds,
        "Time from sending a request to a replica to its response head"
    );
}
