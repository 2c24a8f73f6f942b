#!/usr/bin/env python3
"""Render the tensor / config section of tests/fixtures/kimi_k3/README.md from tiny-hf/.

The README is assembled from README.head.md-style sections kept in this script so that a
regenerated fixture cannot drift from its documentation. Run after gen_tiny_k3.py."""
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "kimi_k3"


def tensor_section() -> str:
    man = json.loads((FIX / "tiny-hf-tensors.json").read_text())
    lines = []
    experts = [m for m in man if ".experts." in m["name"]]
    rest = [m for m in man if ".experts." not in m["name"]]
    lines.append(f"{len(man)} tensors in total: {len(rest)} non-expert (shard 1, `model-00001-of-00002.safetensors`),")
    lines.append(f"{len(experts)} routed-expert MXFP4 tensors (shard 2, `model-00002-of-00002.safetensors`).")
    lines.append("Shapes are safetensors (= PyTorch) shapes, i.e. `[out_features, in_features]` for Linear weights.")
    lines.append("")
    lines.append("### Non-expert tensors (every one)")
    lines.append("")
    lines.append("| name | dtype | shape |")
    lines.append("|---|---|---|")
    for m in rest:
        lines.append(f"| `{m['name']}` | {m['dtype']} | {m['shape']} |")
    lines.append("")
    lines.append("### Routed experts (every layer 1..7, every expert 0..15)")
    lines.append("")
    pats = {}
    for m in experts:
        key = re.sub(r"layers\.\d+\.", "layers.{L}.", m["name"])
        key = re.sub(r"experts\.\d+\.", "experts.{E}.", key)
        pats.setdefault(key, set()).add((m["dtype"], tuple(m["shape"])))
    lines.append("| name pattern (L in 1..7, E in 0..15) | dtype | shape |")
    lines.append("|---|---|---|")
    for k, v in sorted(pats.items()):
        assert len(v) == 1, (k, v)
        d, s = next(iter(v))
        lines.append(f"| `{k}` | {d} | {list(s)} |")
    lines.append("")
    lines.append("The complete per-tensor list is also in `tiny-hf-tensors.json` (one JSON object per line).")
    return "\n".join(lines)


def config_section() -> str:
    cfg = (FIX / "tiny-hf" / "config.json").read_text()
    return "```json\n" + cfg.rstrip() + "\n```"


def draft_section() -> str:
    """The draft model (gen_tiny_k3.py --draft): what it shares with the target, and every
    text_config value that differs (read from both config.json files)."""
    tgt = json.loads((FIX / "tiny-hf" / "config.json").read_text())["text_config"]
    dft = json.loads((FIX / "tiny-draft-hf" / "config.json").read_text())["text_config"]
    man = json.loads((FIX / "tiny-draft-hf-tensors.json").read_text())
    nbytes = (FIX / "tiny-draft-hf" / "model.safetensors").stat().st_size
    same = ["tiktoken.model", "tokenizer_config.json", "generation_config.json"]
    for f in same:
        assert (FIX / "tiny-hf" / f).read_bytes() == (FIX / "tiny-draft-hf" / f).read_bytes(), f
    for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert tgt[k] == dft[k], k

    def flat(c):
        out = {k: v for k, v in c.items() if not isinstance(v, dict)}
        out.update({f"linear_attn_config.{k}": v for k, v in c["linear_attn_config"].items()})
        return out

    ft, fd = flat(tgt), flat(dft)
    assert ft.keys() == fd.keys()
    lines = [
        "`python3 scripts/k3/gen_tiny_k3.py --draft` (step 1b of `make-fixtures.sh`): a smaller tiny K3 to",
        "serve as a speculative-decoding draft for `tiny-hf/`. "
        + ", ".join(f"`{f}`" for f in same) + " are",
        f"byte-identical to the target's, so the vocabulary is shared exactly (`vocab_size` {dft['vocab_size']}, "
        f"bos/eos/pad {dft['bos_token_id']}/{dft['eos_token_id']}/{dft['pad_token_id']}).",
        f"Own seed (gen_tiny_k3.DRAFT); one `model.safetensors` (no index, {len(man)} tensors, {nbytes} bytes); same dtypes and MXFP4",
        "expert packing as the target; every tensor is listed in `tiny-draft-hf-tensors.json`.",
        "Layer 0 = KDA + dense SiTU MLP, layer 1 = gated NoPE MLA + latent MoE (`full_attn_layers` is 1-indexed);",
        "with `attn_res_block_size = 1` both layers bank a checkpoint. The weights are unrelated to the target's:",
        "their greedy tokens essentially never agree (numpy reference: 0 of the 44 positions of the two",
        "`llamacpp-logits.json` prompts).",
        "",
        "| text_config | `tiny-hf` | `tiny-draft-hf` |",
        "|---|---|---|",
    ]
    for k in ft:
        if ft[k] != fd[k]:
            lines.append(f"| `{k}` | {json.dumps(ft[k])} | {json.dumps(fd[k])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else None
    head = (Path(__file__).resolve().parent / "fixtures-readme-head.md").read_text()
    txt = head + "## config.json (verbatim)\n\n" + config_section() + "\n\n## Tensors\n\n" + tensor_section()
    txt += "\n\n## Draft model (`tiny-draft-hf/`)\n\n" + draft_section() + "\n"
    if out:
        Path(out).write_text(txt)
    else:
        print(txt)
