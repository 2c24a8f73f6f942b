//! `specgate generate`: one prompt, one sequence, straight through the model
//! runtime. Prints the continuation on stdout (nothing else, so it can be
//! piped and compared) and prefill/decode speeds on stderr.

use crate::tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};
use anyhow::{bail, Context, Result};
use specgate_verify::kv_pool::DEFAULT_BLOCK_SIZE;
use specgate_verify::model::load_model;
use specgate_verify::{KvPool, LogitsWanted, Model, Sampler, SamplingParams};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Prompt tokens per prefill forward: bounds scratch memory on long prompts.
const PREFILL_CHUNK: usize = 512;

/// Arguments of `specgate generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A .gguf file, or a directory with config.json, model.safetensors and tokenizer.json.
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
        })
    }
}

/// Loads the tokenizer that belongs to a model path.
pub fn load_tokenizer(model: &Path) -> Result<TextTokenizer> {
    if model.is_dir() {
        let json = model.join("tokenizer.json");
        TextTokenizer::from_tokenizer_json(&json, None, None)
            .with_context(|| format!("loading {}", json.display()))
    } else {
        TextTokenizer::from_gguf_file(model)
            .with_context(|| format!("loading the tokenizer of {}", model.display()))
    }
}

/// Runs `specgate generate`.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let sampling = args.sampling()?;
    let t0 = Instant::now();
    let model = load_model(&args.model)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let tok = load_tokenizer(&args.model)?;
    eprintln!(
        "loaded {} in {:.1}s",
        args.model.display(),
        t0.elapsed().as_secs_f64()
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
    let mut out = std::io::stdout().lock();
    let stats = generate(&model, &tok, &prompt, args, sampling, &mut |s| {
        out.write_all(s.as_bytes())?;
        out.flush()
    })?;
    writeln!(out)?;
    stats.report();
    Ok(())
}

/// Timings of one generation.
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub generated: usize,
    pub decode_secs: f64,
}

impl GenStats {
    fn report(&self) {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        eprintln!(
            "prefill: {} tokens in {:.2}s, {:.1} tok/s",
            self.prompt_tokens,
            self.prefill_secs,
            rate(self.prompt_tokens, self.prefill_secs)
        );
        // The first token comes from the prefill; decode steps make the rest.
        let steps = self.generated.saturating_sub(1);
        eprintln!(
            "decode: {steps} tokens in {:.2}s, {:.1} tok/s",
            self.decode_secs,
            rate(steps, self.decode_secs)
        );
    }
}

/// Generates up to `max_tokens` after `prompt`, calling `emit` with each
/// piece of text as soon as it is whole UTF-8.
pub fn generate(
    model: &Model,
    tok: &TextTokenizer,
    prompt: &[u32],
    args: &GenerateArgs,
    sampling: SamplingParams,
    emit: &mut dyn FnMut(&str) -> std::io::Result<()>,
) -> Result<GenStats> {
    let total = prompt.len() + args.max_tokens;
    let blocks = total.div_ceil(DEFAULT_BLOCK_SIZE).max(1);
    let mut pool = KvPool::new(model.config(), blocks, DEFAULT_BLOCK_SIZE)?;
    // One sequence owns the whole pool; the engine's BlockManager is not needed.
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut sampler = Sampler::new(sampling);
    let mut detok = IncrementalDecoder::new(true);

    let t0 = Instant::now();
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        let start = i * PREFILL_CHUNK;
        let last = start + chunk.len() == prompt.len();
        let want = if last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        let rows = model.forward_one(&mut pool, chunk, start, &table, want)?;
        if last {
            logits = rows
                .into_iter()
                .next()
                .context("no logits for the prompt")?;
        }
    }
    let prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut generated = 0;
    let mut pos = prompt.len();
    while generated < args.max_tokens {
        let next = sampler.sample(&logits);
        generated += 1;
        if !args.ignore_eos && tok.is_eos(next) {
            break;
        }
        emit(&detok.push(tok, next)?)?;
        if generated == args.max_tokens {
            break;
        }
        logits = model
            .forward_one(&mut pool, &[next], pos, &table, LogitsWanted::Last)?
            .remove(0);
        pos += 1;
    }
    emit(&detok.finish())?;
    Ok(GenStats {
        prompt_tokens: prompt.len(),
        prefill_secs,
        generated,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}
