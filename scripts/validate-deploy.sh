#!/usr/bin/env bash
# Validates deploy/ offline: the Kubernetes manifests in deploy/k8s against
# the Kubernetes schemas (PyPI `kubernetes-validate`, which bundles them, in
# a venv under target/), strictly (unknown fields fail). The ServiceMonitor
# in deploy/prometheus is a CRD whose schema is not bundled: it is checked
# for the fields the Prometheus Operator needs instead. Then the Grafana
# dashboard: it parses and names only metrics defined in src/metrics.rs.
# Each check is also run on a broken copy, which must fail.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/deploy-venv
K8S_VERSION="${K8S_VERSION:-1.30.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check 'kubernetes-validate>=1.30,<2'
kv() { "$VENV/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$@"; }

kv deploy/k8s/*.yaml
echo "validate-deploy: deploy/k8s/*.yaml valid against Kubernetes $K8S_VERSION"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A misspelt field must be refused, or the check above proves nothing.
sed 's/readinessProbe:/readynessProbe:/' deploy/k8s/engine.yaml >"$tmp/broken.yaml"
if kv "$tmp/broken.yaml" >/dev/null 2>&1; then
  echo "validate-deploy: the validator accepted a misspelt field" >&2
  exit 1
fi

"$VENV/bin/python" - deploy/prometheus/servicemonitor.yaml <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for d in docs:
    assert d["apiVersion"] == "monitoring.coreos.com/v1", d["apiVersion"]
    assert d["kind"] == "ServiceMonitor", d["kind"]
    assert d["metadata"]["name"], "metadata.name"
    assert d["spec"]["selector"]["matchLabels"], "spec.selector.matchLabels"
    for e in d["spec"]["endpoints"]:
        assert e["port"] and e["path"] == "/metrics", e
print(f"validate-deploy: {sys.argv[1]}: {len(docs)} ServiceMonitor(s) well formed")
PY

python3 scripts/check-dashboard.py deploy/grafana/specgate-dashboard.json src/metrics.rs
sed 's/specgate_kv_cache_usage_ratio/specgate_kv_cache_usage_typo/' \
  deploy/grafana/specgate-dashboard.json >"$tmp/bad.json"
if python3 scripts/check-dashboard.py "$tmp/bad.json" src/metrics.rs 2>/dev/null; then
  echo "validate-deploy: the dashboard check accepted an unknown metric" >&2
  exit 1
fi
echo "validate-deploy: ok"
