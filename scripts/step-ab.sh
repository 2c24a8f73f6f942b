#!/usr/bin/env bash
# Step-logged A/B of specgate settings, one server at a time (no idle twin):
# for each round, each of CONFIGS (off: speculation off; draft: the default
# [speculative]; nopool: the default without the cross-request pool) starts
# `specgate serve` on configs/default.toml's other sections with every step
# logged (RUST_LOG=info,specgate::engine=debug), runs N requests at
# concurrency C through specgate-bench, saves the log, JSON and /metrics
# under OUT, and prints output tok/s and TTFT. Summarise the logs with
# scripts/step-log.py OUT/*.log. Needs a release build (cargo build --release;
# BIN=DIR runs the specgate and specgate-bench binaries in DIR instead).
#
#   OUT=/tmp/ab C=32 N=128 ROUNDS=2 CONFIGS="off draft" scripts/step-ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/step-ab}; C=${C:-32}; N=${N:-128}; ROUNDS=${ROUNDS:-2}; CONFIGS=${CONFIGS:-"off draft"}
WORKLOAD=${WORKLOAD:-benches/workloads/chat.jsonl}; MAX_TOKENS=${MAX_TOKENS:-48}
mkdir -p "$OUT"
BIN=${BIN:-target/release}
base=$(sed '/^\[speculative\]/,$d' configs/default.toml)
spec() {
  case $1 in
    off) printf '[speculative]\nmethod = "off"\n' ;;
    draft) sed -n '/^\[speculative\]/,$p' configs/default.toml ;;
    nopool) sed -n '/^\[speculative\]/,$p' configs/default.toml; printf '\n[speculative.suffix]\nenabled = false\n' ;;
    *) echo "unknown config $1 (off, draft, nopool)" >&2; exit 2 ;;
  esac
}
# Checked up front: spec() runs in a command substitution, whose exit
# would not stop the script.
for cfg in $CONFIGS; do spec "$cfg" >/dev/null; done
for r in $(seq 1 "$ROUNDS"); do
  for cfg in $CONFIGS; do
    printf '%s\n\n%s\n' "$base" "$(spec "$cfg")" >"$OUT/$cfg.toml"
    log=$OUT/$cfg.r$r.log
    RUST_LOG=info,specgate::engine=debug "$BIN/specgate" serve --config "$OUT/$cfg.toml" --port 0 2>"$log" &
    pid=$!
    url=""
    for _ in $(seq 1 300); do
      url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n1 || true)
      [ -n "$url" ] && curl -sf "$url/health" >/dev/null && break
      sleep 1
    done
    [ -n "$url" ] || { echo "server for $cfg did not start (see $log)" >&2; kill "$pid"; exit 1; }
    "$BIN/specgate-bench" run --base-url "$url" --wait-ready 600 --workload "$WORKLOAD" \
      --concurrency "$C" --num-requests "$N" --warmup 1 --max-tokens "$MAX_TOKENS" --ignore-eos \
      --temperature 0 --label "$cfg" --json "$OUT/$cfg.r$r.json" >"$OUT/$cfg.r$r.txt" 2>&1
    curl -s "$url/metrics" >"$OUT/$cfg.r$r.metrics"
    kill "$pid"; wait "$pid" || true
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print(sys.argv[2], round(r['output_throughput'], 2), 'tok/s, ttft p90', round(r['ttft']['p90'], 2), 's')" "$OUT/$cfg.r$r.json" "$cfg r$r"
  done
done
