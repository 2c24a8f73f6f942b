#!/usr/bin/env python3
"""Tokenizer test vectors for the tiny K3 vocab.

Encodes a fixed list of strings with `tiktoken` (PyPI) built exactly like Kimi's
tokenization_kimi.py builds it: `tiktoken.Encoding(pat_str=KIMI_PAT_STR,
mergeable_ranks=<tiny-hf/tiktoken.model>, special_tokens=<K3's 256 reserved ids>)`.

Plain text is encoded with `encode(text, allowed_special="all")` so special-token TEXT such as
"<|end_of_msg|>" becomes its special id (what llama.cpp does with parse_special=true), and
also with `encode_ordinary` (special text is plain BPE; llama.cpp parse_special=false).

If `--llama-tokens FILE` is given (written by scripts/k3/tokenize_llama, see
make-fixtures.sh), llama.cpp's ids for the same strings are added as "llama_ids" /
"llama_ids_ordinary", and mismatches are reported.

Writes tests/fixtures/kimi_k3/tokenizer-vectors.json:
  {"pattern": str, "vocab": "tiny-hf/tiktoken.model", "num_base_tokens": 512,
   "cases": [{"text", "ids", "ids_ordinary", ["llama_ids", "llama_ids_ordinary"]}]}
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_tiny_k3 import KIMI_PAT_STR, special_tokens  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "kimi_k3"

STRINGS = [
    "Hello, world!",
    "Hello world",
    "the quick brown fox jumps over the lazy dog",
    "The Quick BROWN fox",
    "don't",
    "I'll tell you what they've said: we're sure it's fine, you'd agree. I'M SURE.",
    "DON'T STOP, It'S",
    "1234567890",
    "3.14159 2026-08-11 0xDEADBEEF",
    "a1b22c333d4444",
    "fn main() {\n    println!(\"total = {}\", total);\n}\n",
    "def forward(self, x):\n\treturn x * 2  # comment\n",
    "for (int i = 0; i < n; ++i) { out[i] = in[i]; }",
    "    indented with four spaces",
    "trailing spaces   ",
    "many     spaces     inside",
    "\n\n\nthree newlines",
    "line\r\nwindows\r\nendings",
    " \t \t\t mixed whitespace \n \n",
    "你好世界",
    "我想在apple工作1314151天",
    "日本語のテキスト",
    "Привет, мир",
    "emoji 🚀🦙 and ✅",
    "😶‍🌫️",
    "naïve café résumé",
    "<|end_of_msg|>",
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "[BOS]text[EOS]",
    "'''```\"\"\"......!!!!!!??????",
    "",
]


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if not line:
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def make_encoding(hf_dir: Path):
    import tiktoken

    ranks = load_ranks(hf_dir / "tiktoken.model")
    return tiktoken.Encoding(
        name="kimi-k3-tiny",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=special_tokens(),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", type=Path, default=FIX / "tiny-hf")
    ap.add_argument("--out", type=Path, default=FIX / "tokenizer-vectors.json")
    ap.add_argument("--llama-tokens", type=Path, default=None,
                    help="JSON from tokenize_llama: [{hex, ids, ids_ordinary}]")
    ap.add_argument("--print-hex", action="store_true",
                    help="print the strings hex-encoded, one per line, and exit (stdin of tokenize_llama)")
    args = ap.parse_args()

    if args.print_hex:
        for s in STRINGS:
            print(s.encode("utf-8").hex())
        return

    enc = make_encoding(args.hf_dir)
    cases = []
    for s in STRINGS:
        ids = enc.encode(s, allowed_special="all")
        ordn = enc.encode_ordinary(s)
        assert enc.decode(ordn) == s
        cases.append({"text": s, "ids": ids, "ids_ordinary": ordn})

    mismatches = 0
    if args.llama_tokens is not None:
        ll = json.loads(args.llama_tokens.read_text())
        assert [bytes.fromhex(c["hex"]).decode("utf-8") for c in ll] == STRINGS, "llama tokens were made for other strings"
        for c, l in zip(cases, ll):
            c["llama_ids"] = l["ids"]
            c["llama_ids_ordinary"] = l["ids_ordinary"]
            for a, b in (("ids", "llama_ids"), ("ids_ordinary", "llama_ids_ordinary")):
                if c[a] != c[b]:
                    mismatches += 1
                    print(f"MISMATCH {a}: {c['text']!r}\n  tiktoken {c[a]}\n  llama    {c[b]}", file=sys.stderr)

    out = {
        "pattern": KIMI_PAT_STR,
        "vocab": "tiny-hf/tiktoken.model",
        "num_base_tokens": len(load_ranks(args.hf_dir / "tiktoken.model")),
        "tiktoken_encode": "ids: encode(text, allowed_special='all'); ids_ordinary: encode_ordinary(text)",
        "llama_cpp": ("llama_tokenize(add_special=false, parse_special=true) -> llama_ids; "
                      "parse_special=false -> llama_ids_ordinary") if args.llama_tokens else "not run",
        "cases": cases,
    }
    with open(args.out, "w") as f:
        f.write("{\n")
        keys = [k for k in out if k != "cases"]
        for k in keys:
            f.write(f"  {json.dumps(k)}: {json.dumps(out[k], ensure_ascii=False)},\n")
        f.write('  "cases": [\n')
        f.write(",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n  ]\n}\n")
    print(f"wrote {args.out}: {len(cases)} cases, {mismatches} llama.cpp mismatches", file=sys.stderr)
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
