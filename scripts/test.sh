#!/usr/bin/env bash
# The test command of README.md and CI: fetches the real weights (idempotent,
# checksummed), then runs every test with optimizations (candle in a debug
# build is far too slow for real weights).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh models
cargo fmt --all -- --check
# candle works out its thread count on every matmul (reading /proc/cpuinfo)
# unless RAYON_NUM_THREADS is set; `specgate` sets it when it starts, and the
# tests that run models in their own process get it here.
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-$(nproc)}"  # rayon's own default
# Open MPI (and libclang, for mpi-sys's bindgen) first, so that one build
# with the `mpi` feature serves every test, the soak, the SDK runs and
# tests/mpi.rs (ranks as processes under mpirun: logits at 2 and 4 ranks over
# shared memory and TCP, serving equal to one process, a killed or hung
# worker). Before, the `mpi` build came last and compiled the workspace's
# crates a second time.
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null \
    || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev libclang-dev >/dev/null
fi
# The one feature selection of every cargo call below and in the scripts it
# runs (--workspace keeps the dependencies' features those of this build;
# another selection would compile candle again).
export SPECGATE_TEST_FEATURES="--features specgate/mpi"
# shellcheck disable=SC2086
cargo test --release --workspace $SPECGATE_TEST_FEATURES
# Again on the AVX2 kernels, what an AVX2-only CPU runs, where this machine
# has better ones: the kernel tests of every format and the whole-model
# differential tests (the same build). The 1.5B's comparison (3 minutes) is
# left to the native pass: the 0.5B that runs here has its architecture and
# its quantization formats.
if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx2 /proc/cpuinfo; then
    # shellcheck disable=SC2086
    SPECGATE_KERNEL_ISA=avx2 cargo test --release --workspace $SPECGATE_TEST_FEATURES --lib kernels
    # shellcheck disable=SC2086
    SPECGATE_KERNEL_ISA=avx2 cargo test --release --workspace $SPECGATE_TEST_FEATURES \
        --test differential -- --skip real_qwen_coder_1_5b_matches_reference
fi
# Soak: 300 requests at concurrency 16 on SmolLM2-135M (clients hanging up
# mid-stream, slow readers, hostile bodies), then the server must be idle and
# healthy. Longer runs by flag: scripts/soak.sh -n 2000 -c 32 --config ...
scripts/soak.sh -n 300 -c 16
# The official OpenAI Python client against `specgate serve` on the real pair,
# then on the tiny Kimi K3 (hybrid target at TP 2, hybrid draft).
scripts/test-openai.sh
SPECGATE_CONFIG=configs/kimi-k3-tiny.toml SPECGATE_MODEL=kimi-k3-tiny SPECGATE_RANDOM_WEIGHTS=1 \
    scripts/test-openai.sh
# Kubernetes manifests against the schemas, the Grafana dashboard's metric names.
scripts/validate-deploy.sh
