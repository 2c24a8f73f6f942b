#!/usr/bin/env python3
"""Checks a Grafana dashboard JSON: it parses, every panel has a query, and
every specgate_* metric a query names exists in src/metrics.rs (histogram
series _bucket/_sum/_count count as their histogram). Exit 1 on a problem.
Usage: scripts/check-dashboard.py DASHBOARD.json [src/metrics.rs]"""
import json
import re
import sys

def metric_names(rust_path):
    text = open(rust_path, encoding="utf-8").read()
    return set(re.findall(r'pub const [A-Z0-9_]+: &str = "(specgate_[a-z0-9_]+)";', text))

def exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            else:
                yield from exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from exprs(v)

def check(dashboard_path, rust_path):
    known = metric_names(rust_path)
    if not known:
        return [f"no metric constants found in {rust_path}"]
    with open(dashboard_path, encoding="utf-8") as f:
        dash = json.load(f)
    problems = []
    panels = dash.get("panels", [])
    if not panels:
        problems.append("the dashboard has no panels")
    for p in panels:
        if not list(exprs(p.get("targets", []))):
            problems.append(f"panel {p.get('title')!r} has no query")
    used = set()
    for e in exprs(dash):
        for name in re.findall(r"\bspecgate_[a-z0-9_]+", e):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            used.add(name if name in known else base)
            if name not in known and base not in known:
                problems.append(f"unknown metric {name} in: {e}")
    if not used:
        problems.append("no specgate metric is queried")
    return problems

if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    problems = check(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "src/metrics.rs")
    for p in problems:
        print(f"check-dashboard: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"check-dashboard: {sys.argv[1]} ok")
