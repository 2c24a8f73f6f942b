#!/usr/bin/env bash
# Real-client test: installs the official `openai`, `anthropic` and
# `openai-agents` Python packages (pinned) into a venv under target/, starts
# `specgate serve` on the real pair (default config, a free port), runs
# tests/openai_client.py (chat and completions) and tests/agent_sdks_client.py
# (Responses, Anthropic Messages, one Agents SDK run) against it, stops it.
# Another config: SPECGATE_CONFIG=configs/kimi-k3-tiny.toml
# SPECGATE_MODEL=kimi-k3-tiny SPECGATE_RANDOM_WEIGHTS=1 scripts/test-openai.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/openai-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
  'openai==3.63.0' 'anthropic==2.17.0' 'openai-agents==0.24.0'
# The same selection as scripts/test.sh's `cargo test` (SPECGATE_TEST_FEATURES
# carries its features), so this reuses that build: building the binary alone unifies the dependencies' features
# differently and would compile candle a second time.
# shellcheck disable=SC2086
cargo test --release --workspace ${SPECGATE_TEST_FEATURES:-} --no-run
log=$(mktemp)
"${CARGO_TARGET_DIR:-target}/release/specgate" serve --config "${SPECGATE_CONFIG:-configs/default.toml}" --port 0 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
url=""
ready=""
for _ in $(seq 1 300); do
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "specgate serve exited" >&2; exit 1; }
  [ -n "$url" ] || url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)
  # /health answers 503 while the models load, 200 when ready.
  if [ -n "$url" ] && "$VENV/bin/python" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$url/health').status != 200)" 2>/dev/null; then
    ready=1
    break
  fi
  sleep 1
done
[ -n "$ready" ] || { cat "$log"; echo "specgate serve did not become ready" >&2; exit 1; }
echo "openai client against $url"
SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/openai_client.py
SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/agent_sdks_client.py
# The README's own Python example, as written (only its address changed),
# on the config the README serves.
if [ -z "${SPECGATE_CONFIG:-}" ]; then
  SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/readme_example.py
fi
