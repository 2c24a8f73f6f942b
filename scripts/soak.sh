#!/usr/bin/env bash
# Soak test: `specgate serve` on a loopback port under N requests at
# concurrency C with random parameters, a third of the clients hanging up
# mid-stream, slow readers, hostile bodies, chats run to the end of the
# context and JSON answers that spell chat markup; then checks that every
# request not dropped by its client completed, running = waiting = 0,
# kv_cache_usage_ratio = 0, /health is 200 and a fresh request completes.
# Prints the counts and `N passed, M failed`; exits non-zero on any failure.
#
#   scripts/soak.sh                        # CI setting: tiny model, N=300, C=16
#   scripts/soak.sh -n 2000 -c 32 --config configs/default.toml   # the real pair
#   scripts/soak.sh --through-router       # the same load through `specgate route`
#   flags: -n N  -c C  --config FILE  --seed S  --max-seconds T  --through-router
#          (see scripts/soak.py -h)
#
# The model files come from scripts/fetch-models.sh. Python 3.11+ stdlib only.
set -euo pipefail
cd "$(dirname "$0")/.."
# The same selection as scripts/test.sh's `cargo test` (which runs first;
# SPECGATE_TEST_FEATURES carries its features): building the binary alone
# unifies the dependencies' features
# differently and would compile candle a second time, which on CI costs
# minutes and gigabytes of disk.
# shellcheck disable=SC2086
cargo test --release --workspace ${SPECGATE_TEST_FEATURES:-} --no-run
exec python3 scripts/soak.py --binary "${CARGO_TARGET_DIR:-target}/release/specgate" "$@"
