"""The GIL is released while Rust waits: a second Python thread keeps counting while ``pull()`` blocks, both on the
SSP gate (BSP, another worker has not pushed yet) and while the shards are not up yet."""

import threading
import time

import numpy as np

import tether
from tether.cluster import LocalCluster

from conftest import data_features, mlp_config

BLOCK_S = 1.5
# A pure-Python loop counts millions of times a second; 10,000 in 1.5 s is far below that on any machine, and far
# above what a thread starved by a held GIL manages (it gets no turn at all).
MIN_COUNT = 10_000


class Counter:
    """Counts in a Python loop until stopped (bounded: 120 s at most)."""

    def __init__(self):
        self.n = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        end = time.monotonic() + 120
        while not self.stop.is_set() and time.monotonic() < end:
            self.n += 1

    def close(self):
        self.stop.set()
        self.t.join(timeout=10)


def test_a_thread_progresses_while_pull_waits_on_the_staleness_gate(tmp_path, mlp_file):
    _, model_file = mlp_file(data_features(), [64], 10)
    # BSP; a lagging worker is evicted after 10 s at the latest, which bounds the wait if the GIL were held.
    cfg = mlp_config(model_file, workers=2, staleness=0,
                     extra={"cluster": {"worker_timeout_ms": 5000, "progress_timeout_ms": 10000}})
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        with tether.Worker(c.config_path, 0) as w0, tether.Worker(c.config_path, 1) as w1:
            w0.pull()
            w1.pull()
            zeros = np.zeros(w0.num_params, dtype=np.float32)
            w0.push(zeros, 1.0)
            counter = Counter()
            released = {}

            def lagging_push():
                time.sleep(BLOCK_S)
                released["count"] = counter.n
                released["at"] = time.monotonic()
                w1.push(zeros, 1.0)

            pusher = threading.Thread(target=lagging_push, daemon=True)
            t0 = time.monotonic()
            before = counter.n
            pusher.start()
            w0.pull()  # clock 1 under BSP: waits for rank 1's push of clock 0
            waited = time.monotonic() - t0
            during = counter.n - before
            counter.close()
            pusher.join(timeout=30)
            assert "at" in released, "the lagging push never ran"
            print(f"pull waited {waited:.2f}s; the counter advanced {during} times meanwhile")
            # The pull returned only after the other thread pushed: it really waited on the gate...
            assert waited >= BLOCK_S * 0.9, f"pull returned after {waited:.2f}s, before rank 1 pushed"
            # ...and the other threads ran meanwhile (the push itself came from one of them).
            assert released["count"] - before >= MIN_COUNT, released
            assert during >= MIN_COUNT
            assert w0.clock == 1 and w1.clock == 1


def test_a_thread_progresses_while_pull_waits_for_shards_to_start(tmp_path, mlp_file):
    _, model_file = mlp_file(data_features(), [64], 10)
    cfg = mlp_config(model_file, workers=1, staleness=0)
    c = LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=1)
    c.keygen()
    try:
        with tether.Worker(c.config_path, 0, reconnect_deadline_s=30) as w:
            counter = Counter()
            starter = threading.Thread(target=lambda: (time.sleep(BLOCK_S), c.start()), daemon=True)
            t0 = time.monotonic()
            starter.start()
            w.pull()  # the shards are not up yet: the driver retries until they are
            waited = time.monotonic() - t0
            during = counter.n
            counter.close()
            starter.join(timeout=60)
            print(f"first pull waited {waited:.2f}s for the shards; the counter advanced {during} times")
            assert waited >= BLOCK_S * 0.9
            assert during >= MIN_COUNT
            assert np.isfinite(w.params).all()
    finally:
        c.stop()
