#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests (no cluster runs here): generates the Secrets with keygen, renders
# the kustomization with `kubectl kustomize` (kustomize v5, built into kubectl), validates every rendered object
# against the Kubernetes OpenAPI schemas with `kubernetes-validate` (PyPI; bundled schemas, no network), and checks
# what the schemas cannot: every node's Secret (shards, standbys, the witness, workers) exists and holds its own key
# and no CA key, with a certificate for the host its address has in cluster.toml; each pod mounts only its own bundle
# into its long-running container; every address in cluster.toml is a pod of the right StatefulSet behind its headless
# Service; every shard has a standby that a required anti-affinity rule keeps off its primary's node, and the witness
# is kept off every shard node's; shard nodes and the witness keep their state on a PersistentVolumeClaim; and the
# binary accepts the rendered config and each role's bundle (each role started for a moment on loopback).
# Then the same for the PyTorch overlay deploy/k8s-torch (rendered over the same base and Secrets; its checks are
# described where they start below).
#
# Usage: deploy/k8s/validate.sh        (needs kubectl and kubernetes-validate; TETHER_BIN=DIR optional)
set -euo pipefail
cd "$(dirname "$0")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r . "$work/k8s"
rm -f "$work/k8s/secrets.yaml"
bin=${TETHER_BIN:-${CARGO_TARGET_DIR:-$PWD/../../target}/release}
./make-secrets.sh 2 4 "$work/ca" > "$work/k8s/secrets.yaml"
kubectl kustomize "$work/k8s" > "$work/rendered.yaml"
version=${K8S_VERSION:-1.33.0}
kubernetes-validate --strict --kubernetes-version "$version" "$work/rendered.yaml"
python3 - "$work/rendered.yaml" "$work/ca" "$bin" "$work" <<'PY'
import base64, os, re, signal, ssl, subprocess, sys, time, yaml
try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:
    import tomli as tomllib
rendered, ca_dir, bin_dir, work = sys.argv[1:5]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
print("k8s: rendered", ", ".join(kinds))
def by_kind(kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
secrets, services, sets, jobs = by_kind("Secret"), by_kind("Service"), by_kind("StatefulSet"), by_kind("Job")
config_maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("tether-config")]
assert len(config_maps) == 1, "expected one tether-config ConfigMap"
config_text = config_maps[0]["data"]["cluster.toml"]
config = tomllib.loads(config_text)
cluster = config["cluster"]
servers, standbys, witness = cluster["servers"], cluster.get("standbys", []), cluster.get("witness")
shards, workers = len(servers), cluster["workers"]
assert len(standbys) == shards, f"cluster.standbys has {len(standbys)} addresses for {shards} shards"
assert witness, "standbys need cluster.witness"
def host_port(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)

# Secrets: one per node, its own key and certificate (a shard node's also shard K's checkpoint key), no CA key.
# node -> (file stem, has a checkpoint key, certificate CN, host the certificate must name or None)
nodes = {}
for k in range(shards):
    nodes[f"server-{k}"] = ("server", True, f"tether-server-{k}", host_port(servers[k])[0])
    nodes[f"standby-{k}"] = ("server", True, f"tether-standby-{k}", host_port(standbys[k])[0])
nodes["witness"] = ("server", False, "tether-witness", host_port(witness)[0])
for r in range(workers):
    nodes[f"worker-{r}"] = ("worker", False, f"tether-worker-{r}", None)
assert sorted(secrets) == sorted(f"tether-{n}" for n in nodes), ("Secrets", sorted(secrets))
def cert_names(pem):
    """(CN, DNS names) of a PEM certificate: the stdlib's decoder, else the openssl CLI."""
    path = os.path.join(work, "cert.pem")
    with open(path, "w") as f:
        f.write(pem)
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode:
        c = decode(path)
        cn = [v for rdn in c["subject"] for (k, v) in rdn if k == "commonName"]
        return cn[0] if cn else None, [v for (k, v) in c.get("subjectAltName", ()) if k == "DNS"]
    out = subprocess.run(["openssl", "x509", "-in", path, "-noout", "-subject", "-ext", "subjectAltName"],
                         check=True, capture_output=True, text=True).stdout
    cn = re.search(r"CN\s*=\s*([^,/\n]+)", out)
    return cn and cn.group(1).strip(), re.findall(r"DNS:([^,\s]+)", out)
for node, (stem, ckpt, cn, host) in nodes.items():
    data = secrets[f"tether-{node}"]["data"]
    own = ["ca.pem", f"{stem}.pem", f"{stem}.key"] + (["checkpoint.key"] if ckpt else [])
    assert sorted(data) == sorted(own), (node, sorted(data))
    cert = base64.b64decode(data[f"{stem}.pem"]).decode()
    assert "BEGIN CERTIFICATE" in cert
    got_cn, dns = cert_names(cert)
    assert got_cn == cn, f"{node}'s certificate is {got_cn}'s, not {cn}'s"
    # Peers check the host part of the node's address in cluster.toml against its certificate.
    assert host is None or host in dns, f"{node}'s certificate names {dns}, not {host} (its cluster.toml host)"
for k in range(shards):
    key = secrets[f"tether-server-{k}"]["data"]["checkpoint.key"]
    assert secrets[f"tether-standby-{k}"]["data"]["checkpoint.key"] == key, f"standby-{k} lacks shard {k}'s key"
for s in secrets.values():
    assert "ca.key" not in s["data"], f"{s['metadata']['name']} carries the CA key"
assert os.path.exists(os.path.join(ca_dir, "ca.key")), "keygen wrote no CA key (the check above proves nothing)"
print("k8s: one Secret per node (shards, standbys, witness, workers), no CA key in any; each certificate names its "
      "node's cluster.toml host; standby-K holds shard K's checkpoint key")

# Addresses: every address in cluster.toml is pod NAME-i of its StatefulSet behind that StatefulSet's headless
# Service, which selects that StatefulSet's pods and no other's.
roles = {
    "server": ("tether-shards", servers),
    "standby": ("tether-standbys", standbys),
    "witness": ("tether-witness", [witness]),
}
assert sorted(sets) == sorted(roles), ("StatefulSets", sorted(sets))
def matches(selector, labels):
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        has, value, op = e["key"] in labels, labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and has and value in e["values"]) \
                or (op == "Exists" and not has) or (op == "DoesNotExist" and has):
            return False
    return True
def pod_labels(name, i):
    labels = dict(sets[name]["spec"]["template"]["metadata"]["labels"])
    labels.update({"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": f"{name}-{i}"})
    return labels
all_templates = [d["spec"]["template"]["metadata"]["labels"] for d in list(sets.values()) + list(jobs.values())]
for name, (service_name, addrs) in roles.items():
    d = sets[name]
    spec, template = d["spec"], d["spec"]["template"]["metadata"]["labels"]
    assert spec["serviceName"] == service_name, (name, spec["serviceName"])
    assert spec["replicas"] == len(addrs), f"StatefulSet {name} has {spec['replicas']} pods for {len(addrs)} addresses"
    assert sum(matches(spec["selector"], t) for t in all_templates) == 1, f"{name}'s selector matches other pods"
    svc = services[service_name]["spec"]
    assert svc["clusterIP"] == "None" and svc.get("publishNotReadyAddresses"), f"{service_name} is not headless"
    assert [matches({"matchLabels": svc["selector"]}, t) for t in all_templates].count(True) == 1 \
        and matches({"matchLabels": svc["selector"]}, template), f"{service_name} selects other pods than {name}'s"
    (c,) = d["spec"]["template"]["spec"]["containers"]
    for i, addr in enumerate(addrs):
        host, port = host_port(addr)
        assert host == f"{name}-{i}.{service_name}", f"{addr} is not pod {name}-{i} behind {service_name}"
        assert any(p["protocol"] == "UDP" and p["port"] == port for p in svc["ports"]), (service_name, port)
        assert any(p["containerPort"] == port and p["protocol"] == "UDP" for p in c["ports"]), (name, port)
        args = " ".join(c["command"])
        listen = re.search(r"--listen[ =](\S+)", args)
        assert listen is None or host_port(listen.group(1))[1] == port, (name, "listens elsewhere", args)
print("k8s: every cluster.toml address is a pod of its StatefulSet behind its own headless Service (UDP)")

# Roles, flags and state: shard nodes resume and keep checkpoints and fence votes on a PVC; the witness keeps its
# votes on one.
def on_claim(d, path):
    spec = d["spec"]["template"]["spec"]
    claims = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
    claims |= {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    (c,) = spec["containers"]
    return any(m["name"] in claims and not m.get("readOnly") and
               (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")) for m in c["volumeMounts"])
ckpt_dir = config.get("checkpoint", {}).get("dir")
for name in ("server", "standby"):
    (c,) = sets[name]["spec"]["template"]["spec"]["containers"]
    args = " ".join(c["command"])
    assert "--shard" in args and "--resume" in args, (name, args)
    assert ("--standby" in args) == (name == "standby"), (name, args)
    assert ckpt_dir and on_claim(sets[name], ckpt_dir), f"{name}: checkpoint.dir {ckpt_dir} is not on a PVC"
(c,) = sets["witness"]["spec"]["template"]["spec"]["containers"]
assert c["command"][:2] == ["tether-server", "witness"], c["command"]
state = c["command"][c["command"].index("--state") + 1] if "--state" in c["command"] else f"{ckpt_dir}/witness.json"
assert on_claim(sets["witness"], state), f"the witness's state file {state} is not on a PersistentVolumeClaim"
print(f"k8s: shard nodes resume, with checkpoints and fence votes on a PVC; the witness keeps {state} on a PVC")

# Scheduling: a required anti-affinity rule (on either pod: the scheduler honours both sides) keeps shard K's primary
# and standby apart, and the witness off every shard node's node. matchLabelKeys takes the value from the pod that
# carries the rule.
def rule_selects(term, own, other):
    if term.get("topologyKey") not in ("kubernetes.io/hostname", "topology.kubernetes.io/zone"):
        return False
    if term.get("namespaces") or term.get("namespaceSelector") is not None:
        return False
    selector = dict(term.get("labelSelector") or {})
    extra = [{"key": k, "operator": "In", "values": [own[k]]} for k in term.get("matchLabelKeys", []) if k in own]
    extra += [{"key": k, "operator": "NotIn", "values": [own[k]]}
              for k in term.get("mismatchLabelKeys", []) if k in own]
    selector["matchExpressions"] = list(selector.get("matchExpressions", [])) + extra
    return bool(term.get("labelSelector")) and matches(selector, other)
def kept_apart(a, i, b, j):
    pa, pb = pod_labels(a, i), pod_labels(b, j)
    for name, own, other in ((a, pa, pb), (b, pb, pa)):
        aff = sets[name]["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
        if any(rule_selects(t, own, other) for t in aff.get("requiredDuringSchedulingIgnoredDuringExecution", [])):
            return True
    return False
for k in range(shards):
    assert kept_apart("server", k, "standby", k), f"shard {k}'s primary and standby may share a node"
    assert kept_apart("witness", 0, "server", k) and kept_apart("witness", 0, "standby", k), \
        f"the witness may share a node with a node of shard {k}"
    # The rule must not be unsatisfiable for the shard's own pod (a standby kept off itself never schedules).
    assert not kept_apart("standby", k, "standby", k) and not kept_apart("server", k, "server", k)
print("k8s: every shard has a standby, kept off its primary's node by a required anti-affinity rule; the witness "
      "is kept off every shard node's node")

# Bundles: each long-running container mounts only its own: an emptyDir its init container filled from
# /all/KIND-<index> (a projected volume of that kind's Secrets, one folder per node), or its pod's one Secret.
workloads = [(name, name, sets[name]["spec"]["replicas"]) for name in ("server", "standby")] + \
    [("witness", "witness", 1)] + [(name, "worker", d["spec"]["completions"]) for name, d in jobs.items()]
for name, kind, count in workloads:
    d = sets.get(name) or jobs[name]
    spec = d["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in spec["containers"]:
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert "certs" in mounts and mounts["certs"].get("readOnly"), (name, "certs not read-only")
        assert not any(m.startswith("all-") or "secret" in volumes.get(m, {}) or "projected" in volumes.get(m, {})
                       for m in mounts if m != "certs"), (name, sorted(mounts))
    certs = volumes["certs"]
    if "secret" in certs:
        assert count == 1 and certs["secret"]["secretName"] == f"tether-{kind}", (name, certs)
        assert not spec.get("initContainers"), (name, "an init container sees other Secrets")
        continue
    assert "emptyDir" in certs, (name, certs)
    (init,) = spec["initContainers"]
    assert f"/all/{kind}-$" in " ".join(init["command"]), (name, init["command"])
    (all_,) = [m["name"] for m in init["volumeMounts"] if m["name"].startswith("all-")]
    sources = volumes[all_]["projected"]["sources"]
    assert [s["secret"]["name"] for s in sources] == [f"tether-{kind}-{i}" for i in range(count)], (name, sources)
    for s in sources:
        node = s["secret"]["name"].removeprefix("tether-")
        assert all(item["path"].startswith(f"{node}/") for item in s["secret"]["items"]), (name, s)
        assert sorted(item["key"] for item in s["secret"]["items"]) == sorted(secrets[f"tether-{node}"]["data"])
    if d["kind"] == "Job":
        assert d["spec"]["completionMode"] == "Indexed"
print("k8s: long-running containers mount only their own bundle (read-only)")

# /metrics: bound to the pod IP; the witness serves none and is no endpoint of tether-metrics.
metrics_svc = services["tether-metrics"]["spec"]
(metrics_port,) = metrics_svc["ports"]
target = metrics_port.get("targetPort", metrics_port["port"])
for d in list(sets.values()) + list(jobs.values()):
    name = d["metadata"]["name"]
    for c in d["spec"]["template"]["spec"]["containers"]:
        args = " ".join(c["command"])
        declares = any(p.get("name") == target or p["containerPort"] == target for p in c.get("ports", []))
        if name == "witness":
            assert "--metrics" not in args and not declares, (name, "the witness has no /metrics")
        else:
            assert "--metrics" in args and "0.0.0.0:9100" not in args and declares, (name, args)
    labels = d["spec"]["template"]["metadata"]["labels"]
    if matches({"matchLabels": metrics_svc["selector"]}, labels) and name == "witness":
        assert isinstance(target, str), "tether-metrics targets a port number, so the witness would be an endpoint"
policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
assert len(policies) == 1, "expected one NetworkPolicy"
p = policies[0]["spec"]
assert p["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "tether-node"}
open_udp = set()
for rule in p["ingress"]:
    ports = {(q["protocol"], q["port"]) for q in rule["ports"]}
    if ("TCP", 9100) in ports:
        assert rule.get("from"), "/metrics is open to every pod"
    if not rule.get("from"):
        open_udp |= {port for proto, port in ports if proto == "UDP"}
for d in list(sets.values()) + list(jobs.values()):
    assert matches(p["podSelector"], d["spec"]["template"]["metadata"]["labels"]), (d["metadata"]["name"], "no policy")
for addr in servers + standbys + [witness]:
    assert host_port(addr)[1] in open_udp, f"the NetworkPolicy drops QUIC to {addr}"
print("k8s: /metrics bound to the pod IP and reachable only from the Prometheus selector; QUIC open to every node")

# The binary: each role started for a moment on loopback with the rendered config (its tls_dir and checkpoint.dir
# pointed at a copy of that node's Secret and a scratch folder) must load the config, accept its bundle for its
# role and listen. Nothing is dialled successfully (the cluster names do not resolve here); that is not checked.
from listen_check import nodes_listen
nodes = [f"server-{k}" for k in range(shards)] + [f"standby-{k}" for k in range(shards)] + ["witness"]
failed = nodes_listen(nodes, secrets, config_text, work, bin_dir)
for node, why in failed.items():
    print(f"--- {node}: {why}", file=sys.stderr)
assert not failed, f"the binary refused the rendered config or a bundle: {sorted(failed)}"
print(f"k8s: tether-server accepts the rendered cluster.toml and each role's bundle ({', '.join(nodes)} listened)")
PY

# The PyTorch overlay (deploy/k8s-torch) over the same base copy and Secrets: rendered, validated against the same
# schemas, then checked for what they cannot: it reuses every base object but the Rust worker Job (gone) and the
# config (the base's but for [model] = a model file); the shard and standby pods get that file from an init container
# of the workers' image at the path cluster.toml names (the path the image's build writes it to); the Job runs one
# `python -m tether.launch --role ranks` per rank, as many pods as cluster.toml's workers, each pod mounting only its
# own bundle; and the binary accepts the overlay's config with a model file of train.py's layout.
cp -r ../k8s-torch "$work/k8s-torch"
kubectl kustomize "$work/k8s-torch" > "$work/rendered-torch.yaml"
kubernetes-validate --strict --kubernetes-version "$version" "$work/rendered-torch.yaml"
python3 - "$work/rendered.yaml" "$work/rendered-torch.yaml" "$work/k8s/cluster.toml" "$work/k8s-torch" "$bin" \
  "$work" <<'PY'
import array, base64, copy, json, math, os, re, shlex, signal, struct, subprocess, sys, time, yaml
try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:
    import tomli as tomllib
base_rendered, rendered, base_toml, overlay, bin_dir, work = sys.argv[1:7]
def load(path):
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(path)) if d}
base, objs = load(base_rendered), load(rendered)
print("k8s-torch: rendered", ", ".join(sorted(f"{k}/{n}" for k, n in objs)))

# The config: deploy/k8s-torch/cluster.toml, the base's but for [model], which names an absolute model file.
(cm_key,) = [k for k in objs if k[0] == "ConfigMap" and k[1].startswith("tether-config")]
(base_cm_key,) = [k for k in base if k[0] == "ConfigMap" and k[1].startswith("tether-config")]
config_text = objs[cm_key]["data"]["cluster.toml"]
assert config_text == open(os.path.join(overlay, "cluster.toml")).read(), "tether-config is not k8s-torch/cluster.toml"
config = tomllib.loads(config_text)
with open(base_toml, "rb") as f:
    base_config = tomllib.load(f)
assert {k: v for k, v in config.items() if k != "model"} == {k: v for k, v in base_config.items() if k != "model"}, \
    "deploy/k8s-torch/cluster.toml differs from deploy/k8s/cluster.toml outside [model]"
model_file = config["model"].get("file", "")
assert config["model"].get("kind") == "file" and model_file.startswith("/"), ("[model]", config["model"])
model_dir, model_name = os.path.split(model_file)
workers = config["cluster"]["workers"]

# Reuse: the base's Rust Job is gone, one Job of PyTorch workers came in; every other object is the base's (its
# ConfigMap references renamed), the shard and standby StatefulSets once the model file's additions are taken out.
jobs = {n: d for (k, n), d in objs.items() if k == "Job"}
assert ("Job", "worker") in base and len(jobs) == 1, ("Jobs", sorted(jobs))
((job_name, job),) = jobs.items()
kept = {k for k in base if k[0] not in ("ConfigMap", "Job")}
assert {k for k in objs if k[0] not in ("ConfigMap", "Job")} == kept, "the overlay adds or drops base objects"
pod = job["spec"]["template"]["spec"]
(c,) = pod["containers"]
image = c["image"]
def with_base_config(d):
    return json.loads(json.dumps(d).replace(json.dumps(base_cm_key[1]), json.dumps(cm_key[1])))
for key in sorted(kept):
    d = copy.deepcopy(objs[key])
    if key in (("StatefulSet", "server"), ("StatefulSet", "standby")):
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (node,) = spec["containers"]
        found = [m for m in node["volumeMounts"] if m["mountPath"] == model_dir]
        assert len(found) == 1, f"{key[1]} mounts no volume at {model_dir}, where cluster.toml's model file is"
        (mount,) = found
        assert mount.get("readOnly") and "emptyDir" in volumes[mount["name"]], (key, mount)
        (fill,) = [i for i in spec["initContainers"] if any(m["name"] == mount["name"] for m in i["volumeMounts"])]
        (out,) = [m["mountPath"] for m in fill["volumeMounts"]]  # the model volume and nothing else (no Secret)
        assert fill["image"] == image, f"{key[1]}'s model comes from {fill['image']}, the workers' from {image}"
        assert fill["command"] == ["cp", model_file, f"{out}/{model_name}"], (key, fill["command"])
        spec["initContainers"].remove(fill)
        spec["volumes"].remove(volumes[mount["name"]])
        node["volumeMounts"].remove(mount)
    assert d == with_base_config(base[key]), f"{key[0]}/{key[1]} differs from the base's"
print(f"k8s-torch: the base's objects reused; tether-config names the model file {model_file}, which the shard and "
      f"standby pods get from an init container of {image} (the rest as in the base)")

# The Job: Indexed, one pod per rank, each running the launcher for its rank with its own bundle only.
spec = job["spec"]
assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never", job_name
assert spec["completions"] == spec["parallelism"] == workers, \
    f"{job_name}: completions {spec['completions']}, parallelism {spec['parallelism']}, cluster.toml workers {workers}"
assert spec.get("backoffLimitPerIndex", 0) >= 1, f"{job_name}: a failed pod must be replaced (its rank rejoins)"
args = list(c["command"]) + list(c.get("args", []))
if args[:2] in (["bash", "-c"], ["sh", "-c"]):
    args = shlex.split(args[2])
    args = args[1:] if args[0] == "exec" else args
assert args[0] in ("python", "python3") and args[1:3] == ["-m", "tether.launch"], args
opts, i = {}, 3
while args[i].startswith("-"):
    opts[args[i]], i = args[i + 1], i + 2
script = args[i]
assert opts.get("--role") == "ranks", ("not --role ranks", args)
assert opts.get("--nproc-per-host", "1") == "1", ("one rank per pod, so that completions = workers", args)
env = {e["name"]: e for e in c.get("env", [])}
assert "--node-rank" not in opts and not {"TETHER_NODE_RANK", "SLURM_NODEID"} & set(env), \
    "the host place must come from $JOB_COMPLETION_INDEX"
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
conf_dir, conf_name = os.path.split(opts["--config"])
assert volumes[mounts[conf_dir]["name"]].get("configMap", {}).get("name") == cm_key[1] and conf_name == "cluster.toml"
tls = opts.get("--tls-dir", config["cluster"]["tls_dir"])
assert mounts[tls]["name"] == "certs" and mounts[tls].get("readOnly") and "emptyDir" in volumes["certs"], tls
# The reports go to --work-dir (default: the config's folder, a read-only ConfigMap here).
work_mount = mounts.get(opts.get("--work-dir"), {"readOnly": True, "name": None})
assert not work_mount.get("readOnly") and "emptyDir" in volumes.get(work_mount["name"], {}), \
    ("--work-dir on a writable volume", opts)
assert model_dir not in mounts, f"{job_name} hides the image's {model_dir}, where its model file is"
assert not any(m["name"].startswith("all-") or "secret" in volumes[m["name"]] or "projected" in volumes[m["name"]]
               for m in c["volumeMounts"]), (job_name, "the worker container mounts Secrets", sorted(mounts))
(init,) = pod["initContainers"]
assert init["image"] == image and "/all/worker-$JOB_COMPLETION_INDEX/" in " ".join(init["command"]), init["command"]
assert "batch.kubernetes.io/job-completion-index" in json.dumps(
    {e["name"]: e for e in init.get("env", [])}["JOB_COMPLETION_INDEX"]), "select-bundle's index is not the pod's"
init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
assert init_mounts.get(tls) == "certs", init_mounts
(all_,) = [n for n in init_mounts.values() if n.startswith("all-")]
secrets = {n: d for (k, n), d in objs.items() if k == "Secret"}
sources = volumes[all_]["projected"]["sources"]
assert [s["secret"]["name"] for s in sources] == [f"tether-worker-{r}" for r in range(workers)], sources
for s in sources:
    node = s["secret"]["name"].removeprefix("tether-")
    assert all(item["path"].startswith(f"{node}/") for item in s["secret"]["items"]), s
    assert sorted(item["key"] for item in s["secret"]["items"]) == sorted(secrets[f"tether-{node}"]["data"])
labels = job["spec"]["template"]["metadata"]["labels"]
policy = objs[("NetworkPolicy", "tether-nodes")]["spec"]["podSelector"]["matchLabels"]
assert all(labels.get(k) == v for k, v in policy.items()), "the NetworkPolicy does not cover the PyTorch workers"
dockerfile = open(os.path.join(overlay, "Dockerfile")).read()
assert re.search(rf"^COPY\s+\S+\s+{re.escape(script)}\s*$", dockerfile, re.M), f"the image has no {script}"
assert f"TETHER_PREPARE={model_file} " in dockerfile, f"the image's build writes no {model_file}"
print(f"k8s-torch: {job_name} runs `python -m tether.launch --role ranks` ({script}) in {workers} pods, one per "
      f"rank (cluster.toml workers), each mounting only its own bundle; the image's build writes {model_file}")

# The binary: each shard node started for a moment on loopback with the overlay's config, its own bundle and a model
# file of train.py's layout (MLP 784-256-128-10 as nn.Sequential names it) must load the file and listen.
layout = [("0.weight", (256, 784)), ("0.bias", (256,)), ("2.weight", (128, 256)), ("2.bias", (128,)),
          ("4.weight", (10, 128)), ("4.bias", (10,))]
header, body = {"__metadata__": {"tether.order": json.dumps([n for n, _ in layout])}}, bytearray()
for name, shape in layout:
    n = math.prod(shape)
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(body), len(body) + 4 * n]}
    body += array.array("f", [0.01] * n).tobytes()
head = json.dumps(header).encode()
head += b" " * (-len(head) % 8)
model_path = os.path.join(work, "torch-model.safetensors")
with open(model_path, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + body)
from listen_check import nodes_listen
nodes = [f"{r}-{k}" for r in ("server", "standby") for k in range(len(config["cluster"]["servers"]))]
failed = nodes_listen(nodes, secrets, config_text, work, bin_dir, prefix="torch-", replace={"file": model_path})
for node, why in failed.items():
    print(f"--- {node}: {why}", file=sys.stderr)
assert not failed, f"the binary refused the overlay's cluster.toml, the model file or a bundle: {sorted(failed)}"
print(f"k8s-torch: tether-server accepts the overlay's cluster.toml with a model file of train.py's layout "
      f"({', '.join(nodes)} listened)")
PY
echo "k8s: PASS (validated against Kubernetes $version schemas, offline)"
