"""Shared fixtures of the Python package's tests: configurations, model files, and worker subprocesses under
guards that kill them (SIGKILL) when a test ends, with every wait bounded.

The shards are the release ``tether-server`` (``cargo build --release -p tether-server``; found as
:func:`tether.cluster.find_binary` does). Data: Fashion-MNIST when installed, else the embedded digits set, through
``tether.load_data``, so the Python workers train on exactly what the Rust worker would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers.py"
sys.path.insert(0, str(HERE))


def fashion_installed() -> bool:
    """Whether Fashion-MNIST is where the Rust worker looks (``$TETHER_DATA_DIR`` or the Debian path)."""
    d = Path(os.environ.get("TETHER_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    return (d / "train-images-idx3-ubyte.gz").exists()


def digits_epochs(workers: int, batch: int, updates: int = 840, train: int = 1437) -> int:
    """Epochs that give at least ``updates`` updates in all (as tests/e2e.rs sizes its digits runs)."""
    per_worker = train // workers
    steps = max(1, per_worker // batch)
    return -(-updates // (workers * steps))


def mlp_config(model_file: Path, *, workers: int, staleness=2, local_steps: int = 0, epochs: int = 1,
               batch: int = 64, updates: int = 0, extra: Optional[Dict] = None) -> Dict[str, Dict]:
    """The MLP configuration of tests/e2e.rs: q4 without zstd, Adam 1e-3, warm-up 50 then cosine to 0.05."""
    dataset = "fashion-mnist" if fashion_installed() else "digits"
    cfg = {
        "cluster": {"staleness": staleness, "worker_timeout_ms": 5000, "progress_timeout_ms": 20000},
        "model": {"kind": "file", "file": str(model_file)},
        "data": {"dataset": dataset},
        "train": {"batch": batch, "epochs": epochs, "eval_every": 0, "seed": 7, "local_steps": local_steps},
        "optimizer": {
            "kind": "adam", "lr": 1e-3,
            "schedule": {"kind": "warmup_cosine", "warmup": 50, "total": max(updates, 51), "min_ratio": 0.05},
            "outer": {"kind": "nesterov", "lr": 0.7, "momentum": 0.5},
        },
        "compression": {"scheme": "q4", "zstd": local_steps > 0},
        "checkpoint": {"every_updates": 0},
    }
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    return cfg


class Proc:
    """A worker subprocess with its log file; :meth:`wait` is bounded, and the guard kills it at teardown."""

    def __init__(self, args: List[str], log: Path, out: Path):
        self.args = args
        self.log = log
        self.out = out
        self._logf = open(log, "ab")
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        env["OMP_NUM_THREADS"] = "1"
        self.p = subprocess.Popen([sys.executable, str(WORKERS)] + args + ["--out", str(out)],
                                  stdin=subprocess.DEVNULL, stdout=self._logf, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait(self, timeout_s: float) -> dict:
        """Waits at most ``timeout_s`` for a successful exit and returns the worker's JSON result; fails the test
        (with the log tail) on a timeout or a failure."""
        try:
            rc = self.p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"worker {self.args[:1]} {self.args} did not finish in {timeout_s:.0f} s:\n"
                        f"{self.log_text()[-4000:]}")
        if rc != 0:
            pytest.fail(f"worker exited with {rc}:\n{self.log_text()[-4000:]}")
        return json.loads(self.out.read_text())

    def wait_for_log(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.log_text():
            if self.p.poll() is not None:
                pytest.fail(f"worker exited ({self.p.returncode}) before `{needle}`:\n{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no `{needle}` within {timeout_s:.0f} s:\n{self.log_text()[-4000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._logf.close()


@pytest.fixture
def procs():
    """Starts worker subprocesses: ``procs(args, name, workdir)``; all are killed when the test ends."""
    started: List[Proc] = []

    def start(args: List[str], name: str, workdir: Path) -> Proc:
        n = 0
        while (workdir / f"{name}-{n}.log").exists():
            n += 1
        p = Proc(args, workdir / f"{name}-{n}.log", workdir / f"{name}-{n}.json")
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture
def mlp_file(tmp_path):
    """``make(features, hidden, classes, seed=0)`` -> (module, model file path): the module's weights exported."""
    import torch
    import tether.torch as tt
    from workers import build_mlp

    def make(features: int, hidden, classes: int = 10, seed: int = 0, name: str = "model.safetensors"):
        torch.manual_seed(seed)
        m = build_mlp(features, hidden, classes)
        path = tmp_path / name
        tt.export_model(m, str(path))
        return m, path

    return make


def data_features() -> int:
    return 784 if fashion_installed() else 64
