#!/usr/bin/env bash
# Serving benchmark of specgate on the real pair (models/): for each
# speculation setting (off, n-gram, draft model, adaptive draft) it starts
# `specgate serve` with configs/default.toml's model, KV and scheduler
# settings and that [speculative] section, waits for /health, runs
# specgate-bench over a concurrency sweep, stops the server; then it writes
# the comparison charts into docs/bench/ and the "Serving benchmark" section
# of BENCHMARKS.md (between its markers; the rest of the file is kept).
#
# Settings (environment): CONCURRENCY (1,4,8), NUM_REQUESTS per point (8),
# MAX_TOKENS (64), WARMUP (2), WORKLOAD (benches/workloads/editing.jsonl),
# CONFIGS ("off ngram draft adaptive"), OUT (target/bench-sweep).
# REPORT_ONLY=1 skips the runs and rewrites the section from the results
# already in OUT (for a sweep that was cut short: the configs with results).
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${CONCURRENCY:-1,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-8}
MAX_TOKENS=${MAX_TOKENS:-64}
WARMUP=${WARMUP:-2}
WORKLOAD=${WORKLOAD:-benches/workloads/editing.jsonl}
CONFIGS=${CONFIGS:-off ngram draft adaptive}
OUT=${OUT:-target/bench-sweep}
DOCS=docs/bench
mkdir -p "$OUT" "$DOCS"

# The same selection as `cargo test --release --workspace`, so the features
# of shared dependencies unify alike and this reuses that build (building
# only the two binaries would rebuild candle with other features). It builds
# both: `specgate` (root package) and `specgate-bench` (the loadgen/ member).
[ -n "${REPORT_ONLY:-}" ] || cargo test --release --workspace --no-run
BIN=${CARGO_TARGET_DIR:-target}/release

# default.toml up to its [speculative] section, then each setting's own.
base=$(sed '/^\[speculative\]/,$d' configs/default.toml)
speculative() {
  case "$1" in
    off) printf '[speculative]\nmethod = "off"\n' ;;
    ngram) printf '[speculative]\nmethod = "ngram"\npolicy = "table"\ntable = [[1, 3], [2, 2], [4, 1]]\n' ;;
    draft) sed -n '/^\[speculative\]/,$p' configs/default.toml ;;
    adaptive) printf '[speculative]\nmethod = "draft"\npolicy = "adaptive"\nnum_tokens = 4\n' ;;
    *) echo "unknown config $1" >&2; exit 1 ;;
  esac
}

pid=""
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null || true' EXIT
if [ -z "${REPORT_ONLY:-}" ]; then
  printf 'load_before="%s"\nstarted="%s"\n' "$(cut -d' ' -f1-3 /proc/loadavg)" \
    "$(date -u '+%Y-%m-%d %H:%M UTC')" >"$OUT/meta.env"
  rm -f "$OUT"/*.json
fi
for cfg in $CONFIGS; do
  [ -z "${REPORT_ONLY:-}" ] || continue
  printf '%s\n\n%s\n' "$base" "$(speculative "$cfg")" >"$OUT/$cfg.toml"
  log="$OUT/$cfg.log"
  "$BIN/specgate" serve --config "$OUT/$cfg.toml" --port 0 2>"$log" &
  pid=$!
  url=""
  for _ in $(seq 1 120); do
    kill -0 $pid 2>/dev/null || { cat "$log"; echo "specgate serve ($cfg) exited" >&2; exit 1; }
    url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)
    [ -n "$url" ] && break
    sleep 1
  done
  [ -n "$url" ] || { cat "$log"; echo "specgate serve ($cfg) printed no address" >&2; exit 1; }
  echo "== $cfg at $url"
  "$BIN/specgate-bench" run --base-url "$url" --wait-ready 600 \
    --workload "$WORKLOAD" --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" \
    --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" --ignore-eos --temperature 0 \
    --label "$cfg" --json "$OUT/$cfg.json"
  kill $pid
  wait $pid || true
  pid=""
done
[ -n "${REPORT_ONLY:-}" ] || printf 'load_after="%s"\n' "$(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/meta.env"
# shellcheck disable=SC1091
. "$OUT/meta.env"
files=()
missing=""
for cfg in $CONFIGS; do
  if [ -f "$OUT/$cfg.json" ]; then files+=("$OUT/$cfg.json"); else missing="$missing $cfg"; fi
done
[ ${#files[@]} -gt 0 ] || { echo "no results in $OUT" >&2; exit 1; }

"$BIN/specgate-bench" report --markdown --svg-dir "$DOCS" "${files[@]}" >"$OUT/table.md"
cp "${files[@]}" "$DOCS/"

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
section="$OUT/section.md"
{
  echo "<!-- serving-benchmark:begin (written by scripts/bench-sweep.sh; edits here are overwritten) -->"
  echo "## Serving benchmark (\`scripts/bench-sweep.sh\`)"
  echo
  echo "\`specgate-bench\` against \`specgate serve\` on the real pair (target"
  echo "Qwen2.5-Coder-1.5B Q4_K_M, draft 0.5B Q4_K_M), configs/default.toml's KV and"
  echo "scheduler settings, one server per speculation setting: **off**; **ngram**"
  echo "(prompt lookup, per-batch-size table k = 3/2/1 up to 4 sequences, 0 above);"
  echo "**draft** (the 0.5B draft, the same table: configs/default.toml); **adaptive**"
  echo "(the 0.5B draft, adaptive k up to 4). Workload \`$WORKLOAD\` (code edits whose"
  echo "answer repeats the input), greedy, $MAX_TOKENS output tokens per request"
  echo "(\`ignore_eos\`), closed loop at concurrency $CONCURRENCY, $NUM_REQUESTS requests"
  echo "per point after $WARMUP uncounted warm-up request(s)."
  echo
  echo "Run of $started on $cpu, $(nproc) cores visible, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, no GPU."
  [ -z "$missing" ] || echo "Not measured in this run (cut short for time):$missing."
  echo "Load average (1/5/15 min) before / after: $load_before / ${load_after:-unknown}."
  # Only a busy machine gets the warning: a 1-minute load above the core
  # count before the run means other work competed with it.
  if awk -v l="${load_before%% *}" -v c="$(nproc)" 'BEGIN { exit !(l > c) }'; then
    echo "The machine was busy with other work when this started, so absolute"
    echo "figures are disturbed."
  fi
  echo "The settings ran one after another in one script run."
  echo
  echo "TTFT: time to the first streamed token. ITL: gap between streamed text"
  echo "events (with speculation one event may carry several tokens). TPOT: per"
  echo "request, (end - first token) / (tokens - 1). accept: accepted / drafted"
  echo "tokens; acc. len: tokens per verify pass that drafted (1 + accepted / drafts),"
  echo "both from the server's /metrics over the run."
  echo
  cat "$OUT/table.md"
  echo
  for c in throughput ttft itl e2e; do
    echo "![$c]($DOCS/$c.svg)"
  done
  echo
  echo "Reproduce: \`scripts/bench-sweep.sh\` (settings via CONCURRENCY, NUM_REQUESTS,"
  echo "MAX_TOKENS, WARMUP, WORKLOAD, CONFIGS). Every figure: \`$DOCS/*.json\`."
  echo "<!-- serving-benchmark:end -->"
} >"$section"

python3 - "$section" <<'EOF'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
pat = re.compile(r"<!-- serving-benchmark:begin.*?<!-- serving-benchmark:end -->", re.S)
if pat.search(text):
    text = pat.sub(lambda _: section, text)
else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
open("BENCHMARKS.md", "w").write(text)
EOF
echo "wrote BENCHMARKS.md (serving section) and $DOCS/*.svg"
cat "$OUT/table.md"
