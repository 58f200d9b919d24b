"""What deploy/k8s/validate.sh asks of the real binary: each named node (server-K, standby-K, witness) started for a
moment on loopback with the rendered config, its tls_dir pointed at a copy of that node's Secret and its state at a
scratch folder (plus any other `key = value` lines replaced), must load the config, accept its bundle and listen.
"""

import base64
import os
import re
import signal
import subprocess
import time


def nodes_listen(nodes, secrets, config_text, work, bin_dir, prefix="", replace=None, timeout_s=60.0):
    """Starts every node, waits until each logs "listening on" (or exits, or ``timeout_s`` passes), stops them all;
    returns ``{node: why}`` for the nodes that failed, each with its log printed by the caller."""
    procs = {}
    for node in nodes:
        bundle = os.path.join(work, f"{prefix}bundles", node)
        scratch = os.path.join(work, f"{prefix}state", node)
        os.makedirs(bundle)
        for name, value in secrets[f"tether-{node}"]["data"].items():
            with open(os.path.join(bundle, name), "wb") as out:
                out.write(base64.b64decode(value))
            os.chmod(os.path.join(bundle, name), 0o600)
        text = re.sub(r'(?m)^tls_dir\s*=.*$', f'tls_dir = "{bundle}"', config_text)
        text = re.sub(r'(?m)^dir\s*=.*$', f'dir = "{scratch}"', text)
        for key, value in (replace or {}).items():
            text = re.sub(rf'(?m)^{key}\s*=.*$', f'{key} = "{value}"', text)
        cfg = os.path.join(work, f"{prefix}{node}.toml")
        with open(cfg, "w") as out:
            out.write(text)
        exe = os.path.join(bin_dir, "tether-server")
        if node == "witness":
            cmd = [exe, "witness", "--config", cfg, "--listen", "127.0.0.1:0",
                   "--state", os.path.join(scratch, "witness.json")]
        else:
            role, k = node.rsplit("-", 1)
            cmd = [exe, "--config", cfg, "--shard", k, "--listen", "127.0.0.1:0", "--resume"]
            cmd += ["--standby"] if role == "standby" else []
        log = open(os.path.join(work, f"{prefix}{node}.log"), "w")
        env = {**os.environ, "RUST_LOG": "warn"}
        procs[node] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log.name)
    deadline, failed, waiting = time.time() + timeout_s, {}, dict(procs)
    while waiting and time.time() < deadline:
        for node, (proc, log) in list(waiting.items()):
            if "listening on" in open(log).read():
                del waiting[node]
            elif proc.poll() is not None:
                failed[node] = f"exited with {proc.returncode}"
                del waiting[node]
        time.sleep(0.1)
    failed.update({node: f"did not listen within {timeout_s:.0f} s" for node in waiting})
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {node: f"{why}\n{open(procs[node][1]).read()}" for node, why in failed.items()}
