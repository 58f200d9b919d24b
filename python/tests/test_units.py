"""Pure-Python parts without shards: the TOML writer, binary lookup, model files written from a module, and the
layout check's messages."""

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import tether
import tether.torch as tt
from tether.cluster import ClusterStartError, find_binary, toml_dumps

from workers import GPT, build_mlp


def test_toml_writer_round_trips_a_cluster_config():
    cfg = {
        "cluster": {"servers": ["127.0.0.1:7000", "127.0.0.1:7001"], "workers": 3, "staleness": "inf",
                    "tls_dir": "/tmp/a \"quoted\" dir\\x"},
        "model": {"kind": "file", "file": Path("/tmp/m.safetensors"), "hidden": [64, 32], "absent": None},
        "train": {"clip_norm": 5.0, "lr_int_like": 1.0, "tiny": 1e-8},
        "compression": {"zstd": False, "error_feedback": True},
        "optimizer": {"schedule": {"kind": "warmup_cosine", "warmup": 50, "total": 840, "min_ratio": 0.05},
                      "outer": {"kind": "nesterov", "lr": 0.7}},
    }
    back = tomllib.loads(toml_dumps(cfg))
    assert back["cluster"] == cfg["cluster"]
    assert back["model"] == {"kind": "file", "file": "/tmp/m.safetensors", "hidden": [64, 32]}
    assert back["train"] == {"clip_norm": 5.0, "lr_int_like": 1.0, "tiny": 1e-8}
    assert isinstance(back["train"]["lr_int_like"], float)
    assert back["compression"] == {"zstd": False, "error_feedback": True}
    assert back["optimizer"]["schedule"]["total"] == 840
    assert back["optimizer"]["outer"] == {"kind": "nesterov", "lr": 0.7}
    with pytest.raises(TypeError):
        toml_dumps({"x": {"y": object()}})


def test_a_missing_binary_names_where_it_looked(tmp_path):
    with pytest.raises(ClusterStartError, match=str(tmp_path)):
        find_binary("tether-server", bin_dir=tmp_path)


def test_export_model_writes_named_parameters_in_order_and_tied_weights_once(tmp_path):
    torch.manual_seed(0)
    gpt = GPT(layers=1, heads=2, dim=16, context=8)
    path = tmp_path / "gpt.safetensors"
    written = tt.export_model(gpt, str(path))
    expect = [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]
    assert written == expect
    got = [(str(n), tuple(s)) for n, s in tether.read_model_file(str(path))]
    assert got == expect
    # The head is tied to wte: one tensor, not two.
    assert sum(1 for n, _ in got if n == "wte.weight") == 1
    assert len(got) == len({n for n, _ in got})


def test_export_refuses_a_non_float32_parameter(tmp_path):
    m = nn.Linear(4, 2).double()
    with pytest.raises(tether.LayoutMismatchError, match="weight"):
        tt.export_model(m, str(tmp_path / "m.safetensors"))


class _Layout:
    """Stands in for a Worker where only the layout matters."""

    def __init__(self, module):
        self.layout = []
        off = 0
        for n, p in module.named_parameters():
            self.layout.append((n, tuple(p.shape), off))
            off += p.numel()
        self.num_params = off


def test_check_layout_names_the_first_offending_tensor():
    ref = _Layout(build_mlp(64, [64], 10))
    tt.check_layout(build_mlp(64, [64], 10), ref)  # same shapes: accepted
    with pytest.raises(tether.LayoutMismatchError) as e:
        tt.check_layout(build_mlp(64, [32], 10), ref)
    msg = str(e.value)
    assert "0.weight" in msg and "[32, 64]" in msg and "[64, 64]" in msg, msg
    with pytest.raises(tether.LayoutMismatchError, match=r"4\.weight.*missing in the model file"):
        tt.check_layout(nn.Sequential(*build_mlp(64, [64], 10), nn.ReLU(), nn.Linear(10, 10)), ref)
    with pytest.raises(tether.LayoutMismatchError, match=r"2\.weight.*missing in the module"):
        tt.check_layout(nn.Sequential(nn.Linear(64, 64)), ref)
    with pytest.raises(tether.LayoutMismatchError, match=r"0\.weight.*float64"):
        tt.check_layout(build_mlp(64, [64], 10).double(), ref)
    assert isinstance(e.value, tether.RefusedError) and isinstance(e.value, tether.TetherError)


def test_iter_batches_drops_the_last_partial_batch():
    got = [b.tolist() for b in tt.iter_batches(np.arange(7), 3)]
    assert got == [[0, 1, 2], [3, 4, 5]]


class FakeWorker:
    """A stand-in for tether.Worker: pull() writes the next 'public copy' in place, push() records its updates."""

    def __init__(self, module, local_steps=0):
        lay = _Layout(module)
        self.layout, self.num_params = lay.layout, lay.num_params
        self.params = np.zeros(self.num_params, dtype=np.float32)
        self.local_steps = local_steps
        self.pulls = 0
        self.pushes = []
        self.rolled_back = False
        self.roll_back_on_pull = None

    def pull(self, out=None):
        self.pulls += 1
        self.params[:] = np.arange(self.num_params, dtype=np.float32) * 0.01 + self.pulls
        self.rolled_back = self.pulls == self.roll_back_on_pull
        return self.params

    def push(self, update, loss=None, kind="gradient", steps=1):
        self.pushes.append((np.array(update, copy=True), loss, kind))
        self.at_push = self.params.copy()  # the module's values when it pushed (CPU parameters are views)
        return True


def test_flat_params_are_views_that_pull_updates_in_place_and_grads_gather_in_layout_order():
    torch.manual_seed(0)
    m = build_mlp(8, [4], 3)
    before = [p.detach().clone() for p in m.parameters()]
    w = FakeWorker(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # built before: must keep working
    fp = tt.FlatParams(m, w)
    # The module's values were copied in; nothing changed yet.
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.detach(), b)
    fp.pull()
    for name, shape, off in w.layout:
        p = dict(m.named_parameters())[name]
        n = int(np.prod(shape))
        assert np.array_equal(p.detach().numpy().ravel(), w.params[off:off + n]), name
    assert p.data.data_ptr() == torch.from_numpy(w.params[off:]).data_ptr()
    # Gradients in layout order; a parameter without one contributes zeros.
    loss = m(torch.ones(2, 8)).sum()
    loss.backward()
    m[2].bias.grad = None
    g = fp.gather_grads()
    name, shape, off = w.layout[1]
    assert np.array_equal(g[off:off + 4], m[0].bias.grad.numpy())
    name, shape, off = w.layout[3]
    assert name == "2.bias" and not g[off:off + 3].any()
    # An optimizer step writes straight into the worker's vector.
    opt.step()
    assert np.array_equal(w.params[:32], m[0].weight.detach().numpy().ravel())


def test_diloco_pushes_start_minus_end_every_h_steps_and_resets_state_after_a_rollback():
    torch.manual_seed(0)
    m = build_mlp(8, [4], 3)
    w = FakeWorker(m, local_steps=2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    d = tt.DiLoCo(m, opt, w)
    assert w.pulls == 1
    start = w.params.copy()
    for i in range(2):
        opt.zero_grad()
        loss = m(torch.ones(2, 8)).pow(2).sum()
        loss.backward()
        ended = d.step(loss=loss)
        assert ended == (i == 1)
    assert len(w.pushes) == 1 and w.pulls == 2
    delta, round_loss, kind = w.pushes[0]
    assert kind == "delta" and round_loss is not None and np.isfinite(round_loss)
    # theta_start - theta_end, theta_end being the module after its 2 inner steps.
    assert np.array_equal(delta, start - w.at_push)
    assert not np.allclose(delta, 0.0)
    # After the round the module holds the new public copy and it is the next theta_start.
    assert np.array_equal(d._start.numpy(), w.params)
    assert len(opt.state) > 0
    w.roll_back_on_pull = 3
    for _ in range(2):
        opt.zero_grad()
        m(torch.ones(2, 8)).sum().backward()
        d.step()  # no loss given: the round's loss is None, not NaN
    assert w.pushes[1][1] is None
    assert d.rollbacks == 1 and len(opt.state) == 0
    # A partial round is pushed only by sync().
    opt.zero_grad()
    m(torch.ones(2, 8)).sum().backward()
    d.step()
    assert len(w.pushes) == 2 and d.pending_steps == 1
    d.sync()
    assert len(w.pushes) == 3 and d.pending_steps == 0


def test_per_step_pushes_the_gradient_then_pulls():
    torch.manual_seed(0)
    m = build_mlp(8, [4], 3)
    w = FakeWorker(m)
    s = tt.PerStep(m, w)
    m(torch.ones(2, 8)).sum().backward()
    expect = np.concatenate([p.grad.numpy().ravel() for p in m.parameters()])
    assert s.step(loss=torch.tensor(1.5))
    grad, loss, kind = w.pushes[0]
    assert kind == "gradient" and loss == 1.5
    assert np.array_equal(grad, expect)
    assert w.pulls == 2
    with pytest.raises(tether.ConfigError):
        tt.PerStep(m, FakeWorker(m, local_steps=4))
    with pytest.raises(tether.ConfigError):
        tt.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), FakeWorker(m, local_steps=0))
