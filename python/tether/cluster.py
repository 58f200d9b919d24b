"""Local shards for development, tests and examples: :class:`LocalCluster` starts ``tether-server`` processes on
loopback for a configuration given as a dict, with certificates from ``tether-server keygen``; with standbys, also
one standby per shard and the witness (the fence's third vote).

This module owns process management only (ports, ``cluster.toml``, certificates, node processes and their logs);
the shards themselves are the Rust binary, and workers are :class:`tether.Worker` objects the caller creates with
:attr:`LocalCluster.config_path`. It never binds or connects to anything but 127.0.0.1.

The binary is looked up in ``bin_dir``, else ``$TETHER_BIN_DIR``, else ``<repo>/target/release`` (when this file
lies in a checkout), else ``PATH``.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

__all__ = ["LocalCluster", "ClusterStartError", "find_binary", "free_udp_port", "toml_dumps"]

# A path argument: a string or a path object.
_StrPath = Union[str, "os.PathLike[str]"]


class ClusterStartError(RuntimeError):
    """A shard or keygen could not be started (missing binary, a shard that exited or did not listen in time)."""


# --------------------------------------------------------------------------------------------------------------------
# A small TOML writer: tables of scalars, strings, booleans, lists and inline tables (all `cluster.toml` needs).
# --------------------------------------------------------------------------------------------------------------------


def _toml_string(s: str) -> str:
    out = ['"']
    for ch in s:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(k: str) -> str:
    if k and all(c.isalnum() or c in "_-" for c in k) and k.isascii():
        return k
    return _toml_string(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        r = repr(v)
        return r if any(c in r for c in ".eE") else r + ".0"
    if isinstance(v, (str, os.PathLike)):
        return _toml_string(os.fspath(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def toml_dumps(config: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML text of ``config``: each top-level key is a table (``[section]``) of values; nested dicts inside a
    section are written as inline tables (``schedule = { kind = "constant" }``, ``outer = { ... }``), which TOML
    treats exactly as sub-tables. Values: bool, int, float, str, path, list/tuple, dict. ``None`` values are left
    out (the key's default applies)."""
    lines: List[str] = []
    for section, table in config.items():
        if not isinstance(table, Mapping):
            raise TypeError(f"section {section!r} must be a dict, not {type(table).__name__}")
        lines.append(f"[{_toml_key(str(section))}]")
        for k, v in table.items():
            if v is None:
                continue
            lines.append(f"{_toml_key(str(k))} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Binaries and ports
# --------------------------------------------------------------------------------------------------------------------


def find_binary(name: str = "tether-server", bin_dir: Optional[_StrPath] = None) -> Path:
    """The path of binary ``name``: in ``bin_dir``, else ``$TETHER_BIN_DIR``, else ``<repo>/target/release``, else
    on ``PATH``. Raises :class:`ClusterStartError` naming the places looked at."""
    tried: List[str] = []
    candidates: List[Path] = []
    if bin_dir is not None:
        candidates.append(Path(bin_dir) / name)
    elif os.environ.get("TETHER_BIN_DIR"):
        candidates.append(Path(os.environ["TETHER_BIN_DIR"]) / name)
    else:
        here = Path(__file__).resolve()
        if len(here.parents) > 2:
            repo = here.parents[2]
            if (repo / "Cargo.toml").exists():
                candidates.append(repo / "target" / "release" / name)
    for c in candidates:
        tried.append(str(c))
        if c.is_file() and os.access(c, os.X_OK):
            return c
    if bin_dir is None:
        found = shutil.which(name)
        if found:
            return Path(found)
        tried.append(f"{name} on PATH")
    raise ClusterStartError(
        f"{name} not found (looked at: {', '.join(tried)}); build it with "
        "`cargo build --release -p tether-server` or set TETHER_BIN_DIR"
    )


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that was free a moment ago (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --------------------------------------------------------------------------------------------------------------------
# LocalCluster
# --------------------------------------------------------------------------------------------------------------------


class LocalCluster:
    """``shards`` ``tether-server`` processes on 127.0.0.1 for ``workers`` workers, configured by ``config``.

    ``config`` maps ``cluster.toml`` sections to dicts (``{"model": {"kind": "file", "file": path}, ...}``); an
    unbounded staleness is the string ``"inf"``. ``cluster.servers``, ``cluster.workers`` and ``cluster.tls_dir``
    are set here (free UDP ports, ``workers``, ``workdir/certs``); everything else is passed as given. The file is
    written to ``workdir/cluster.toml``; certificates (``tether-server keygen``) to ``workdir/certs``: ``server-K/``
    per shard and ``worker-R/`` per rank, which :class:`tether.Worker` finds through ``cluster.tls_dir``. Shard K
    logs to ``workdir/server-K.log`` and writes its run report to ``workdir/server-K.json`` when it stops.

    **Standbys.** With ``standbys=True`` (or, when ``standbys`` is left ``None``, a non-empty ``cluster.standbys``
    in ``config``), every shard also gets a standby (``tether-server --standby``, bundle ``standby-K/``, log
    ``standby-K.log``, report ``standby-K.json``) and the cluster a witness (``tether-server witness``, log
    ``witness.log``); ``cluster.standbys`` and ``cluster.witness`` are set to free ports. A killed primary
    (:meth:`kill_shard`) is then replaced by its standby within ``cluster.failover_ms`` or so, with no restart.

    Use it as a context manager (``with LocalCluster(...) as c:``) or call :meth:`start` and :meth:`stop`.
    ``start_timeout_s`` bounds the wait for each node to listen; ``stop_timeout_s`` the wait after SIGTERM before
    SIGKILL. ``extra_args`` are added to every shard's and standby's command line (e.g. ``["--spike-factor", "0"]``).
    """

    def __init__(
        self,
        workdir: _StrPath,
        config: Mapping[str, Mapping[str, Any]],
        shards: int = 2,
        workers: int = 2,
        bin_dir: Optional[_StrPath] = None,
        *,
        standbys: Optional[bool] = None,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 15.0,
        extra_args: Optional[List[str]] = None,
        log_level: Optional[str] = None,
    ) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.workdir = Path(workdir).resolve()
        self.shards = int(shards)
        self.workers = int(workers)
        self.server_bin = find_binary("tether-server", bin_dir)
        self.start_timeout_s = float(start_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.extra_args = list(extra_args or [])
        self.log_level = log_level
        self.certs_dir = self.workdir / "certs"
        self._procs: Dict[str, subprocess.Popen[bytes]] = {}
        self._logs: Dict[str, Any] = {}
        self._started = False

        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg: Dict[str, Dict[str, Any]] = {k: dict(v) for k, v in config.items()}
        cluster = cfg.setdefault("cluster", {})
        if standbys is None:
            standbys = bool(cluster.get("standbys"))
        self.replicated = bool(standbys)
        taken: "set[str]" = set()
        self.servers = [_free_port_except(taken) for _ in range(self.shards)]
        cluster["servers"] = self.servers
        if self.replicated:
            self.standbys = [_free_port_except(taken) for _ in range(self.shards)]
            self.witness: Optional[str] = _free_port_except(taken)
            cluster["standbys"] = self.standbys
            cluster["witness"] = self.witness
        else:
            self.standbys = []
            self.witness = None
            cluster.pop("standbys", None)
            cluster.pop("witness", None)
        cluster["workers"] = self.workers
        cluster["tls_dir"] = str(self.certs_dir)
        # `cluster` first, as people read it.
        ordered = {"cluster": cluster}
        ordered.update((k, v) for k, v in cfg.items() if k != "cluster")
        self.config = ordered
        self._config_path = self.workdir / "cluster.toml"
        self._config_path.write_text(toml_dumps(ordered))

    # ---------------------------------------------------------------------------------------------------------------

    @property
    def config_path(self) -> str:
        """Path of the written ``cluster.toml`` (give it to :class:`tether.Worker`)."""
        return str(self._config_path)

    def log_path(self, k: int) -> Path:
        """Shard ``k``'s log file (every start of it appends to the same file)."""
        return self.workdir / f"server-{k}.log"

    def report_path(self, k: int) -> Path:
        """Shard ``k``'s JSON run report, written when it stops."""
        return self.workdir / f"server-{k}.json"

    def log_text(self, k: int) -> str:
        """Shard ``k``'s whole log so far ("" before it first started)."""
        return self.node_log_text(f"server-{k}")

    def node_log_text(self, node: str) -> str:
        """The whole log so far of ``node`` (``server-K``, ``standby-K`` or ``witness``; "" before it started)."""
        try:
            return (self.workdir / f"{node}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        if self.log_level is not None:
            env["RUST_LOG"] = self.log_level
        else:
            env.setdefault("RUST_LOG", "info")
        return env

    def keygen(self) -> None:
        """Writes the certificates (once: skipped when ``workdir/certs`` already holds the CA; a replicated cluster
        in a work directory an unreplicated one used gets its standby and witness bundles issued from that CA)."""
        if (self.certs_dir / "ca" / "ca.pem").exists():
            if self.replicated:
                for k in range(self.shards):
                    if not (self.certs_dir / f"standby-{k}").exists():
                        self._issue(["--standby", str(k)])
                if not (self.certs_dir / "witness").exists():
                    self._issue(["--witness"])
            return
        cmd = [
            str(self.server_bin), "keygen", "--out", str(self.certs_dir),
            "--servers", str(self.shards), "--workers", str(self.workers),
        ]
        if self.replicated:
            cmd.append("--standbys")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=self._env())
        except subprocess.TimeoutExpired as e:
            raise ClusterStartError(f"keygen did not finish in 120 s: {' '.join(cmd)}") from e
        if out.returncode != 0:
            raise ClusterStartError(f"keygen failed ({out.returncode}): {out.stderr.strip()}")

    def issue_worker(self, rank: int) -> Path:
        """Signs one more worker bundle, ``certs/worker-R/`` for rank ``rank`` (``keygen issue``), e.g. to try a
        rank outside ``cluster.workers``; returns its folder."""
        self.keygen()
        self._issue(["--worker", str(int(rank))])
        return self.certs_dir / f"worker-{int(rank)}"

    def _issue(self, node: List[str]) -> None:
        cmd = [
            str(self.server_bin), "keygen", "issue", "--ca", str(self.certs_dir / "ca"),
            "--out", str(self.certs_dir),
        ] + node
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=self._env())
        if out.returncode != 0:
            raise ClusterStartError(f"keygen issue failed ({out.returncode}): {out.stderr.strip()}")

    def start(self) -> "LocalCluster":
        """Generates certificates (first time) and starts the witness (with standbys), every shard and every
        standby, waiting until each listens."""
        self.keygen()
        self._started = True
        try:
            if self.replicated:
                self._forget_votes()
                self.start_witness()
            for k in range(self.shards):
                self.start_shard(k, resume=False)
                if self.replicated:
                    self.start_standby(k)
        except BaseException:
            self.stop()
            raise
        return self

    def _forget_votes(self) -> None:
        # A new cluster: votes an earlier cluster in this work directory recorded (the witness's state, each node's
        # fence file) name nodes that no longer exist and would only hold the new ones back.
        ckpt = Path(os.fspath(self.config.get("checkpoint", {}).get("dir", "ckpt")))  # relative to cluster.toml
        if not ckpt.is_absolute():
            ckpt = self.workdir / ckpt
        stale = [self.workdir / "witness.json"]
        for k in range(self.shards):
            stale += [ckpt / f"shard-{k}" / "fence-primary.json", ckpt / f"shard-{k}" / "fence-standby.json"]
        for f in stale:
            try:
                f.unlink()
            except FileNotFoundError:
                pass

    def standby_report_path(self, k: int) -> Path:
        """Shard ``k``'s standby's JSON run report, written when it stops."""
        return self.workdir / f"standby-{k}.json"

    def _check_shard(self, k: int) -> None:
        if not 0 <= k < self.shards:
            raise ValueError(f"shard {k} out of range 0..{self.shards}")

    def start_shard(self, k: int, resume: bool = True, wait: bool = True) -> None:
        """Starts shard ``k`` (``--resume`` from its newest checkpoint unless ``resume=False``) and, with ``wait``,
        returns once its log says it is listening. Raises :class:`ClusterStartError` when it exits first or does
        not listen within ``start_timeout_s``. With standbys, a primary that comes back asks the node that serves
        to seed it and follows it."""
        self._check_shard(k)
        args = ["--config", self.config_path, "--shard", str(k), "--report", str(self.report_path(k))]
        if resume:
            args.append("--resume")
        self._start_node(f"server-{k}", args + self.extra_args, wait)

    def start_standby(self, k: int, wait: bool = True) -> None:
        """Starts shard ``k``'s standby (``--standby``); it follows the primary and takes over when it dies."""
        self._check_shard(k)
        if not self.replicated:
            raise ClusterStartError("this cluster has no standbys (pass standbys=True)")
        args = ["--config", self.config_path, "--shard", str(k), "--standby",
                "--report", str(self.standby_report_path(k))]
        self._start_node(f"standby-{k}", args + self.extra_args, wait)

    def start_witness(self, wait: bool = True) -> None:
        """Starts the witness (``tether-server witness``), keeping its votes in ``workdir/witness.json``."""
        if not self.replicated:
            raise ClusterStartError("this cluster has no standbys, so no witness (pass standbys=True)")
        args = ["witness", "--config", self.config_path, "--state", str(self.workdir / "witness.json")]
        self._start_node("witness", args, wait)

    def _start_node(self, node: str, args: List[str], wait: bool) -> None:
        p = self._procs.get(node)
        if p is not None and p.poll() is None:
            raise ClusterStartError(f"{node} is already running (pid {p.pid})")
        self.keygen()
        self._started = True
        log_path = self.workdir / f"{node}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")
        cmd = [str(self.server_bin)] + args
        try:
            proc = subprocess.Popen(
                cmd, cwd=str(self.workdir), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self._env(),
            )
        except OSError as e:
            log.close()
            raise ClusterStartError(f"cannot start {cmd[0]}: {e}") from e
        old = self._logs.pop(node, None)
        if old is not None:
            old.close()
        self._procs[node] = proc
        self._logs[node] = log
        if wait:
            self._wait_listening(node, offset)

    def wait_listening(self, k: int, offset: int = 0) -> None:
        """Waits (at most ``start_timeout_s``) until shard ``k``'s log, past byte ``offset``, says "listening on"."""
        self._wait_listening(f"server-{k}", offset)

    def _wait_listening(self, node: str, offset: int) -> None:
        proc = self._procs[node]
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            with open(self.workdir / f"{node}.log", "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if "listening on" in text:
                return
            if proc.poll() is not None:
                raise ClusterStartError(
                    f"{node} exited with {proc.returncode} before listening; log tail:\n{text[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"{node} did not listen within {self.start_timeout_s:.0f} s; log tail:\n{text[-3000:]}"
                )
            time.sleep(0.02)

    def node_alive(self, node: str) -> bool:
        """Whether ``node``'s process (``server-K``, ``standby-K`` or ``witness``) is running."""
        p = self._procs.get(node)
        return p is not None and p.poll() is None

    def shard_alive(self, k: int) -> bool:
        """Whether shard ``k``'s primary process is running."""
        return self.node_alive(f"server-{k}")

    def kill_node(self, node: str) -> None:
        """SIGKILLs ``node`` (a crash: no final checkpoint) and reaps it."""
        p = self._procs.get(node)
        if p is None:
            return
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        log = self._logs.pop(node, None)
        if log is not None:
            log.close()

    def kill_shard(self, k: int) -> None:
        """SIGKILLs shard ``k``'s primary (a crash: no final checkpoint) and reaps it."""
        self.kill_node(f"server-{k}")

    def kill_standby(self, k: int) -> None:
        """SIGKILLs shard ``k``'s standby and reaps it."""
        self.kill_node(f"standby-{k}")

    def stop_node(self, node: str) -> Optional[int]:
        """Stops ``node`` gracefully: SIGTERM (final checkpoint and report), SIGKILL after ``stop_timeout_s``.
        Returns its exit code (None when it was never started)."""
        p = self._procs.get(node)
        if p is None:
            return None
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        log = self._logs.pop(node, None)
        if log is not None:
            log.close()
        return p.returncode

    def stop_shard(self, k: int) -> Optional[int]:
        """Stops shard ``k``'s primary gracefully (see :meth:`stop_node`); returns its exit code."""
        return self.stop_node(f"server-{k}")

    def _shards_by_index(self, codes: Dict[str, Optional[int]]) -> Dict[Any, Optional[int]]:
        # Primaries keep their historical integer keys; standbys and the witness are keyed by name.
        return {int(n[len("server-"):]) if n.startswith("server-") else n: c for n, c in codes.items()}

    def stop(self) -> Dict[Any, Optional[int]]:
        """Stops every node (SIGTERM to all, then bounded waits, then SIGKILL). Idempotent; returns exit codes:
        shard K's primary under K, standbys under ``"standby-K"``, the witness under ``"witness"``."""
        for p in self._procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return self._shards_by_index({n: self.stop_node(n) for n in list(self._procs)})

    def wait_exit(self, timeout_s: float) -> Dict[Any, Optional[int]]:
        """Waits (at most ``timeout_s`` in all) for every shard and standby to exit by itself
        (``--exit-after-workers``); returns exit codes keyed as :meth:`stop`'s, None for those still running. The
        witness, which never exits by itself, is not waited for."""
        deadline = time.monotonic() + timeout_s
        codes: Dict[str, Optional[int]] = {}
        for n, p in self._procs.items():
            if n == "witness":
                continue
            try:
                codes[n] = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[n] = None
        return self._shards_by_index(codes)

    def __enter__(self) -> "LocalCluster":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave node processes behind
        try:
            for p in getattr(self, "_procs", {}).values():
                if p.poll() is None:
                    p.kill()
        except Exception:
            pass

    def __repr__(self) -> str:
        alive = [n for n in sorted(self._procs) if self.node_alive(n)]
        return f"LocalCluster({self.workdir}, shards={self.shards}, workers={self.workers}, running={alive})"


def _free_port_except(taken: "set[str]") -> str:
    """A free 127.0.0.1 UDP address not in ``taken`` (which it joins)."""
    for _ in range(100):
        addr = f"127.0.0.1:{free_udp_port()}"
        if addr not in taken:
            taken.add(addr)
            return addr
    raise ClusterStartError("no free UDP port on 127.0.0.1 after 100 tries")
