#!/usr/bin/env bash
# A growing multi-turn chat against llama.cpp's llama-server and specgate on
# the same GGUF (issue 48): `specgate-bench conversation` (a long system
# prompt, then TURNS user turns, each answer appended to the history before
# the next turn) reports the time to first token of every turn; a prefix
# cache shows as a TTFT that stays flat while the prompt grows.
#
# Usage: scripts/bench-conversation.sh MODEL.gguf
#
# Every server runs alone, on 127.0.0.1, started fresh for each round and
# stopped after it: llama.cpp (`llama-server -m MODEL --jinja -t THREADS -c
# CTX -np 1`), then specgate (`specgate serve --model MODEL
# --speculative-method SPEC_METHOD`, RAYON_NUM_THREADS=THREADS) once per
# value of PREFIX_CACHING. ROUNDS rounds alternate the order (round 2 runs
# the servers in the reverse order of round 1, and so on). The table gives,
# per turn, the prompt tokens and the TTFT of each server (the median over
# rounds of the turn's mean over conversations) and ours / llama.cpp; the
# CPU model and its ISA flags are printed with it. Each run leaves its
# results (LABEL.rROUND.json), table, server log and /metrics in OUT.
#
# Settings (environment):
#   (The Kimi K3 slices' 768-token vocabulary makes 600 words about 2700
#   tokens: with 6 turns of 64 tokens the last turn passes the slice's 4096
#   context, which llama.cpp caps its slot to; SYSTEM_WORDS=500 fits.)
#   ROUNDS (2), TURNS (6), CONVERSATIONS (1), SYSTEM_WORDS (600),
#   TURN_WORDS (30), MAX_TOKENS (64), SEED (0), WARMUP (1: uncounted short
#   requests per server), IGNORE_EOS (0; 1 passes --ignore-eos so every
#   answer, hence every history, has the same length on both servers)
#   CHAT_TEMPLATE_KWARGS ('{"thinking": false}': sent with every request;
#                  K3's template then opens the response channel, so the
#                  answer is content and goes back into the history; "" sends
#                  none), REPLAY_REASONING (0; 1 sends reasoning back too)
#   THREADS (2), CTX (8192: llama.cpp's -c)
#   PREFIX_CACHING ("": ours with the server's default; a list such as
#                  "true false" runs ours once per value with
#                  --prefix-caching VALUE)
#   SPEC_METHOD (off: off, ngram, draft or auto, --speculative-method;
#                auto is what `serve --model` alone does: the built-in
#                Qwen draft where it fits, else n-gram)
#   OURS_CONFIG   a TOML file passed to ours as --config (flags still apply)
#   OURS_ARGS     extra `specgate serve` arguments (word-split)
#   LLAMA_ARGS    extra llama-server arguments (word-split)
#   LLAMACPP_BIN  directory holding llama-server (default: the bin directory
#                 of scripts/llamacpp-peer.sh build --isa native, which builds
#                 it when missing)
#   SPECGATE_BIN  specgate binary (default target/release/specgate, built with
#                 cargo when missing); BENCH_BIN likewise for specgate-bench
#   SKIP_LLAMA (0), SKIP_OURS (0): leave one side out
#   OUT           results directory (default target/bench-conversation/<UTC time>)
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-}
[ -n "$MODEL" ] && [ -f "$MODEL" ] || { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; echo "bench-conversation: give a GGUF file" >&2; exit 2; }
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
ROUNDS=${ROUNDS:-2}
TURNS=${TURNS:-6}
CONVERSATIONS=${CONVERSATIONS:-1}
SYSTEM_WORDS=${SYSTEM_WORDS:-600}
TURN_WORDS=${TURN_WORDS:-30}
MAX_TOKENS=${MAX_TOKENS:-64}
SEED=${SEED:-0}
WARMUP=${WARMUP:-1}
IGNORE_EOS=${IGNORE_EOS:-0}
THREADS=${THREADS:-2}
CTX=${CTX:-8192}
PREFIX_CACHING=${PREFIX_CACHING:-}
SPEC_METHOD=${SPEC_METHOD:-off}
OUT=${OUT:-target/bench-conversation/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

die() { echo "bench-conversation: error: $*" >&2; exit 1; }
say() { echo "bench-conversation: $*" >&2; }

http_code() { curl --noproxy '*' -s -o /dev/null -w '%{http_code}' --max-time 5 "$1" 2>/dev/null || true; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The binaries.
if [ "${SKIP_LLAMA:-0}" != 1 ]; then
  if [ -z "${LLAMACPP_BIN:-}" ]; then
    LLAMACPP_BIN=$(scripts/llamacpp-peer.sh build --isa native) || die "building llama.cpp failed"
  fi
  [ -x "$LLAMACPP_BIN/llama-server" ] || die "no llama-server in $LLAMACPP_BIN"
fi
SPECGATE_BIN=${SPECGATE_BIN:-target/release/specgate}
BENCH_BIN=${BENCH_BIN:-target/release/specgate-bench}
if [ "${SKIP_OURS:-0}" != 1 ] && [ ! -x "$SPECGATE_BIN" ]; then
  say "building specgate (cargo build --release --bin specgate)"
  nice -n 19 cargo build --release --bin specgate >&2 || die "building specgate failed"
fi
if [ ! -x "$BENCH_BIN" ]; then
  say "building specgate-bench (cargo build --release -p specgate-bench)"
  nice -n 19 cargo build --release -p specgate-bench >&2 || die "building specgate-bench failed"
fi

# The servers: labels and how each starts.
LABELS=()
[ "${SKIP_LLAMA:-0}" = 1 ] || LABELS+=(llamacpp)
if [ "${SKIP_OURS:-0}" != 1 ]; then
  if [ -z "$PREFIX_CACHING" ]; then
    LABELS+=(ours)
  else
    for v in $PREFIX_CACHING; do
      case "$v" in true | false) LABELS+=("ours-pc-$v") ;; *) die "PREFIX_CACHING values are true or false, not '$v'" ;; esac
    done
  fi
fi
[ ${#LABELS[@]} -gt 0 ] || die "nothing to run"

pid=""
trap '[ -z "$pid" ] || { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }' EXIT

# start LABEL LOG: starts that server in the background (pid), sets url once
# its /health answers 200.
start() {
  local label=$1 log=$2 port args=()
  port=$(free_port)
  url=http://127.0.0.1:$port
  if [ "$label" = llamacpp ]; then
    # shellcheck disable=SC2206 # LLAMA_ARGS is a list of arguments
    args=(-m "$MODEL" --alias k3-slice --jinja -t "$THREADS" -tb "$THREADS" -c "$CTX" -np 1 -ngl 0
      --metrics --host 127.0.0.1 --port "$port" ${LLAMA_ARGS:-})
    printf '%q ' "$LLAMACPP_BIN/llama-server" "${args[@]}" >"$OUT/$label.cmd"
    "$LLAMACPP_BIN/llama-server" "${args[@]}" >"$log" 2>&1 &
  else
    args=(serve --model "$MODEL" --served-model-name k3-slice --host 127.0.0.1 --port "$port"
      --speculative-method "$SPEC_METHOD")
    [ -z "${OURS_CONFIG:-}" ] || args=(serve --config "$OURS_CONFIG" "${args[@]:1}")
    case "$label" in ours-pc-*) args+=(--prefix-caching "${label#ours-pc-}") ;; esac
    # shellcheck disable=SC2206 # OURS_ARGS is a list of arguments
    args+=(${OURS_ARGS:-})
    printf 'RAYON_NUM_THREADS=%q %q ' "$THREADS" "$SPECGATE_BIN" >"$OUT/$label.cmd"
    printf '%q ' "${args[@]}" >>"$OUT/$label.cmd"
    RAYON_NUM_THREADS=$THREADS "$SPECGATE_BIN" "${args[@]}" >"$log" 2>&1 &
  fi
  pid=$!
  echo >>"$OUT/$label.cmd"
  for _ in $(seq 1 1200); do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$log" >&2; pid=""; die "$label exited before it was ready (log: $log)"; }
    [ "$(http_code "$url/health")" != 200 ] || return 0
    sleep 0.5
  done
  tail -n 30 "$log" >&2
  die "$label not ready after 600 s (log: $log)"
}

stop() {
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
}

bench_args=(conversation --turns "$TURNS" --conversations "$CONVERSATIONS" --system-words "$SYSTEM_WORDS"
  --turn-words "$TURN_WORDS" --max-tokens "$MAX_TOKENS" --seed "$SEED" --warmup "$WARMUP")
[ "$IGNORE_EOS" = 1 ] && bench_args+=(--ignore-eos)
CHAT_TEMPLATE_KWARGS=${CHAT_TEMPLATE_KWARGS-'{"thinking": false}'}
[ -z "$CHAT_TEMPLATE_KWARGS" ] || bench_args+=(--chat-template-kwargs "$CHAT_TEMPLATE_KWARGS")
[ "${REPLAY_REASONING:-0}" != 1 ] || bench_args+=(--replay-reasoning)

CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
ISA=$(grep -o -w -E 'avx2|avx_vnni|avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')
{
  printf 'model=%q\nrounds=%q\nthreads=%q\nctx=%q\nspec_method=%q\n' "$MODEL" "$ROUNDS" "$THREADS" "$CTX" "$SPEC_METHOD"
  printf 'cpu=%q\nisa=%q\nnproc=%q\nstarted=%q\n' "$CPU" "$ISA" "$(nproc)" "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'git_head=%q\ngit_dirty=%q\n' "$(git rev-parse --short HEAD 2>/dev/null)" "$(git status --porcelain -- src verify draft 2>/dev/null | wc -l)"
  [ -z "${LLAMACPP_BIN:-}" ] || printf 'llamacpp_version=%q\n' "$("$LLAMACPP_BIN/llama-server" --version 2>&1 | grep -m1 version)"
} >"$OUT/meta.env"

status=0
order=("${LABELS[@]}")
for round in $(seq 1 "$ROUNDS"); do
  for label in "${order[@]}"; do
    log="$OUT/$label.r$round.log"
    say "round $round: $label (load $(cut -d' ' -f1-3 /proc/loadavg))"
    start "$label" "$log"
    if ! "$BENCH_BIN" "${bench_args[@]}" --url "$url" --label "$label" \
      --out "$OUT/$label.r$round.json" >"$OUT/$label.r$round.txt" 2>"$OUT/$label.r$round.err"; then
      say "the workload against $label failed: $(tail -n 3 "$OUT/$label.r$round.err")"
      status=1
    fi
    cat "$OUT/$label.r$round.txt" >&2
    # The server's counters after the run (prefix-cache hits and the like).
    curl --noproxy '*' -s --max-time 10 "$url/metrics" >"$OUT/$label.r$round.metrics" 2>/dev/null || true
    stop
  done
  mapfile -t order < <(printf '%s\n' "${order[@]}" | tac)
done

python3 - "$OUT" "$ROUNDS" "${LABELS[@]}" <<'EOF' | tee "$OUT/table.md"
import json, os, re, shlex, statistics, sys
out, rounds, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
meta = {}
for line in open(os.path.join(out, "meta.env")):
    k, _, v = line.rstrip("\n").partition("=")
    meta[k] = " ".join(shlex.split(v)) if v else ""
runs = {l: [] for l in labels}
for l in labels:
    for r in range(1, rounds + 1):
        p = os.path.join(out, f"{l}.r{r}.json")
        if os.path.exists(p):
            runs[l].append(json.load(open(p)))
turns = max((len(d["per_turn"]) for v in runs.values() for d in v), default=0)

def med(l, t, f):
    vals = [f(d["per_turn"][t]) for d in runs[l] if t < len(d["per_turn"])]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None

ttft = lambda s: s["ttft"]["mean"]
prompt = lambda s: s["prompt_tokens_mean"]
fmt = lambda v, f="{:.0f}": "-" if v is None else f.format(v)
base = "llamacpp" if "llamacpp" in labels else None
ours = [l for l in labels if l != "llamacpp"]
first = next((d for v in runs.values() for d in v), None)
spec = first["spec"] if first else {}
print(f"### Multi-turn conversation, TTFT per turn ({os.path.basename(meta.get('model', ''))})\n")
print(f"CPU: {meta.get('cpu')}, {meta.get('nproc')} CPUs; ISA flags: {meta.get('isa')}")
print(f"Threads {meta.get('threads')}; {rounds} alternating rounds (median of the rounds' per-turn means); "
      f"{spec.get('conversations')} conversation(s), system prompt {spec.get('system_words')} words, "
      f"{spec.get('turns')} turns of {spec.get('turn_words')} words, max_tokens {first['max_tokens'] if first else '-'}, "
      f"ignore_eos {first['ignore_eos'] if first else '-'}, seed {spec.get('seed')}.")
slot_ctx = None
if "llamacpp" in labels and os.path.exists(os.path.join(out, "llamacpp.r1.log")):
    m = re.search(r"n_ctx_slot = (\d+)", open(os.path.join(out, "llamacpp.r1.log"), errors="replace").read())
    slot_ctx = m and m.group(1)
print(f"llama.cpp: {meta.get('llamacpp_version', '-')}, -c {meta.get('ctx')} (slot context {slot_ctx or '?'}), -np 1. "
      f"Ours: specgate {meta.get('git_head')} (+{meta.get('git_dirty')} uncommitted files in src/verify/draft), "
      f"--speculative-method {meta.get('spec_method')}.\n")
head = ["turn"] + [f"prompt tok {l}" for l in labels] + [f"TTFT ms {l}" for l in labels]
if base:
    head += [f"{l} / llama.cpp" for l in ours]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
sums = {l: 0.0 for l in labels}
for t in range(turns):
    row = [str(t + 1)] + [fmt(med(l, t, prompt)) for l in labels]
    tt = {l: med(l, t, ttft) for l in labels}
    for l in labels:
        sums[l] = sums[l] + tt[l] if (sums[l] is not None and tt[l] is not None) else None
    row += [fmt(None if tt[l] is None else tt[l] * 1000) for l in labels]
    if base:
        row += [fmt(tt[l] / tt[base] if tt[l] and tt[base] else None, "{:.2f}x") for l in ours]
    print("| " + " | ".join(row) + " |")
row = ["all"] + ["" for _ in labels] + [fmt(None if sums[l] is None else sums[l] * 1000) for l in labels]
if base:
    row += [fmt(sums[l] / sums[base] if sums[l] and sums[base] else None, "{:.2f}x") for l in ours]
print("| " + " | ".join(row) + " |")
fails = {l: sum(s["failed"] for d in runs[l] for s in d["per_turn"]) for l in labels}
missing = {l: rounds - len(runs[l]) for l in labels}
if any(fails.values()) or any(missing.values()):
    print(f"\nFailed turns: {fails}; rounds without a result: {missing}.")
print(f"\nResults and logs: {out}")
EOF
exit $status
