#!/usr/bin/env bash
# Real-client test: installs the official `openai`, `anthropic` and
# `openai-agents` Python packages (pinned) into a venv under target/, starts
# `specgate serve` on the real pair (default config, a free port), runs
# tests/openai_client.py (chat and completions) and tests/agent_sdks_client.py
# (Responses, Anthropic Messages, one Agents SDK run) against it, then the
# latter again through `specgate route` in front of it, and stops both.
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
bin="${CARGO_TARGET_DIR:-target}/release/specgate"
log=$(mktemp)
rlog=$(mktemp)
pid=""
rpid=""
trap 'for p in $rpid $pid; do kill $p 2>/dev/null || true; wait $p 2>/dev/null || true; done; rm -f "$log" "$rlog"' EXIT
# The address process $1 logs to $2, once its /health answers 200.
wait_ready() {
  local p=$1 plog=$2 u=""
  for _ in $(seq 1 300); do
    kill -0 "$p" 2>/dev/null || { cat "$plog" >&2; echo "process $p exited" >&2; return 1; }
    [ -n "$u" ] || u=$(grep -o 'http://[0-9.]*:[0-9]*' "$plog" | head -n 1 || true)
    # /health answers 503 while the models load, 200 when ready.
    if [ -n "$u" ] && "$VENV/bin/python" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$u/health').status != 200)" 2>/dev/null; then
      echo "$u"
      return 0
    fi
    sleep 1
  done
  cat "$plog" >&2
  echo "process $p did not become ready" >&2
  return 1
}
"$bin" serve --config "${SPECGATE_CONFIG:-configs/default.toml}" --port 0 2>"$log" &
pid=$!
url=$(wait_ready $pid "$log")
echo "openai client against $url"
SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/openai_client.py
SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/agent_sdks_client.py
# The README's own Python example, as written (only its address changed),
# on the config the README serves.
if [ -z "${SPECGATE_CONFIG:-}" ]; then
  SPECGATE_URL="$url/v1" "$VENV/bin/python" tests/readme_example.py
fi
# The Responses, Messages and Agents clients again through `specgate route`
# in front of the server: each API's stream must arrive as the server ended
# it (an extra event or `[DONE]` makes the SDKs raise), and the router must
# log no warning for a complete stream.
"$bin" route --host 127.0.0.1 --port 0 --replica "$url" >"$rlog" 2>&1 &
rpid=$!
rurl=$(wait_ready $rpid "$rlog")
echo "agent SDK clients through the router at $rurl"
SPECGATE_URL="$rurl/v1" "$VENV/bin/python" tests/agent_sdks_client.py
if grep -E 'WARN|"level":"warn' "$rlog"; then
  echo "the router warned while relaying complete answers" >&2
  exit 1
fi
