#!/usr/bin/env bash
# Alternating rounds with fresh servers: the method of BENCHMARKS.md's
# "Token trees, alternating rounds" sections. For each concurrency level and
# round it runs scripts/bench-sweep.sh once (so every (level, round) gets
# freshly started servers, and no prompt reaches a server twice: the
# cross-request pool cannot replay an answer it saw in an earlier round).
# Round 1 sends WORKLOAD's lines in order with CONFIGS in the order given;
# round 2 sends the workload rotated by half its requests (the first line,
# the warm-up, stays first) with CONFIGS reversed, so drift of the host and
# the order of prompts fall on every setting alike. llama.cpp's
# llama-server runs beside specgate at the levels listed in PEER_LEVELS,
# with -np equal to the level. Then it prints every round's output tok/s
# and the ratios (scripts/bench-alternate-table.py).
#
# Usage: scripts/bench-alternate.sh
# Settings (environment): LEVELS ("1:12 4:16 16:46 32:46": level:requests),
# PEER_LEVELS ("1 4"), CONFIGS ("off chain draft"), PEERS ("plain draft"),
# WORKLOAD (benches/workloads/varied.jsonl), MAX_TOKENS (64), OUT_PREFIX
# (target/alt: results go to OUT_PREFIX-cLEVEL-rROUND/ and .log),
# LLAMACPP_BUILD (target/llamacpp/build-native), PEER_ISA (native).
# Levels of 16 and more run one wave (WAVES=1), the others 4.
# The binaries must be built (it passes SKIP_BUILD=1 to the sweep).
set -uo pipefail
cd "$(dirname "$0")/.."
LEVELS=${LEVELS:-"1:12 4:16 16:46 32:46"}
PEER_LEVELS=${PEER_LEVELS:-"1 4"}
CONFIGS=${CONFIGS:-"off chain draft"}
PEERS=${PEERS:-"plain draft"}
WORKLOAD=${WORKLOAD:-benches/workloads/varied.jsonl}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT_PREFIX=${OUT_PREFIX:-target/alt}
LLAMACPP_BUILD=${LLAMACPP_BUILD:-target/llamacpp/build-native}
PEER_ISA=${PEER_ISA:-native}

mkdir -p "$(dirname "$OUT_PREFIX")"
lines=$(wc -l <"$WORKLOAD")
half=$(((lines - 1) / 2))
rotated="$OUT_PREFIX-workload-rotated.jsonl"
{ head -n 1 "$WORKLOAD"; tail -n +$((half + 2)) "$WORKLOAD"; sed -n "2,$((half + 1))p" "$WORKLOAD"; } >"$rotated"
reversed=$(echo "$CONFIGS" | tr ' ' '\n' | tac | tr '\n' ' ' | sed 's/ $//')

status=0
for level in $LEVELS; do
  c=${level%%:*} n=${level##*:}
  waves=4
  [ "$c" -ge 16 ] && waves=1
  peer=()
  for p in $PEER_LEVELS; do [ "$p" = "$c" ] && peer=(--peer-llamacpp --peer-isa "$PEER_ISA"); done
  for r in 1 2; do
    wl=$WORKLOAD order=$CONFIGS
    [ "$r" = 2 ] && wl=$rotated order=$reversed
    out="$OUT_PREFIX-c$c-r$r"
    echo "=== c=$c round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) -> $out"
    # The sweep exits non-zero after a point without a result; the table
    # below shows what is missing, and the status is kept.
    SKIP_BUILD=1 NO_WRITE=1 MAX_TOKENS=$MAX_TOKENS LLAMACPP_BUILD=$LLAMACPP_BUILD \
      CONFIGS="$order" PEERS="$PEERS" CONCURRENCY=$c NUM_REQUESTS=$n WAVES=$waves ROUNDS=1 \
      OUT="$out" WORKLOAD="$wl" scripts/bench-sweep.sh "${peer[@]}" >"$out.log" 2>&1 ||
      { echo "    the sweep exited non-zero: see $out.log"; status=1; }
  done
done
python3 scripts/bench-alternate-table.py "$OUT_PREFIX"
exit $status
