"""PyTorch glue for Tether: a ``torch.nn.Module``'s parameters mapped onto the cluster's flat layout.

This module owns the mapping between a module and a :class:`tether.Worker`, and nothing on the wire:

- :func:`export_model` writes the module's ``named_parameters()`` as the model file the shards read
  (``[model] kind = "file"``, ``file = PATH``). Its values are the initial weights: the shards start from them and
  every worker's first pull returns them, so all workers start from the same weights. One process writes it once
  (the launcher, or rank 0 before any shard starts).
- :func:`prepare` writes that file in the launcher's preparing run (``TETHER_PREPARE``) and exits; a no-op otherwise.
- :func:`check_layout` compares a module with the worker's layout (name, shape, float32) and raises
  :class:`tether.LayoutMismatchError` naming the first tensor that differs.
- :class:`FlatParams` makes every CPU parameter a view into one flat float32 tensor over ``worker.params``, so
  ``pull()`` writes the module's weights in place (modules on another device get a copy after each pull), and
  gathers gradients into one preallocated flat buffer.
- :class:`PerStep` pushes every step's gradient (the shards apply the configured optimizer, within the SSP bound).
- :class:`DiLoCo` runs the user's inner optimizer for H steps, then pushes ``theta_start - theta_end`` as one
  local-step round and loads the new public copy in place.

Import it as ``import tether.torch`` (or ``from tether.torch import DiLoCo``); ``import tether`` alone does not
import torch.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import numpy as np
import torch

from . import _tether

__all__ = ["export_model", "prepare", "check_layout", "FlatParams", "PerStep", "DiLoCo", "iter_batches"]


def _named(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    # named_parameters() yields a shared (tied) parameter once, under its first name.
    return list(module.named_parameters())


def _layout_error(message: str) -> Exception:
    err = _tether.LayoutMismatchError(message)
    for attr, value in (("code", "LayoutMismatch"), ("shard", None)):
        try:
            setattr(err, attr, value)
        except (AttributeError, TypeError):
            pass
    return err


def export_model(module: torch.nn.Module, path: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """Writes ``module.named_parameters()`` (float32, in that order, tied parameters once) to the model file
    ``path``; returns the (name, shape) list written. The values are the run's initial weights.

    Raises :class:`tether.LayoutMismatchError` for a parameter that is not float32 (Tether's layout is f32) and
    ``ValueError`` for a module without parameters."""
    tensors = []
    shapes = []
    for name, p in _named(module):
        if p.dtype != torch.float32:
            raise _layout_error(f"tensor {name}: dtype {p.dtype}, model files hold float32")
        arr = np.ascontiguousarray(p.detach().to("cpu").contiguous().numpy(), dtype=np.float32)
        tensors.append((name, arr))
        shapes.append((name, tuple(int(d) for d in p.shape)))
    if not tensors:
        raise ValueError("the module has no parameters")
    _tether.write_model_file(str(path), tensors)
    return shapes


def prepare(module: torch.nn.Module) -> None:
    """The launcher's hook for the model file: under ``python -m tether.launch``'s preparing run (``TETHER_PREPARE``
    set to the path that ``[model] file`` names), writes ``module`` there with :func:`export_model` and ends the
    process with status 0; otherwise returns at once. Call it once the model is built, before the worker."""
    path = os.environ.get("TETHER_PREPARE")
    if path:
        export_model(module, path)
        raise SystemExit(0)


def check_layout(module: torch.nn.Module, worker: Any) -> None:
    """Checks that ``module.named_parameters()`` has exactly the tensors of ``worker.layout`` (the model file the
    worker and the shards use): same names, same shapes, float32. Raises :class:`tether.LayoutMismatchError`
    naming the first tensor that differs (in the module's order, then the model file's)."""
    layout = {str(name): tuple(int(d) for d in shape) for name, shape, _ in worker.layout}
    seen = set()
    for name, p in _named(module):
        shape = tuple(int(d) for d in p.shape)
        if name not in layout:
            raise _layout_error(f"tensor {name} {list(shape)}: in the module but missing in the model file")
        if shape != layout[name]:
            raise _layout_error(
                f"tensor {name}: shape {list(shape)} in the module, {list(layout[name])} in the model file"
            )
        if p.dtype != torch.float32:
            raise _layout_error(f"tensor {name}: dtype {p.dtype} in the module, float32 in the model file")
        seen.add(name)
    for name, shape, _ in worker.layout:
        if name not in seen:
            raise _layout_error(
                f"tensor {name} {list(shape)}: in the model file but missing in the module"
            )


class FlatParams:
    """A module's parameters laid over the worker's flat parameter vector.

    After construction every CPU parameter's ``.data`` is a view into :attr:`flat`, a torch tensor over
    ``worker.params`` (``torch.from_numpy``: no copy), so :meth:`pull` updates the module in place. The module's
    current values are copied into the flat vector first, so the module is unchanged until the first pull.
    Parameters on another device (CUDA) stay there and receive a copy of their slice after each pull.
    The parameters keep their identity (optimizers created before or after keep working).

    :attr:`grad` (torch) / :attr:`grad_np` (numpy, same memory) is one preallocated float32 buffer that
    :meth:`gather_grads` fills in layout order (a parameter without a gradient contributes zeros).
    """

    def __init__(self, module: torch.nn.Module, worker: Any) -> None:
        check_layout(module, worker)
        self.module = module
        self.worker = worker
        self.num_params = int(worker.num_params)
        params_np = worker.params
        if not (isinstance(params_np, np.ndarray) and params_np.dtype == np.float32 and params_np.ndim == 1
                and params_np.shape[0] == self.num_params):
            raise TypeError("worker.params must be a 1-D float32 numpy array of num_params values")
        self.flat_np: np.ndarray = params_np
        self.flat: torch.Tensor = torch.from_numpy(params_np)
        self.grad_np: np.ndarray = np.zeros(self.num_params, dtype=np.float32)
        self.grad: torch.Tensor = torch.from_numpy(self.grad_np)
        by_name = dict(_named(module))
        # (parameter, offset, numel, shape) in layout order.
        self.slots: List[Tuple[torch.nn.Parameter, int, int, Tuple[int, ...]]] = []
        self.device_slots: List[Tuple[torch.nn.Parameter, int, int, Tuple[int, ...]]] = []
        for name, shape, offset in worker.layout:
            p = by_name[name]
            shape = tuple(int(d) for d in shape)
            n = int(math.prod(shape))
            off = int(offset)
            if off < 0 or off + n > self.num_params:
                raise _layout_error(f"tensor {name}: offset {off} + {n} values beyond {self.num_params}")
            slot = (p, off, n, shape)
            self.slots.append(slot)
            view = self.flat[off:off + n].view(shape)
            with torch.no_grad():
                view.copy_(p.detach())
            if p.device.type == "cpu":
                p.data = view
            else:
                self.device_slots.append(slot)
        self._host_values: Optional[torch.Tensor] = None

    @property
    def on_device(self) -> bool:
        """Whether some parameters live off the CPU (and are copied after each pull)."""
        return bool(self.device_slots)

    def load_flat(self) -> None:
        """Copies the flat vector into the parameters that live on another device (CPU ones are views)."""
        with torch.no_grad():
            for p, off, n, shape in self.device_slots:
                p.data.copy_(self.flat[off:off + n].view(shape), non_blocking=False)

    def pull(self) -> torch.Tensor:
        """``worker.pull()`` into ``worker.params`` (blocks within the SSP bound, GIL released), then loads device
        parameters. Returns :attr:`flat`."""
        self.worker.pull()
        self.load_flat()
        return self.flat

    def values(self) -> torch.Tensor:
        """The module's current values as one flat CPU float32 tensor: :attr:`flat` itself when every parameter is
        on the CPU, else a host buffer refreshed from the device parameters."""
        if not self.device_slots:
            return self.flat
        if self._host_values is None:
            self._host_values = self.flat.clone()
        out = self._host_values
        with torch.no_grad():
            for p, off, n, shape in self.slots:
                out[off:off + n].view(shape).copy_(p.detach())
        return out

    def gather_grads(self) -> np.ndarray:
        """Copies every parameter's ``.grad`` into :attr:`grad` (zeros where a parameter has none) and returns the
        numpy view :attr:`grad_np`."""
        with torch.no_grad():
            for p, off, n, shape in self.slots:
                dst = self.grad[off:off + n]
                g = p.grad
                if g is None:
                    dst.zero_()
                else:
                    if g.is_sparse:
                        g = g.to_dense()
                    dst.view(shape).copy_(g)
        return self.grad_np


def _loss_value(loss: Any) -> Optional[float]:
    """The loss as a float, or None when not given (the shards then get no loss: a NaN would mark the round as
    non-finite)."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().item())
    return float(loss)


class PerStep:
    """Per-step synchronisation: every :meth:`step` pushes the module's gradient and pulls the new weights.

    Construction checks the layout and pulls the initial weights into the module. Call :meth:`step` after
    ``loss.backward()`` in place of an optimizer step (there is no local optimizer: the shards apply the configured
    ``[optimizer]``). The push clips to ``train.clip_norm``, applies error feedback and encodes with the configured
    codec in Rust; the pull then waits within the SSP bound (``cluster.staleness``). Zero the gradients yourself
    (``module.zero_grad()``) as with any optimizer. Needs ``train.local_steps = 0``.
    """

    def __init__(self, module: torch.nn.Module, worker: Any) -> None:
        if int(worker.local_steps) != 0:
            raise _tether.ConfigError(
                f"train.local_steps = {worker.local_steps}: the shards expect local-step rounds; use DiLoCo"
            )
        self.worker = worker
        self.flat = FlatParams(module, worker)
        self.steps = 0
        self.flat.pull()

    def step(self, loss: Any = None) -> bool:
        """Pushes the gradient (``kind="gradient"``, with ``loss`` for the shards' spike detector) and pulls.
        Returns False when the gradient (or loss) was not finite and a skip marker went instead."""
        sent = self.worker.push(self.flat.gather_grads(), _loss_value(loss), kind="gradient")
        self.steps += 1
        self.flat.pull()
        return bool(sent) if sent is not None else True

    def report(self) -> Dict[str, Any]:
        """The worker's report (bytes, waits, pushes)."""
        return cast(Dict[str, Any], self.worker.report())

    def close(self, timeout_s: float = 60.0) -> Dict[str, Any]:
        """Closes the worker (settles, says goodbye); returns its final report."""
        return cast(Dict[str, Any], self.worker.close(timeout_s))


class DiLoCo:
    """Local-step rounds (DiLoCo): ``inner_optimizer`` runs H steps locally, then the round's pseudo-gradient
    ``theta_start - theta_end`` is pushed (``kind="delta"``) and the new public copy is loaded into the module in
    place. The shards apply ``[optimizer.outer]`` (Nesterov by default) to the mean of the workers' deltas.

    Construction checks the layout and pulls the initial weights into the module. Call :meth:`step` after
    ``loss.backward()`` instead of ``inner_optimizer.step()``; pass ``loss=`` to report the round's mean loss.
    ``local_steps`` defaults to the config's ``train.local_steps`` (which must be positive: the shards run the outer
    optimizer only in local-step mode). When a pull reports a shard rollback (``worker.rolled_back``), the inner
    optimizer's state is cleared.

    A partial round (fewer than H steps since the last push) is pushed only by an explicit :meth:`sync`;
    :meth:`close` discards it (:attr:`pending_steps` says how many steps that is).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        worker: Any,
        local_steps: Optional[int] = None,
    ) -> None:
        configured = int(worker.local_steps)
        if configured <= 0:
            raise _tether.ConfigError(
                "train.local_steps = 0: the shards expect a gradient every step; set train.local_steps = H or "
                "use PerStep"
            )
        h = configured if local_steps is None else int(local_steps)
        if h < 1:
            raise ValueError(f"local_steps must be at least 1, not {local_steps}")
        self.local_steps = h
        self.worker = worker
        self.optimizer = inner_optimizer
        self.flat = FlatParams(module, worker)
        self.rounds = 0
        self.steps = 0
        self.rollbacks = 0
        self.pending_steps = 0
        self.last_round_loss = float("nan")
        self.last_round_sent = True
        self._loss_sum = 0.0
        self._loss_n = 0
        self._delta_np = np.zeros(self.flat.num_params, dtype=np.float32)
        self._delta = torch.from_numpy(self._delta_np)
        self.flat.pull()
        self._start = self.flat.values().clone()

    def step(self, loss: Any = None) -> bool:
        """One inner step (``inner_optimizer.step()``); every H-th call ends the round: push, pull, reload.
        Returns whether this call ended a round."""
        self.optimizer.step()
        self.steps += 1
        self.pending_steps += 1
        v = _loss_value(loss)
        if v is not None and math.isfinite(v):
            self._loss_sum += v
            self._loss_n += 1
        if self.pending_steps >= self.local_steps:
            self.sync()
            return True
        return False

    def sync(self) -> None:
        """Ends the current round now (even with fewer than H inner steps): pushes theta_start - theta_end with the
        round's mean loss, pulls the new public copy into the module and snapshots it as the next theta_start.
        Does nothing when no inner step ran since the last round."""
        if self.pending_steps == 0:
            return
        end = self.flat.values()
        torch.sub(self._start, end, out=self._delta)
        loss = self._loss_sum / self._loss_n if self._loss_n else None
        self.last_round_sent = bool(
            self.worker.push(self._delta_np, loss, kind="delta", steps=self.pending_steps))
        self.last_round_loss = float("nan") if loss is None else loss
        self._loss_sum = 0.0
        self._loss_n = 0
        self.pending_steps = 0
        self.rounds += 1
        self.flat.pull()
        if bool(getattr(self.worker, "rolled_back", False)):
            self.reset_optimizer()
            self.rollbacks += 1
        self._start.copy_(self.flat.values())

    def reset_optimizer(self) -> None:
        """Clears the inner optimizer's state (moments, step counts), as after a shard rollback."""
        self.optimizer.state = collections.defaultdict(dict)

    def report(self) -> Dict[str, Any]:
        """The worker's report (bytes, waits, pushes)."""
        return cast(Dict[str, Any], self.worker.report())

    def close(self, timeout_s: float = 60.0) -> Dict[str, Any]:
        """Closes the worker (settles, says goodbye) without pushing a partial round; returns its final report."""
        return cast(Dict[str, Any], self.worker.close(timeout_s))


def iter_batches(order: Iterable[int], batch: int) -> Iterable[np.ndarray]:
    """Full batches of ``batch`` indices from ``order`` (the last partial batch is dropped, as the Rust worker
    does)."""
    arr = np.asarray(list(order) if not isinstance(order, np.ndarray) else order, dtype=np.int64)
    for i in range(0, (len(arr) // batch) * batch, batch):
        yield arr[i:i + batch]
