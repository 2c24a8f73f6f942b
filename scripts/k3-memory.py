#!/usr/bin/env python3
"""Kimi K3 at full size: parameter, weight-byte and per-sequence state arithmetic
from the published config. Computed, not measured. Standard library only.

    python3 scripts/k3-memory.py            # markdown tables on stdout

Conventions
  * GB = 1e9 bytes (decimal); devices are taken at their nominal size and only
    USABLE_FRACTION of it is given to weights + state (the rest: activations,
    workspace, CUDA context, fragmentation).
  * Routed experts at MXFP4 as shipped (compressed-tensors "mxfp4-pack-quantized",
    E2M1 4-bit values + one E8M0 scale byte per 32 weights = 4.25 bits/weight).
  * Everything else at the checkpoint's dtype: BF16, except the few tensors the
    checkpoint stores in F32 (KDA conv taps, A_log, dt_bias, o_norm, the router's
    e_score_correction_bias), counted at 4 bytes.
  * The "FP8 non-experts" column is a what-if (1 byte per BF16 weight, scales
    ignored): the release ships the non-expert weights in BF16.
  * Tensor shapes are those of the checkpoint (language_model.model.layers.N.*);
    see the notes at the bottom of the output.
"""

# Source: https://huggingface.co/moonshotai/Kimi-K3/raw/main/config.json
# (text_config, trimmed to the keys used here; values as published, July 2026).
# Transcribed from copies of that file quoted in public code (one pinned to revision
# f831ab66814297da540d832a5235f8e904f29d06), not downloaded by this script.
CONFIG = {
    "model_type": "kimi_k3",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "vocab_size": 163840,
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": 12,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            # 1-based layer numbers
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48,
                                 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93],
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
        },
    },
}

MXFP4_BYTES = (4 + 8 / 32) / 8          # 0.53125 bytes per weight
BF16, F32, FP8 = 2, 4, 1
GB = 1e9
USABLE_FRACTION = 0.90
CONTEXT = 128 * 1024                     # 131072 tokens
N_SEQS = 64
DEVICES_GB = (80, 141, 192)
TP_SIZES = (8, 16, 32, 64)


def model_inventory(c):
    """Returns a list of (group, params, dtype_bytes, sharded, kind).
    kind: 'expert' | 'bf16' | 'f32'. sharded: False for what every TP rank holds whole."""
    t = c["text_config"]
    la = t["linear_attn_config"]
    d = t["hidden_size"]
    n_layer = t["num_hidden_layers"]
    full = {i - 1 for i in la["full_attn_layers"]}
    n_mla = len(full)
    n_kda = n_layer - n_mla
    hk, dk, w = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    p = hk * dk
    h = t["num_attention_heads"]
    qk = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
    n_dense = t["first_k_dense_replace"]
    n_moe = n_layer - n_dense
    e, fe, lat = t["num_experts"], t["moe_intermediate_size"], t["routed_expert_hidden_size"]
    sh = fe * t["num_shared_experts"]
    v = t["vocab_size"]

    inv = []
    add = lambda g, n, kind, sharded=True: inv.append((g, n, kind, sharded))
    add("embed_tokens", v * d, "bf16")
    add("lm_head", v * d, "bf16")
    add("final norm + output AttnRes (norm, proj)", 3 * d, "bf16", False)
    # per layer: input/post norms + two AttnRes (norm, proj) pairs
    add("layer norms + AttnRes vectors", n_layer * 6 * d, "bf16", False)
    # KDA
    kda_bf16 = (3 * p * d          # q, k, v proj
                + dk * d + p * dk  # f_a, f_b
                + hk * d           # b_proj
                + p * d            # g_proj (full rank)
                + d * p)           # o_proj
    kda_f32 = 3 * p * w + dk + p + dk   # conv taps, A_log (stored padded to 128), dt_bias, o_norm
    add("KDA projections (69 layers)", n_kda * kda_bf16, "bf16")
    add("KDA conv/A_log/dt_bias/o_norm (F32)", n_kda * kda_f32, "f32")
    # MLA
    mla = (t["q_lora_rank"] * d + t["q_lora_rank"]                    # q_a + q_a_layernorm
           + h * qk * t["q_lora_rank"]                                 # q_b
           + (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * d           # kv_a_proj_with_mqa
           + t["kv_lora_rank"]                                         # kv_a_layernorm
           + h * (t["qk_nope_head_dim"] + t["v_head_dim"]) * t["kv_lora_rank"]  # kv_b
           + h * t["v_head_dim"] * d                                   # g_proj (output gate)
           + d * h * t["v_head_dim"])                                  # o_proj
    add("MLA projections (24 layers)", n_mla * mla, "bf16")
    # dense layer(s)
    add("dense SiTU MLP (layer 0)", n_dense * 3 * t["intermediate_size"] * d, "bf16")
    # MoE non-expert
    add("router weight", n_moe * e * d, "bf16", False)
    add("router e_score_correction_bias (F32)", n_moe * e, "f32", False)
    add("latent down/up + latent norm", n_moe * (2 * lat * d + lat), "bf16")
    add("shared experts (2 x 3072, full width)", n_moe * 3 * sh * d, "bf16")
    # routed experts
    add("routed experts (896 x 3 x 3072 x 3584, 92 layers)", n_moe * e * 3 * fe * lat, "expert")
    return inv, dict(n_kda=n_kda, n_mla=n_mla, n_moe=n_moe, expert_params=3 * fe * lat)


def nbytes(n, kind, nonexpert_bytes=BF16):
    if kind == "expert":
        return n * MXFP4_BYTES
    if kind == "f32":
        return n * F32
    return n * nonexpert_bytes


def state_per_seq(c):
    t = c["text_config"]
    la = t["linear_attn_config"]
    n_mla = len(la["full_attn_layers"])
    n_kda = t["num_hidden_layers"] - n_mla
    p = la["num_heads"] * la["head_dim"]
    conv = 3 * p * (la["short_conv_kernel_size"] - 1)        # last W-1 inputs of q, k, v
    rec = la["num_heads"] * la["head_dim"] * la["head_dim"]  # S: [dk x dv] per head
    latent = t["kv_lora_rank"] + t["qk_rope_head_dim"]       # absorbed MLA cache per token per layer
    full_kv = t["num_attention_heads"] * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"] + t["v_head_dim"])
    return dict(n_kda=n_kda, n_mla=n_mla, conv=conv, rec=rec,
                kda_vals=n_kda * (conv + rec), latent=latent,
                mla_vals_per_tok=n_mla * latent, full_kv_per_tok=n_mla * full_kv)


def fmt_gb(b):
    return f"{b / GB:,.2f}"


def main():
    inv, m = model_inventory(CONFIG)
    st = state_per_seq(CONFIG)

    tot_p = sum(n for _, n, _, _ in inv)
    exp_p = sum(n for _, n, k, _ in inv if k == "expert")
    tot_b = sum(nbytes(n, k) for _, n, k, _ in inv)
    tot_b8 = sum(nbytes(n, k, FP8) for _, n, k, _ in inv)
    t = CONFIG["text_config"]
    active_p = tot_p - exp_p + m["n_moe"] * t["num_experts_per_token"] * m["expert_params"] \
        - t["vocab_size"] * t["hidden_size"]  # embedding lookup is not a matmul

    print("### Weights (routed experts MXFP4 at 4.25 bits/weight; rest BF16, F32 where shipped so)\n")
    print("| group | parameters | GB as shipped | GB, FP8 non-experts (what-if) |")
    print("|---|---:|---:|---:|")
    for g, n, k, _ in inv:
        print(f"| {g} | {n:,} | {fmt_gb(nbytes(n, k))} | {fmt_gb(nbytes(n, k, FP8))} |")
    print(f"| **total** | **{tot_p:,}** ({tot_p / 1e12:.3f} T) | **{fmt_gb(tot_b)}** | **{fmt_gb(tot_b8)}** |")
    print(f"\nRouted experts: {exp_p:,} parameters ({100 * exp_p / tot_p:.1f}% of all), "
          f"{fmt_gb(exp_p * MXFP4_BYTES)} GB. Non-expert: {tot_p - exp_p:,} parameters, "
          f"{fmt_gb(tot_b - exp_p * MXFP4_BYTES)} GB.")
    print(f"Active per token (16 of 896 experts + all non-expert matmuls, lm_head included, "
          f"embedding excluded): {active_p / 1e9:,.1f} B parameters.\n")

    print("### Per-sequence state\n")
    print("| item | values | f32 | bf16 |")
    print("|---|---:|---:|---:|")
    kda_conv = st["n_kda"] * st["conv"]
    kda_rec = st["n_kda"] * st["rec"]
    print(f"| KDA conv state, {st['n_kda']} layers x 3 x 12288 x 3 | {kda_conv:,} | "
          f"{kda_conv * F32 / 1e6:,.1f} MB | {kda_conv * BF16 / 1e6:,.1f} MB |")
    print(f"| KDA recurrent state, {st['n_kda']} layers x 96 x 128 x 128 | {kda_rec:,} | "
          f"{kda_rec * F32 / 1e6:,.1f} MB | {kda_rec * BF16 / 1e6:,.1f} MB |")
    print(f"| **KDA total per sequence (independent of length)** | {st['kda_vals']:,} | "
          f"**{st['kda_vals'] * F32 / 1e6:,.1f} MB** | **{st['kda_vals'] * BF16 / 1e6:,.1f} MB** |")
    lt = st["mla_vals_per_tok"]
    print(f"| MLA latent per token, {st['n_mla']} layers x (512 + 64) | {lt:,} | "
          f"{lt * F32:,} B | {lt * BF16:,} B |")
    print(f"| MLA latent at {CONTEXT:,} tokens | {lt * CONTEXT:,} | "
          f"{fmt_gb(lt * CONTEXT * F32)} GB | {fmt_gb(lt * CONTEXT * BF16)} GB |")
    fk = st["full_kv_per_tok"]
    print(f"| (not absorbed: per-head K 192 + V 128, 96 heads, per token) | {fk:,} | "
          f"{fk * F32:,} B | {fk * BF16:,} B |")
    seq_b = st["kda_vals"] * F32 + lt * CONTEXT * BF16
    print(f"\nBudget used below, per sequence at {CONTEXT:,} tokens: KDA state in f32 + MLA latent in bf16 = "
          f"{fmt_gb(seq_b)} GB; for {N_SEQS} sequences {fmt_gb(N_SEQS * seq_b)} GB.\n")

    # per rank at TP: sharded groups / tp, replicated groups whole.
    rep_b = sum(nbytes(n, k) for _, n, k, s in inv if not s)
    shard_b = tot_b - rep_b
    kda_seq = st["kda_vals"] * F32
    lat_seq = lt * CONTEXT * BF16
    print(f"### Per rank at tensor parallelism (weights: sharded part / TP + replicated part "
          f"{fmt_gb(rep_b)} GB)\n")
    print(f"State columns: {N_SEQS} sequences x {CONTEXT:,} tokens. KDA state splits by head (/TP); "
          f"the absorbed MLA latent is one shared 'head', so plain TP REPLICATES it on every rank.\n")
    print("| TP | weights/rank GB | KDA state/rank GB | MLA latent/rank GB (replicated) | total/rank GB | "
          f"128k sequences one TP group holds (latent replicated), {' / '.join(str(x) for x in DEVICES_GB)} GB devices |")
    print("|---:|---:|---:|---:|---:|---|")
    for tp in TP_SIZES:
        w = shard_b / tp + rep_b
        k = N_SEQS * kda_seq / tp
        l = N_SEQS * lat_seq
        fits = []
        for dev in DEVICES_GB:
            free = dev * GB * USABLE_FRACTION - w
            per = kda_seq / tp + lat_seq
            fits.append(str(max(0, int(free // per))) if free > 0 else "weights do not fit")
        note = "" if t["num_attention_heads"] % tp == 0 else " (96 heads do not split evenly)"
        print(f"| {tp}{note} | {fmt_gb(w)} | {fmt_gb(k)} | {fmt_gb(l)} | {fmt_gb(w + k + l)} | "
              f"{' / '.join(fits)} |")

    print(f"\n### Minimum ranks, with {int(USABLE_FRACTION * 100)}% of each device usable\n")
    print("| device | weights only | weights + 64 x 128k state, state sharded by sequence too | "
          "same, rounded up to a TP size that divides 96 heads | plain TP (latent replicated) |")
    print("|---|---:|---:|---:|---|")
    total_state = N_SEQS * (kda_seq + lat_seq)
    for dev in DEVICES_GB:
        usable = dev * GB * USABLE_FRACTION
        n_w = next(n for n in range(1, 4096) if shard_b / n + rep_b <= usable)
        n_ws = next(n for n in range(1, 4096) if (shard_b + total_state) / n + rep_b <= usable)
        n_tp = next(n for n in range(n_ws, 4096) if 96 % n == 0 or n % 96 == 0)
        plain = "never: 64 x 128k latent alone is " + fmt_gb(N_SEQS * lat_seq) + " GB per rank"
        if N_SEQS * lat_seq < usable:
            cand = [n for n in range(1, 4096)
                    if shard_b / n + rep_b + N_SEQS * (kda_seq / n + lat_seq) <= usable]
            plain = str(cand[0]) if cand else "never"
        print(f"| {dev} GB | {n_w} | {n_ws} | {n_tp} | {plain} |")

    print("\nNotes: the expert count assumes every routed expert resident (no offload); "
          "'sharded by sequence' means the MLA latent and KDA state of the 64 sequences are spread "
          "over the ranks (data-parallel attention or context parallelism), not replicated; "
          "activations, logits (163840 x f32 per row) and communication buffers are not counted.")


if __name__ == "__main__":
    main()
