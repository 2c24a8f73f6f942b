#!/usr/bin/env bash
# Validates deploy/ offline: the Kubernetes manifests in deploy/k8s against
# the Kubernetes schemas (PyPI `kubernetes-validate`, which bundles them, in
# a venv under target/), strictly (unknown fields fail). The ServiceMonitor
# in deploy/prometheus is a CRD whose schema is not bundled: it is checked
# for the fields the Prometheus Operator needs instead. So is the multi-host
# K3 group in deploy/lws (a LeaderWorkerSet): its fields against the LWS v1
# API, plus what the MPI launch needs; its core objects and both pod
# templates (wrapped into Pods) go through the Kubernetes schemas, its
# scripts through `bash -n`, its engine.toml's keys against
# configs/example-all.toml. Then the Grafana dashboard: it parses and names
# only metrics defined in src/metrics.rs. Each check is also run on broken
# copies, which must fail.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/deploy-venv
K8S_VERSION="${K8S_VERSION:-1.30.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check 'kubernetes-validate>=1.30,<2'
# tomllib is in Python >= 3.11; tomli is the same parser for older ones.
"$VENV/bin/python" -c 'import tomllib' 2>/dev/null ||
  "$VENV/bin/pip" install --quiet --disable-pip-version-check 'tomli>=2,<3'
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

# check_lws FILE OUT: the LeaderWorkerSet's fields, the objects around it and
# the MPI launch's needs; writes the core objects, both pod templates as Pods
# and the ConfigMap's scripts into OUT for the checks below.
check_lws() {
  "$VENV/bin/python" - "$1" "$2" configs/example-all.toml <<'PY'
import pathlib, re, sys, yaml
try:
    import tomllib
except ImportError:
    import tomli as tomllib

src, out, example = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
LWS = "leaderworkerset.x-k8s.io/v1"
# Fields and enums of the LWS v1 API (api/leaderworkerset/v1 in
# kubernetes-sigs/lws); an unknown field is refused, as the API server would.
FIELDS = {
    "spec": {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"},
    "leaderWorkerTemplate": {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                             "subGroupPolicy", "volumeClaimTemplates",
                             "persistentVolumeClaimRetentionPolicy"},
    "rolloutStrategy": {"type", "rollingUpdateConfiguration"},
    "rollingUpdateConfiguration": {"partition", "maxUnavailable", "maxSurge"},
    "networkConfig": {"subdomainPolicy"},
    "subGroupPolicy": {"subGroupPolicyType", "subGroupSize"},
}
ENUMS = {
    "startupPolicy": {"LeaderCreated", "LeaderReady"},
    "restartPolicy": {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"},
    "type": {"RollingUpdate"},
    "subdomainPolicy": {"Shared", "UniquePerReplica"},
}

def fail(msg):
    sys.exit(f"validate-deploy: {src}: {msg}")

def check_fields(where, obj, kind):
    if not isinstance(obj, dict):
        fail(f"{where} must be a mapping")
    unknown = set(obj) - FIELDS[kind]
    if unknown:
        fail(f"{where}: unknown field(s) {sorted(unknown)}")
    for k, v in obj.items():
        if k in ENUMS and v not in ENUMS[k]:
            fail(f"{where}.{k}: {v!r} is not one of {sorted(ENUMS[k])}")
        if k in FIELDS and k != "spec":
            check_fields(f"{where}.{k}", v, k)

docs = [d for d in yaml.safe_load_all(open(src)) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
sets = by_kind.get("LeaderWorkerSet", [])
if len(sets) != 1:
    fail(f"expected one LeaderWorkerSet, found {len(sets)}")
lws = sets[0]
if lws["apiVersion"] != LWS:
    fail(f"apiVersion {lws['apiVersion']!r}, expected {LWS}")
name = lws["metadata"]["name"]
spec = lws["spec"]
check_fields("spec", spec, "spec")
if "leaderWorkerTemplate" not in spec:
    fail("spec.leaderWorkerTemplate is required")
lwt = spec["leaderWorkerTemplate"]
for k, lo in (("replicas", 1), ("size", 2)):
    v = spec.get(k) if k == "replicas" else lwt.get(k)
    if not isinstance(v, int) or v < lo:
        fail(f"{k} must be an integer >= {lo} (a group spans hosts), not {v!r}")
# The fault model: a failed rank ends the whole group, which LWS recreates;
# the leader waits for its workers, so they must be created with it.
if lwt.get("restartPolicy") != "RecreateGroupOnPodRestart":
    fail("leaderWorkerTemplate.restartPolicy must be RecreateGroupOnPodRestart")
if spec.get("startupPolicy", "LeaderCreated") != "LeaderCreated":
    fail("startupPolicy must be LeaderCreated (LeaderReady deadlocks: the "
         "leader is ready only once its workers run)")
if "workerTemplate" not in lwt or "leaderTemplate" not in lwt:
    fail("leaderTemplate and workerTemplate are both required")
tpl = {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
pods = {}
for role, t in tpl.items():
    podspec = t.get("spec") or fail(f"{role}Template.spec is required")
    cs = podspec.get("containers") or fail(f"{role}Template: no containers")
    pods[role] = (podspec, cs[0])

(cms,) = by_kind.get("ConfigMap", [None]) or fail("no ConfigMap")
cm_data = cms["data"]
leader_spec, leader = pods["leader"]
worker_spec, worker = pods["worker"]
# Every rank runs the same binary and command line: same image, volumes
# and mount paths on both sides.
if leader["image"] != worker["image"]:
    fail("leader and worker images differ (every rank must run the same build)")
mounts = {r: sorted((m["name"], m["mountPath"]) for m in c.get("volumeMounts", []))
          for r, (_, c) in pods.items()}
if mounts["leader"] != mounts["worker"]:
    fail(f"leader and worker mounts differ: {mounts}")
if leader_spec.get("volumes") != worker_spec.get("volumes"):
    fail("leader and worker volumes differ")
vols = {v["name"]: v for v in leader_spec.get("volumes", [])}
pvcs = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
cm_mount = None
for v in vols.values():
    if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in pvcs:
        fail(f"volume {v['name']}: claim {v['persistentVolumeClaim']['claimName']} not in the file")
    if "configMap" in v:
        if v["configMap"]["name"] != cms["metadata"]["name"]:
            fail(f"volume {v['name']}: ConfigMap {v['configMap']['name']} not in the file")
        cm_mount = dict(mounts["leader"])[v["name"]]

def script(c, role):
    cmd = c.get("command") or fail(f"{role}: command is required")
    path = cmd[0]
    if not path.startswith(cm_mount + "/") or path[len(cm_mount) + 1:] not in cm_data:
        fail(f"{role}: command {path} is not a script of the ConfigMap at {cm_mount}")
    return cm_data[path[len(cm_mount) + 1:]]

launch = script(leader, "leader")
run = re.search(r"\bmpirun\b[^&]*?specgate serve --config (\S+) --distributed mpi", launch, re.S)
if not run:
    fail("the leader's script must run `mpirun ... specgate serve --config C --distributed mpi`")
if '-np "$LWS_GROUP_SIZE"' not in launch:
    fail("mpirun must start one rank per pod of the group (-np \"$LWS_GROUP_SIZE\")")
config = run.group(1)
if not config.startswith(cm_mount + "/") or config[len(cm_mount) + 1:] not in cm_data:
    fail(f"--config {config} is not a file of the ConfigMap at {cm_mount}")
toml = tomllib.loads(cm_data[config[len(cm_mount) + 1:]])

# The engine config: keys that exist (configs/example-all.toml documents
# every one; commented lines included), serving on the leader's port.
def leaves(d, pre=""):
    for k, v in d.items():
        yield from leaves(v, f"{pre}{k}.") if isinstance(v, dict) else [f"{pre}{k}"]
known, section = set(leaves(tomllib.load(open(example, "rb")))), ""
for line in open(example):
    if m := re.match(r"\[([a-z_.]+)\]", line):
        section = m.group(1)
    elif m := re.match(r"#\s*([a-z_]+)\s*=", line):
        known.add(f"{section}.{m.group(1)}")
if unknown := sorted(set(leaves(toml)) - known):
    fail(f"engine config: unknown key(s) {unknown} (see configs/example-all.toml)")
ports = {p["name"]: p["containerPort"] for p in leader.get("ports", [])}
if toml.get("server", {}).get("port", 8000) not in ports.values():
    fail("the leader container does not expose [server] port")
for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
    g = leader.get(probe, {}).get("httpGet") or fail(f"leader: {probe} must be an httpGet")
    if g.get("path") != "/health" or g.get("port") not in ports:
        fail(f"leader: {probe} must GET /health on a named container port")

# sshd on the workers: the port mpirun's ssh uses.
script(worker, "worker")
sshd = cm_data.get("sshd_config") or fail("no sshd_config in the ConfigMap")
sshd_port = int(re.search(r"^Port (\d+)$", sshd, re.M).group(1))
if sshd_port not in [p["containerPort"] for p in worker.get("ports", [])]:
    fail(f"the worker container does not expose sshd's port {sshd_port}")
if f"-p {sshd_port}" not in launch:
    fail(f"the leader's ssh does not use sshd's port {sshd_port}")

# Clients reach the leaders only (rank 0 serves HTTP).
svcs = by_kind.get("Service") or fail("no Service for the leaders")
for s in svcs:
    sel = s["spec"].get("selector", {})
    want = {"leaderworkerset.sigs.k8s.io/name": name, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    if any(sel.get(k) != v for k, v in want.items()):
        fail(f"Service {s['metadata']['name']} must select the leaders: {want}")
    for p in s["spec"]["ports"]:
        if p.get("targetPort") not in ports and p.get("targetPort") not in ports.values():
            fail(f"Service {s['metadata']['name']}: targetPort {p.get('targetPort')} is no leader port")

# Out: core objects and pod templates for the Kubernetes schemas, scripts
# for bash -n.
for d in docs:
    if d["kind"] != "LeaderWorkerSet":
        (out / f"{d['kind']}-{d['metadata']['name']}.yaml").write_text(yaml.safe_dump(d))
for role, t in tpl.items():
    meta = dict(t.get("metadata") or {}, name=f"{name}-{role}")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": t["spec"]}
    (out / f"Pod-{role}.yaml").write_text(yaml.safe_dump(pod))
for key, text in cm_data.items():
    if key.endswith(".sh"):
        (out / key).write_text(text)
print(f"validate-deploy: {src}: LeaderWorkerSet {name} well formed "
      f"({spec.get('replicas')} group(s) of {lwt['size']} pods, one MPI rank each)")
PY
}
# check_lws_all FILE OUT: check_lws, then the Kubernetes schemas, then bash -n.
check_lws_all() {
  rm -rf "$2" && mkdir -p "$2" && check_lws "$1" "$2" && kv "$2"/*.yaml || return 1
  local s
  for s in "$2"/*.sh; do bash -n "$s" || return 1; done
}
check_lws_all deploy/lws/kimi-k3.yaml "$tmp/lws"
echo "validate-deploy: deploy/lws: core objects and pod templates valid against Kubernetes $K8S_VERSION, scripts parse"
# Broken copies, each of which one of the checks above must refuse.
lws_must_fail() {
  local what="$1"
  shift
  sed "$@" deploy/lws/kimi-k3.yaml >"$tmp/broken-lws.yaml"
  if check_lws_all "$tmp/broken-lws.yaml" "$tmp/lws-broken" >/dev/null 2>&1; then
    echo "validate-deploy: accepted a LeaderWorkerSet with $what" >&2
    exit 1
  fi
}
lws_must_fail "a misspelt LWS field" -e 's/leaderWorkerTemplate:/leaderWorkerTemplat:/'
lws_must_fail "a restart policy that keeps a broken group" \
  -e 's/restartPolicy: RecreateGroupOnPodRestart/restartPolicy: None/'
lws_must_fail "the LeaderReady startup policy" -e 's/startupPolicy: LeaderCreated/startupPolicy: LeaderReady/'
lws_must_fail "a misspelt pod template field" \
  -e 's/terminationGracePeriodSeconds:/terminationGracePeriodSecs:/'
lws_must_fail "workers mounting the models elsewhere" \
  -e '/workerTemplate:/,$ s#mountPath: /models#mountPath: /weights#'
lws_must_fail "no --distributed mpi" -e 's/ --distributed mpi//'
lws_must_fail "a Service reaching workers too" -e '/worker-index: "0"/d'
lws_must_fail "an unknown engine config key" -e 's/max_num_batched_tokens/max_batched_tokens/'
lws_must_fail "a launch script that does not parse" -e 's/^\( *\)done$/\1don/'

# sim_launch FILE DIR MODE: the leader's launch script for real under Open
# MPI (where mpirun is installed, as in CI), as a group of 3 on this
# machine: ssh is replaced by a local shell and specgate by a stub rank.
# Every rank must start with the serve command line and mpirun must reach
# the workers by the names the hostfile gives them. MODE drain: SIGTERM
# must drain rank 0 before any other rank is told to stop. MODE fault: a
# worker rank exits 3 on its own; the script must exit non-zero (so the
# leader container restarts and LWS recreates the group).
sim_launch() {
  local dir=$2 mode=$3 pid i status=0
  rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/ssh" && : >"$dir/ssh/id_ed25519" || return 1
  "$VENV/bin/python" - "$1" "$dir" <<'PY' || return 1
import sys, yaml
src, d = sys.argv[1], sys.argv[2]
(cm,) = [x for x in yaml.safe_load_all(open(src)) if x and x["kind"] == "ConfigMap"]
s = cm["data"]["launch-leader.sh"]
for a, b in (("/etc/specgate-ssh", "ssh"), ("/usr/local/bin/specgate", "bin/specgate"),
             ("/tmp/hostfile", "hostfile"), ("/tmp/ssh", "sshtmp")):
    s = s.replace(a, f"{d}/{b}")
open(f"{d}/launch.sh", "w").write(s)
PY
  cat >"$dir/bin/ssh" <<'SH'
#!/bin/bash
while [[ $1 == -* ]]; do case $1 in -[pio]) shift 2 ;; *) shift ;; esac; done
echo "$1" >>"${0%/bin/ssh}/ssh-hosts"
shift
exec /bin/sh -c "$*"
SH
  cat >"$dir/bin/specgate" <<'SH'
#!/bin/bash
log="${0%/bin/specgate}/rank$OMPI_COMM_WORLD_RANK.log"
trap 'echo "term $(date +%s%N)" >>"$log"; sleep 1; echo "drained $(date +%s%N)" >>"$log"; exit 0' TERM
echo "pid $$ size $OMPI_COMM_WORLD_SIZE args $*" >>"$log"
if [[ $SIM_MODE == fault && $OMPI_COMM_WORLD_RANK == 2 ]]; then sleep 0.5; exit 3; fi
while :; do sleep 0.1; done
SH
  chmod +x "$dir/bin/ssh" "$dir/bin/specgate"
  SIM_MODE=$mode PATH="$dir/bin:$PATH" LWS_GROUP_SIZE=3 LWS_LEADER_ADDRESS="$HOSTNAME.specgate-k3.ns" \
    SPECGATE_MPI_IF=lo RUST_LOG=info OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    bash "$dir/launch.sh" >"$dir/out.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 300; i++)); do
    [ "$(cat "$dir"/rank*.log 2>/dev/null | grep -c '^pid ')" = 3 ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  [[ $mode == fault ]] || kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid"
    echo "sim_launch: the group did not end within 60 s ($mode)" >&2
  fi
  wait "$pid" 2>/dev/null || status=$?
  # Stub ranks that outlive their group (a broken copy's) end here, not later.
  for pid in $(sed -n 's/^pid \([0-9]*\) .*/\1/p' "$dir"/rank*.log 2>/dev/null); do
    for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if grep -qs "$dir" "/proc/$pid/cmdline"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  # mpirun outlives a killed launch script, and the workers' orted
  # daemonize: left running, they broke the next group's start (seen in a
  # CI run). The simulated hosts' names are this check's own.
  pkill -KILL -f -- "$dir/hostfile" 2>/dev/null || true
  pkill -KILL -f -- "specgate-k3\.ns" 2>/dev/null || true
  "$VENV/bin/python" - "$dir" "$mode" "$status" <<'PY'
import pathlib, sys
d, mode, status = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def fail(msg):
    print(f"sim_launch: {msg}", file=sys.stderr)
    print((d / "out.log").read_text(), file=sys.stderr)
    sys.exit(1)
logs = {r: (d / f"rank{r}.log").read_text().split("\n") if (d / f"rank{r}.log").exists() else []
        for r in range(3)}
for r, lines in logs.items():
    if not any(l.startswith("pid ") and l.endswith(
            "size 3 args serve --config /etc/specgate/engine.toml --distributed mpi") for l in lines):
        fail(f"rank {r} did not start with the serve command line: {lines}")
hosts = set((d / "ssh-hosts").read_text().split())
if not all(h.endswith(".specgate-k3.ns") for h in hosts) or len(hosts) != 2:
    fail(f"mpirun must ssh to the hostfile's worker names, got {sorted(hosts)}")
if mode == "fault":
    if status == 0 or status == 137:
        fail(f"a worker rank exited 3 but the launch script ended with {status}")
    print(f"validate-deploy: deploy/lws launch script: a failed worker rank ends the "
          f"group with exit status {status}")
    sys.exit(0)
t = {r: {l.split()[0]: int(l.split()[1]) for l in ls if l.startswith(("term", "drained"))}
     for r, ls in logs.items()}
if "drained" not in t[0]:
    fail("rank 0 did not drain on SIGTERM")
early = [r for r in (1, 2) if t[r].get("term", 1 << 62) < t[0]["drained"]]
if early:
    fail(f"rank(s) {early} were stopped before rank 0 had drained")
print("validate-deploy: deploy/lws launch script: a group of 3 under mpirun started, "
      "reached its workers by name and drained rank 0 first on SIGTERM")
PY
}
if command -v mpirun >/dev/null; then
  # Up to three tries for the real script only: Open MPI's start of a
  # simulated 3-host group on one machine sometimes leaves the ranks
  # unstarted for a minute (seen in about one run in four, here and in a
  # CI run; the cause is in that simulation, not in the script under
  # test). The broken copies below get one try: a start that fails there
  # only makes them fail, as they must.
  sim_try() { sim_launch "$@" || sim_launch "$@" || sim_launch "$@"; }
  sim_try deploy/lws/kimi-k3.yaml "$tmp/sim-drain" drain
  sim_try deploy/lws/kimi-k3.yaml "$tmp/sim-fault" fault
  sed 's/kill -TERM "${pid:-$mpi}"/kill -TERM "$mpi"/' deploy/lws/kimi-k3.yaml >"$tmp/broken-lws.yaml"
  if sim_launch "$tmp/broken-lws.yaml" "$tmp/sim-broken" drain >/dev/null 2>&1; then
    echo "validate-deploy: the launch check accepted a SIGTERM that stops every rank at once" >&2
    exit 1
  fi
  sed 's/^    exit "$status"$/    exit 0/' deploy/lws/kimi-k3.yaml >"$tmp/broken-lws.yaml"
  if sim_launch "$tmp/broken-lws.yaml" "$tmp/sim-broken" fault >/dev/null 2>&1; then
    echo "validate-deploy: the launch check accepted a script that hides a failed rank" >&2
    exit 1
  fi
else
  echo "validate-deploy: no mpirun here: the launch script was not run (apt-get install openmpi-bin)"
fi

python3 scripts/check-dashboard.py deploy/grafana/specgate-dashboard.json src/metrics.rs
sed 's/specgate_kv_cache_usage_ratio/specgate_kv_cache_usage_typo/' \
  deploy/grafana/specgate-dashboard.json >"$tmp/bad.json"
if python3 scripts/check-dashboard.py "$tmp/bad.json" src/metrics.rs 2>/dev/null; then
  echo "validate-deploy: the dashboard check accepted an unknown metric" >&2
  exit 1
fi
echo "validate-deploy: ok"
