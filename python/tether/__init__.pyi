"""Tether for Python: the worker side of the Tether parameter server (re-exports of ``tether._tether``)."""

from . import cluster as cluster
from ._tether import ClockFromFutureError as ClockFromFutureError
from ._tether import ConfigError as ConfigError
from ._tether import ConfigMismatchError as ConfigMismatchError
from ._tether import LayoutMismatchError as LayoutMismatchError
from ._tether import Partition as Partition
from ._tether import ProtocolStateError as ProtocolStateError
from ._tether import RefusedError as RefusedError
from ._tether import ShardUnreachableError as ShardUnreachableError
from ._tether import SupersededError as SupersededError
from ._tether import TetherError as TetherError
from ._tether import UnauthorizedError as UnauthorizedError
from ._tether import Worker as Worker
from ._tether import __version__ as __version__
from ._tether import enable_logging as enable_logging
from ._tether import load_data as load_data
from ._tether import read_config as read_config
from ._tether import read_model_file as read_model_file
from ._tether import write_model_file as write_model_file
from .cluster import LocalCluster as LocalCluster

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
