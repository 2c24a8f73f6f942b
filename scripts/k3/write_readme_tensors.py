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


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else None
    head = (Path(__file__).resolve().parent / "fixtures-readme-head.md").read_text()
    txt = head + "## config.json (verbatim)\n\n" + config_section() + "\n\n## Tensors\n\n" + tensor_section() + "\n"
    if out:
        Path(out).write_text(txt)
    else:
        print(txt)
