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
# configs/example-all.toml, and its protections: mpirun checks every
# worker's own host key against known hosts written from the group (the
# client key only on the leader), NetworkPolicies admit sshd and MPI's
# ports only within the group and the API only on the leaders from the
# Service's clients, the API key and metrics_auth come from a Secret, and
# every container runs under Pod Security's "restricted" context. Then the
# Grafana dashboard: it parses and names only metrics defined in
# src/metrics.rs. Each check is also run on broken copies, which must fail
# (a copy missing one protection must fail with that protection's message).
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
# Every rank runs the same binary and command line: same image, and the
# checkpoint and the config mounted alike on both sides (the ssh material
# differs by design: the client key on the leader, a host key per worker).
if leader["image"] != worker["image"]:
    fail("leader and worker images differ (every rank must run the same build)")
mounts = {r: {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
          for r, (_, c) in pods.items()}
vols = {v["name"]: v for v in leader_spec.get("volumes", [])}
wvols = {v["name"]: v for v in worker_spec.get("volumes", [])}
pvcs = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
cm_mount, rank_vols = None, set()
for v in vols.values():
    if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in pvcs:
        fail(f"volume {v['name']}: claim {v['persistentVolumeClaim']['claimName']} not in the file")
    if "configMap" in v:
        if v["configMap"]["name"] != cms["metadata"]["name"]:
            fail(f"volume {v['name']}: ConfigMap {v['configMap']['name']} not in the file")
        cm_mount = mounts["leader"].get(v["name"])
    if "configMap" in v or "persistentVolumeClaim" in v:
        rank_vols.add(v["name"])
for n in rank_vols:
    if wvols.get(n) != vols[n]:
        fail(f"leader and worker volumes {n} differ")
    if mounts["worker"].get(n) != mounts["leader"].get(n):
        fail(f"leader and worker mounts differ: {n} at {mounts['leader'].get(n)} "
             f"and {mounts['worker'].get(n)}")

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

# --- Protections (deploy/lws/kimi-k3.yaml's header says why each).
def secret_sources(v):
    """(secret, key) pairs a volume projects; key "*" for a whole secret."""
    srcs = [(v["secret"]["secretName"], v["secret"])] if "secret" in v else []
    for s in (v.get("projected") or {}).get("sources", []):
        if "secret" in s:
            srcs.append((s["secret"]["name"], s["secret"]))
    return [(name, i["key"]) for name, sec in srcs for i in sec.get("items") or []] + \
        [(name, "*") for name, sec in srcs if not sec.get("items")]

def private(key):
    return key == "*" or not key.endswith(".pub")

def volume_at(path, c, volumes):
    best = max((m for m in c.get("volumeMounts", [])
                if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")),
               key=lambda m: len(m["mountPath"]), default=None)
    return volumes.get(best["name"]) if best else None

# ssh: host keys checked against known hosts written from the group.
m = re.search(r"^\s*ssh_opts=\((.*?)\)", launch, re.S | re.M) or fail("no ssh_opts=(...) in the launch script")
words = m.group(1).split()
opts = dict(words[i + 1].partition("=")[::2] for i, w in enumerate(words[:-1]) if w == "-o")
if opts.get("StrictHostKeyChecking") != "yes":
    fail("ssh must check the workers' host keys (StrictHostKeyChecking=yes), not "
         f"{opts.get('StrictHostKeyChecking')!r}")
khf = opts.get("UserKnownHostsFile", "")
if not khf or khf == "/dev/null":
    fail(f"ssh's known hosts must be a file written from the group, not {khf!r}")
if not re.search(r"@cert-authority[^\n]*(?:\\\n[^\n]*)?>\s*" + re.escape(khf), launch):
    fail(f"the launch script must write {khf} from the group (@cert-authority per worker)")
leader_private = {(s, k) for v in vols.values() for s, k in secret_sources(v) if private(k)}
if len(leader_private) != 1:
    fail(f"the leader must mount one private key (mpirun's client key), not {sorted(leader_private)}")
(client_secret, client_key), = leader_private
for v in wvols.values():
    for s, k in secret_sources(v):
        if private(k) and s == client_secret:
            fail(f"a worker pod holds the client private key ({s}/{k}); only its public half belongs there")
        if private(k) and v["name"] in mounts["worker"]:
            fail(f"the worker's sshd container mounts the private key {s}/{k}")
host_keys = re.findall(r"^HostKey (\S+)$", sshd, re.M) or fail("sshd_config has no HostKey")
for hk in host_keys:
    v = volume_at(hk, worker, wvols)
    if not v or "emptyDir" not in v:
        fail(f"sshd's host key {hk} must be made in the pod (an emptyDir), not shared "
             f"({sorted(v or {})})")
    makers = [c for c in worker_spec.get("initContainers", [])
              if v["name"] in {m["name"] for m in c.get("volumeMounts", [])}]
    if not any(re.search(r"ssh-keygen .*-s \S+ .*-h ", script(c, "worker init")) for c in makers):
        fail(f"no init container makes and certifies the host key {hk} (ssh-keygen -s CA -h)")
if not re.search(r"^HostCertificate \S+$", sshd, re.M):
    fail("sshd_config must present the host key's certificate (HostCertificate)")
ak = re.search(r"^AuthorizedKeysFile (\S+)$", sshd, re.M)
akv = ak and volume_at(ak.group(1), worker, wvols)
if not akv or not any(s == client_secret and k.endswith(".pub") for s, k in secret_sources(akv)):
    fail(f"sshd's authorized key must be the public half of {client_secret}")

# NetworkPolicy: sshd and MPI's ports within the group, the API from the
# Service's clients on the leaders only.
def port_range(pattern, what):
    return re.search(pattern, launch) or fail(
        f"mpirun must fix Open MPI's {what} ports ({pattern}): a NetworkPolicy cannot "
        "admit ephemeral ones")
oob = port_range(r"--mca oob_tcp_dynamic_ipv4_ports (\d+)-(\d+)", "control")
btl_min = port_range(r"--mca btl_tcp_port_min_v4 (\d+)", "data")
btl_n = port_range(r"--mca btl_tcp_port_range_v4 (\d+)", "data")
group_ports = {sshd_port} | set(range(int(oob.group(1)), int(oob.group(2)) + 1)) | \
    set(range(int(btl_min.group(1)), int(btl_min.group(1)) + int(btl_n.group(1))))
api_target = svcs[0]["spec"]["ports"][0]["targetPort"]
api_port = ports.get(api_target, api_target)
nps = by_kind.get("NetworkPolicy", [])

def selects(sel, labels):
    if sel.get("matchExpressions"):
        fail("NetworkPolicy selectors here use matchLabels only")
    return all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())

def admits(rule, port, named):
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        lo = named.get(p.get("port"), p.get("port"))
        if p.get("protocol", "TCP") == "TCP" and (
                lo is None or lo == port or (isinstance(lo, int) and lo <= port <= p.get("endPort", lo))):
            return True
    return False

set_label, gi_label, wi_label = (f"leaderworkerset.sigs.k8s.io/{k}"
                                 for k in ("name", "group-index", "worker-index"))
members = []
for g in range(spec.get("replicas", 1)):
    for role, (podspec, c) in pods.items():
        labels = dict((tpl[role].get("metadata") or {}).get("labels") or {},
                      **{set_label: name, gi_label: str(g)})
        labels[wi_label] = "0" if role == "leader" else "1"
        mine = [np for np in nps if "Ingress" in np["spec"].get("policyTypes", ["Ingress"])
                and selects(np["spec"].get("podSelector") or {}, labels)]
        if not mine:
            fail(f"no NetworkPolicy isolates the {role} pods of group {g}: every port is open to every pod")
        members.append((g, role, c, mine))
for g, role, c, mine in members:
    named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    rules = [r for np in mine for r in np["spec"].get("ingress") or []]
    for port in sorted(group_ports | {api_port}):
        for r in rules:
            if not admits(r, port, named):
                continue
            peers = r.get("from") or fail(f"group {g} {role}: port {port} admitted from anywhere")
            for peer in peers:
                if set(peer) != {"podSelector"}:
                    fail(f"group {g} {role}: port {port} admitted from {sorted(peer)} (pods only)")
                ml = peer["podSelector"].get("matchLabels") or {}
                if port == api_port and role == "leader":
                    if not ml:
                        fail(f"group {g}: the API admitted from every pod, not the Service's clients")
                elif ml.get(set_label) != name or ml.get(gi_label) != str(g):
                    fail(f"group {g} {role}: port {port} admitted from outside the group ({ml})")
        if port in group_ports and not any(admits(r, port, named) for r in rules):
            fail(f"group {g} {role}: port {port} not admitted from the group (MPI could not run)")
    if role == "leader" and not any(admits(r, api_port, named) for r in rules):
        fail(f"group {g}: the API port {api_port} is admitted from nobody")

# The API key and metrics_auth from a Secret; never in the ConfigMap.
srv = toml.get("server", {})
if srv.get("api_keys"):
    fail("API keys written into the ConfigMap: they belong in a Secret")
if srv.get("metrics_auth") is not True:
    fail("[server] metrics_auth must be true (/metrics behind the API key)")
env = {e["name"]: e for e in leader.get("env", [])}
key = env.get("SPECGATE_API_KEY") or fail("no API key: SPECGATE_API_KEY from a Secret on the leader")
if "value" in key or not (key.get("valueFrom") or {}).get("secretKeyRef"):
    fail("SPECGATE_API_KEY must come from a Secret (valueFrom.secretKeyRef)")
if re.search(r"-x\s+SPECGATE_API_KEY\b", launch):
    fail("mpirun must not forward SPECGATE_API_KEY to the workers")

# Pod Security "restricted", in both templates and every container.
for role, (podspec, _) in pods.items():
    psc = podspec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        fail(f"{role}: securityContext.runAsNonRoot must be true")
    for c in podspec.get("initContainers", []) + podspec["containers"]:
        sc = c.get("securityContext") or {}
        where = f"{role} container {c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            fail(f"{where}: allowPrivilegeEscalation must be false")
        if sc.get("privileged") or sc.get("runAsNonRoot") is False or sc.get("runAsUser") == 0:
            fail(f"{where}: runs privileged or as root")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            fail(f"{where}: capabilities must drop ALL (and add none)")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            fail(f"{where}: seccompProfile must be RuntimeDefault or Localhost, not {seccomp!r}")

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
# lws_must_refuse WHAT MESSAGE SED-ARGS: a copy missing one protection must
# fail with that protection's message (not by chance on another check).
lws_must_refuse() {
  local what="$1" want="$2" out
  shift 2
  sed "$@" deploy/lws/kimi-k3.yaml >"$tmp/broken-lws.yaml"
  if out=$(check_lws_all "$tmp/broken-lws.yaml" "$tmp/lws-broken" 2>&1); then
    echo "validate-deploy: accepted a LeaderWorkerSet with $what" >&2
    exit 1
  fi
  if [[ $out != *"$want"* ]]; then
    echo "validate-deploy: a LeaderWorkerSet with $what failed, but not for that: $out" >&2
    exit 1
  fi
  echo "validate-deploy: refused $what ($want)"
}
lws_must_refuse "unchecked host keys" "StrictHostKeyChecking=yes" \
  -e 's/StrictHostKeyChecking=yes/StrictHostKeyChecking=no/'
lws_must_refuse "known hosts in /dev/null" "known hosts must be a file" \
  -e 's#UserKnownHostsFile=/tmp/ssh/known_hosts#UserKnownHostsFile=/dev/null#'
lws_must_refuse "known hosts not written from the group" "@cert-authority per worker" \
  -e 's/@cert-authority %s %s/%s %s/'
lws_must_refuse "the client key as every worker's host key" "must be made in the pod" \
  -e 's#^    HostKey /var/run/specgate-ssh/host_key$#    HostKey /etc/specgate-ssh/authorized_keys#'
lws_must_refuse "workers holding the client private key" "holds the client private key" \
  -e 's/- key: id_ed25519.pub/- key: id_ed25519/'
lws_must_refuse "uncertified host keys" "HostCertificate" -e '/^    HostCertificate /d'
lws_must_refuse "the host CA key in the workers' sshd container" "sshd container mounts the private key" \
  -e '/^    workerTemplate:/,$ s/^              - name: host-key$/              - name: host-ca/'
lws_must_refuse "no NetworkPolicy for the group" "no NetworkPolicy isolates" \
  -e '/^# Ingress of group 0/,/^---$/d'
lws_must_refuse "sshd and MPI open to every pod" "admitted from anywhere" \
  -e "/# the group's own pods only/,+4d"
lws_must_refuse "sshd and MPI open to other groups" "admitted from outside the group" \
  -e "/# the group's own pods only/,+4 s/group-index: \"0\"/group-index: \"1\"/"
lws_must_refuse "MPI data ports outside the policy" "not admitted from the group" \
  -e 's/btl_tcp_port_min_v4 41100/btl_tcp_port_min_v4 42100/'
lws_must_refuse "ephemeral MPI ports" "must fix Open MPI's control ports" \
  -e '/--mca oob_tcp_dynamic_ipv4_ports/d'
lws_must_refuse "the API open to every pod" "admitted from anywhere" \
  -e "/# the Service's clients only/,+7d"
lws_must_refuse "no metrics_auth" "metrics_auth must be true" -e '/^    metrics_auth = true$/d'
lws_must_refuse "no API key" "no API key" -e '/- name: SPECGATE_API_KEY/,+4d'
lws_must_refuse "an API key in the ConfigMap" "belong in a Secret" \
  -e 's/^    metrics_auth = true$/&\n    api_keys = ["k"]/'
lws_must_refuse "an API key written into the pod spec" "must come from a Secret" \
  -e '/- name: SPECGATE_API_KEY/,+4 {/valueFrom:/,+3d}' \
  -e 's/^\( *\)- name: SPECGATE_API_KEY$/&\n\1  value: k/'
lws_must_refuse "privilege escalation allowed" "allowPrivilegeEscalation must be false" \
  -e '/^    workerTemplate:/,$ {/allowPrivilegeEscalation: false/d}'
lws_must_refuse "capabilities kept" "capabilities must drop ALL" -e '/drop: \["ALL"\]/d'
lws_must_refuse "no seccomp profile" "seccompProfile must be" \
  -e '/seccompProfile:/d' -e '/type: RuntimeDefault/d'
lws_must_refuse "a pod that may run as root" "runAsNonRoot must be true" -e '/runAsNonRoot: true/d'

# host_key_check FILE DIR: the workers' init script for real (where
# ssh-keygen is installed): two pods of one group each make their own host
# key, certified by the group's CA for exactly the name the leader dials
# (<leader pod>-i.<subdomain>.<namespace>, the hostfile's and known hosts'
# name).
host_key_check() {
  local dir=$2 i
  rm -rf "$dir" && mkdir -p "$dir/ca" || return 1
  "$VENV/bin/python" - "$1" "$dir" <<'PY' || return 1
import sys, yaml
src, d = sys.argv[1], sys.argv[2]
(cm,) = [x for x in yaml.safe_load_all(open(src)) if x and x["kind"] == "ConfigMap"]
s = cm["data"]["make-host-key.sh"]
for a, b in (("/etc/specgate-ssh-ca", "ca"), ("/var/run/specgate-ssh", "key")):
    s = s.replace(a, f"{d}/{b}")
open(f"{d}/make-host-key.sh", "w").write(s)
PY
  ssh-keygen -q -t ed25519 -N '' -C host-ca -f "$dir/ca/host_ca" || return 1
  for i in 1 2; do
    mkdir -p "$dir/key" && rm -f "$dir/key"/* || return 1
    HOSTNAME=specgate-k3-0-$i LWS_LEADER_ADDRESS=specgate-k3-0.specgate-k3.ns \
      bash "$dir/make-host-key.sh" || return 1
    ssh-keygen -L -f "$dir/key/host_key-cert.pub" >"$dir/cert$i.txt" || return 1
    ssh-keygen -l -f "$dir/key/host_key.pub" | cut -d' ' -f2 >"$dir/fp$i.txt" || return 1
  done
  ssh-keygen -l -f "$dir/ca/host_ca.pub" | cut -d' ' -f2 >"$dir/ca.txt" || return 1
  "$VENV/bin/python" - "$dir" <<'PY'
import pathlib, re, sys
d = pathlib.Path(sys.argv[1])
ca = (d / "ca.txt").read_text().strip()
for i in (1, 2):
    cert = (d / f"cert{i}.txt").read_text()
    name = f"specgate-k3-0-{i}.specgate-k3.ns"
    principals = re.search(r"Principals:\s*\n((?:\s{16,}\S+\n)+)", cert)
    if "host certificate" not in cert or f"Signing CA: ED25519 {ca}" not in cert or \
            not principals or principals.group(1).split() != [name]:
        sys.exit(f"host_key_check: pod {i}'s certificate is not a host certificate of the "
                 f"group's CA for {name} alone:\n{cert}")
if (d / "fp1.txt").read_text() == (d / "fp2.txt").read_text():
    sys.exit("host_key_check: two pods made the same host key")
print("validate-deploy: deploy/lws worker host keys: one per pod, certified by the "
      "group's CA for the name the leader dials")
PY
}
if command -v ssh-keygen >/dev/null; then
  host_key_check deploy/lws/kimi-k3.yaml "$tmp/host-key"
  sed 's/ -n "\$name"//' deploy/lws/kimi-k3.yaml >"$tmp/broken-lws.yaml"
  if host_key_check "$tmp/broken-lws.yaml" "$tmp/host-key-broken" >/dev/null 2>&1; then
    echo "validate-deploy: the host key check accepted a certificate valid for any name" >&2
    exit 1
  fi
else
  echo "validate-deploy: no ssh-keygen here: the workers' host key script was not run"
fi

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
  echo "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGroupHostCaOfTheSimulation specgate-k3-host-ca" \
    >"$dir/ssh/host_ca.pub"
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
echo "$*" >>"${0%/bin/ssh}/ssh-args"
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
# Every ssh (the script's wait for sshd, and mpirun's) checks host keys
# against the known hosts the script wrote: one CA line per worker name.
known = d / "sshtmp" / "known_hosts"
ca = (d / "ssh" / "host_ca.pub").read_text().strip()
want = {f"@cert-authority {h} {ca}" for h in hosts}
if not known.exists() or set(known.read_text().splitlines()) != want:
    fail(f"known hosts {known} must hold {sorted(want)}")
for call in (d / "ssh-args").read_text().splitlines():
    if "StrictHostKeyChecking=yes" not in call or f"UserKnownHostsFile={known}" not in call:
        fail(f"an ssh without the group's known hosts: {call}")
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
