"""Faults and refusals seen from Python: a worker process killed (SIGKILL) and started again rejoins and the run
completes; a shard killed and resumed from its checkpoint (LocalCluster.kill_shard / start_shard) is ridden out; a
module or a model file that does not match the shards' layout is refused with LayoutMismatchError naming the
tensor; a rank outside the cluster is refused with a typed exception, never a crash."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tether
import tether.torch as tt
from tether.cluster import LocalCluster, toml_dumps

from conftest import data_features, mlp_config
from workers import build_mlp


def test_a_killed_worker_rejoins_and_the_run_completes(tmp_path, mlp_file, procs):
    _, model_file = mlp_file(data_features(), [64], 10)
    epochs, steps = 6, 66  # digits: 11 steps per epoch; Fashion-MNIST: capped at the same 66 steps
    cfg = mlp_config(model_file, workers=2, staleness=2, epochs=epochs, updates=2 * steps,
                     extra={"cluster": {"worker_timeout_ms": 1500, "progress_timeout_ms": 3000}})
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        def args(rank):
            return ["mlp", "--config", c.config_path, "--rank", str(rank), "--workers", "2", "--hidden", "64",
                    "--epochs", str(epochs), "--max-steps", str(steps), "--step-delay-ms", "30", "--reconnect-deadline-s", "30"] \
                + (["--evaluate"] if rank == 0 else [])
        w0 = procs(args(0), "worker-0", tmp_path)
        w1 = procs(args(1), "worker-1", tmp_path)
        w1.wait_for_log("rank 1 step 20", 120)
        w1.kill()  # SIGKILL: no goodbye
        assert w1.p.returncode == -9
        w1b = procs(args(1) + ["--resume"], "worker-1", tmp_path)
        r1 = w1b.wait(180)
        r0 = w0.wait(180)
        logs = c.log_text(0) + c.log_text(1)
    print(f"rank 0 {r0['steps']} steps, accuracy {r0['accuracy']:.4f}; restarted rank 1 ran steps "
          f"{r1['first']}..{r1['total']}; rank 1 reconnects {r1['report']['reconnects']}")
    assert r0["first"] == 0 and r0["steps"] == r0["total"]
    # The restarted rank was welcomed at its clock (past the 20 steps it had done) and finished the rest.
    assert r1["first"] >= 20 and r1["first"] + r1["steps"] == r1["total"], r1
    assert r0["report"]["pushes"] == r0["steps"]
    assert r1["report"]["pushes"] == r1["steps"]
    assert np.isfinite(r0["final_loss"])
    assert r0["accuracy"] > 0.5, r0
    assert "panicked" not in logs


def _worker_config(c: LocalCluster, model_file, path) -> str:
    """A copy of the cluster's config pointing at another model file (same shards, same certificates)."""
    cfg = {k: dict(v) for k, v in c.config.items()}
    cfg["model"] = dict(cfg["model"], file=str(model_file))
    path.write_text(toml_dumps(cfg))
    return str(path)


def test_layout_mismatches_are_refused_with_the_tensor_name(tmp_path, mlp_file):
    features = data_features()
    _, model_file = mlp_file(features, [64], 10)
    cfg = mlp_config(model_file, workers=2, staleness=2)
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        # A module that differs from the model file: refused before any traffic, naming the tensor.
        with tether.Worker(c.config_path, 0) as w:
            assert [n for n, _, _ in w.layout] == ["0.weight", "0.bias", "2.weight", "2.bias"]
            with pytest.raises(tether.LayoutMismatchError) as e:
                tt.PerStep(build_mlp(features, [32], 10), w)
            assert "0.weight" in str(e.value) and "[32," in str(e.value), str(e.value)
            with pytest.raises(tether.LayoutMismatchError, match="2.weight"):
                tt.check_layout(torch.nn.Sequential(torch.nn.Linear(features, 64)), w)
            # The matching module trains: the first pull returns the model file's weights.
            m = build_mlp(features, [64], 10)
            sync = tt.PerStep(m, w)
            ref, _ = mlp_file(features, [64], 10, name="same-seed.safetensors")
            for a, b in zip(m.parameters(), ref.parameters()):
                assert torch.equal(a.detach(), b.detach())
            assert sync.steps == 0

        # A worker whose model file differs from the shards' (same shapes, other values): the shards refuse the
        # layout hash, and the worker raises LayoutMismatchError instead of crashing.
        _, other = mlp_file(features, [64], 10, seed=1, name="other.safetensors")
        bad_cfg = _worker_config(c, other, tmp_path / "other.toml")
        with tether.Worker(bad_cfg, 1, reconnect_deadline_s=20) as w:
            with pytest.raises(tether.LayoutMismatchError) as e:
                w.pull()
            assert isinstance(e.value, tether.RefusedError)
            print(f"refused: code {getattr(e.value, 'code', None)!r}: {e.value}")

        # Other shapes in the model file: refused the same way.
        _, wider = mlp_file(features, [96], 10, name="wider.safetensors")
        with tether.Worker(_worker_config(c, wider, tmp_path / "wider.toml"), 1, reconnect_deadline_s=20) as w:
            with pytest.raises(tether.LayoutMismatchError):
                w.pull()
        assert c.shard_alive(0) and c.shard_alive(1)


def test_a_rank_outside_the_cluster_is_refused_not_a_crash(tmp_path, mlp_file):
    _, model_file = mlp_file(data_features(), [64], 10)
    cfg = mlp_config(model_file, workers=2, staleness=2)
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        # A certificate the CA signed for rank 2, but the shards serve ranks 0 and 1 only.
        c.issue_worker(2)
        with pytest.raises((tether.UnauthorizedError, tether.RefusedError)) as e:
            with tether.Worker(c.config_path, 2, reconnect_deadline_s=20) as w:
                w.pull()
        print(f"rank 2: {type(e.value).__name__}: {e.value}")
        # The same rank with a config that claims 3 workers passes the worker's own check: the shards refuse it.
        cfg3 = {k: dict(v) for k, v in c.config.items()}
        cfg3["cluster"]["workers"] = 3
        (tmp_path / "three.toml").write_text(toml_dumps(cfg3))
        with pytest.raises((tether.UnauthorizedError, tether.RefusedError)) as e:
            with tether.Worker(str(tmp_path / "three.toml"), 2, reconnect_deadline_s=20) as w:
                w.pull()
        print(f"rank 2 at the shards: {type(e.value).__name__} code={getattr(e.value, 'code', None)}: {e.value}")
        # Rank 1's own bundle cannot claim rank 0: refused by the worker's own certificate check or the shards.
        with pytest.raises(tether.TetherError):
            with tether.Worker(c.config_path, 0, tls_dir=str(c.certs_dir / "worker-1"),
                               reconnect_deadline_s=20) as w:
                w.pull()
        assert c.shard_alive(0) and c.shard_alive(1)


def test_misuse_after_close_is_a_typed_error_in_a_fresh_interpreter(tmp_path, mlp_file):
    """Pushing after close raises ProtocolStateError; the interpreter survives (checked in a subprocess)."""
    _, model_file = mlp_file(data_features(), [64], 10)
    cfg = mlp_config(model_file, workers=2, staleness=2)
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        code = (
            "import numpy as np, tether\n"
            f"w = tether.Worker({c.config_path!r}, 0)\n"
            "w.pull(); w.close()\n"
            "try:\n"
            "    w.push(np.zeros(w.num_params, dtype=np.float32))\n"
            "except tether.ProtocolStateError as e:\n"
            "    print('refused:', e)\n"
            "else:\n"
            "    raise SystemExit('push after close was accepted')\n"
            "w.close()\n"
            "print('alive')\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused:" in out.stdout and "alive" in out.stdout


def _slow_mlp_worker(config_path: str, rank: int, steps: int) -> list:
    """Arguments of a 2-worker MLP process (``workers.py mlp``) slowed to 30 ms a step, so a fault lands mid-run."""
    return ["mlp", "--config", config_path, "--rank", str(rank), "--workers", "2", "--hidden", "64",
            "--epochs", "6", "--max-steps", str(steps), "--step-delay-ms", "30",
            "--reconnect-deadline-s", "30"] + (["--evaluate"] if rank == 0 else [])


def test_workers_ride_out_a_shard_killed_and_resumed_from_its_checkpoint(tmp_path, mlp_file, procs):
    _, model_file = mlp_file(data_features(), [64], 10)
    steps = 66
    cfg = mlp_config(model_file, workers=2, staleness=2, epochs=6, updates=2 * steps,
                     extra={"checkpoint": {"every_updates": 10, "keep": 3}})
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2) as c:
        ws = [procs(_slow_mlp_worker(c.config_path, r, steps), f"worker-{r}", tmp_path) for r in range(2)]
        ws[0].wait_for_log("rank 0 step 20", 120)
        c.kill_shard(0)
        assert not c.shard_alive(0)
        c.start_shard(0, resume=True)
        results = [w.wait(180) for w in ws]
        log0 = c.log_text(0)
    print(f"after a shard crash: accuracy {results[0]['accuracy']:.4f}, reconnects "
          f"{[r['report']['reconnects'] for r in results]}")
    assert all(r["steps"] == steps for r in results)
    assert all(r["report"]["reconnects"] >= 1 for r in results), [r["report"] for r in results]
    assert log0.count("listening on") == 2
    assert "resumed from checkpoint" in log0
    assert results[0]["accuracy"] > 0.5


def test_a_killed_primary_is_replaced_by_its_standby_without_losing_an_update(tmp_path, mlp_file, procs):
    """LocalCluster(standbys=True): one standby per shard and the witness. Shard 0's primary is killed for good
    mid-run; its standby takes over, the workers finish without a restart of anything, and shard 0's standby
    applied every push exactly once (BSP, so the count is exact: 2 workers x steps per shard)."""
    _, model_file = mlp_file(data_features(), [64], 10)
    steps = 66
    cfg = mlp_config(model_file, workers=2, staleness=0, epochs=6, updates=2 * steps,
                     extra={"cluster": {"failover_ms": 1000}})
    with LocalCluster(tmp_path / "cluster", cfg, shards=2, workers=2, standbys=True) as c:
        assert c.standbys and c.witness and c.config["cluster"]["standbys"] == c.standbys
        ws = [procs(_slow_mlp_worker(c.config_path, r, steps), f"worker-{r}", tmp_path) for r in range(2)]
        ws[0].wait_for_log("rank 0 step 20", 120)
        c.kill_shard(0)
        assert not c.shard_alive(0)
        results = [w.wait(180) for w in ws]
        codes = c.stop()
        standby0 = json.loads(c.standby_report_path(0).read_text())
        primary1 = json.loads(c.report_path(1).read_text())
        logs = c.node_log_text("standby-0") + c.log_text(1) + c.node_log_text("witness")
    print(f"primary 0 killed at step 20: accuracy {results[0]['accuracy']:.4f}, standby 0 applied "
          f"{standby0['updates_applied']}, primary 1 applied {primary1['updates_applied']}, exit codes {codes}")
    assert all(r["steps"] == steps for r in results)
    assert all(r["report"]["pushes"] == steps for r in results)
    # Shard 0's standby holds every update: those it replayed from the primary's log and those it applied itself.
    assert standby0["updates_applied"] == 2 * steps, standby0
    assert primary1["updates_applied"] == 2 * steps, primary1
    assert standby0["updates_rejected"] == 0 and primary1["updates_rejected"] == 0
    assert codes[0] == -9 and codes["standby-0"] == 0 and codes[1] == 0, codes
    assert "standby took over" in logs, logs[-3000:]
    assert results[0]["accuracy"] > 0.5
    assert "panicked" not in logs
