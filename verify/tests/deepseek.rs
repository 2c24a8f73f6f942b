//! The DeepSeek-V3 / Kimi K2 family against an independent reference: the
//! committed tiny checkpoints in tests/fixtures/tiny-kimi* and the logits
//! transformers' DeepseekV3 computed for them (scripts/kimi-reference.sh;
//! the versions are in the reference file's metadata). Also: absorbed vs
//! expanded latent attention, incremental decoding through the latent
//! cache, the cache's size, and tensor parallelism at world sizes 2 and 4.

use specgate_verify::model::{
    load_safetensors, load_safetensors_shard, load_safetensors_tp, MlaPrefill,
};
use specgate_verify::{KvPool, LogitsWanted, Model, ThreadComm};
use std::path::{Path, PathBuf};

/// Max |ours - transformers| over all logits (f32 weights, logits of size
/// ~10): both sides compute in f32, with different summation orders.
const REF_TOL: f32 = 2e-4;
/// Max |a - b| between two of our own paths (absorbed vs expanded, TP world
/// N vs 1, chunked vs whole): same math, reordered sums.
const SELF_TOL: f32 = 1e-4;
const BS: usize = 4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// (prompt, expected logits per position) pairs of a fixture.
fn reference(name: &str) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let path = fixture(name).join("reference.safetensors");
    let t = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    (0..)
        .map_while(|i| {
            let p = t.get(&format!("prompt_{i}"))?;
            let l = &t[&format!("logits_{i}")];
            let prompt = p
                .to_vec1::<i64>()
                .unwrap()
                .iter()
                .map(|&x| x as u32)
                .collect();
            Some((prompt, l.to_vec2::<f32>().unwrap()))
        })
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits of every position of `prompt`, fed in chunks of `chunk` tokens
/// (1 = token by token: every row after the first reads the latent cache).
fn logits_chunked(model: &Model, prompt: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let blocks = prompt.len().div_ceil(BS) + 1;
    let mut pool = KvPool::for_model(model, blocks, BS).unwrap();
    // Reversed block ids: nothing may depend on contiguous blocks.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut out = Vec::new();
    for (i, c) in prompt.chunks(chunk).enumerate() {
        let rows = model
            .forward_one(&mut pool, c, i * chunk, &table, LogitsWanted::All)
            .unwrap();
        out.extend(rows);
    }
    out
}

/// Greedy decoding: the prompt's logits, then `n` tokens one at a time.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let blocks = (prompt.len() + n).div_ceil(BS);
    let mut pool = KvPool::for_model(model, blocks, BS).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut logits = model
        .forward_one(&mut pool, prompt, 0, &table, LogitsWanted::All)
        .unwrap();
    let mut tokens = vec![argmax(logits.last().unwrap())];
    while tokens.len() < n {
        let pos = prompt.len() + tokens.len() - 1;
        let row = model
            .forward_one(
                &mut pool,
                &tokens[tokens.len() - 1..],
                pos,
                &table,
                LogitsWanted::Last,
            )
            .unwrap();
        tokens.push(argmax(&row[0]));
        logits.extend(row);
    }
    (logits, tokens)
}

#[test]
fn tiny_kimi_matches_transformers_deepseek_v3() {
    for name in ["tiny-kimi", "tiny-kimi-qproj"] {
        let model = load_safetensors(&fixture(name)).unwrap();
        for (i, (prompt, want)) in reference(name).iter().enumerate() {
            // Whole prompt in one forward, then token by token (absorbed
            // decode through the latent cache), then in uneven chunks.
            for chunk in [prompt.len(), 1, 5] {
                let got = logits_chunked(&model, prompt, chunk);
                let d = max_diff(&got, want);
                eprintln!("{name} prompt {i} chunk {chunk}: max |diff| {d:e}");
                assert!(d < REF_TOL, "{name} prompt {i} chunk {chunk}: {d}");
                let greedy_ours: Vec<u32> = got.iter().map(|r| argmax(r)).collect();
                let greedy_ref: Vec<u32> = want.iter().map(|r| argmax(r)).collect();
                assert_eq!(greedy_ours, greedy_ref, "{name} prompt {i}");
            }
        }
    }
}

#[test]
fn expanded_prefill_equals_absorbed_attention() {
    for name in ["tiny-kimi", "tiny-kimi-qproj"] {
        let absorbed = load_safetensors(&fixture(name)).unwrap();
        let mut expanded = load_safetensors(&fixture(name)).unwrap();
        expanded.set_mla_prefill(MlaPrefill::ExpandFresh).unwrap();
        for (prompt, want) in reference(name) {
            let a = logits_chunked(&absorbed, &prompt, prompt.len());
            let e = logits_chunked(&expanded, &prompt, prompt.len());
            let d = max_diff(&a, &e);
            eprintln!("{name}: absorbed vs expanded max |diff| {d:e}");
            assert!(d < SELF_TOL, "{name}: {d}");
            assert!(max_diff(&e, &want) < REF_TOL);
            // A first chunk expanded, the rest absorbed over its cache.
            let mixed = logits_chunked(&expanded, &prompt, 7);
            assert!(max_diff(&mixed, &a) < SELF_TOL);
        }
    }
}

#[test]
fn latent_cache_stores_kv_lora_rank_plus_rope_dims_per_layer() {
    let model = load_safetensors(&fixture("tiny-kimi")).unwrap();
    let cfg = model.config();
    let mla = cfg.mla.as_ref().unwrap();
    let expected = cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4;
    assert_eq!(expected, 3 * (32 + 8) * 4);
    let pool = KvPool::new(cfg, 8, BS).unwrap();
    assert_eq!(pool.bytes_per_token(), expected);
    assert_eq!(cfg.kv_bytes_per_token(), expected);
    // Per-head K/V would be 2 * heads * (nope + rope or v) per layer.
    assert!(expected < cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * 4);
    let llama_pool_cfg = specgate_verify::ModelConfig {
        mla: None,
        arch: specgate_verify::Arch::Llama,
        ..cfg.clone()
    };
    let wrong = KvPool::new(&llama_pool_cfg, 8, BS).unwrap();
    let mut wrong = wrong;
    let err = model.forward_one(&mut wrong, &[1], 0, &[0], LogitsWanted::Last);
    assert!(err.is_err(), "a per-head pool must be refused");
}

fn tp_run(name: &str, world: usize, prompt: &[u32], n: usize) -> Vec<(Vec<Vec<f32>>, Vec<u32>)> {
    let dir = fixture(name);
    let handles: Vec<_> = ThreadComm::group(world)
        .unwrap()
        .into_iter()
        .map(|comm| {
            let dir = dir.clone();
            let prompt = prompt.to_vec();
            std::thread::spawn(move || {
                let model = load_safetensors_shard(&dir, Box::new(comm)).unwrap();
                greedy(&model, &prompt, n)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn tensor_parallel_kimi_equals_world_one() {
    let (name, n) = ("tiny-kimi", 12);
    let (prompt, _) = reference(name).swap_remove(1);
    let single = greedy(&load_safetensors(&fixture(name)).unwrap(), &prompt, n);
    for world in [2, 4] {
        let ranks = tp_run(name, world, &prompt, n);
        for (rank, (logits, tokens)) in ranks.iter().enumerate() {
            let d = max_diff(logits, &single.0);
            eprintln!("world {world} rank {rank}: max |diff| {d:e}");
            assert!(d < SELF_TOL, "world {world} rank {rank}: {d}");
            assert_eq!(tokens, &single.1, "world {world} rank {rank}: greedy");
        }
    }
    // The same ranks run by one Model (threads per forward, as the engine
    // runs a `tensor_parallel_size` target), each rank with its own copy of
    // the latent cache.
    for world in [2, 4] {
        let model = load_safetensors_tp(&fixture(name), world).unwrap();
        assert_eq!(model.world_size(), world);
        let (logits, tokens) = greedy(&model, &prompt, n);
        let d = max_diff(&logits, &single.0);
        eprintln!("in-process world {world}: max |diff| {d:e}");
        assert!(d < SELF_TOL, "in-process world {world}: {d}");
        assert_eq!(tokens, single.1, "in-process world {world}: greedy");
        let pool = KvPool::for_model(&model, 1, BS).unwrap();
        assert_eq!(pool.bytes_per_token(), model.kv_bytes_per_token());
        assert_eq!(
            model.kv_bytes_per_token(),
            world * model.config().kv_bytes_per_token()
        );
    }
    assert!(load_safetensors_tp(&fixture(name), 3).is_err());
    // Shapes that do not split fail at load with the world sizes that work.
    let comm = ThreadComm::group(3).unwrap().swap_remove(0);
    let err = match load_safetensors_shard(&fixture(name), Box::new(comm)) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("4 heads split across 3 ranks"),
    };
    assert!(
        err.contains("num_attention_heads") && err.contains("[1, 2, 4]"),
        "{err}"
    );
}
