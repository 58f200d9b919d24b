"""``python -m tether.launch``: the plan of a host (pure), and real launches of python/tests/launched.py against real
``tether-server`` nodes on loopback: one box (``--standalone``), two hosts (127.0.0.1 and 127.0.0.2, each with its
own launcher), a rank that crashes and rejoins, a rank that crashes past the limit, a script that exits without
closing its worker, a rank without a bundle, an address named twice, and SIGTERM. After every launch no node or rank
process may be left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import tether
from tether.cluster import find_binary, free_udp_port, toml_dumps
from tether.launch import LaunchError, default_node_rank, plan_host

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "launched.py"

BASE = {
    "cluster": {"staleness": 0, "worker_timeout_ms": 5000},
    "data": {"dataset": "digits"},
    "train": {"batch": 32, "eval_every": 0, "seed": 7, "local_steps": 4},
    "optimizer": {"kind": "adam", "lr": 3e-3, "outer": {"kind": "nesterov", "lr": 0.7, "momentum": 0.5}},
    "compression": {"scheme": "q4"},
    "checkpoint": {"every_updates": 0},
}


def _bin_dir() -> str:
    return str(find_binary("tether-server").parent)


def _leftovers(*needles: str) -> List[str]:
    """Command lines of live processes that contain one of ``needles``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().split(") ")[1][:1]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(n in cmd for n in needles):
            found.append(cmd)
    return found


def _assert_nothing_left(tmp: Path) -> None:
    deadline = time.monotonic() + 10
    while (left := _leftovers(str(tmp), str(SCRIPT))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running: {left}"


def _launch(args: List[str], tmp: Path, env: Optional[Dict[str, str]] = None,
            timeout_s: float = 240) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.setdefault("RUST_LOG", "warn")
    e.update(env or {})
    cmd = [sys.executable, "-m", "tether.launch", "--bin-dir", _bin_dir()] + args + [str(SCRIPT)]
    try:
        return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout_s, cwd=str(tmp))
    finally:
        _assert_nothing_left(tmp)


def _standalone(tmp: Path, nproc: int = 3, env: Optional[Dict[str, str]] = None,
                extra: Optional[List[str]] = None) -> subprocess.CompletedProcess:
    base = tmp / "base.toml"
    base.write_text(toml_dumps(BASE))
    return _launch(["--standalone", "--nproc", str(nproc), "--shards", "2", "--config", str(base),
                    "--work-dir", str(tmp / "run")] + (extra or []), tmp, env)


def _lines(out: str) -> List[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# --- the plan (pure) -------------------------------------------------------------------------------------------------

def _cfg(servers, standbys=(), witness=None, workers=4):
    c = {"servers": list(servers), "standbys": list(standbys), "workers": workers}
    if witness:
        c["witness"] = witness
    return {"cluster": c}


def test_a_host_runs_the_nodes_its_name_is_in_and_its_block_of_ranks():
    cfg = _cfg(["a:7400", "b:7401"], ["b:7402", "c:7403"], "c:7404", workers=6)
    p = plan_host(cfg, "b", 1, 2)
    assert [n.name for n in p.nodes] == ["server-1", "standby-0"]
    assert p.ranks == [2, 3]
    p = plan_host(cfg, "c", 1, 4)  # the last block is cut at cluster.workers
    assert [n.name for n in p.nodes] == ["standby-1", "witness"] and p.ranks == [4, 5]
    assert plan_host(cfg, "a", 0, 0).ranks == []


def test_a_host_holding_a_shards_primary_and_standby_is_warned():
    p = plan_host(_cfg(["a:1"], ["a:2"]), "a", 0, 1)
    assert any("shard 0's primary and standby" in w for w in p.warnings)


def test_an_address_named_twice_is_refused_naming_both_keys():
    with pytest.raises(LaunchError, match=r"names a:7400 twice \(cluster.servers\[0\] and cluster.standbys\[1\]\)"):
        plan_host(_cfg(["a:7400", "b:7401"], ["b:7402", "a:7400"]), "a", 0, 1)


def test_a_place_past_the_ranks_or_a_host_with_nothing_is_refused():
    with pytest.raises(LaunchError, match="starts at rank 8, but cluster.workers is 4"):
        plan_host(_cfg(["a:1"]), "a", 4, 2)
    with pytest.raises(LaunchError, match="nothing to run on 'z'"):
        plan_host(_cfg(["a:1"]), "z", 0, 0)
    assert plan_host(_cfg(["a:1"]), "z", 0, 0, allow_empty=True).nodes == []


def test_the_node_rank_comes_from_slurm_an_indexed_job_or_the_pod_ordinal():
    assert default_node_rank({"SLURM_NODEID": "3"}) == 3
    assert default_node_rank({"JOB_COMPLETION_INDEX": "2"}) == 2
    assert default_node_rank({"HOSTNAME": "tether-torch-workers-5"}) == 5
    assert default_node_rank({"TETHER_NODE_RANK": "1", "SLURM_NODEID": "3"}) == 1
    assert default_node_rank({}) == 0


def test_worker_without_arguments_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("TETHER_CONFIG", raising=False)
    with pytest.raises(tether.ConfigError, match=r"\$TETHER_CONFIG is not set.*tether.launch"):
        tether.Worker()


# --- real launches ---------------------------------------------------------------------------------------------------

def test_one_box_trains_and_every_node_exits_after_the_last_goodbye(tmp_path):
    r = _standalone(tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    (rank0,) = [x for x in _lines(r.stdout) if x["rank"] == 0]
    assert rank0["clock"] >= 40 and rank0["accuracy"] >= 0.85, rank0
    run = tmp_path / "run"
    assert all((run / f"worker-{k}.json").exists() for k in range(3))
    # The shards exited by themselves after the third goodbye, writing their reports.
    reports = [json.loads((run / f"server-{k}.json").read_text()) for k in range(2)]
    assert all(x["updates_applied"] > 0 for x in reports), reports


def test_a_crashed_rank_is_started_again_and_rejoins_at_the_running_clock(tmp_path):
    r = _standalone(tmp_path, env={"LAUNCHED_CRASH_RANK": "1", "LAUNCHED_CRASH_AT": "10"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rank 1 exited with 3; starting it again (1 of 3)" in r.stderr
    lines = _lines(r.stdout)
    (back,) = [x for x in lines if x["rank"] == 1]
    assert back["restarts"] == 1 and back["start_clock"] >= 10, back
    (rank0,) = [x for x in lines if x["rank"] == 0]
    assert rank0["accuracy"] >= 0.85, rank0


def test_a_rank_crashing_past_the_limit_ends_the_launch_with_its_status(tmp_path):
    r = _standalone(tmp_path, env={"LAUNCHED_CRASH_RANK": "1", "LAUNCHED_CRASH_AT": "2",
                                   "LAUNCHED_CRASH_ALWAYS": "1"}, extra=["--max-restarts", "1"])
    assert r.returncode == 3, r.stderr[-4000:]
    assert "rank 1 exited with 3 after 1 restart(s) (--max-restarts 1)" in r.stderr


def test_a_script_that_exits_without_closing_its_worker_is_named(tmp_path):
    r = _standalone(tmp_path, env={"LAUNCHED_EARLY": "1"})
    assert r.returncode == 1, r.stderr[-4000:]
    assert "exited 0 without closing its tether.Worker" in r.stderr and "call close()" in r.stderr


def test_sigterm_reaches_every_process_and_the_launcher_exits_143(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(toml_dumps(BASE))
    env = dict(os.environ, RUST_LOG="warn", LAUNCHED_ROUNDS="100000", LAUNCHED_STEP_SLEEP="0.01")
    cmd = [sys.executable, "-m", "tether.launch", "--bin-dir", _bin_dir(), "--standalone", "--nproc", "2",
           "--config", str(base), "--work-dir", str(tmp_path / "run"), str(SCRIPT)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(_leftovers(str(SCRIPT))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # the ranks are training
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-4000:]
    _assert_nothing_left(tmp_path)


def _cluster_files(tmp: Path, servers: List[str], workers: int) -> Path:
    cfg = {"cluster": {"servers": servers, "workers": workers, "tls_dir": str(tmp / "certs"), **BASE["cluster"]}}
    cfg.update({k: v for k, v in BASE.items() if k != "cluster"})
    cfg["model"] = {"kind": "file", "file": str(tmp / "model.safetensors")}
    path = tmp / "cluster.toml"
    path.write_text(toml_dumps(cfg))
    # A CA and shard 0's bundle (keygen writes at least one worker bundle: worker-0, removed again); the launchers
    # issue the rest from the CA (--ca-dir).
    subprocess.run([str(find_binary("tether-server")), "keygen", "--out", str(tmp / "certs"), "--ca-dir",
                    str(tmp / "ca"), "--servers", "1", "--workers", "1"], check=True, capture_output=True)
    shutil.rmtree(tmp / "certs" / "worker-0")
    return path


def test_a_rank_without_a_bundle_is_named_and_nothing_starts(tmp_path):
    config = _cluster_files(tmp_path, [f"127.0.0.1:{free_udp_port()}"], 2)
    r = _launch(["--config", str(config), "--host", "127.0.0.1", "--nproc-per-host", "2"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "no bundle for rank 0" in r.stderr and "keygen issue" in r.stderr and "--ca-dir" in r.stderr
    assert not (tmp_path / "server-0.log").exists()


def test_an_address_named_twice_is_refused_before_anything_starts(tmp_path):
    addr = f"127.0.0.1:{free_udp_port()}"
    config = _cluster_files(tmp_path, [addr, addr], 2)
    r = _launch(["--config", str(config), "--host", "127.0.0.1"], tmp_path)
    assert r.returncode == 2 and f"names {addr} twice" in r.stderr, r.stderr


def test_two_hosts_each_with_its_launcher_train_together(tmp_path):
    # Host A (127.0.0.1) holds shard 0 and ranks 0-1, host B (127.0.0.2) shard 1 and ranks 2-3; each launcher
    # issues the bundles it lacks from the CA and writes nothing the other needs but the model file (A prepares it
    # before B starts).
    config = _cluster_files(tmp_path, [f"127.0.0.1:{free_udp_port()}", f"127.0.0.2:{free_udp_port()}"], 4)
    env = dict(os.environ, RUST_LOG="warn")
    procs = []
    try:
        for place, host in enumerate(["127.0.0.1", "127.0.0.2"]):
            work = tmp_path / f"host-{place}"
            cmd = [sys.executable, "-m", "tether.launch", "--bin-dir", _bin_dir(), "--config", str(config),
                   "--host", host, "--node-rank", str(place), "--nproc-per-host", "2", "--ca-dir",
                   str(tmp_path / "ca"), "--work-dir", str(work), str(SCRIPT)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            if place == 0:
                deadline = time.monotonic() + 60
                while not (tmp_path / "model.safetensors").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    (rank0,) = [x for x in _lines(outs[0][0]) if x["rank"] == 0]
    assert rank0["accuracy"] >= 0.85, rank0
    assert (tmp_path / "certs" / "server-1" / "server.pem").exists()
    assert all((tmp_path / f"host-{r // 2}" / f"worker-{r}.json").exists() for r in range(4))
    _assert_nothing_left(tmp_path)
