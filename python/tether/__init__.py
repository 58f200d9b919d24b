"""Tether for Python: the worker side of the Tether parameter server.

The native module ``tether._tether`` (Rust, PyO3) owns everything on the wire: :class:`Worker` joins a cluster with
its rank's TLS bundle and runs the QUIC driver and the worker's protocol on a Rust runtime thread; ``pull()`` fills
the flat parameter vector in place, ``push()`` clips, applies error feedback, encodes and sends a gradient (or a
local-step round's delta). The shards are the ``tether-server`` binary and never run Python.

This package re-exports the native API and adds two pure-Python modules:

- :mod:`tether.torch`: PyTorch glue (``export_model``, ``check_layout``, ``FlatParams``, the ``DiLoCo`` and
  ``PerStep`` wrappers); imported on demand, so ``import tether`` does not need torch.
- :mod:`tether.launch`: ``python -m tether.launch``, one command per host that starts the host's shard nodes and
  runs the training script once per local rank (``tether.Worker()`` then reads its rank and config from the
  environment).
- :mod:`tether.cluster`: :class:`~tether.cluster.LocalCluster`, shards on loopback for development and tests.

Every refusal is a typed exception under :class:`TetherError` carrying the shard's message; see docs/python.md.
"""

from ._tether import (  # noqa: F401  (re-exports)
    ClockFromFutureError,
    ConfigError,
    ConfigMismatchError,
    LayoutMismatchError,
    Partition,
    ProtocolStateError,
    RefusedError,
    ShardUnreachableError,
    SupersededError,
    TetherError,
    UnauthorizedError,
    Worker,
    __version__,
    enable_logging,
    load_data,
    read_config,
    read_model_file,
    write_model_file,
)
from . import cluster  # noqa: F401
from .cluster import LocalCluster  # noqa: F401

__all__ = [
    "Worker",
    "write_model_file",
    "read_model_file",
    "load_data",
    "read_config",
    "Partition",
    "enable_logging",
    "TetherError",
    "ConfigError",
    "RefusedError",
    "UnauthorizedError",
    "LayoutMismatchError",
    "ClockFromFutureError",
    "ConfigMismatchError",
    "SupersededError",
    "ShardUnreachableError",
    "ProtocolStateError",
    "LocalCluster",
    "cluster",
]
