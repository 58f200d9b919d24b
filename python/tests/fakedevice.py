"""A fake accelerator for the device tests when no GPU is present: ``fakedev``, a device that is not the CPU.

Why: :class:`tether.torch.FlatParams` makes CPU parameters views into the worker's flat vector, but parameters on
any other device keep their own memory, so every pull must copy the flat vector onto them and every push must read
the gradients the device computed. Those two copies are what ``test_devices.py`` checks, and CI has no GPU; this
module gives it a device with the same obligations.

What it is: PyTorch's PrivateUse1 backend renamed ``fakedev`` and set up from Python
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``: a no-op device guard, which autograd
needs for a non-CPU device), whose tensors are :class:`FakeDeviceTensor`, a wrapper subclass
(``torch.Tensor._make_wrapper_subclass``) that reports ``device == fakedev:0`` and holds a CPU tensor of its own.
``__torch_dispatch__`` runs every op on the held CPU tensors and wraps the results again, so forward, backward
(gradients land on ``fakedev``) and optimizer steps compute exactly what the CPU would. ``t.to("fakedev")``,
``module.to("fakedev")`` and ``torch.zeros(..., device="fakedev")`` work (the backend's ``empty`` kernels make
wrappers and ``copy_`` fills them); ``.cpu()`` / ``.to("cpu")`` return plain CPU tensors.

What it enforces, as a real accelerator would:

- its memory is its own: held tensors come only from its own kernels (never from a CPU tensor passed in), there is
  no storage to share (``numpy()`` and ``untyped_storage()`` fail, ``data_ptr()`` is 0), ``p.data = cpu_tensor``
  fails, and an op that mixes a fake tensor with a CPU tensor of one or more dimensions raises (as CUDA does) instead
  of running. So a module on ``fakedev`` changes only through an explicit copy (``copy_``, ``.to``): code that
  skips the copy after a pull leaves it stale, and code that reads it without one fails;
- every crossing is counted in :data:`COPIES`: ``h2d`` (host to device: ``copy_`` into a fake tensor from a CPU
  one) and ``d2h`` (device to host: ``copy_`` into a CPU tensor from a fake one, ``.cpu()``, ``.item()``).

:data:`AVAILABLE` is False (and :data:`UNAVAILABLE_REASON` says why) where this torch lacks the Python backend hooks;
the tests then skip the fake device. Importing it turns off autograd's device threads for the importing (main)
thread: backward runs on the caller, for every device (see :func:`_setup`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils._pytree import tree_map

NAME = "fakedev"
DEVICE = f"{NAME}:0"
COPIES: Dict[str, int] = collections.Counter()
AVAILABLE = False
UNAVAILABLE_REASON = ""

_DEV = torch.device("cpu")  # fakedev:0 once _setup() succeeds
_CPU = torch.device("cpu")
_aten = torch.ops.aten


def reset_counts() -> None:
    """Zeroes :data:`COPIES`."""
    COPIES.clear()


class FakeDeviceTensor(torch.Tensor):
    """A tensor on ``fakedev:0`` whose values live in a private CPU tensor (``_held``)."""

    _held: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, held: torch.Tensor) -> "FakeDeviceTensor":
        assert type(held) is torch.Tensor and held.device.type == "cpu" and not held.requires_grad
        r = torch.Tensor._make_wrapper_subclass(
            cls, held.size(), strides=held.stride(), storage_offset=held.storage_offset(), dtype=held.dtype,
            layout=held.layout, device=_DEV, requires_grad=False)
        r._held = held
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeDeviceTensor({self._held!r}, device='{DEVICE}')"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, FakeDeviceTensor) != isinstance(src, FakeDeviceTensor):
                COPIES["h2d" if isinstance(dst, FakeDeviceTensor) else "d2h"] += 1
        elif func is _aten._local_scalar_dense.default:
            COPIES["d2h"] += 1
        else:
            for a in _tensors((args, kwargs)):
                if not isinstance(a, FakeDeviceTensor) and a.dim() > 0:
                    raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found "
                                       f"{DEVICE} and {a.device} (copy explicitly with .to())")
        target = kwargs.get("device")
        to_cpu = func is _aten._to_copy.default and target is not None and torch.device(target).type == "cpu"
        if to_cpu:
            COPIES["d2h"] += 1
        originals = {id(_unwrap(a)): a for a in _tensors((args, kwargs))}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if to_cpu:
            return out

        def rewrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in originals:  # an in-place or out= op: return the argument itself (fake or CPU)
                return originals[id(t)]
            return FakeDeviceTensor(t)

        return tree_map(rewrap, out)


def _tensors(tree: Any):
    leaves = []
    tree_map(lambda x: leaves.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return leaves


def _unwrap(x: Any) -> Any:
    """A fake tensor's held CPU tensor, and ``fakedev`` as a device argument becomes the CPU; all else unchanged."""
    if isinstance(x, FakeDeviceTensor):
        return x._held
    if isinstance(x, torch.device) and x.type == NAME:
        return _CPU
    return x


def _empty_kernel(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return FakeDeviceTensor(make(*args, **kwargs))
    return kernel


def _setup() -> None:
    global AVAILABLE, UNAVAILABLE_REASON, _DEV, _LIB
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        UNAVAILABLE_REASON = f"the PrivateUse1 backend is already {current!r}"
        return
    try:
        if current != NAME:
            from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
            _setup_privateuseone_for_python_backend(NAME)
        _DEV = torch.device(NAME, 0)
        # Tensors made on fakedev by CPU code (t.to("fakedev"), torch.zeros(..., device="fakedev")) come from these
        # kernels; all else dispatches on FakeDeviceTensor. _LIB must stay alive: dropping it unregisters them.
        _LIB = torch.library.Library("aten", "IMPL")
        _LIB.impl("empty.memory_format", _empty_kernel(torch.empty), "PrivateUse1")
        _LIB.impl("empty_strided", _empty_kernel(torch.empty_strided), "PrivateUse1")
        # Backward through fakedev would otherwise run on autograd's device thread, which can drop the last
        # reference to a graph task (and the Python objects it holds) while the interpreter shuts down: an abort at
        # exit ("terminate called without an active exception"). On the calling thread it computes the same.
        torch._C._set_multithreading_enabled(False)
    except (ImportError, AttributeError, RuntimeError) as e:
        UNAVAILABLE_REASON = f"torch {torch.__version__} cannot define a device in Python: {e}"
        return
    AVAILABLE = True


_LIB: Optional[torch.library.Library] = None
_setup()
