"""A module whose parameters live on an accelerator, against a real shard: a push must carry what the device computed
and a pull must land on the device.

One shard, one worker, uncompressed pushes and pulls, plain SGD without a schedule or clipping. The module on the
device starts off the exported weights (each parameter + 1), so the first pull must overwrite it. After one
``PerStep.step`` the device parameters must equal ``theta - lr * g`` where ``g`` is the gradient the device computed
(and a CPU copy of the module computes the same ``g`` to float tolerance). DiLoCo must push ``theta_start -
theta_end`` of the device parameters and load the shard's answer (outer SGD at lr 0.5: halfway back to the round's
start, not the device's own values) onto the device.

Runs on every CUDA device PyTorch sees and, always, on ``fakedev:0`` (``fakedevice.py``: a fake accelerator whose
memory is its own and which counts host<->device copies), so CI without a GPU checks the copies too;
scripts/gpu-check.sh runs these on a GPU.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

import tether
import tether.torch as tt
from tether.cluster import LocalCluster

import fakedevice
from workers import build_mlp

DEVICES = [f"cuda:{i}" for i in range(torch.cuda.device_count())] + [
    fakedevice.DEVICE if fakedevice.AVAILABLE
    else pytest.param(fakedevice.DEVICE, marks=pytest.mark.skip(reason=fakedevice.UNAVAILABLE_REASON))]
OUTER_LR = 0.5
LR = 0.125  # a power of two: theta - lr * g is one rounding away on either side


def _config(model_file, local_steps: int):
    return {
        "cluster": {"staleness": 0, "worker_timeout_ms": 5000},
        "model": {"kind": "file", "file": str(model_file)},
        "data": {"dataset": "digits"},
        "train": {"batch": 16, "epochs": 1, "eval_every": 0, "seed": 7, "local_steps": local_steps,
                  "clip_norm": 0.0},
        "optimizer": {"kind": "sgd", "lr": LR, "outer": {"kind": "sgd", "lr": OUTER_LR}},
        "compression": {"scheme": "none", "pull_scheme": "none", "error_feedback": False},
        "checkpoint": {"every_updates": 0},
    }


def _flat(module: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().cpu().numpy().ravel() for p in module.parameters()])


def _batch(device: str):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    return x.to(device), y.to(device)


@contextlib.contextmanager
def _one_shard(tmp_path, device: str, seed: int, local_steps: int):
    """Yields (CPU module, its copy on `device` moved off those weights (+1 each), a worker of a 1-shard cluster
    started from the CPU module's weights)."""
    torch.manual_seed(seed)
    cpu_module = build_mlp(64, [32], 10)
    tt.export_model(cpu_module, str(tmp_path / "model.safetensors"))
    module = copy.deepcopy(cpu_module).to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    cfg = _config(tmp_path / "model.safetensors", local_steps)
    with LocalCluster(tmp_path / "cluster", cfg, shards=1, workers=1) as c:
        with tether.Worker(c.config_path, 0) as w:
            yield cpu_module, module, w


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def test_per_step_pushes_the_device_gradient_and_pulls_onto_the_device(tmp_path, device):
    with _one_shard(tmp_path, device, seed=0, local_steps=0) as (cpu_module, module, w):
        s = tt.PerStep(module, w)
        assert s.flat.on_device and all(p.device == torch.device(device) for p in module.parameters())
        theta = _flat(module)
        assert np.array_equal(theta, _flat(cpu_module)), "the first pull must land the exported weights"
        x, y = _batch(device)
        loss = torch.nn.functional.cross_entropy(module(x), y)
        loss.backward()
        g_dev = np.concatenate([p.grad.detach().cpu().numpy().ravel() for p in module.parameters()])
        torch.nn.functional.cross_entropy(cpu_module(x.cpu()), y.cpu()).backward()
        g_cpu = np.concatenate([p.grad.numpy().ravel() for p in cpu_module.parameters()])
        assert np.abs(g_dev - g_cpu).max() <= 1e-4 * np.abs(g_cpu).max()
        fakedevice.reset_counts()
        assert s.step(loss=loss)
        if device == fakedevice.DEVICE:
            # The push read the device (its gradients) and the pull wrote it (a fake tensor changes no other way).
            assert fakedevice.COPIES["d2h"] >= 1 and fakedevice.COPIES["h2d"] >= 1, dict(fakedevice.COPIES)
        after = _flat(module)
        # The shard applied the device's gradient, and the pull wrote the result onto the device.
        expect = theta - np.float32(LR) * g_dev
        assert np.allclose(after, expect, rtol=0, atol=1e-6 * max(1.0, np.abs(theta).max())), \
            np.abs(after - expect).max()
        assert not np.array_equal(after, theta)
        assert np.array_equal(after, w.params), "device parameters differ from the worker's public copy"


def test_diloco_pushes_the_device_delta_and_loads_the_round_onto_the_device(tmp_path, device):
    with _one_shard(tmp_path, device, seed=1, local_steps=2) as (cpu_module, module, w):
        inner = torch.optim.SGD(module.parameters(), lr=0.05)
        d = tt.DiLoCo(module, inner, w)
        start = _flat(module)
        assert np.array_equal(start, _flat(cpu_module)), "the first pull must land the exported weights"
        x, y = _batch(device)
        ended = []
        for _ in range(2):
            inner.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(x), y)
            loss.backward()
            ended.append(d.step(loss=loss))
        assert ended == [False, True]
        # One worker, outer SGD at OUTER_LR: the new public copy is theta_start - OUTER_LR * (theta_start -
        # theta_end), not the device's theta_end, so it must have been pushed from the device and loaded back onto
        # it; theta_end comes from an independent CPU replay of the two inner steps.
        replay = copy.deepcopy(cpu_module)
        opt = torch.optim.SGD(replay.parameters(), lr=0.05)
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(replay(x.cpu()), y.cpu()).backward()
            opt.step()
        end = _flat(replay)
        expect = start - np.float32(OUTER_LR) * (start - end)
        after = _flat(module)
        assert np.allclose(after, expect, rtol=0, atol=1e-5), np.abs(after - expect).max()
        assert not np.allclose(after, end, rtol=0, atol=1e-5), "the round's pull did not reach the device"
        assert not np.allclose(after, start)
        assert np.array_equal(after, w.params), "device parameters differ from the worker's public copy"


@pytest.mark.skipif(not fakedevice.AVAILABLE, reason=fakedevice.UNAVAILABLE_REASON or "fake device available")
def test_the_fake_device_changes_only_through_counted_copies():
    """What makes the fake a device for the tests above: CPU memory never stands in for its parameters, and every
    crossing is an explicit, counted copy."""
    torch.manual_seed(0)
    m = build_mlp(4, [3], 2).to(fakedevice.DEVICE)
    p = m[0].weight
    assert isinstance(p, torch.nn.Parameter) and p.device == torch.device(fakedevice.DEVICE)
    host = torch.zeros(p.shape)
    with pytest.raises(RuntimeError):
        p.data = host  # a parameter cannot become a view of host memory
    with pytest.raises(RuntimeError):
        p.detach() + host  # nor compute with it, as on CUDA
    with pytest.raises(RuntimeError):
        p.detach().numpy()
    fakedevice.reset_counts()
    m(torch.ones(5, 4).to(fakedevice.DEVICE)).sum().backward()
    assert p.grad is not None and p.grad.device == p.device
    with torch.no_grad():
        p.copy_(host)
        host.copy_(p.grad)
    assert dict(fakedevice.COPIES) == {"h2d": 2, "d2h": 1}
    assert torch.equal(p.detach().cpu(), torch.zeros(p.shape)) and fakedevice.COPIES["d2h"] == 2
