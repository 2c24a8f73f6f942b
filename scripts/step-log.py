#!/usr/bin/env python3
"""Summarises the engine's per-step debug log by kind of step.

`specgate serve` logs every step at debug ("step time against the cost
model", `RUST_LOG=info,specgate::engine=debug`, text format) with its
measured and predicted time, its stages and its rows. This groups a log's
steps by whether the batch was full (at least --full decoding sequences),
carried prompt rows (+P), drafted (+D) and ran the draft model (+M), and
prints per group the count, the summed and median step time, the median
prediction and the rows, so two servers' runs of the same load (say the
default and speculation off) can be compared step by step. Then, for the
steps a plan priced, measured / predicted time by decode or prompt step and
by rows (how well the cost model prices each part of its curve).

Usage: scripts/step-log.py [--full N] LOG...
"""
import argparse
import re
import statistics
import sys
from datetime import datetime

FIELDS = [
    "predicted_ms", "measured_ms", "plan_ms", "propose_ms", "draft_forwards_ms",
    "verify_ms", "draft_prefill_ms", "decoding", "prompt_rows", "drafted",
]


def steps(path):
    out = []
    for line in open(path, errors="replace"):
        if "step time against the cost model" not in line:
            continue
        kv = dict(re.findall(r"(\w+)=(\S+)", line))
        try:
            step = {k: float(kv[k]) for k in FIELDS}
        except KeyError:
            continue
        step["model"] = kv.get("draft_model") == "true"
        step["ts"] = datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
        out.append(step)
    return out


def kind(step, full):
    return ("full" if step["decoding"] >= full else "part") \
        + ("+P" if step["prompt_rows"] > 0 else "") \
        + ("+D" if step["drafted"] > 0 else "") \
        + ("+M" if step["model"] else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", type=int, default=32, help="decoding sequences of a full batch")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args()
    for path in args.logs:
        s = steps(path)
        if not s:
            print(f"{path}: no step lines (was RUST_LOG=specgate::engine=debug set?)")
            continue
        total = sum(x["measured_ms"] for x in s)
        span = (s[-1]["ts"] - s[0]["ts"]) * 1e3 + s[0]["measured_ms"]
        print(f"{path}: {len(s)} steps, {total / 1e3:.1f} s in steps over {span / 1e3:.1f} s, "
              f"{sum(x['drafted'] for x in s):.0f} tokens drafted, "
              f"{sum(x['model'] for x in s)} steps ran the draft model, "
              f"draft forwards {sum(x['draft_forwards_ms'] for x in s) / 1e3:.2f} s, "
              f"draft prompt chunks {sum(x['draft_prefill_ms'] for x in s) / 1e3:.2f} s")
        groups = {}
        for x in s:
            groups.setdefault(kind(x, args.full), []).append(x)
        print(f"  {'kind':11} {'steps':>5} {'sum s':>7} {'med ms':>7} {'pred ms':>7} "
              f"{'decoding':>8} {'prompt':>6} {'drafted':>7}")
        for k, g in sorted(groups.items()):
            m = [x["measured_ms"] for x in g]
            print(f"  {k:11} {len(g):5d} {sum(m) / 1e3:7.1f} {statistics.median(m):7.1f} "
                  f"{statistics.median(x['predicted_ms'] for x in g):7.1f} "
                  f"{statistics.mean(x['decoding'] for x in g):8.1f} "
                  f"{statistics.mean(x['prompt_rows'] for x in g):6.1f} "
                  f"{sum(x['drafted'] for x in g):7.0f}")
        pricing(s)
    return 0


def pricing(s):
    bins = {}
    for x in s:
        if x["predicted_ms"] <= 0:
            continue
        rows = x["decoding"] + x["drafted"] + x["prompt_rows"]
        span = "<=64" if rows <= 64 else "65-128" if rows <= 128 else ">128"
        step = "prompt" if x["prompt_rows"] > 0 else "decode"
        bins.setdefault((step, span), []).append(x["measured_ms"] / x["predicted_ms"])
    if not bins:
        return
    print("  measured / predicted:")
    for (step, span), r in sorted(bins.items()):
        print(f"    {step} steps of {span:>6} rows: {len(r):4d}, median {statistics.median(r):.2f}, "
              f"range {min(r):.2f}-{max(r):.2f}")


if __name__ == "__main__":
    sys.exit(main())
