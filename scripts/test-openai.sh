#!/usr/bin/env bash
# Real-client test: installs the official `openai` Python package into a
# venv under target/, starts `specgate serve` on the real pair (default
# config, a free port), runs tests/openai_client.py against it, stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/openai-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check 'openai>=1.40,<3'
cargo build --release --bin specgate
log=$(mktemp)
target/release/specgate serve --config configs/default.toml --port 0 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
url=""
for _ in $(seq 1 180); do
  url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)
  [ -n "$url" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "specgate serve exited" >&2; exit 1; }
  sleep 1
done
[ -n "$url" ] || { cat "$log"; echo "specgate serve did not start" >&2; exit 1; }
echo "openai client against $url"
SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/openai_client.py
