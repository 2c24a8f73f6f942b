//! The scripted model: a model double for tests that replays given token
//! sequences through the real engine, so a chat format's parser can be
//! tested on exact markup (random weights never write it).
//!
//! A Hugging Face-style directory whose `config.json` has `"model_type":
//! "specgate_scripted"`, `vocab_size`, `eos_token_id` and `"scripts":
//! [[ids...], ...]` (no weights; the tokenizer files sit next to it as
//! for any model). Each cached token is its id, one float in a one-layer
//! latent pool through the ordinary [`crate::KvLayout`], so speculation
//! rollback, preemption and prefix caching work unchanged: the next token
//! depends only on the sequence's history as the pool holds it.

use super::rows::flatten;
use super::{Arch, MlaConfig, Model, ModelConfig, RopeStyle, SeqInput};
use crate::error::{Result, VerifyError};
use crate::kv_pool::KvPool;
use candle_core::{Device, Tensor};

/// The logit of the scripted token; every other token gets
/// [`LOW_LOGIT`], so greedy and sampled decoding both follow the script
/// (the gap leaves the others a probability of about e^-60 even at
/// temperature 2).
const HIGH_LOGIT: f32 = 100.0;
const LOW_LOGIT: f32 = -20.0;

/// The scripts a model replays and the id it ends each with.
///
/// Invariant: every id (scripts and `eos`) is below the config's
/// `vocab_size`; no script is empty.
pub(crate) struct Scripts {
    scripts: Vec<Vec<u32>>,
    eos: u32,
}

impl Scripts {
    /// The token that follows `history`: find the script and the longest
    /// `j >= 1` with `history` ending in `script[..j]` (the first script
    /// on ties); none such means the start of the first script. Then
    /// `script[j]`, or `eos` once the script is spent.
    fn next(&self, history: &[u32]) -> u32 {
        let mut best: Option<(usize, usize)> = None;
        for (si, s) in self.scripts.iter().enumerate() {
            for j in (1..=s.len().min(history.len())).rev() {
                if history.ends_with(&s[..j]) {
                    if best.is_none_or(|(_, bj)| j > bj) {
                        best = Some((si, j));
                    }
                    break;
                }
            }
        }
        let (si, j) = best.unwrap_or((0, 0));
        self.scripts[si].get(j).copied().unwrap_or(self.eos)
    }
}

/// The config and scripts of a `specgate_scripted` config.json.
///
/// Errors: a missing `vocab_size` or `eos_token_id`, `scripts` missing,
/// empty, holding an empty script or an id outside the vocabulary.
pub(crate) fn config_from_hf_json(json: &serde_json::Value) -> Result<(ModelConfig, Scripts)> {
    let bad = |m: String| VerifyError::BadConfig(format!("scripted model config.json: {m}"));
    let vocab = super::loader::json_usize(json, "vocab_size")?;
    let eos = super::loader::json_usize(json, "eos_token_id")?;
    let max_position = json
        .get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .unwrap_or(4096) as usize;
    let scripts: Vec<Vec<u32>> = json
        .get("scripts")
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| bad(format!("scripts: {e}")))?
        .ok_or_else(|| bad("no `scripts`".into()))?;
    if scripts.is_empty() || scripts.iter().any(Vec::is_empty) {
        return Err(bad(
            "`scripts` must be a non-empty list of non-empty id lists".into(),
        ));
    }
    if let Some(t) = scripts
        .iter()
        .flatten()
        .copied()
        .chain([eos as u32])
        .find(|&t| t as usize >= vocab)
    {
        return Err(bad(format!("token {t} outside the vocabulary of {vocab}")));
    }
    let cfg = ModelConfig {
        arch: Arch::Scripted,
        vocab_size: vocab,
        hidden_size: 1,
        intermediate_size: 1,
        num_layers: 1,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Neox,
        max_position,
        // One cached float per token: its id (as a one-wide latent row).
        mla: Some(Box::new(MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 1,
            qk_nope_head_dim: 0,
            qk_rope_head_dim: 0,
            v_head_dim: 1,
        })),
        moe: None,
        yarn: None,
    };
    cfg.validate()?;
    Ok((
        cfg,
        Scripts {
            scripts,
            eos: eos as u32,
        },
    ))
}

/// Loads a scripted model (no weights: `weight_bytes` 0).
///
/// Errors: those of [`config_from_hf_json`], or `world` other than 1.
pub(crate) fn load(json: &serde_json::Value, world: usize) -> Result<Model> {
    if world != 1 {
        return Err(VerifyError::BadConfig(format!(
            "the scripted model runs unsharded, not over {world} ranks"
        )));
    }
    let (cfg, scripts) = config_from_hf_json(json)?;
    Ok(Model {
        cfg,
        body: super::Body::Scripted(scripts),
        weight_bytes: 0,
        head_tokens: None,
        lm_bytes: 0,
        // Token ids are the cached values: bf16 would round ids past 256.
        latent_cache: crate::kv_pool::CacheDtype::F32,
        step: std::sync::Mutex::new(()),
        leader: None,
    })
}

/// Stores every new token's id in the pool, then for each row that wants
/// logits reads its sequence's history back from the pool and puts
/// [`HIGH_LOGIT`] on the scripted next token.
pub(crate) fn forward(
    model: &Model,
    scripts: &Scripts,
    pool: &mut KvPool,
    seqs: &[SeqInput],
) -> Result<Tensor> {
    let rows = flatten(model, pool, seqs)?;
    let shard = &mut pool.shards_mut()[0];
    for i in 0..rows.tokens.len() {
        let table = seqs[rows.seq[i]].block_table;
        shard.write_latent(0, table, rows.positions[i], &[rows.tokens[i] as f32]);
    }
    let vocab = model.cfg.vocab_size;
    let mut out = vec![LOW_LOGIT; rows.logit_rows.len() * vocab];
    for (r, &row) in rows.logit_rows.iter().enumerate() {
        let row = row as usize;
        let table = seqs[rows.seq[row]].block_table;
        // Ids below 2^24 are exact in f32.
        let history: Vec<u32> = (0..=rows.positions[row])
            .map(|p| shard.latent_row(0, table, p).get(0) as u32)
            .collect();
        out[r * vocab + scripts.next(&history) as usize] = HIGH_LOGIT;
    }
    Ok(Tensor::from_vec(
        out,
        (rows.logit_rows.len(), vocab),
        &Device::Cpu,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LogitsWanted;
    use serde_json::json;

    fn model(scripts: serde_json::Value) -> Model {
        load(
            &json!({"model_type": "specgate_scripted", "vocab_size": 50,
                    "eos_token_id": 49, "scripts": scripts}),
            1,
        )
        .unwrap()
    }

    fn greedy(row: &[f32]) -> u32 {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32
    }

    #[test]
    fn replays_the_script_after_any_prompt_and_ends_with_eos() {
        let m = model(json!([[7, 8, 7, 9]]));
        let mut pool = KvPool::for_model(&m, 4, 4).unwrap();
        let table = [2, 0, 3];
        // Prompt of 5 tokens, then decode one token at a time.
        let mut seq = vec![1, 2, 3, 4, 5];
        let rows = m
            .forward_one(&mut pool, &seq, 0, &table, LogitsWanted::Last)
            .unwrap();
        let mut next = greedy(&rows[0]);
        while seq.len() < 10 {
            seq.push(next);
            let p = seq.len() - 1;
            let rows = m
                .forward_one(&mut pool, &seq[p..], p, &table, LogitsWanted::Last)
                .unwrap();
            next = greedy(&rows[0]);
        }
        // 7 8 7 9 then EOS (49).
        assert_eq!(&seq[5..], &[7, 8, 7, 9, 49]);
    }

    #[test]
    fn verification_rows_follow_the_pool_and_a_second_script_is_picked_by_its_start() {
        let m = model(json!([[10, 11, 12], [20, 21, 22]]));
        let mut pool = KvPool::for_model(&m, 2, 8).unwrap();
        // All rows: a prompt ending in 20 continues the second script.
        let rows = m
            .forward_one(&mut pool, &[3, 20, 21, 5], 0, &[1], LogitsWanted::All)
            .unwrap();
        let got: Vec<u32> = rows.iter().map(|r| greedy(r)).collect();
        assert_eq!(got, [10, 21, 22, 10]);
        // Overwriting position 3 (a rejected draft rolled back) changes
        // what follows: the pool, not the call, holds the history.
        let rows = m
            .forward_one(&mut pool, &[22], 3, &[1], LogitsWanted::Last)
            .unwrap();
        assert_eq!(greedy(&rows[0]), 49);
    }

    #[test]
    fn bad_scripts_are_refused() {
        for scripts in [json!([]), json!([[]]), json!([[50]]), json!("x")] {
            let r = load(
                &json!({"model_type": "specgate_scripted", "vocab_size": 50,
                        "eos_token_id": 49, "scripts": scripts}),
                1,
            );
            assert!(r.is_err(), "{scripts}");
        }
    }
}
