//! `specgate generate`: one prompt, one sequence, decoded by speculative
//! rounds (k = 0 without a proposer). Prints the continuation on stdout
//! (nothing else, so it can be piped and compared) and prefill/decode speeds
//! and speculation statistics on stderr.

use crate::config::LatentDtype;
use crate::spec::{spec_round, RoundInput, SpecSeq, SpecStats};
use crate::tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};
use anyhow::{bail, Context, Result};
use specgate_draft::{DraftPolicy, ModelDraft, NgramProposer, PolicyState, Proposer};
use specgate_verify::kv_pool::DEFAULT_BLOCK_SIZE;
use specgate_verify::model::{load_model, load_model_tp};
use specgate_verify::{KvPool, LogitsWanted, Model, Sampler, SamplingParams};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Prompt tokens per prefill forward: bounds scratch memory on long prompts.
const PREFILL_CHUNK: usize = 512;

/// Arguments of `specgate generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A .gguf file, or a Hugging Face directory: config.json, model.safetensors
    /// (or model-0000x-of-0000y.safetensors with model.safetensors.index.json),
    /// tokenizer.json, and optionally tokenizer_config.json / generation_config.json.
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 disables the top-k cut.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens (for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Speculate with this draft model (same vocabulary as the target).
    #[arg(long, conflicts_with = "ngram")]
    pub draft: Option<PathBuf>,
    /// Restrict the draft's output head to the token ids in this file (one
    /// per line, e.g. configs/draft-head-qwen2.5.txt); lossless.
    #[arg(long, requires = "draft")]
    pub draft_head_tokens: Option<PathBuf>,
    /// Speculate with n-gram prompt lookup.
    #[arg(long)]
    pub ngram: bool,
    /// Shortest and longest n-gram the lookup matches.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    #[arg(long, default_value_t = 4)]
    pub ngram_max: usize,
    /// Tokens drafted per round (with --draft or --ngram); with --adaptive,
    /// the most drafted per round.
    #[arg(long, default_value_t = 4)]
    pub num_speculative_tokens: usize,
    /// Pick k each round from the measured acceptance (EMA) instead of fixed.
    #[arg(long)]
    pub adaptive: bool,
    /// Shard the target over this many tensor-parallel ranks (threads); the
    /// draft always runs unsharded.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Storage of the target's latent KV rows (Kimi K3): auto (bf16 for
    /// bf16 or quantized weights, f32 for f32 ones), f32 or bf16.
    #[arg(long, value_enum, default_value_t = LatentDtype::Auto)]
    pub kv_latent_dtype: LatentDtype,
}

impl GenerateArgs {
    fn sampling(&self) -> Result<SamplingParams> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1]");
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            ..SamplingParams::default()
        })
    }
}

/// Loads the tokenizer that belongs to a model path: a GGUF file's metadata, or a
/// Hugging Face directory's `tokenizer.json` with its `tokenizer_config.json` (chat
/// template, BOS/EOS, special tokens) and `generation_config.json` (stop ids).
pub fn load_tokenizer(model: &Path) -> Result<TextTokenizer> {
    if model.is_dir() {
        TextTokenizer::from_hf_dir(model)
            .with_context(|| format!("loading the tokenizer of {}", model.display()))
    } else {
        TextTokenizer::from_gguf_file(model)
            .with_context(|| format!("loading the tokenizer of {}", model.display()))
    }
}

/// Runs `specgate generate`.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let sampling = args.sampling()?;
    let t0 = Instant::now();
    if args.tensor_parallel_size == 0 {
        bail!("--tensor-parallel-size must be at least 1");
    }
    let mut model = load_model_tp(&args.model, args.tensor_parallel_size)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    crate::server::apply_latent_dtype(&mut model, args.kv_latent_dtype)?;
    model.warm_up()?;
    let tok = load_tokenizer(&args.model)?;
    tracing::info!(
        model = %args.model.display(),
        secs = t0.elapsed().as_secs_f64(),
        kernels_isa = specgate_verify::kernels::Isa::current().name(),
        amx = %specgate_verify::kernels::amx_status(),
        "model loaded"
    );
    let text = if args.chat {
        tok.apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    let prompt = tok.encode(&text, !args.chat)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let total = prompt.len() + args.max_tokens;
    let ctx = model.config().max_position;
    if total > ctx {
        bail!(
            "prompt ({} tokens) + max tokens ({}) = {total} exceeds the model's context of {ctx}",
            prompt.len(),
            args.max_tokens
        );
    }
    let blocks = blocks_needed(prompt.len(), args);
    let mut proposer: Option<Box<dyn Proposer>> = if let Some(path) = &args.draft {
        let mut draft =
            load_model(path).with_context(|| format!("loading draft model {}", path.display()))?;
        if let Some((_, ids)) = crate::server::draft_head(args.draft_head_tokens.as_deref(), path)?
        {
            draft.restrict_head(&ids)?;
        }
        draft.warm_up()?;
        let d = ModelDraft::new(Arc::new(draft), blocks, DEFAULT_BLOCK_SIZE)?;
        d.check_compatible(model.config())?;
        Some(Box::new(d))
    } else if args.ngram {
        Some(Box::new(
            NgramProposer::new(args.ngram_min, args.ngram_max).map_err(anyhow::Error::msg)?,
        ))
    } else {
        None
    };
    let speculative = proposer.is_some();
    let mut out = std::io::stdout().lock();
    let stats = generate(
        &model,
        proposer.as_deref_mut(),
        &tok,
        &prompt,
        args,
        sampling,
        &mut |s| {
            out.write_all(s.as_bytes())?;
            out.flush()
        },
    )?;
    writeln!(out)?;
    stats.report(speculative);
    Ok(())
}

/// Blocks for the prompt, the output and one round of lookahead.
pub fn blocks_needed(prompt_len: usize, args: &GenerateArgs) -> usize {
    (prompt_len + args.max_tokens + args.num_speculative_tokens + 1).div_ceil(DEFAULT_BLOCK_SIZE)
}

/// Timings of one generation.
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Until the first round's tokens (time to first token).
    pub prefill_secs: f64,
    /// Tokens after the first round, and the time they took.
    pub decode_tokens: usize,
    pub decode_secs: f64,
    pub spec: SpecStats,
}

impl GenStats {
    fn report(&self, speculative: bool) {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        tracing::info!(
            tokens = self.prompt_tokens,
            secs = self.prefill_secs,
            tokens_per_sec = rate(self.prompt_tokens, self.prefill_secs),
            "prefill"
        );
        tracing::info!(
            tokens = self.decode_tokens,
            secs = self.decode_secs,
            tokens_per_sec = rate(self.decode_tokens, self.decode_secs),
            "decode"
        );
        if speculative {
            tracing::info!(
                acceptance_rate = self.spec.acceptance_rate(),
                accepted_tokens = self.spec.accepted_tokens,
                drafted_tokens = self.spec.draft_tokens,
                mean_accepted_length = self.spec.mean_accepted_length(),
                "speculation"
            );
        }
    }
}

/// Generates up to `max_tokens` after `prompt` by speculative rounds,
/// calling `emit` with each piece of text as soon as it is whole UTF-8.
pub fn generate<P: Proposer + ?Sized>(
    model: &Model,
    mut proposer: Option<&mut P>,
    tok: &TextTokenizer,
    prompt: &[u32],
    args: &GenerateArgs,
    sampling: SamplingParams,
    emit: &mut dyn FnMut(&str) -> std::io::Result<()>,
) -> Result<GenStats> {
    let blocks = blocks_needed(prompt.len(), args);
    let mut pool = KvPool::for_model(model, blocks, DEFAULT_BLOCK_SIZE)?;
    // One sequence owns the whole pool; the engine's BlockManager is not needed.
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut seq = SpecSeq {
        id: 0,
        tokens: prompt.to_vec(),
        sampler: Sampler::new(sampling),
        policy_state: PolicyState::default(),
    };
    let policy = match (&proposer, args.adaptive) {
        (None, _) => DraftPolicy::Fixed { k: 0 },
        (Some(_), false) => DraftPolicy::Fixed {
            k: args.num_speculative_tokens,
        },
        (Some(_), true) => DraftPolicy::Adaptive {
            min_k: 0,
            max_k: args.num_speculative_tokens,
            alpha: 0.3,
            // Measured on this CPU (BENCHMARKS.md): a 0.5B draft step costs
            // ~0.5 of a 1.5B verify pass and each extra verify row ~0.2;
            // an n-gram lookup costs nothing but that extra row.
            draft_cost: if args.draft.is_some() { 0.7 } else { 0.2 },
            initial_acceptance: 0.7,
            probe_every: 8,
        },
    };
    let mut detok = IncrementalDecoder::new(true);
    let mut stats = SpecStats::default();

    // The target's cache holds all but the last token before each round.
    let t0 = Instant::now();
    let head = &prompt[..prompt.len() - 1];
    for (i, chunk) in head.chunks(PREFILL_CHUNK).enumerate() {
        let start = i * PREFILL_CHUNK;
        model.forward_one(&mut pool, chunk, start, &table, LogitsWanted::None)?;
    }
    let mut prefill_secs = None;
    let mut first_round = 0;
    let mut generated = 0;
    'outer: while generated < args.max_tokens {
        let k = policy
            .k(1, &seq.policy_state)
            .min(args.max_tokens - generated - 1);
        let new = spec_round(
            model,
            &mut pool,
            proposer.as_deref_mut(),
            &policy,
            &mut [RoundInput {
                seq: &mut seq,
                block_table: &table,
                k,
                branches: 0,
                state_slot: 0,
                snapshot: None,
            }],
            &[],
            &mut stats,
        )?;
        if prefill_secs.is_none() {
            prefill_secs = Some(t0.elapsed().as_secs_f64());
            first_round = new[0].len();
        }
        for &t in &new[0] {
            generated += 1;
            if !args.ignore_eos && tok.is_eos(t) {
                break 'outer;
            }
            emit(&detok.push(tok, t)?)?;
        }
    }
    emit(&detok.finish())?;
    let prefill_secs = prefill_secs.unwrap_or(0.0);
    Ok(GenStats {
        prompt_tokens: prompt.len(),
        prefill_secs,
        decode_tokens: generated.saturating_sub(first_round),
        decode_secs: t0.elapsed().as_secs_f64() - prefill_secs,
        spec: stats,
    })
}
