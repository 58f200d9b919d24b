"""``python -m tether.launch``: one command per host that starts the host's shard nodes and runs the user's script
once per local rank, as ``torchrun`` does for ``torch.distributed``.

This module owns the host's processes and nothing on the wire. Per host it

- reads one ``cluster.toml`` (parsed and validated by the same Rust code as the shards, :func:`tether.read_config`)
  and finds the host's place in it: the nodes whose address names this host (``--host``, default the host name) and
  the ranks ``node_rank * nproc_per_host + local_rank`` (``--node-rank``, default ``$SLURM_NODEID``,
  ``$JOB_COMPLETION_INDEX``, the pod ordinal in ``$HOSTNAME`` or 0);
- checks that every bundle it needs is in ``cluster.tls_dir`` or issues it from ``--ca-dir``;
- writes the model file the shards read when it is missing, by running the script once with ``TETHER_PREPARE`` set
  (the script calls :func:`tether.torch.prepare`);
- starts the host's primaries, standbys and witness (``tether-server``), restarting a node that dies;
- runs the script once per local rank with ``TETHER_CONFIG``, ``TETHER_RANK``, ``TETHER_TLS_DIR``,
  ``TETHER_REPORT``, ``TETHER_LOCAL_RANK``, ``TETHER_WORLD_SIZE``, ``TETHER_NODE_RANK`` and ``TETHER_RESTARTS`` in
  its environment, restarting a rank that crashes (it rejoins at the cluster's clock) up to ``--max-restarts``;
- forwards SIGINT/SIGTERM to everything it started and exits with the script's status.

``--standalone`` is the one-box mode: it writes a loopback cluster.toml for ``--nproc`` ranks and ``--shards``
shards (``--standbys`` adds a standby per shard and the witness) from the sections of ``--config`` when given,
issues every bundle and runs everything on this host. ``--role nodes`` and ``--role ranks`` split a host's work
between two steps (Slurm, Kubernetes): the nodes' step lives as long as the shards, the ranks' step can be cancelled
and started again.

Errors that the user must fix (a rank without a bundle, a config naming one address twice, a script that exits
without closing its worker) are :class:`LaunchError`: one message naming what to fix, and nothing left running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _tether
from .cluster import ClusterStartError, LocalCluster, find_binary

__all__ = ["LaunchError", "HostPlan", "NodeSpec", "plan_host", "Launcher", "main"]

#: Exit status of the launcher for a :class:`LaunchError` (bad input or set-up), as argparse's usage errors.
EXIT_SETUP = 2


class LaunchError(RuntimeError):
    """What the launcher cannot start, or a run that ended badly; ``status`` is the exit status it leads to."""

    def __init__(self, message: str, status: int = EXIT_SETUP) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class NodeSpec:
    """One ``tether-server`` process of this host: ``kind`` is ``primary``, ``standby`` or ``witness``."""

    kind: str
    shard: Optional[int]
    address: str

    @property
    def name(self) -> str:
        """``server-K``, ``standby-K`` or ``witness``: its bundle's folder and its log's name."""
        if self.kind == "witness":
            return "witness"
        return f"{'server' if self.kind == 'primary' else 'standby'}-{self.shard}"


@dataclass
class HostPlan:
    """What one host runs: its nodes and its ranks, from cluster.toml and the host's place."""

    host: str
    node_rank: int
    nproc_per_host: int
    workers: int
    nodes: List[NodeSpec] = field(default_factory=list)
    ranks: List[int] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def _split_host(address: str) -> str:
    """The host part of ``host:port``, ``[v6]:port`` or ``v6``; the address itself when it has no port."""
    a = address.strip()
    if a.startswith("["):
        return a[1:a.index("]")] if "]" in a else a
    if a.count(":") == 1:
        return a.rsplit(":", 1)[0]
    return a


def plan_host(config: Mapping[str, Any], host: str, node_rank: int, nproc_per_host: int,
              allow_empty: bool = False) -> HostPlan:
    """This host's nodes (those whose address names ``host``) and ranks (``node_rank * nproc_per_host`` onwards,
    below ``cluster.workers``). Raises :class:`LaunchError` for an address named twice, a place outside the cluster,
    or (unless ``allow_empty``) a host with nothing to run."""
    cluster = config.get("cluster", {})
    servers = [str(s) for s in cluster.get("servers", [])]
    standbys = [str(s) for s in cluster.get("standbys", []) or []]
    witness = cluster.get("witness")
    workers = int(cluster.get("workers", 0))
    if nproc_per_host < 0:
        raise LaunchError(f"--nproc-per-host is {nproc_per_host}: give 0 (no ranks here) or more")
    if node_rank < 0:
        raise LaunchError(f"--node-rank is {node_rank}: host places count from 0")
    entries: List[Tuple[str, NodeSpec]] = [(f"cluster.servers[{k}]", NodeSpec("primary", k, a))
                                           for k, a in enumerate(servers)]
    entries += [(f"cluster.standbys[{k}]", NodeSpec("standby", k, a)) for k, a in enumerate(standbys)]
    if witness:
        entries.append(("cluster.witness", NodeSpec("witness", None, str(witness))))
    seen: Dict[str, str] = {}
    for key, node in entries:
        norm = node.address.strip().lower()
        if norm in seen:
            raise LaunchError(
                f"cluster.toml names {node.address} twice ({seen[norm]} and {key}): two nodes cannot listen on one "
                f"address; give each its own host or port")
        seen[norm] = key
    plan = HostPlan(host=host, node_rank=node_rank, nproc_per_host=nproc_per_host, workers=workers)
    plan.nodes = [n for _, n in entries if _split_host(n.address) == host]
    first = node_rank * nproc_per_host
    if nproc_per_host > 0 and first >= workers:
        raise LaunchError(
            f"host place {node_rank} with {nproc_per_host} rank(s) per host starts at rank {first}, but "
            f"cluster.workers is {workers}: pass a smaller --node-rank or --nproc-per-host, or raise cluster.workers")
    plan.ranks = list(range(first, min(first + nproc_per_host, workers)))
    here = {n.shard for n in plan.nodes if n.kind != "witness"}
    for k in sorted(s for s in here if s is not None):
        kinds = {n.kind for n in plan.nodes if n.shard == k}
        if kinds == {"primary", "standby"}:
            plan.warnings.append(
                f"shard {k}'s primary and standby both run on {host}: losing this host loses the shard")
    if not plan.nodes and not plan.ranks and not allow_empty:
        raise LaunchError(
            f"nothing to run on {host!r} (place {node_rank}): no address in cluster.toml names it and no rank falls "
            f"to it; pass --host as the addresses spell this host, or --node-rank/--nproc-per-host")
    return plan


def default_node_rank(env: Mapping[str, str]) -> int:
    """``$TETHER_NODE_RANK``, Slurm's ``$SLURM_NODEID``, an Indexed Job's ``$JOB_COMPLETION_INDEX``, the ordinal of a
    StatefulSet pod (``name-N`` in ``$HOSTNAME``), else 0."""
    for var in ("TETHER_NODE_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX"):
        v = env.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    m = re.fullmatch(r".*-(\d+)", env.get("HOSTNAME", ""))
    return int(m.group(1)) if m else 0


def default_host(env: Mapping[str, str]) -> str:
    """``$TETHER_HOST``, Slurm's ``$SLURMD_NODENAME``, else the short host name."""
    return env.get("TETHER_HOST") or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _single_bundle_is(tls_dir: Path, name: str) -> bool:
    # A folder holding one mounted bundle (Kubernetes): the shards and workers read it as their own and check the
    # certificate's name themselves, so the launcher accepts it for any one node.
    return not any(tls_dir.glob("*/ca.pem"))


class Launcher:
    """Runs one host's plan: bundles, the model file, nodes, ranks, restarts and signals (see the module's doc)."""

    def __init__(
        self,
        config_path: Path,
        plan: HostPlan,
        argv: Sequence[str],
        *,
        role: str = "all",
        max_restarts: int = 3,
        ca_dir: Optional[Path] = None,
        tls_dir: Optional[Path] = None,
        work_dir: Optional[Path] = None,
        log_dir: Optional[Path] = None,
        bin_dir: Optional[Path] = None,
        node_restarts: int = 5,
        grace_s: float = 15.0,
    ) -> None:
        if role not in ("all", "nodes", "ranks"):
            raise LaunchError(f"--role {role!r}: give all, nodes or ranks")
        if max_restarts < 0:
            raise LaunchError("--max-restarts must be 0 or more")
        self.config_path = config_path.resolve()
        self.config = _tether.read_config(str(self.config_path))
        self.plan = plan
        self.argv = list(argv)
        self.role = role
        self.max_restarts = max_restarts
        self.node_restarts = node_restarts
        self.ca_dir = ca_dir
        tls = Path(self.config["cluster"].get("tls_dir", "certs"))
        self.tls_dir = (tls_dir or (tls if tls.is_absolute() else self.config_path.parent / tls)).resolve()
        self.work_dir = (work_dir or self.config_path.parent).resolve()
        self.log_dir = log_dir.resolve() if log_dir else None
        self.bin_dir = bin_dir
        self.grace_s = grace_s
        self._nodes: Dict[str, subprocess.Popen[bytes]] = {}
        self._node_tries: Dict[str, int] = {}
        self._ranks: Dict[int, subprocess.Popen[bytes]] = {}
        self._rank_tries: Dict[int, int] = {}
        self._offsets: Dict[str, int] = {}
        self._signal: Optional[int] = None
        self._logs: List[Any] = []

    # --- checks before anything starts ------------------------------------------------------------------------------

    def _server_bin(self) -> Path:
        return find_binary("tether-server", self.bin_dir)

    def check_bundles(self) -> None:
        """Every bundle this host needs is in the TLS folder, or is issued from ``--ca-dir``; else a
        :class:`LaunchError` naming the first missing one and the command that writes it."""
        needed: List[Tuple[str, str, List[str]]] = []
        if self.role in ("all", "nodes"):
            for n in self.plan.nodes:
                stem = "server"
                flag = {"primary": ["--server", str(n.shard)], "standby": ["--standby", str(n.shard)],
                        "witness": ["--witness"]}[n.kind]
                needed.append((n.name, stem, flag + ["--host", _split_host(n.address)]))
        if self.role in ("all", "ranks"):
            needed += [(f"worker-{r}", "worker", ["--worker", str(r)]) for r in self.plan.ranks]
        for name, stem, flag in needed:
            if (self.tls_dir / name / f"{stem}.pem").exists():
                continue
            if (self.tls_dir / f"{stem}.pem").exists() and _single_bundle_is(self.tls_dir, name):
                continue
            if self.ca_dir is None:
                what = name.replace("worker-", "rank ").replace("server-", "shard ")
                raise LaunchError(
                    f"no bundle for {what} in {self.tls_dir / name}: issue it with `tether-server keygen issue "
                    f"--ca CA_DIR --out {self.tls_dir} {' '.join(flag)}`, or pass --ca-dir CA_DIR and the launcher "
                    f"issues it")
            cmd = [str(self._server_bin()), "keygen", "issue", "--ca", str(self.ca_dir), "--out",
                   str(self.tls_dir)] + flag
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise LaunchError(f"issuing {name} from {self.ca_dir} failed: {out.stderr.strip()}")

    def prepare_model(self) -> None:
        """Writes the model file the shards read (``[model] kind = "file"``) when it is missing: the script runs
        once with ``TETHER_PREPARE`` set to the path and must call :func:`tether.torch.prepare` (which writes the
        file and exits)."""
        model = self.config.get("model", {})
        if model.get("kind") != "file":
            return
        path = Path(model.get("file", ""))
        if not path.is_absolute():
            path = self.config_path.parent / path
        if path.exists():
            return
        env = self._rank_env(self.plan.ranks[0] if self.plan.ranks else 0, 0)
        env["TETHER_PREPARE"] = str(path)
        try:
            proc = subprocess.run(self.argv, env=env, stdin=subprocess.DEVNULL, timeout=600)
        except subprocess.TimeoutExpired as e:
            raise LaunchError(f"the preparing run (TETHER_PREPARE={path}) did not end within 600 s: call "
                              f"tether.torch.prepare(model) before training starts") from e
        if proc.returncode != 0 or not path.exists():
            raise LaunchError(
                f"the model file {path} is missing and preparing it failed: the script ran with "
                f"TETHER_PREPARE={path} and exited {proc.returncode} without writing it; call "
                f"tether.torch.prepare(model) once the model is built (or write the file with "
                f"tether.torch.export_model before launching)")

    # --- processes --------------------------------------------------------------------------------------------------

    def _log(self, name: str) -> Any:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.log_dir / f"{name}.log", "ab")
        self._logs.append(f)
        return f

    def _node_log(self, name: str) -> Any:
        d = self.log_dir or self.work_dir
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / f"{name}.log", "ab")
        self._logs.append(f)
        return f

    def report_path(self, rank: int) -> Path:
        """Where rank ``rank`` writes its report when it closes its worker (``TETHER_REPORT``)."""
        return self.work_dir / f"worker-{rank}.json"

    def _rank_env(self, rank: int, tries: int) -> Dict[str, str]:
        env = dict(os.environ)
        env.update({
            "TETHER_CONFIG": str(self.config_path),
            "TETHER_RANK": str(rank),
            "TETHER_TLS_DIR": str(self.tls_dir),
            "TETHER_REPORT": str(self.report_path(rank)),
            "TETHER_LOCAL_RANK": str(rank - self.plan.node_rank * self.plan.nproc_per_host),
            "TETHER_WORLD_SIZE": str(self.plan.workers),
            "TETHER_NODE_RANK": str(self.plan.node_rank),
            "TETHER_RESTARTS": str(tries),
        })
        env.pop("TETHER_PREPARE", None)
        return env

    def _start_node(self, node: NodeSpec) -> None:
        args = [str(self._server_bin())]
        if node.kind == "witness":
            args += ["witness", "--config", str(self.config_path), "--state", str(self.work_dir / "witness.json")]
        else:
            args += ["--config", str(self.config_path), "--shard", str(node.shard),
                     "--exit-after-workers", str(self.plan.workers),
                     "--report", str(self.work_dir / f"{node.name}.json")]
            if node.kind == "standby":
                args.append("--standby")
            elif self._node_tries.get(node.name, 0) > 0 and not self.config["cluster"].get("standbys"):
                args.append("--resume")  # an unreplicated primary comes back from its newest checkpoint
        log = self._node_log(node.name)
        self._offsets[node.name] = log.tell()
        self._nodes[node.name] = subprocess.Popen(args, cwd=str(self.config_path.parent), stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT)

    def _start_rank(self, rank: int) -> None:
        tries = self._rank_tries.get(rank, 0)
        log = self._log(f"rank-{rank}")
        self._ranks[rank] = subprocess.Popen(self.argv, env=self._rank_env(rank, tries), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT if log else None)

    def _wait_listening(self, timeout_s: float = 60.0) -> None:
        d = self.log_dir or self.work_dir
        deadline = time.monotonic() + timeout_s
        pending = {n.name for n in self.plan.nodes}
        while pending:
            for name in sorted(pending):
                with open(d / f"{name}.log", "rb") as f:
                    f.seek(self._offsets.get(name, 0))  # logs are appended to: only this start's lines count
                    text = f.read().decode(errors="replace")
                if "listening on" in text:
                    pending.discard(name)
                elif self._nodes[name].poll() is not None:
                    raise LaunchError(f"{name} exited with {self._nodes[name].returncode} before listening; its "
                                      f"log: {d / (name + '.log')}\n{text[-2000:]}", status=1)
            if time.monotonic() > deadline:
                raise LaunchError(f"{', '.join(sorted(pending))} did not listen within {timeout_s:.0f} s", status=1)
            time.sleep(0.05)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def _terminate(self, procs: Mapping[Any, subprocess.Popen[bytes]], sig: int = signal.SIGTERM) -> None:
        for p in procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.grace_s
        for p in procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        """Stops every rank, then every node (SIGTERM, then SIGKILL after the grace period)."""
        self._terminate(self._ranks)
        self._terminate(self._nodes)
        for f in self._logs:
            f.close()
        self._logs.clear()

    # --- the run ----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Starts the host's plan and supervises it to the end; returns the exit status."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            self.stop_all()
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> int:
        self.check_bundles()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.role in ("all", "nodes"):
            self.prepare_model()
            for n in self.plan.nodes:
                self._start_node(n)
            self._wait_listening()
        if self.role in ("all", "ranks"):
            for r in self.plan.ranks:
                if self.role == "ranks" and self.report_path(r).exists():
                    continue  # finished in an earlier run of this step (a cancelled and restarted step)
                self.report_path(r).unlink(missing_ok=True)
                self._start_rank(r)
        finished: Dict[int, int] = {}
        while True:
            if self._signal is not None:
                sig = self._signal
                self._terminate(self._ranks, signal.Signals(sig))
                return 128 + int(sig)
            for name, p in list(self._nodes.items()):
                code = p.poll()
                if code is None or code == 0:
                    continue
                tries = self._node_tries.get(name, 0)
                if tries >= self.node_restarts:
                    raise LaunchError(f"{name} died {tries + 1} times (last status {code}); giving up. Its log: "
                                      f"{(self.log_dir or self.work_dir) / (name + '.log')}", status=1)
                self._node_tries[name] = tries + 1
                print(f"tether.launch: {name} exited with {code}; starting it again ({tries + 1})", file=sys.stderr)
                time.sleep(1.0)
                self._start_node(next(n for n in self.plan.nodes if n.name == name))
            for r, p in list(self._ranks.items()):
                if r in finished:
                    continue
                code = p.poll()
                if code is None:
                    continue
                if code == 0:
                    if not self.report_path(r).exists():
                        raise LaunchError(
                            f"rank {r} exited 0 without closing its tether.Worker (no report at "
                            f"{self.report_path(r)}): the script must train to the end and call close() on its worker "
                            f"(or leave its `with tether.Worker() as w:` block); the shards wait for every rank's "
                            f"goodbye", status=1)
                    finished[r] = 0
                    continue
                tries = self._rank_tries.get(r, 0)
                if tries >= self.max_restarts:
                    where = f"; its log: {self.log_dir / f'rank-{r}.log'}" if self.log_dir else ""
                    raise LaunchError(f"rank {r} exited with {code} after {tries} restart(s) (--max-restarts "
                                      f"{self.max_restarts}){where}", status=code if code > 0 else 1)
                self._rank_tries[r] = tries + 1
                print(f"tether.launch: rank {r} exited with {code}; starting it again ({tries + 1} of "
                      f"{self.max_restarts})", file=sys.stderr)
                self._start_rank(r)
            ranks_done = len(finished) == len(self._ranks)
            # The shard nodes exit by themselves after the last goodbye; the witness serves until it is stopped, so
            # it is stopped once this host's shard nodes are done (a host holding only the witness runs until it
            # is signalled).
            shard_nodes = [p for name, p in self._nodes.items() if name != "witness"]
            nodes_done = bool(shard_nodes) and all(p.poll() == 0 for p in shard_nodes)
            if ranks_done and (self.role == "ranks" or not self._nodes or nodes_done):
                return 0
            time.sleep(0.1)


def _standalone_config(args: argparse.Namespace, work: Path) -> Path:
    base: Dict[str, Dict[str, Any]] = {}
    if args.config:
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            import tomli as tomllib  # type: ignore[no-redef, import-not-found, unused-ignore]
        src = Path(args.config).resolve()
        with open(src, "rb") as f:
            base = {k: dict(v) for k, v in tomllib.load(f).items() if isinstance(v, dict)}
        model = base.get("model", {})
        if model.get("kind") == "file" and not Path(str(model.get("file", ""))).is_absolute():
            model["file"] = str(src.parent / str(model["file"]))  # relative to the file it was written in
    base.setdefault("model", {"kind": "file", "file": str(work / "model.bin")})
    base.setdefault("checkpoint", {}).setdefault("dir", str(work / "ckpt"))
    # LocalCluster picks free loopback ports, writes the config and issues every bundle; the launcher runs the nodes.
    lc = LocalCluster(work, base, shards=args.shards, workers=args.nproc, bin_dir=args.bin_dir,
                      standbys=args.standbys)
    lc.keygen()
    return Path(lc.config_path)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The launcher's command line (see docs/python.md and docs/design.md)."""
    p = argparse.ArgumentParser(prog="python -m tether.launch", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="cluster.toml (with --standalone: a file whose sections other than [cluster] "
                                    "are used)")
    p.add_argument("--host", help="this host's name as cluster.toml's addresses spell it (default: $TETHER_HOST, "
                                  "$SLURMD_NODENAME, the host name)")
    p.add_argument("--node-rank", type=int, help="this host's place among the worker hosts (default: "
                                                 "$TETHER_NODE_RANK, $SLURM_NODEID, $JOB_COMPLETION_INDEX, the pod "
                                                 "ordinal, 0)")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per rank (default 3)")
    p.add_argument("--role", default="all", choices=["all", "nodes", "ranks"],
                   help="start the host's nodes, its ranks, or both (default)")
    p.add_argument("--ca-dir", help="CA folder to issue missing bundles with (default: missing bundles are errors)")
    p.add_argument("--tls-dir", help="bundle folder (default: cluster.tls_dir)")
    p.add_argument("--work-dir", help="reports and node state (default: the config's folder; with --standalone a new "
                                      "temporary folder)")
    p.add_argument("--log-dir", help="one log per rank here (default: ranks print to the launcher's output); node "
                                     "logs go here too (default: the work folder)")
    p.add_argument("--bin-dir", help="folder holding tether-server (default: $TETHER_BIN_DIR, target/release, PATH)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the model file the shards read (when missing) and exit")
    p.add_argument("--standalone", action="store_true", help="one box: a loopback cluster of --shards shards for "
                                                             "--nproc ranks")
    p.add_argument("--nproc", type=int, default=2, help="with --standalone: ranks (default 2)")
    p.add_argument("--shards", type=int, default=2, help="with --standalone: shards (default 2)")
    p.add_argument("--standbys", action="store_true", help="with --standalone: a standby per shard and the witness")
    p.add_argument("-m", dest="module", action="store_true", help="run the script argument as a module (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m tether.launch``; returns the exit status."""
    args = parse_args(argv)
    cmd = [sys.executable, "-m", args.script] if args.module else [sys.executable, args.script]
    cmd += args.script_args
    try:
        if args.standalone:
            if args.node_rank not in (None, 0) or args.role != "all":
                raise LaunchError("--standalone runs the whole cluster on this host: drop --node-rank and --role")
            work = (Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tether-launch-"))).resolve()
            config = _standalone_config(args, work)
            plan = plan_host(_tether.read_config(str(config)), "127.0.0.1", 0, args.nproc)
            launcher = Launcher(config, plan, cmd, max_restarts=args.max_restarts, work_dir=work,
                                log_dir=Path(args.log_dir) if args.log_dir else None,
                                bin_dir=Path(args.bin_dir) if args.bin_dir else None)
        else:
            if not args.config:
                raise LaunchError("--config cluster.toml is required (or --standalone for one box)")
            config = Path(args.config)
            cfg = _tether.read_config(str(config))
            host = args.host or default_host(os.environ)
            node_rank = args.node_rank if args.node_rank is not None else default_node_rank(os.environ)
            nproc = args.nproc_per_host if args.role != "nodes" and not args.prepare_only else 0
            plan = plan_host(cfg, host, node_rank, nproc, allow_empty=args.role == "nodes" or args.prepare_only)
            launcher = Launcher(config, plan, cmd, role=args.role, max_restarts=args.max_restarts,
                                ca_dir=Path(args.ca_dir).resolve() if args.ca_dir else None,
                                tls_dir=Path(args.tls_dir) if args.tls_dir else None,
                                work_dir=Path(args.work_dir) if args.work_dir else None,
                                log_dir=Path(args.log_dir) if args.log_dir else None,
                                bin_dir=Path(args.bin_dir) if args.bin_dir else None)
        if args.prepare_only:
            launcher.prepare_model()
            return 0
        for w in plan.warnings:
            print(f"tether.launch: warning: {w}", file=sys.stderr)
        print(f"tether.launch: {plan.host} (place {plan.node_rank}): nodes "
              f"{[n.name for n in plan.nodes] if launcher.role != 'ranks' else []}, ranks "
              f"{plan.ranks if launcher.role != 'nodes' else []}; {shlex.join(cmd)}", file=sys.stderr)
        return launcher.run()
    except LaunchError as e:
        print(f"tether.launch: error: {e}", file=sys.stderr)
        return e.status
    except _tether.ConfigError as e:
        print(f"tether.launch: error: {args.config}: {e}", file=sys.stderr)
        return EXIT_SETUP
    except ClusterStartError as e:  # --standalone: keygen or the binary's lookup failed
        print(f"tether.launch: error: {e}", file=sys.stderr)
        return EXIT_SETUP


if __name__ == "__main__":
    sys.exit(main())
