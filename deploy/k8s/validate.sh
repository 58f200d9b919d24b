#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests (no cluster runs here): generates the Secrets with keygen, renders
# the kustomization with `kubectl kustomize` (kustomize v5, built into kubectl), validates every rendered object
# against the Kubernetes OpenAPI schemas with `kubernetes-validate` (PyPI; bundled schemas, no network), and checks
# what the schemas cannot: every node's Secret exists and holds its own key and no CA key, and each pod mounts only
# its own bundle into its long-running container.
#
# Usage: deploy/k8s/validate.sh        (needs kubectl and kubernetes-validate; TETHER_BIN=DIR optional)
set -euo pipefail
cd "$(dirname "$0")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r . "$work/k8s"
rm -f "$work/k8s/secrets.yaml"
./make-secrets.sh 2 4 "$work/ca" > "$work/k8s/secrets.yaml"
kubectl kustomize "$work/k8s" > "$work/rendered.yaml"
version=${K8S_VERSION:-1.33.0}
kubernetes-validate --strict --kubernetes-version "$version" "$work/rendered.yaml"
python3 - "$work/rendered.yaml" "$work/ca" <<'PY'
import base64, os, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
print("k8s: rendered", ", ".join(kinds))
secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
for node, stem in [(f"server-{k}", "server") for k in range(2)] + [(f"worker-{r}", "worker") for r in range(4)]:
    s = secrets.get(f"tether-{node}")
    assert s, f"no Secret for {node}"
    keys = sorted(s["data"])
    own = ["ca.pem", f"{stem}.pem", f"{stem}.key"] + (["checkpoint.key"] if stem == "server" else [])
    assert keys == sorted(own), (node, keys)
    cert = base64.b64decode(s["data"][f"{stem}.pem"]).decode()
    assert "BEGIN CERTIFICATE" in cert
for s in secrets.values():
    assert "ca.key" not in s["data"], f"{s['metadata']['name']} carries the CA key"
assert os.path.exists(os.path.join(sys.argv[2], "ca.key")), "keygen wrote no CA key (the check above proves nothing)"
for d in docs:
    if d["kind"] not in ("StatefulSet", "Job"):
        continue
    spec = d["spec"]["template"]["spec"]
    for c in spec["containers"]:
        mounts = {m["name"] for m in c["volumeMounts"]}
        assert "certs" in mounts and not any(m.startswith("all-") for m in mounts), (d["metadata"]["name"], mounts)
    if d["kind"] == "StatefulSet":
        assert any(a == "--resume" or "--resume" in a for c in spec["containers"] for a in c["command"]), "no --resume"
        assert d["spec"]["serviceName"] == "tether-shards"
    else:
        assert d["spec"]["completionMode"] == "Indexed"
print("k8s: one Secret per node, no CA key in any; long-running containers mount only their own bundle")
for d in docs:
    if d["kind"] in ("StatefulSet", "Job"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            args = " ".join(c["command"])
            assert "--metrics" in args and "0.0.0.0:9100" not in args, (d["metadata"]["name"], args)
policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
assert len(policies) == 1, "expected one NetworkPolicy"
p = policies[0]["spec"]
assert p["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "tether-node"}
for rule in p["ingress"]:
    ports = {(q["protocol"], q["port"]) for q in rule["ports"]}
    if ("TCP", 9100) in ports:
        assert rule.get("from"), "/metrics is open to every pod"
print("k8s: /metrics bound to the pod IP and reachable only from the Prometheus selector")
PY
echo "k8s: PASS (validated against Kubernetes $version schemas, offline)"
