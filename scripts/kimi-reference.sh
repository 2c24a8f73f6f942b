#!/usr/bin/env bash
# Regenerates the tiny Kimi-architecture fixtures (tests/fixtures/tiny-kimi*)
# with the Hugging Face transformers DeepseekV3 model as the reference.
# Builds its own venv under target/ from PyPI with pinned versions; CI never
# runs this (the fixtures are committed), so CI needs no torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KIMI_REF_VENV:-target/kimi-ref-venv}
TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.24.0
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" "safetensors>=0.4" numpy
fi
"$VENV/bin/python" scripts/kimi-reference.py "${1:-tests/fixtures}"
