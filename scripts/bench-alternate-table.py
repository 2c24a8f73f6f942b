#!/usr/bin/env python3
"""The tables of scripts/bench-alternate.sh: every (level, round)'s output
tok/s and tokens per verify pass per config, then per round the default
(`draft`) against `off`, against `chain` and against llama.cpp's best.

Usage: scripts/bench-alternate-table.py OUT_PREFIX (e.g. target/alt; reads
OUT_PREFIX-cLEVEL-rROUND/CONFIG.cLEVEL.r1.json).
"""
import glob
import json
import os
import re
import statistics
import sys

prefix = sys.argv[1] if len(sys.argv) > 1 else "target/alt"
cfgs = ["off", "chain", "draft", "llamacpp-plain", "llamacpp-draft"]
rows = {}
for d in glob.glob(f"{prefix}-c*-r*"):
    m = re.fullmatch(re.escape(prefix) + r"-c(\d+)-r(\d+)", d)
    if not m or not os.path.isdir(d):
        continue
    c, r = int(m.group(1)), int(m.group(2))
    for cfg in cfgs:
        f = f"{d}/{cfg}.c{c}.r1.json"
        if not os.path.exists(f):
            continue
        run = json.load(open(f))["runs"][0]
        s = run.get("server") or {}
        rows.setdefault(c, {}).setdefault(cfg, []).append(
            (r, run["output_throughput"], s.get("mean_accepted_length"))
        )
print("| level | config | out tok/s by round | median | tokens per verify pass by round |")
print("|---|---|---|---|---|")
for c in sorted(rows):
    for cfg in cfgs:
        v = sorted(rows[c].get(cfg, []))
        if not v:
            continue
        tps = [x[1] for x in v]
        al = ["-" if x[2] is None else f"{x[2]:.2f}" for x in v]
        name = "default" if cfg == "draft" else cfg
        print(f"| c={c} | {name} | {', '.join(f'{t:.1f}' for t in tps)} | "
              f"{statistics.median(tps):.1f} | {', '.join(al)} |")
print()
print("| level | round | default / off | default / chain | default / best llama.cpp |")
print("|---|---|---|---|---|")
for c in sorted(rows):
    for r in sorted({x[0] for v in rows[c].values() for x in v}):
        def get(cfg):
            return next((x[1] for x in rows[c].get(cfg, []) if x[0] == r), None)

        d, o, ch = get("draft"), get("off"), get("chain")
        peers = [p for p in (get("llamacpp-plain"), get("llamacpp-draft")) if p]

        def ratio(a, b):
            return f"{a / b:.2f}x" if a and b else "-"

        print(f"| c={c} | {r} | {ratio(d, o)} | {ratio(d, ch)} | "
              f"{ratio(d, max(peers)) if peers else '-'} |")
