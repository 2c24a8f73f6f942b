#!/usr/bin/env bash
# The test command of README.md and CI: fetches the real weights (idempotent,
# checksummed), then runs every test with optimizations (candle in a debug
# build is far too slow for real weights).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh models
cargo fmt --all -- --check
cargo test --release --workspace
# The official OpenAI Python client against `specgate serve` on the real pair.
scripts/test-openai.sh
# Kubernetes manifests against the schemas, the Grafana dashboard's metric names.
scripts/validate-deploy.sh
