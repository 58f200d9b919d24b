"""Type stubs of the native module ``tether._tether`` (Rust, PyO3): python/src/lib.rs is the source of truth."""

import os
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, final

import numpy as np
from numpy.typing import NDArray
from typing_extensions import TypeAlias

__all__ = [
    "Worker",
    "Partition",
    "write_model_file",
    "read_model_file",
    "load_data",
    "read_config",
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
    "__version__",
]

_StrPath: TypeAlias = str | os.PathLike[str]
"""A path: a ``str`` or an ``os.PathLike`` of ``str`` (converted to a Rust ``PathBuf``)."""

__version__: str
"""The package version (the ``tether-py`` crate's version)."""

class _Report(TypedDict):
    """A worker session's counters, as ``Worker.report()`` and ``Worker.close()`` return them."""

    rank: int
    clock: int
    pushes: int
    skips: int
    pushes_refused: int
    stale_replies_dropped: int
    rollbacks_seen: int
    reconnects: int
    max_clock_lead: int
    wire_bytes_pushed: int
    wire_bytes_pulled: int
    fp32_bytes_pushed: int
    fp32_bytes_pulled: int
    pull_wait_seconds: float
    push_seconds: float

class _Data(TypedDict):
    """The configured data set, as ``load_data`` returns it."""

    x_train: NDArray[np.float32]
    y_train: NDArray[np.int64]
    x_test: NDArray[np.float32]
    y_test: NDArray[np.int64]
    features: int
    classes: int
    note: str | None

@final
class Worker:
    """A Tether worker: joins the shards, pulls parameters into a NumPy array, pushes updates Rust encodes."""

    def __new__(
        cls,
        config: _StrPath | None = None,
        rank: int | None = None,
        *,
        tls_dir: _StrPath | None = None,
        servers: Sequence[str] | None = None,
        reconnect_deadline_s: float = 60.0,
    ) -> Worker:
        """Joins the cluster; config, rank and tls_dir default to $TETHER_CONFIG, $TETHER_RANK, $TETHER_TLS_DIR."""

    @property
    def rank(self) -> int:
        """Rank."""

    @property
    def shards(self) -> int:
        """Number of shards."""

    @property
    def num_params(self) -> int:
        """Number of parameters (the layout's length)."""

    @property
    def clock(self) -> int:
        """Rounds pushed or skipped so far."""

    @property
    def local_steps(self) -> int:
        """``train.local_steps`` (H of local-step rounds; 0 = per-step updates)."""

    @property
    def staleness(self) -> int | None:
        """The SSP bound ``cluster.staleness`` (None = unbounded)."""

    @property
    def batch(self) -> int:
        """``train.batch``."""

    @property
    def config(self) -> dict[str, Any]:
        """The whole configuration as a dict (the sections of cluster.toml)."""

    @property
    def layout(self) -> list[tuple[str, list[int], int]]:
        """The layout: (name, shape, flat offset) per tensor, in layout order."""

    @property
    def params(self) -> NDArray[np.float32]:
        """The parameters as a float32 NumPy array over Rust memory, written in place by ``pull()``."""

    @property
    def rolled_back(self) -> bool:
        """Whether the last pull reported a shard rollback."""

    def pull(self, out: NDArray[np.float32] | None = None) -> NDArray[np.float32]:
        """Pulls the current clock's parameters (SSP-gated) into ``out`` (or ``params``) and returns that array."""

    def push(
        self,
        update: NDArray[np.float32],
        loss: float | None = None,
        kind: Literal["gradient", "delta"] = "gradient",
        steps: int = 1,
    ) -> bool:
        """Pushes one round's update (clipped gradient or local-step delta); False when a skip marker went instead."""

    def skip(self, loss: float | None = None) -> None:
        """Ends this round without an update (a skip marker)."""

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Waits until every push has its outcome (at most ``timeout_s``); returns whether they all have."""

    def report(self) -> _Report:
        """The session's counters."""

    def close(self, timeout_s: float = 60.0) -> _Report:
        """Settles, says goodbye to every shard, stops the runtime; returns the final report. Idempotent."""

    def __enter__(self) -> Worker:
        """Returns the worker itself."""

    def __exit__(self, *_args: object) -> Literal[False]:
        """Closes the worker (``close(60.0)``); never suppresses the exception."""

@final
class Partition:
    """One worker's share of a data set: the same disjoint share and per-epoch shuffle the Rust worker uses."""

    def __new__(cls, n: int, rank: int, workers: int, seed: int) -> Partition:
        """The share of rank ``rank`` among ``workers`` of ``n`` samples, shuffled from ``seed``."""

    def indices(self) -> NDArray[np.int64]:
        """The sample indices of this share."""

    def epoch_order(self, epoch: int) -> NDArray[np.int64]:
        """The share's indices in epoch ``epoch``'s order."""

    def __len__(self) -> int:
        """The number of samples in this share."""

def write_model_file(path: _StrPath, tensors: Sequence[tuple[str, NDArray[np.float32]]]) -> None:
    """Writes a model file (safetensors of float32 tensors, order kept): the layout and initial weights."""

def read_model_file(path: _StrPath) -> list[tuple[str, list[int]]]:
    """Names and shapes of a model file's tensors, in layout order."""

def load_data(config: _StrPath) -> _Data:
    """The configured data set as the Rust worker loads it (arrays, features, classes, fallback note)."""

def read_config(path: _StrPath) -> dict[str, Any]:
    """A cluster.toml parsed and validated as the shards read it, as a dict of its sections (defaults filled in)."""

def enable_logging(level: str = "info") -> bool:
    """Sends Tether's logs to stderr at ``level``; False if a subscriber was already installed."""

class TetherError(RuntimeError):
    """Every error Tether raises."""

class ConfigError(TetherError):
    """cluster.toml or the model file is invalid."""

class RefusedError(TetherError):
    """A shard refused this worker (attributes: code, shard)."""

    code: str
    """The refusal's wire code (e.g. ``"Unauthorized"``); set when a shard refused."""
    shard: int
    """The index of the shard that refused; set when a shard refused."""

class UnauthorizedError(RefusedError):
    """Wrong rank, certificate or unknown rank."""

class LayoutMismatchError(RefusedError):
    """The model's layout differs from the shards'."""

class ClockFromFutureError(RefusedError):
    """A clock beyond what the bound allows."""

class ConfigMismatchError(RefusedError):
    """The shards run under another setting."""

class SupersededError(RefusedError):
    """A newer session of this rank replaced this one."""

class ShardUnreachableError(TetherError):
    """A shard stayed unreachable past the deadline."""

class ProtocolStateError(TetherError):
    """A call out of order (e.g. after close)."""
