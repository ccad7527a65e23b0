"""What a schema cannot see in the rendered manifests of one overlay (see check.sh).

Usage: check.py TOKENLOG_BINARY RENDERED.yaml NODES
"""
import base64
import re
import subprocess
import sys

import yaml

binary, rendered, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
errors = []


def fail(msg):
    errors.append(msg)


def help_flags(command):
    out = subprocess.run([binary, command, "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"--[a-z0-9-]+", out))


# Every container's arguments: a tokenlog command and flags it has.
flags = {}
for kind in ("StatefulSet", "Deployment"):
    for name, obj in by_kind.get(kind, {}).items():
        pod = obj["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in obj["spec"].get("volumeClaimTemplates", [])}
        for c in pod["containers"]:
            command, args = c["args"][0], c["args"][1:]
            if command not in flags:
                flags[command] = help_flags(command)
            for a in args:
                flag = a.split("=", 1)[0]
                if flag.startswith("--") and flag not in flags[command]:
                    fail(f"{name}: `tokenlog {command}` has no flag {flag}")
            ports = {p["name"] for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p:
                    fail(f"{name}: no {probe}")
                    continue
                port = (p.get("grpc") or p.get("httpGet") or {}).get("port")
                if port not in ports:
                    fail(f"{name}: {probe} on port {port!r}, which the container does not declare")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes | claims:
                    fail(f"{name}: mounts {m['name']}, which is no volume")
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("capabilities", {}).get("drop") != ["ALL"]:
                fail(f"{name}: the container may escalate or keeps capabilities")
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            fail(f"{name}: may run as root")

# The log: as many voters as replicas, named as the StatefulSet names its pods, ids 1..N.
sts = by_kind["StatefulSet"]["tokenlog-node"]
if sts["spec"]["replicas"] != nodes:
    fail(f"the StatefulSet has {sts['spec']['replicas']} replicas, expected {nodes}")
peers = by_kind["ConfigMap"]["tokenlog-cluster"]["data"]["peers"].split(",")
want = [
    f"{i + 1}=tokenlog-node-{i}.tokenlog-node:7001/tokenlog-node-{i}.tokenlog-node:7002" for i in range(nodes)
]
if peers != want:
    fail(f"peers {peers} != {want}")
cluster = by_kind["ConfigMap"]["tokenlog-cluster"]["data"]["cluster"].split(",")
if cluster != [f"tokenlog-node-{i}.tokenlog-node:7001" for i in range(nodes)]:
    fail(f"cluster {cluster} does not name each node's client port")
if by_kind["Service"]["tokenlog-node"]["spec"].get("clusterIP") != "None":
    fail("the nodes' Service is not headless")

# Each pod's certificate is in the Secret it mounts, and holds the role its pod needs.
def secret(prefix):
    [s] = [s for n, s in by_kind["Secret"].items() if n.startswith(prefix)]
    return {k: base64.b64decode(v) for k, v in s["data"].items()}


node_tls = secret("tokenlog-node-tls")
for i in range(nodes):
    for ext in ("pem", "key"):
        if f"tokenlog-node-{i}.{ext}" not in node_tls:
            fail(f"the node Secret has no tokenlog-node-{i}.{ext}")
for prefix, holder in (("tokenlog-decoder-tls", "tokenlog-decoder"), ("tokenlog-gateway-tls", "gateway")):
    s = secret(prefix)
    for f in ("ca.pem", f"{holder}.pem", f"{holder}.key"):
        if f not in s:
            fail(f"{prefix} has no {f}")

# The network policy: the peer port from nodes only, the client port from gateways and decoders.
policy = by_kind["NetworkPolicy"]["tokenlog-node"]["spec"]["ingress"]
seen = {}
for rule in policy:
    for p in rule["ports"]:
        roles = sorted(f.get("podSelector", {}).get("matchLabels", {}).get("tokenlog.io/role", "*") for f in rule["from"])
        seen[p["port"]] = roles
if seen.get(7002) != ["node"] or seen.get(7001) != ["decoder", "gateway"]:
    fail(f"the nodes' NetworkPolicy lets in {seen}")
pdb = by_kind["PodDisruptionBudget"]["tokenlog-node"]["spec"]
if pdb.get("maxUnavailable") != 1:
    fail("the nodes' PodDisruptionBudget allows more than one node down")

for e in errors:
    print(f"check.py {rendered}: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
