#!/usr/bin/env python3
"""Generates the tiny Kimi-K2-architecture checkpoints (DeepSeek-V3 layout:
MLA attention + MoE) and their reference logits, computed by the Hugging Face
`transformers` DeepseekV3 model in float32 with eager attention.

Run through scripts/kimi-reference.sh, which builds a pinned venv. Writes, per
variant, into tests/fixtures/<name>/:
  config.json        published DeepSeek-V3 / Kimi K2 config keys
  model.safetensors  published tensor names (per-expert gate/up/down)
  reference.safetensors  prompt_<i> (i64 token ids) and logits_<i> (f32,
                     [len, vocab], every position); the metadata records the
                     transformers and torch versions that produced them.

Everything is deterministic for the fixed seeds below. The checkpoint is
saved first and then loaded back through `from_pretrained`, so the reference
runs on exactly the bytes the Rust runtime reads, through transformers' own
mapping of the published names.
"""

import json
import math
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 384  # the tiny llama draft's vocabulary (verify/src/tiny.rs)

VARIANTS = {
    # The main one: low-rank query, YaRN with a non-trivial mscale ratio,
    # group-limited routing (4 groups, 2 kept), a dense first layer.
    "tiny-kimi": dict(
        seed=1234,
        config={
            "model_type": "kimi_k2",
            "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 16,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "qk_nope_head_dim": 16,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
            },
            "attention_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        prompts=[
            [3, 17, 250, 99, 4, 4, 120, 383, 7, 56, 201, 13],
            [100, 101, 102, 103, 104, 100, 101, 102, 9, 8, 7, 300, 301, 5, 60, 61,
             62, 63, 2, 77, 78, 79, 80, 81],
        ],
    ),
    # The other branches: full-rank query (q_lora_rank null), no RoPE
    # scaling, neox-style RoPE pairs, one expert group (as Kimi K2 ships),
    # unnormalized top-k weights, two shared experts.
    "tiny-kimi-qproj": dict(
        seed=4321,
        config={
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": 48,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_shared_experts": 2,
            "n_routed_experts": 8,
            "routed_scaling_factor": 1.5,
            "kv_lora_rank": 24,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "qk_nope_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "norm_topk_prob": False,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_interleave": False,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
        prompts=[[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 200, 11, 12]],
    ),
}


def tensors(cfg, gen):
    """Random weights in the published tensor names, scaled so activations stay
    O(1) and next-token distributions are peaked enough for greedy tests."""

    def uni(shape, a):
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(a).float()

    def mat(out, inp, gain=1.0):
        return uni((out, inp), gain * math.sqrt(3.0 / inp))

    def norm(n):
        return 1.0 + uni((n,), 0.2)

    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kvr = cfg["kv_lora_rank"]
    t = {"model.embed_tokens.weight": uni((cfg["vocab_size"], h), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(h)
        t[f"{p}.post_attention_layernorm.weight"] = norm(h)
        a = f"{p}.self_attn"
        if cfg["q_lora_rank"] is None:
            t[f"{a}.q_proj.weight"] = mat(nh * qk, h)
        else:
            r = cfg["q_lora_rank"]
            t[f"{a}.q_a_proj.weight"] = mat(r, h)
            t[f"{a}.q_a_layernorm.weight"] = norm(r)
            t[f"{a}.q_b_proj.weight"] = mat(nh * qk, r)
        t[f"{a}.kv_a_proj_with_mqa.weight"] = mat(kvr + cfg["qk_rope_head_dim"], h)
        t[f"{a}.kv_a_layernorm.weight"] = norm(kvr)
        t[f"{a}.kv_b_proj.weight"] = mat(nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvr)
        t[f"{a}.o_proj.weight"] = mat(h, nh * cfg["v_head_dim"])
        m = f"{p}.mlp"
        if i < cfg["first_k_dense_replace"]:
            ff = cfg["intermediate_size"]
            t[f"{m}.gate_proj.weight"] = mat(ff, h)
            t[f"{m}.up_proj.weight"] = mat(ff, h)
            t[f"{m}.down_proj.weight"] = mat(h, ff)
            continue
        ff = cfg["moe_intermediate_size"]
        ne = cfg["n_routed_experts"]
        # Router logits of spread ~2 so sigmoid scores differ clearly; the
        # correction bias is large enough to change some selections.
        t[f"{m}.gate.weight"] = mat(ne, h, 2.0)
        t[f"{m}.gate.e_score_correction_bias"] = uni((ne,), 0.3)
        for e in range(ne):
            t[f"{m}.experts.{e}.gate_proj.weight"] = mat(ff, h)
            t[f"{m}.experts.{e}.up_proj.weight"] = mat(ff, h)
            t[f"{m}.experts.{e}.down_proj.weight"] = mat(h, ff)
        sff = ff * cfg["n_shared_experts"]
        t[f"{m}.shared_experts.gate_proj.weight"] = mat(sff, h)
        t[f"{m}.shared_experts.up_proj.weight"] = mat(sff, h)
        t[f"{m}.shared_experts.down_proj.weight"] = mat(h, sff)
    t["model.norm.weight"] = norm(h)
    t["lm_head.weight"] = mat(cfg["vocab_size"], h, 4.0)
    return t


def build(name, spec, root):
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    cfg = spec["config"]
    gen = torch.Generator().manual_seed(spec["seed"])
    weights = tensors(cfg, gen)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

    # transformers does not know model_type "kimi_k2" (Kimi ships its own
    # code under that name, the DeepSeek-V3 architecture); hand it the same
    # keys as a DeepseekV3Config.
    hf = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = DeepseekV3Config(**hf)
    config._attn_implementation = "eager"
    rp = config.rope_parameters
    if "rope_scaling" in cfg:
        assert rp["rope_type"] == "yarn", rp
        assert rp["factor"] == cfg["rope_scaling"]["factor"], rp
        assert rp["mscale_all_dim"] == cfg["rope_scaling"]["mscale_all_dim"], rp
    else:
        assert rp.get("rope_type", "default") == "default", rp
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        out, config=config, dtype=torch.float32, output_loading_info=True
    )
    if info["missing_keys"] or info["unexpected_keys"] or info.get("mismatched_keys"):
        sys.exit(f"{name}: checkpoint does not map onto DeepseekV3: {info}")
    # The loaded model must hold exactly the generated weights.
    sd = model.state_dict()
    for i in range(cfg["num_hidden_layers"]):
        if i >= cfg["first_k_dense_replace"]:
            b = sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
            assert torch.equal(b, weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
            assert b.abs().sum() > 0
    assert torch.equal(sd["lm_head.weight"], weights["lm_head.weight"])
    model.eval()

    ref = {}
    with torch.no_grad():
        for i, prompt in enumerate(spec["prompts"]):
            ids = torch.tensor([prompt], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0].float().contiguous()
            ref[f"prompt_{i}"] = ids[0].clone()
            ref[f"logits_{i}"] = logits
            top = logits.argmax(-1).tolist()
            print(f"{name} prompt {i}: greedy next tokens {top}")
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": "eager",
        "dtype": "float32",
        "seed": str(spec["seed"]),
    }
    save_file(ref, os.path.join(out, "reference.safetensors"), metadata=meta)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: wrote {out} ({size} bytes) with transformers {transformers.__version__}, torch {torch.__version__}")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for name, spec in VARIANTS.items():
        build(name, spec, root)


if __name__ == "__main__":
    main()
