//! Kimi K3 served: the tiny generated target (tests/fixtures/kimi_k3, whose
//! logits the model-level tests check against llama.cpp) under speculation
//! and continuous batching. Its KDA layers keep a recurrent state per
//! sequence, which a rejected draft cannot be trimmed out of: the verify
//! pass keeps the state after every row and the round commits the accepted
//! one. Proven here: greedy speculation (n-gram, a tiny hybrid K3 draft, the
//! target as its own draft) at k = 1..8 equals plain decoding; sampling
//! with speculation follows the target's distribution (chi-square);
//! concurrent requests with preemption equal each request alone at TP 1, 2
//! and 4; cancellation leaks neither blocks nor state slots; and `specgate
//! generate` runs the directory and the GGUF alike.

mod common;

use common::{chi_square, collect_tokens, spec_decode, wait_idle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specgate::engine::scheduler::SchedulerConfig;
use specgate::engine::{spawn, EngineConfig, EngineHandle, GenRequest, KvSize, ProposerKind};
use specgate::spec::SpecStats;
use specgate_draft::{
    DraftError, DraftPolicy, ModelDraft, NgramProposer, Proposal, ProposeRequest, Proposer,
};
use specgate_verify::model::{load_model, load_model_tp};
use specgate_verify::{CacheDtype, KvPool, LogitsWanted, Model, Sampler, SamplingParams, SeqInput};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const BS: usize = 16;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kimi_k3")
        .join(name)
}

fn target(world: usize) -> Model {
    load_model_tp(&fixture("tiny-k3.gguf"), world).unwrap()
}

/// The tiny hybrid K3 draft (2 layers: KDA, gated MLA), same vocabulary.
fn tiny_draft() -> Model {
    load_model(&fixture("tiny-draft-hf")).unwrap()
}

#[test]
fn greedy_speculation_over_recurrent_state_equals_plain_decoding() {
    let target = target(1);
    let draft = Arc::new(tiny_draft());
    // The target as its own draft: every draft accepted.
    // With the target's f32 latent cache (the directory's bf16 weights
    // would load with a bf16 one): then it is the same model exactly.
    let mut twin = load_model(&fixture("tiny-hf")).unwrap();
    twin.set_latent_cache(CacheDtype::F32).unwrap();
    let twin = Arc::new(twin);
    let prompts: [Vec<u32>; 2] = [
        vec![305, 375, 100, 280, 305, 375, 100, 280, 305, 375],
        (0..20).map(|i| (i * 37 % 500) as u32 + 3).collect(),
    ];
    let max_new = 24;
    let (mut partial, mut draft_rej, mut twin_acc) = (0, 0, 0);
    for prompt in &prompts {
        let plain = spec_decode(
            &target,
            None,
            prompt,
            max_new,
            0,
            SamplingParams::default(),
            &mut SpecStats::default(),
        );
        let mut truth = prompt.clone();
        truth.extend_from_slice(&plain);
        for k in 1..=8 {
            let mut scripted = Scripted {
                truth: truth.clone(),
                every: 3,
            };
            let mut s = SpecStats::default();
            let got = spec_decode(
                &target,
                Some(&mut scripted),
                prompt,
                max_new,
                k,
                SamplingParams::default(),
                &mut s,
            );
            assert_eq!(got, plain, "scripted k={k} prompt {prompt:?}");
            if s.accepted_tokens > 0 && s.accepted_tokens < s.draft_tokens {
                partial += 1;
            }
            let mut ngram = NgramProposer::new(1, 3).unwrap();
            let mut s = SpecStats::default();
            let got = spec_decode(
                &target,
                Some(&mut ngram),
                prompt,
                max_new,
                k,
                SamplingParams::default(),
                &mut s,
            );
            assert_eq!(got, plain, "n-gram k={k} prompt {prompt:?}");

            let mut d = ModelDraft::new(draft.clone(), 8, BS).unwrap();
            let mut s = SpecStats::default();
            let got = spec_decode(
                &target,
                Some(&mut d),
                prompt,
                max_new,
                k,
                SamplingParams::default(),
                &mut s,
            );
            assert_eq!(got, plain, "tiny K3 draft k={k} prompt {prompt:?}");
            draft_rej += s.draft_tokens - s.accepted_tokens;
            let mut d = ModelDraft::new(twin.clone(), 8, BS).unwrap();
            let mut s = SpecStats::default();
            let got = spec_decode(
                &target,
                Some(&mut d),
                prompt,
                max_new,
                k,
                SamplingParams::default(),
                &mut s,
            );
            assert_eq!(got, plain, "twin draft k={k} prompt {prompt:?}");
            assert_eq!(
                s.accepted_tokens, s.draft_tokens,
                "the twin draft agrees with its target"
            );
            twin_acc += s.accepted_tokens;
        }
    }
    // Rollback was exercised: partial acceptances and rejections happened.
    assert!(
        partial > 0 && draft_rej > 0 && twin_acc > 0,
        "{partial} {draft_rej} {twin_acc}"
    );
}

/// Proposes the true continuation with every `every`-th position of the
/// whole sequence replaced: acceptance stops at each replaced position, so
/// rounds end at every possible acceptance length.
struct Scripted {
    truth: Vec<u32>,
    every: usize,
}

impl Proposer for Scripted {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        Ok(batch
            .iter()
            .map(|r| Proposal {
                tokens: (r.context.len()..r.context.len() + r.k)
                    .filter_map(|p| {
                        let t = *self.truth.get(p)?;
                        Some(if p % self.every == 0 {
                            (t + 1) % 700
                        } else {
                            t
                        })
                    })
                    .collect(),
                q: None,
                forced: 0,
                branches: Vec::new(),
            })
            .collect())
    }
}

/// Proposes k tokens drawn uniformly from a fixed set, with that uniform q:
/// an unlike draft whose acceptance is partial and random, so sampling
/// rolls back the target's state in most rounds.
struct Uniform {
    set: Vec<u32>,
    vocab: usize,
    rng: StdRng,
}

impl Proposer for Uniform {
    fn propose(&mut self, batch: &mut [ProposeRequest]) -> Result<Vec<Proposal>, DraftError> {
        let mut q = vec![0f32; self.vocab];
        for &t in &self.set {
            q[t as usize] = 1.0 / self.set.len() as f32;
        }
        Ok(batch
            .iter()
            .map(|r| {
                let tokens: Vec<u32> = (0..r.k)
                    .map(|_| self.set[self.rng.random_range(0..self.set.len())])
                    .collect();
                Proposal {
                    q: Some(vec![q.clone(); tokens.len()]),
                    tokens,
                    forced: 0,
                    branches: Vec::new(),
                }
            })
            .collect())
    }
}

#[test]
fn sampling_with_speculation_follows_the_k3_targets_distribution() {
    let target = target(1);
    let vocab = target.config().vocab_size;
    let prompt: Vec<u32> = vec![512, 305, 375, 100, 280, 296, 97];
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 4,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    // Exact p(x1) p(x2 | x1) from whole-prompt forwards.
    let last_row = |tokens: &[u32]| {
        let mut pool = KvPool::for_model(&target, 2, BS).unwrap();
        let rows = target
            .forward_rows(
                &mut pool,
                &[SeqInput {
                    tokens,
                    start_pos: 0,
                    block_table: &[0, 1],
                    logits: LogitsWanted::Last,
                    state_slot: 0,
                }],
            )
            .unwrap();
        sampling(0).warp(&rows[0])
    };
    let p1 = last_row(&prompt);
    let mut exact = vec![0f64; vocab * vocab];
    let mut set: Vec<u32> = Vec::new();
    for x1 in (0..vocab).filter(|&x| p1[x] > 0.0) {
        let mut ctx = prompt.clone();
        ctx.push(x1 as u32);
        let p2 = last_row(&ctx);
        for x2 in (0..vocab).filter(|&x| p2[x] > 0.0) {
            exact[x1 * vocab + x2] = p1[x1] as f64 * p2[x2] as f64;
            set.push(x2 as u32);
        }
        set.push(x1 as u32);
    }
    set.sort_unstable();
    set.dedup();
    // Two tokens the target never picks here: drafts it must reject.
    set.extend([1, 2]);
    let n = 4000;
    let mut counts = vec![0usize; vocab * vocab];
    let mut stats = SpecStats::default();
    for i in 0..n {
        let mut p = Uniform {
            set: set.clone(),
            vocab,
            rng: StdRng::seed_from_u64(i as u64),
        };
        let got = spec_decode(
            &target,
            Some(&mut p),
            &prompt,
            2,
            3,
            sampling(7 + i as u64),
            &mut stats,
        );
        counts[got[0] as usize * vocab + got[1] as usize] += 1;
    }
    let impossible: usize = counts
        .iter()
        .zip(&exact)
        .filter(|(_, &e)| e == 0.0)
        .map(|(c, _)| c)
        .sum();
    assert_eq!(
        impossible, 0,
        "outcomes the target cannot produce were sampled"
    );
    let (stat, crit) = chi_square(&exact, &counts, n);
    eprintln!(
        "chi2 {stat:.1} (critical {crit:.1}), acceptance {:.2}",
        stats.acceptance_rate()
    );
    assert!(
        stat < crit,
        "speculative samples deviate from the target: chi2 {stat} >= {crit}"
    );
    assert!(stats.accepted_tokens > 0 && stats.accepted_tokens < stats.draft_tokens);
}

fn request(i: usize) -> GenRequest {
    let len = 3 + (i * 7) % 30;
    GenRequest {
        prompt: (0..len)
            .map(|j| ((i * 31 + j * (1 + i % 3)) % 500) as u32 + 3)
            .collect(),
        max_new_tokens: 4 + (i * 5) % 16,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: true,
        ..Default::default()
    }
}

/// A request that grows to 4-6 blocks.
fn long(i: usize) -> GenRequest {
    GenRequest {
        max_new_tokens: 48,
        ..request(i)
    }
}

fn engine(
    target: Model,
    proposer: ProposerKind,
    blocks: usize,
    seqs: usize,
    tokens: usize,
) -> EngineHandle {
    let cfg = EngineConfig {
        kv: KvSize::Blocks(blocks),
        block_size: BS,
        scheduler: SchedulerConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: tokens,
        },
        policy: DraftPolicy::Fixed { k: 3 },
        suffix: None,
        tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
        prefix: Default::default(),
        row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
    };
    spawn(target, proposer, None, cfg).unwrap().0
}

#[test]
fn concurrent_requests_with_preemption_equal_each_alone_at_tp_1_2_and_4() {
    let n = 12;
    let (mut preempted, mut trees) = (0, 0);
    for world in [1, 2, 4] {
        // Alone at the same world size: world 2 sums in another order, and
        // this tiny random model can turn 1e-5 into another greedy token.
        let h = engine(target(world), ProposerKind::None, 64, 1, 64);
        let alone: Vec<Vec<u32>> = (0..n)
            .map(|i| collect_tokens(h.submit(long(i)).unwrap()))
            .collect();
        let s = wait_idle(&h);
        assert!(s.prefix_caching, "prefix caching is on by default");
        assert_eq!(s.state_slots, 1);
        for proposer in [
            ProposerKind::None,
            ProposerKind::Ngram { min_n: 1, max_n: 3 },
            ProposerKind::Draft(tiny_draft()),
        ] {
            // 12 blocks cannot hold the 12 sequences together (each grows
            // to 4-6 blocks), and a small token budget chunks prompts.
            let h = engine(target(world), proposer, 12, 12, 40);
            let rxs: Vec<_> = (0..n).map(|i| h.submit(long(i)).unwrap()).collect();
            let together: Vec<Vec<u32>> = rxs.into_iter().map(collect_tokens).collect();
            assert_eq!(together, alone, "world {world}");
            let s = wait_idle(&h);
            assert_eq!(s.state_slots, 12);
            preempted += s.preemptions;
            trees += s.spec.tree_rounds;
        }
    }
    assert!(preempted > 0, "the pool was meant to force preemptions");
    // The n-gram and draft proposals branch: K3 verifies token trees.
    assert!(trees > 0, "no tree was verified");
}

/// Per-row recurrent states are bounded (issue 49, item 3): with room for
/// two rows' states a step, sequences speculating together (n-gram and
/// draft model, chains and trees) shrink their drafts to fit; no step
/// needed more, an unbounded run needed more, and the tokens are the same.
#[test]
fn per_row_states_stay_within_the_row_state_budget_and_change_no_token() {
    let probe = engine(target(1), ProposerKind::None, 64, 1, 64);
    let state_bytes = wait_idle(&probe).checkpoint_slot_bytes;
    assert!(state_bytes > 0, "the tiny K3 has a recurrent state");
    for draft in [false, true] {
        let run = |row_state_bytes: usize| {
            let proposer = if draft {
                ProposerKind::Draft(tiny_draft())
            } else {
                ProposerKind::Ngram { min_n: 1, max_n: 3 }
            };
            let cfg = EngineConfig {
                kv: KvSize::Blocks(64),
                block_size: BS,
                scheduler: SchedulerConfig {
                    max_num_seqs: 6,
                    max_num_batched_tokens: 64,
                },
                policy: DraftPolicy::Fixed { k: 3 },
                suffix: None,
                tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
                prefix: Default::default(),
                row_state_bytes,
            };
            let h = spawn(target(1), proposer, None, cfg).unwrap().0;
            let rxs: Vec<_> = (0..6).map(|i| h.submit(long(i)).unwrap()).collect();
            let tokens: Vec<Vec<u32>> = rxs.into_iter().map(collect_tokens).collect();
            (tokens, wait_idle(&h))
        };
        let (free, f) = run(specgate::engine::DEFAULT_ROW_STATE_BYTES);
        let (bounded, b) = run(2 * state_bytes);
        eprintln!(
            "draft {draft}: peak rows unbounded {} bounded {}",
            f.row_state_peak_bytes / state_bytes,
            b.row_state_peak_bytes / state_bytes
        );
        assert_eq!(bounded, free, "draft model {draft}");
        assert_eq!(b.row_state_rows, 2);
        assert!(
            f.row_state_peak_bytes > 2 * state_bytes,
            "unbounded, a step needed only {} bytes: the bound was never tested",
            f.row_state_peak_bytes
        );
        assert!(b.row_state_peak_bytes > 0, "nothing was verified");
        assert!(
            b.row_state_peak_bytes <= 2 * state_bytes,
            "a step kept {} bytes of row states, over the budget of {}",
            b.row_state_peak_bytes,
            2 * state_bytes
        );
    }
}

/// Clients hanging up at random points (before the first token, mid-way,
/// never) leave no block and no state slot behind, with and without
/// speculation, over many seeds.
#[test]
fn cancellation_leaks_neither_blocks_nor_state_slots() {
    for seed in 0..16u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let proposer = match seed % 3 {
            0 => ProposerKind::None,
            1 => ProposerKind::Ngram { min_n: 1, max_n: 3 },
            _ => ProposerKind::Draft(tiny_draft()),
        };
        let h = engine(target(1 + (seed as usize % 2)), proposer, 16, 6, 48);
        let mut keep = Vec::new();
        for i in 0..10 {
            let mut rx = h.submit(request(seed as usize * 10 + i)).unwrap();
            match rng.random_range(0..3) {
                0 => drop(rx),
                1 => {
                    // Read a few events, then hang up.
                    for _ in 0..rng.random_range(1..4) {
                        if rx.blocking_recv().is_none() {
                            break;
                        }
                    }
                    drop(rx);
                }
                _ => keep.push(rx),
            }
        }
        for rx in keep {
            collect_tokens(rx);
        }
        let s = wait_idle(&h);
        assert_eq!(s.state_slots_used, 0, "seed {seed}");
    }
}

fn generate(model: &Path, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specgate"))
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", "def add(a, b):", "--max-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_runs_the_directory_and_the_gguf_alike() {
    // The directory's bf16 weights load with a bf16 latent cache, the f32
    // GGUF's with an f32 one; with the same cache they are the same model.
    let f32_cache = ["--kv-latent-dtype", "f32"];
    let (ok_dir, dir32, err) = generate(&fixture("tiny-hf"), &f32_cache);
    assert!(ok_dir, "{err}");
    assert!(err.contains("decode tokens="), "{err}");
    let (ok_gguf, gguf, err) = generate(&fixture("tiny-k3.gguf"), &[]);
    assert!(ok_gguf, "{err}");
    assert!(!dir32.is_empty());
    // Same weights, same tokenizer, greedy: the same text.
    assert_eq!(dir32, gguf);
    let (ok, dir, err) = generate(&fixture("tiny-hf"), &[]);
    assert!(ok && !dir.is_empty(), "{err}");
    // K3's chat template (tokenizer_config.json, GGUF metadata) renders
    // and the two agree there too.
    let (ok, chat_dir, err) =
        generate(&fixture("tiny-hf"), &["--chat", "--kv-latent-dtype", "f32"]);
    assert!(ok, "{err}");
    let (ok, chat_gguf, err) = generate(&fixture("tiny-k3.gguf"), &["--chat"]);
    assert!(ok, "{err}");
    assert_eq!(chat_dir, chat_gguf);
    // Sharded, and with speculation (n-gram; the tiny hybrid draft): the
    // same greedy text as the directory alone (its bf16 cache).
    let draft = fixture("tiny-draft-hf");
    let draft = draft.to_str().unwrap();
    for extra in [
        &["--tensor-parallel-size", "2"][..],
        &["--tensor-parallel-size", "4"],
        &["--ngram", "--num-speculative-tokens", "4"],
        &["--draft", draft, "--num-speculative-tokens", "3"],
    ] {
        let (ok, text, err) = generate(&fixture("tiny-hf"), extra);
        assert!(ok, "{extra:?}: {err}");
        assert_eq!(text, dir, "{extra:?}");
    }
}

/// The draft's prefill in chunks (as the engine runs it beside the
/// target's prompt chunks) leaves it exactly where a one-go catch-up does:
/// the first proposal then feeds only the last prompt token and proposes
/// the same tokens, for the hybrid K3 draft and for a plain llama-family
/// draft alike.
#[test]
fn chunked_draft_prefill_equals_catching_up_at_the_first_proposal() {
    use specgate_draft::DraftChunk;
    let tiny_llama = common::tiny_model(
        &specgate_verify::tiny::TinySpec {
            vocab_size: 768,
            ..specgate_verify::tiny::TinySpec::llama(5)
        },
        "k3-llama-draft.gguf",
    );
    let prompt: Vec<u32> = (0..37).map(|i| (i * 41 % 500) as u32 + 3).collect();
    let table: Vec<u32> = (0..4).collect();
    for model in [Arc::new(tiny_draft()), Arc::new(tiny_llama)] {
        let propose = |d: &mut ModelDraft| {
            let mut sampler = Sampler::new(SamplingParams::default());
            d.propose(&mut [ProposeRequest {
                seq_id: 9,
                context: &prompt,
                block_table: &table,
                k: 5,
                branches: 0,
                sampler: &mut sampler,
            }])
            .unwrap()
            .remove(0)
            .tokens
        };
        let mut fresh = ModelDraft::new(model.clone(), 4, BS).unwrap();
        let want = propose(&mut fresh);
        let mut chunked = ModelDraft::new(model.clone(), 4, BS).unwrap();
        for (start, n) in [(0, 10), (10, 16), (26, 10)] {
            chunked
                .prefill(&[DraftChunk {
                    seq_id: 9,
                    tokens: &prompt,
                    start,
                    n,
                    block_table: &table,
                }])
                .unwrap();
        }
        assert_eq!(chunked.held_tokens(9), prompt.len() - 1);
        // A chunk that does not continue what the draft holds is skipped.
        chunked
            .prefill(&[DraftChunk {
                seq_id: 9,
                tokens: &prompt,
                start: 20,
                n: 3,
                block_table: &table,
            }])
            .unwrap();
        assert_eq!(chunked.held_tokens(9), prompt.len() - 1);
        assert_eq!(propose(&mut chunked), want);
        assert!(!want.is_empty());
    }
}

/// The engine sizes its pool from the model's bytes a token: in the same
/// memory the bf16 latent cache (what the bf16 directory loads with) holds
/// twice the blocks of the f32 one.
#[test]
fn bf16_latent_cache_doubles_the_blocks_in_the_same_memory() {
    let blocks = |d: CacheDtype| {
        let mut m = load_model(&fixture("tiny-hf")).unwrap();
        assert_eq!(m.latent_cache(), Some(CacheDtype::Bf16));
        m.set_latent_cache(d).unwrap();
        let cfg = EngineConfig {
            kv: KvSize::MemoryBytes(8 << 20),
            block_size: BS,
            scheduler: SchedulerConfig {
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
            },
            policy: DraftPolicy::Fixed { k: 3 },
            suffix: None,
            tree_branches: specgate::engine::DEFAULT_TREE_BRANCHES,
            prefix: Default::default(),
            row_state_bytes: specgate::engine::DEFAULT_ROW_STATE_BYTES,
        };
        let h = spawn(m, ProposerKind::None, None, cfg).unwrap().0;
        wait_idle(&h).num_blocks
    };
    let (f, b) = (blocks(CacheDtype::F32), blocks(CacheDtype::Bf16));
    assert!(b == 2 * f || b == 2 * f + 1, "f32 {f} blocks, bf16 {b}");
}
