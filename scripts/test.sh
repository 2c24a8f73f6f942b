#!/usr/bin/env bash
# The test command of README.md and CI: fetches the real weights (idempotent,
# checksummed), then runs every test with optimizations (candle in a debug
# build is far too slow for real weights).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh models
cargo fmt --all -- --check
cargo test --release --workspace
# Again on the AVX2 kernels, what an AVX2-only CPU runs, where this machine
# has better ones: the kernel tests of every format and the whole-model
# differential tests (the same build: --workspace keeps the features). The
# 1.5B's comparison (3 minutes) is left to the native pass: the 0.5B that
# runs here has its architecture and its quantization formats.
if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx2 /proc/cpuinfo; then
    SPECGATE_KERNEL_ISA=avx2 cargo test --release --workspace --lib kernels
    SPECGATE_KERNEL_ISA=avx2 cargo test --release --workspace --test differential \
        -- --skip real_qwen_coder_1_5b_matches_reference
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
# Ranks as processes under mpirun (tests/mpi.rs: logits at 2 and 4 ranks over
# shared memory and TCP, serving equal to one process, a killed or hung
# worker). Open MPI is installed when missing; the `mpi` feature rebuilds only
# the workspace's crates (mpi-sys's bindgen needs libclang).
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null \
    || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev libclang-dev >/dev/null
fi
# --workspace keeps the dependencies' features those of the build above
# (-p specgate alone would unify them differently and compile candle again).
cargo test --release --workspace --features specgate/mpi --test mpi
# Kubernetes manifests against the schemas, the Grafana dashboard's metric names.
scripts/validate-deploy.sh
