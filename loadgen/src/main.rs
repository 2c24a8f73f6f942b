//! `specgate-bench`: a load generator and serving benchmark for any
//! OpenAI-compatible server (specgate, vLLM, ...). It streams every request
//! (so it sees each token's arrival), offers load as a closed loop of N
//! clients or as Poisson arrivals, sweeps a list of loads, and reports
//! throughput, TTFT / inter-token / end-to-end percentiles and the server's
//! speculative acceptance, as a table, a JSON file and SVG charts.
//! `report` combines several labelled JSON files into one table and one set
//! of charts. `conversation` runs growing multi-turn chats and reports time
//! to first token turn by turn (what a prefix cache changes).

mod client;
mod conversation;
mod load;
mod report;
mod scrape;
mod stats;
mod svg;
mod workload;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use client::{RequestOptions, Target};
use load::{Bounds, Ctx, Shape};
use report::{Results, RunReport, Warmup};
use scrape::{Counters, ServerDelta};

#[derive(Parser)]
#[command(
    name = "specgate-bench",
    version,
    about = "Serving benchmark for OpenAI-compatible servers: concurrency and request-rate \
             sweeps, throughput, TTFT / inter-token / end-to-end latency percentiles, \
             speculative acceptance from /metrics; table, JSON and SVG charts.",
    after_help = "Examples:\n  \
        specgate-bench run --base-url http://127.0.0.1:8000 --workload benches/workloads/chat.jsonl \\\n      \
        --concurrency 1,4,8 --num-requests 16 --label ngram --json ngram.json\n  \
        specgate-bench run --base-url http://127.0.0.1:8000/v1 --workload benches/workloads/editing.jsonl \\\n      \
        --rate 0.5,1,2 --duration 60 --warmup 2\n  \
        specgate-bench report --svg-dir docs/bench --markdown off.json ngram.json draft.json\n  \
        specgate-bench conversation --url http://127.0.0.1:8000 --turns 6 --conversations 1 \\\n      \
        --system-words 600 --turn-words 30 --max-tokens 64 --out conv.json"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a sweep against a server and report it.
    Run(Box<RunArgs>),
    /// Combine results files (one per configuration) into a table and charts.
    Report(ReportArgs),
    /// Growing multi-turn chats: per turn, prompt tokens, time to first
    /// token, total time and output tokens.
    Conversation(Box<ConversationArgs>),
}

#[derive(clap::Args)]
struct ConversationArgs {
    /// Server root, http:// only (a trailing /v1 is accepted); requests go
    /// to its /v1/chat/completions.
    #[arg(long, alias = "base-url", default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// Model name to request (default: the first on /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// User turns per conversation.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Conversations run at the same time (each its turns one by one).
    #[arg(long, default_value_t = 1)]
    conversations: usize,
    /// Words of each conversation's system prompt (0: no system message).
    #[arg(long, default_value_t = 600)]
    system_words: usize,
    /// Words of each user turn.
    #[arg(long, default_value_t = 30)]
    turn_words: usize,
    /// `max_tokens` of every answer.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Ask for max_tokens regardless of end-of-sequence (`ignore_eos`), so
    /// every server's answers, and so its histories, have the same length.
    #[arg(long)]
    ignore_eos: bool,
    /// Seed of the generated text: the same seed, the same prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One system prompt for every conversation (else one each).
    #[arg(long)]
    shared_system: bool,
    /// A JSON object sent as every request's `chat_template_kwargs`, e.g.
    /// '{"thinking": false}' (Kimi K3: answer in the response channel).
    #[arg(long, value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Send each answer's reasoning back as the assistant message's
    /// `reasoning_content` (default: its content only).
    #[arg(long)]
    replay_reasoning: bool,
    /// Uncounted short requests sent first (one at a time), unrelated to
    /// the conversations' text.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// A request unfinished after this many seconds fails (and ends its
    /// conversation).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// First wait up to this many seconds for GET /health to answer 200.
    #[arg(long, default_value_t = 0.0)]
    wait_ready: f64,
    /// Names this run in the results file.
    #[arg(long, default_value = "conversation")]
    label: String,
    /// Write the per-turn figures and every turn's record here as JSON.
    #[arg(long, alias = "json")]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Server root, http:// only (a trailing /v1 is accepted). Only this
    /// address is contacted.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// JSONL workload: {"prompt": ..} or {"messages": [..]} per line, with
    /// an optional "max_tokens"; requests cycle through the lines in order.
    #[arg(long)]
    workload: PathBuf,
    /// Model name to request (default: the first on /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Closed loop: sweep these numbers of concurrent requests.
    #[arg(long, value_delimiter = ',', conflicts_with = "rate")]
    concurrency: Vec<usize>,
    /// Open loop: sweep these Poisson arrival rates (requests/s).
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Requests per sweep point (default 32 when --duration is not given).
    #[arg(long)]
    num_requests: Option<usize>,
    /// Stop issuing requests after this many seconds per sweep point;
    /// requests in flight then finish.
    #[arg(long)]
    duration: Option<f64>,
    /// Uncounted requests sent before the sweep.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Overrides every workload line's max_tokens.
    #[arg(long)]
    max_tokens: Option<u32>,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Ask the server to generate max_tokens regardless of end-of-sequence
    /// (vLLM's and specgate's `ignore_eos`), for comparable lengths.
    #[arg(long)]
    ignore_eos: bool,
    /// A request unfinished after this many seconds counts as failed.
    #[arg(long, default_value_t = 300.0)]
    request_timeout: f64,
    /// Seed of the Poisson arrival schedule.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Names this configuration in tables and charts.
    #[arg(long, default_value = "run")]
    label: String,
    /// Write every figure here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the SVG charts of this run into this directory.
    #[arg(long)]
    svg_dir: Option<PathBuf>,
    /// First wait up to this many seconds for GET /health to answer 200
    /// (a server still loading its models answers 503 or refuses).
    #[arg(long, default_value_t = 0.0)]
    wait_ready: f64,
    /// No progress bar (it is drawn only when stderr is a terminal anyway).
    #[arg(long)]
    quiet: bool,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// Results files written by `run --json`, one line per file in charts.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Print the table as Markdown.
    #[arg(long)]
    markdown: bool,
    /// Write the comparison charts into this directory.
    #[arg(long)]
    svg_dir: Option<PathBuf>,
}

fn shapes(a: &RunArgs) -> anyhow::Result<Vec<Shape>> {
    if let Some(c) = a.concurrency.iter().find(|&&c| c == 0 || c > 4096) {
        bail!("--concurrency {c}: must be 1..=4096");
    }
    if let Some(r) = a.rate.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        bail!("--rate {r}: must be a positive number");
    }
    Ok(if !a.rate.is_empty() {
        a.rate.iter().map(|&r| Shape::Rate(r)).collect()
    } else if !a.concurrency.is_empty() {
        a.concurrency
            .iter()
            .map(|&c| Shape::Concurrency(c))
            .collect()
    } else {
        vec![Shape::Concurrency(1)]
    })
}

fn bounds(a: &RunArgs) -> anyhow::Result<Bounds> {
    let duration = match a.duration {
        Some(d) if !(d.is_finite() && d > 0.0) => bail!("--duration {d}: must be positive"),
        Some(d) => Some(Duration::from_secs_f64(d)),
        None => None,
    };
    let requests = match (a.num_requests, duration) {
        (Some(0), _) => bail!("--num-requests must be at least 1"),
        (Some(n), _) => Some(n.min(load::MAX_REQUESTS)),
        (None, None) => Some(32),
        (None, Some(_)) => None,
    };
    Ok(Bounds { requests, duration })
}

fn progress(quiet: bool, len: Option<usize>, prefix: String) -> ProgressBar {
    let pb = match len {
        Some(n) => ProgressBar::new(n as u64),
        None => ProgressBar::no_length(),
    };
    if quiet || !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template(
        "{prefix:>14} [{elapsed_precise}] {bar:30} {pos}/{len} requests",
    )
    .expect("valid template");
    pb.set_style(style);
    pb.set_prefix(prefix);
    pb
}

async fn counters(t: &Target, warned: &mut bool) -> Counters {
    match t.get_text("/metrics").await {
        Ok(text) => Counters::parse(&text),
        Err(e) => {
            if !*warned {
                eprintln!("note: no server metrics ({e}); acceptance figures left out");
                *warned = true;
            }
            Counters::default()
        }
    }
}

async fn wait_ready(t: &Target, limit: Duration) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    loop {
        match t.get_text("/health").await {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() >= limit => {
                bail!("server not ready after {limit:?}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// The counters once the previous run's last counts have landed: read until
/// two reads 50 ms apart agree (at most two seconds), since a server may
/// count a request's last tokens just after its stream ended.
async fn stable_counters(t: &Target, warned: &mut bool) -> Counters {
    let mut last = counters(t, warned).await;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = counters(t, warned).await;
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// The server's counters over a run. A server may count a request's end a
/// moment after its stream closed (specgate exports counters after each
/// engine step; vLLM on an interval), so /metrics is read again, for up to
/// two seconds, until it has counted at least what the client saw.
async fn settled_delta(
    t: &Target,
    before: &Counters,
    r: &RunReport,
    warned: &mut bool,
) -> ServerDelta {
    let mut tries = 0;
    loop {
        let d = ServerDelta::between(before, &counters(t, warned).await);
        let behind = d.requests_succeeded.is_some_and(|n| n < r.completed as f64)
            || d.generated_tokens
                .is_some_and(|n| n < r.output_tokens as f64);
        tries += 1;
        if !behind || tries >= 40 {
            return d;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The server at `url` (after waiting up to `wait` seconds for its
/// `/health`, when positive) and the model to ask for: `model`, else the
/// first it lists.
async fn connect(
    url: &str,
    api_key: &Option<String>,
    wait: f64,
    model: &Option<String>,
) -> anyhow::Result<(Target, String)> {
    let target = Target::parse(url, api_key.clone())?;
    if wait > 0.0 {
        wait_ready(&target, Duration::from_secs_f64(wait)).await?;
    }
    let model = match model {
        Some(m) => m.clone(),
        None => target
            .first_model()
            .await
            .context("finding the model name (or pass --model)")?,
    };
    Ok((target, model))
}

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let shapes = shapes(&a)?;
    let bounds = bounds(&a)?;
    if !(a.request_timeout.is_finite() && a.request_timeout > 0.0) {
        bail!("--request-timeout must be positive");
    }
    let entries = workload::load(&a.workload)?;
    let (target, model) = connect(&a.base_url, &a.api_key, a.wait_ready, &a.model).await?;
    let options = RequestOptions {
        model: model.clone(),
        temperature: a.temperature,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        timeout: Duration::from_secs_f64(a.request_timeout),
        chat_template_kwargs: None,
    };
    let mut ctx = Ctx {
        target: Arc::new(target),
        entries: Arc::new(entries),
        options: Arc::new(options),
        progress: ProgressBar::hidden(),
    };
    let mut warmup = Warmup::default();
    if a.warmup > 0 {
        let c = match shapes[0] {
            Shape::Concurrency(c) => c.min(a.warmup),
            Shape::Rate(_) => 1,
        };
        ctx.progress = progress(a.quiet, Some(a.warmup), "warm-up".into());
        let b = Bounds {
            requests: Some(a.warmup),
            duration: None,
        };
        let o = load::run(&ctx, Shape::Concurrency(c), b, a.seed).await;
        ctx.progress.finish_and_clear();
        let r = RunReport::new(Shape::Concurrency(c), &o, ServerDelta::default());
        warmup = Warmup {
            requests: r.requests,
            completed: r.completed,
            output_tokens: r.output_tokens,
        };
    }
    let mut warned = false;
    let mut runs = Vec::new();
    for (i, &shape) in shapes.iter().enumerate() {
        let name = match shape {
            Shape::Concurrency(c) => format!("concurrency {c}"),
            Shape::Rate(r) => format!("rate {r}/s"),
        };
        let before = stable_counters(&ctx.target, &mut warned).await;
        ctx.progress = progress(a.quiet, bounds.requests, name);
        let o = load::run(&ctx, shape, bounds, a.seed.wrapping_add(i as u64)).await;
        ctx.progress.finish_and_clear();
        let mut r = RunReport::new(shape, &o, ServerDelta::default());
        r.server = settled_delta(&ctx.target, &before, &r, &mut warned).await;
        for (class, f) in &r.failures {
            eprintln!("{} failed ({class}), e.g.: {}", f.count, f.example);
        }
        runs.push(r);
    }
    let results = Results {
        label: a.label.clone(),
        base_url: a.base_url.clone(),
        model,
        workload: a.workload.display().to_string(),
        temperature: a.temperature,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        warmup,
        runs,
    };
    let all = [results];
    print!("{}", report::text_table(&all));
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&all[0])?;
        std::fs::write(p, text + "\n").with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(d) = &a.svg_dir {
        write_charts(&all, d)?;
    }
    Ok(())
}

fn write_charts(all: &[Results], dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, chart) in svg::charts(all) {
        let p = dir.join(name);
        std::fs::write(&p, chart.render()).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

fn report_cmd(a: ReportArgs) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for f in &a.files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let r: Results = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a specgate-bench results file", f.display()))?;
        all.push(r);
    }
    if a.markdown {
        print!("{}", report::markdown_table(&all));
    } else {
        print!("{}", report::text_table(&all));
    }
    if let Some(d) = &a.svg_dir {
        write_charts(&all, d)?;
    }
    Ok(())
}

async fn conversation_cmd(a: ConversationArgs) -> anyhow::Result<()> {
    if a.turns == 0 || a.conversations == 0 || a.conversations > 4096 {
        bail!("--turns must be at least 1 and --conversations 1..=4096");
    }
    if a.turn_words == 0 || a.max_tokens == 0 {
        bail!("--turn-words and --max-tokens must be at least 1");
    }
    if !(a.request_timeout.is_finite() && a.request_timeout > 0.0) {
        bail!("--request-timeout must be positive");
    }
    let chat_template_kwargs = match &a.chat_template_kwargs {
        Some(text) => {
            let v: serde_json::Value = serde_json::from_str(text)
                .with_context(|| format!("--chat-template-kwargs {text:?} is not JSON"))?;
            if !v.is_object() {
                bail!("--chat-template-kwargs must be a JSON object");
            }
            Some(v)
        }
        None => None,
    };
    let (target, model) = connect(&a.url, &a.api_key, a.wait_ready, &a.model).await?;
    let options = RequestOptions {
        model: model.clone(),
        temperature: a.temperature,
        max_tokens: Some(a.max_tokens),
        ignore_eos: a.ignore_eos,
        timeout: Duration::from_secs_f64(a.request_timeout),
        chat_template_kwargs,
    };
    for i in 0..a.warmup {
        let entry = workload::Entry {
            input: workload::Input::Messages(vec![serde_json::json!({
                "role": "user",
                "content": "Say hello in one short sentence.",
            })]),
            max_tokens: Some(8),
        };
        let o = RequestOptions {
            max_tokens: None,
            ..options.clone()
        };
        if let Err(f) = client::stream_request(&target, &entry, &o).await {
            eprintln!("warm-up request {} failed: {f}", i + 1);
        }
    }
    let spec = conversation::Spec {
        conversations: a.conversations,
        turns: a.turns,
        system_words: a.system_words,
        turn_words: a.turn_words,
        seed: a.seed,
        shared_system: a.shared_system,
        replay_reasoning: a.replay_reasoning,
    };
    let options_kwargs = options.chat_template_kwargs.clone();
    let (records, duration_s) =
        conversation::run(Arc::new(target), Arc::new(options), Arc::new(spec.clone())).await;
    for r in records.iter().filter(|r| r.error.is_some()) {
        eprintln!(
            "conversation {} turn {} failed: {}",
            r.conversation,
            r.turn,
            r.error.as_deref().unwrap_or_default()
        );
    }
    let results = conversation::ConversationResults {
        label: a.label.clone(),
        url: a.url.clone(),
        model,
        per_turn: conversation::per_turn(&records, spec.turns),
        spec,
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        ignore_eos: a.ignore_eos,
        chat_template_kwargs: options_kwargs,
        duration_s,
        records,
    };
    print!("{}", conversation::text_table(&results));
    if let Some(p) = &a.out {
        let text = serde_json::to_string_pretty(&results)?;
        std::fs::write(p, text + "\n").with_context(|| format!("writing {}", p.display()))?;
    }
    if results.per_turn.iter().all(|t| t.completed == 0) {
        bail!("every turn failed");
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(a) => runtime()?.block_on(run(*a)),
        Command::Report(a) => report_cmd(a),
        Command::Conversation(a) => runtime()?.block_on(conversation_cmd(*a)),
    }
}
