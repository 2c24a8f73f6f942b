#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py on the tiny K3 checkpoint, with two tokenizer patches.

Usage: python3 scripts/k3/convert.py <llama.cpp dir> <hf dir> <out.gguf> [outtype]
       (passes --outtype f32 unless an outtype is given: f32, bf16, f16, q8_0; the MXFP4
       experts stay MXFP4 whatever the outtype)

Why patches are needed (both are about the TOKENIZER only; no tensor or hparam code is touched):

1. Kimi's tokenizer is a custom TikToken class (`tokenization_kimi.py`, loaded through
   `AutoTokenizer.from_pretrained(dir, trust_remote_code=True)`). The fixture does not ship that
   remote-code file (it is Moonshot's and needs the hub), so `AutoTokenizer` cannot build it.
   We substitute `MiniKimiTokenizer`, which exposes exactly the members kimi_linear.py's
   `set_vocab` reads: `model._mergeable_ranks`, `special_tokens`, `eos_id` (plus `encode`).
   It is returned ONLY for `trust_remote_code=True` calls on a directory that has
   `tiktoken.model` and no `tokenizer.json`; the converter's first attempt
   (`_set_vocab_gpt2`, no remote code) still fails as it does for the real K3, and any other
   directory goes to the real AutoTokenizer.

2. `get_vocab_base_pre` identifies the pre-tokenizer by hashing the token ids of a fixed probe
   text. A 512-token vocab cannot reproduce the 163840-token vocab's hash
   (81212dc7...027890 -> "kimi-k2"), so for MiniKimiTokenizer it returns "kimi-k2" directly —
   the split pattern IS Kimi's (see gen_tiny_k3.KIMI_PAT_STR), which is what that hash stands for.
"""

from __future__ import annotations

import base64
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gen_tiny_k3 import KIMI_PAT_STR  # noqa: E402


class _Model:
    def __init__(self, ranks: dict[bytes, int]):
        self._mergeable_ranks = ranks


class MiniKimiTokenizer:
    """Stand-in for tokenization_kimi.TikTokenTokenizer (the members the converter uses)."""

    def __init__(self, hf_dir: Path):
        import json

        import tiktoken

        ranks: dict[bytes, int] = {}
        for line in (hf_dir / "tiktoken.model").read_text().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
        n_base = len(ranks)
        named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        # tokenization_kimi.py: every one of the 256 reserved ids exists, unnamed ones are
        # <|reserved_token_{id}|>
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + 256)}
        self.model = _Model(ranks)
        self.eos_id = self.special_tokens[cfg["eos_token"]]
        self.bos_id = self.special_tokens[cfg["bos_token"]]
        self._enc = tiktoken.Encoding(name="kimi-tiny", pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)

    def encode(self, text: str, **_kw) -> list[int]:
        return self._enc.encode(text, allowed_special="all")


def _is_tiny_kimi_dir(p) -> bool:
    try:
        p = Path(p)
    except TypeError:
        return False
    return (p / "tiktoken.model").is_file() and not (p / "tokenizer.json").exists()


def install_patches(llama_cpp: Path):
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import transformers

    orig_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        if _is_tiny_kimi_dir(path):
            if not kwargs.get("trust_remote_code"):
                raise ValueError("Kimi's TikTokenTokenizer needs trust_remote_code=True")
            return MiniKimiTokenizer(Path(path))
        return orig_from_pretrained(path, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = from_pretrained

    from conversion import base

    orig_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        if isinstance(tokenizer, MiniKimiTokenizer):
            return "kimi-k2"
        return orig_pre(self, tokenizer)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main():
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    llama_cpp, hf_dir, out = (Path(a).resolve() for a in sys.argv[1:4])
    outtype = sys.argv[4] if len(sys.argv) == 5 else "f32"
    install_patches(llama_cpp)
    sys.argv = [str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
    runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
