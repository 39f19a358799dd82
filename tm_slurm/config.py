"""The job's configuration: one tree of frozen dataclasses, loaded from YAML and CLI overrides.

Strict on purpose: an unknown key, a wrong type or timeouts in the wrong order are errors raised
before anything starts, each naming the key and what would be valid.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """Bad configuration; the message says which key and what to do instead."""


@dataclass(frozen=True)
class Layout:
    """Parallel layout. Ranks are numbered tp fastest, then dp, then pp; node i hosts the
    consecutive ranks [i*ranks_per_node, (i+1)*ranks_per_node)."""
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ranks_per_node: int = 1
    # DP ranks that shard one copy of the state between them (FSDP2's shard group, consecutive DP
    # ranks): 1 = every DP rank holds a whole replica (DDP); dp = one sharded copy, no replica
    dp_shard: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass(frozen=True)
class Timeouts:
    """Every timeout of the runtime, in seconds. Their required order is checked in `check()`."""
    heartbeat_interval_s: float = 0.5      # agent <-> controller, and worker -> agent
    heartbeat_timeout_s: float = 2.0       # no heartbeat for this long: the peer is suspect
    worker_heartbeat_timeout_s: float = 2.0  # agent's verdict on one of its workers
    fence_grace_s: float = 1.0             # a fenced process must be gone within this
    hang_timeout_s: float = 10.0           # a collective of a step pending this long is reported:
                                           # members that never joined it are hung (controller/hangs.py)
    collective_timeout_s: float = 30.0     # per-op deadline of every collective (hang backstop)
    vote_timeout_s: float = 120.0          # a rank waits this long for its step's commit decision
    phase1_timeout_s: float = 120.0        # a planned swap's preparation must finish within this
    rebuild_timeout_s: float = 15.0        # a group rebuilt after a failure: all members present
    recovery_timeout_s: float = 180.0      # an aborted rank waits this long for a recovery plan
    admit_timeout_s: float = 120.0         # every agent must have connected by then
    auth_timeout_s: float = 5.0            # a new MPI link must authenticate within this
    reach_timeout_s: float = 5.0           # Slurm: the first node must reach the controller's address
    controller_timeout_s: float = 10.0     # agents: controller silent this long -> it is gone
    shutdown_s: float = 10.0               # clean exit before processes are killed
    launcher_grace_s: float = 2.0          # a launcher may outlive its process this long before it
                                           # is killed (nothing of the job waits on one)

    @property
    def ping_interval_s(self) -> float:
        """The controller pings every agent this often: four pings in an agent's
        controller_timeout_s, not one per heartbeat (a ping costs the controller ~30 us a link,
        60 ms a second at 1,024 nodes with a ping every heartbeat)."""
        return self.controller_timeout_s / 4

    def check(self) -> None:
        order = [
            ("heartbeat_interval_s", "heartbeat_timeout_s"),
            ("heartbeat_interval_s", "worker_heartbeat_timeout_s"),
            ("heartbeat_timeout_s", "collective_timeout_s"),
            ("worker_heartbeat_timeout_s", "collective_timeout_s"),
            ("heartbeat_timeout_s", "hang_timeout_s"),
            ("hang_timeout_s", "collective_timeout_s"),
            ("fence_grace_s", "collective_timeout_s"),
            ("collective_timeout_s", "vote_timeout_s"),
            ("heartbeat_timeout_s", "controller_timeout_s"),
            ("heartbeat_timeout_s", "rebuild_timeout_s"),
            ("rebuild_timeout_s", "recovery_timeout_s"),
            ("collective_timeout_s", "recovery_timeout_s"),
            ("auth_timeout_s", "admit_timeout_s"),
            ("reach_timeout_s", "admit_timeout_s"),
        ]
        for name in (f.name for f in dataclasses.fields(self)):
            if getattr(self, name) <= 0:
                raise ConfigError(f"timeouts.{name} must be > 0, got {getattr(self, name)}")
        for lo, hi in order:
            if not getattr(self, lo) < getattr(self, hi):
                raise ConfigError(
                    f"timeouts.{lo} ({getattr(self, lo)}) must be smaller than timeouts.{hi} "
                    f"({getattr(self, hi)}): required order is "
                    + ", ".join(f"{a} < {b}" for a, b in order))


@dataclass(frozen=True)
class Standby:
    count: int = 1                          # nodes of the allocation kept as standbys
    prestart: bool = True                   # start standby workers at once (false: a cold joiner
                                            # process is started only when it is needed)
    sandbox: bool = True                    # warm standbys up with shadow iterations (no comm)
    sandbox_steps: int = 2                  # shadow iterations per rehearsed role
    when_exhausted: str = "checkpoint_exit"  # wait | shrink | checkpoint_exit
    wait_s: float = 300.0                   # with when_exhausted=wait: how long before checkpoint_exit
    replenish: bool = False                 # submit a companion job when the pool runs low
    replenish_target: int = 1
    replenish_sbatch_args: tuple = ()


@dataclass(frozen=True)
class Checkpoint:
    every_steps: int = 0                    # 0: only on demand (time limit, no replica, exit)
    keep: int = 2
    dir: str = ""                           # default: <job dir>/checkpoints


@dataclass(frozen=True)
class Comm:
    backend: str = "auto"                   # auto | gloo | nccl | nccl-like (gloo with NCCL's semantics)
    gloo_threads: int = 2
    interface: str = ""                     # gloo: bind to this host/IP instead of the node's name;
                                            # under Slurm also the controller's address


@dataclass(frozen=True)
class Slurm:
    backend: str = "auto"                   # auto | cli | pyslurm
    # the job's nodes are asked for every poll_interval_s while they change; after each quiet
    # poll the next waits twice as long, up to poll_max_interval_s (a drain waits for running
    # jobs, a failure is seen by the heartbeats within seconds; each poll is a request that
    # makes slurmctld pack every node of the cluster: README, "Cost to slurmctld")
    poll_interval_s: float = 1.0
    poll_max_interval_s: float = 8.0
    reservation_poll_s: float = 60.0        # maintenance reservations are made well ahead

    def poll_ceiling_s(self) -> float:
        """The longest wait between two node polls (no backoff when poll_interval_s is longer)."""
        return max(self.poll_interval_s, self.poll_max_interval_s)
    maint_horizon_s: float = 600.0          # act on a MAINT reservation starting within this
    release_nodes: bool = True              # give evacuated and failed nodes back to Slurm
    requeue_on_exit: bool = True            # time limit / batch-host loss: requeue the job
    srun_args: tuple = ()                   # extra arguments for each agent's srun


@dataclass(frozen=True)
class Recovery:
    # swap: move only the affected ranks (TrainMover). restart: what torchrun-style elastic
    # training does, every worker restarted in place from the last checkpoint (kept as the
    # honest baseline the benchmark compares against)
    strategy: str = "swap"


Ranks = typing.NewType("Ranks", str)     # output.ranks, as _ranks normalizes it


@dataclass(frozen=True)
class Output:
    # the ranks whose stdout and stderr `tm-slurm run` prints, each line led by `[rank<r>]: `
    # (every rank's is in <job dir>/logs/<node>.w<i>.log): a rank, a list (0,8 or [0, 8]), all
    # or none
    ranks: Ranks = Ranks("0")


@dataclass(frozen=True)
class Straggler:
    enabled: bool = False
    margin: float = 0.5                     # slower than the median peer by this fraction
    window_steps: int = 20                  # ... over this many consecutive steps


# every numeric key but the layout's (checked first, they divide) and the timeouts (their own
# order); floats are finite by then (_coerce)
RANGES: dict[str, tuple[str, float]] = {
    "standby.count": (">=", 0), "standby.sandbox_steps": (">=", 1), "standby.wait_s": (">=", 0),
    "standby.replenish_target": (">=", 0), "checkpoint.every_steps": (">=", 0),
    "checkpoint.keep": (">=", 1), "comm.gloo_threads": (">=", 1),
    "slurm.poll_interval_s": (">", 0), "slurm.maint_horizon_s": (">=", 0),
    "slurm.poll_max_interval_s": (">", 0), "slurm.reservation_poll_s": (">", 0),
    "straggler.margin": (">", 0), "straggler.window_steps": (">=", 1), "seed": (">=", 0)}


@dataclass(frozen=True)
class Config:
    layout: Layout = field(default_factory=Layout)
    timeouts: Timeouts = field(default_factory=Timeouts)
    standby: Standby = field(default_factory=Standby)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    slurm: Slurm = field(default_factory=Slurm)
    straggler: Straggler = field(default_factory=Straggler)
    recovery: Recovery = field(default_factory=Recovery)
    output: Output = field(default_factory=Output)
    seed: int = 0
    job_dir: str = ""                       # default: ./tm_slurm_jobs/<job id>

    def check(self) -> None:
        lay = self.layout
        for k in ("dp", "pp", "tp", "ranks_per_node", "dp_shard"):
            if getattr(lay, k) < 1:
                raise ConfigError(f"layout.{k} must be >= 1, got {getattr(lay, k)}")
        if lay.dp % lay.dp_shard:
            raise ConfigError(f"layout.dp ({lay.dp}) must be a multiple of layout.dp_shard "
                              f"({lay.dp_shard}): each replica of the state is sharded alike")
        if lay.ranks_per_node % lay.tp:
            raise ConfigError(
                f"layout.ranks_per_node ({lay.ranks_per_node}) must be a multiple of layout.tp "
                f"({lay.tp}): tensor-parallel groups stay inside one node")
        if lay.world % lay.ranks_per_node:
            raise ConfigError(
                f"dp*pp*tp = {lay.world} ranks do not fill whole nodes of "
                f"layout.ranks_per_node={lay.ranks_per_node}")
        self.timeouts.check()
        if self.output.ranks not in ("all", "none"):
            top = max(int(r) for r in self.output.ranks.split(","))
            if top >= lay.world:
                raise ConfigError(f"output.ranks names rank {top}, but the layout's ranks are "
                                  f"0..{lay.world - 1}")
        choices = {"standby.when_exhausted": (self.standby.when_exhausted, ("wait", "shrink", "checkpoint_exit")),
                   "comm.backend": (self.comm.backend, ("auto", "gloo", "nccl", "nccl-like")),
                   "slurm.backend": (self.slurm.backend, ("auto", "cli", "pyslurm")),
                   "recovery.strategy": (self.recovery.strategy, ("swap", "restart"))}
        for key, (val, ok) in choices.items():
            if val not in ok:
                raise ConfigError(f"{key} must be one of {', '.join(ok)}; got {val!r}")
        for key, (op, bound) in RANGES.items():
            section, _, name = key.rpartition(".")
            val = getattr(getattr(self, section) if section else self, name)
            if not (val >= bound if op == ">=" else val > bound):
                raise ConfigError(f"{key} must be {op} {bound}, got {val}")

        sl = self.slurm
        if 0 < sl.maint_horizon_s <= sl.reservation_poll_s + sl.poll_ceiling_s():
            raise ConfigError(
                f"slurm.maint_horizon_s ({sl.maint_horizon_s}) must be larger than "
                f"slurm.reservation_poll_s ({sl.reservation_poll_s}) plus the longest node poll "
                f"interval ({sl.poll_ceiling_s()}): a maintenance reservation must be seen before "
                "it begins")

    def active_nodes(self) -> int:
        return self.layout.world // self.layout.ranks_per_node

    def check_nodes(self, total_nodes: int, standbys: int | None = None) -> None:
        """An allocation of `total_nodes` must hold the layout's active nodes plus the standbys."""
        k = self.standby.count if standbys is None else standbys
        need = self.active_nodes()
        lay = self.layout
        what = (f"layout dp={lay.dp} x pp={lay.pp} x tp={lay.tp} = {lay.world} ranks at "
                f"{lay.ranks_per_node} per node needs {need} active nodes")
        if k > total_nodes:
            raise ConfigError(f"{k} standbys requested but the allocation has only {total_nodes} nodes")
        if total_nodes - k != need:
            raise ConfigError(
                f"{what}, plus {k} standby = {need + k} nodes, but {total_nodes} were given; "
                f"change the node count (e.g. --local {need}+{k} or sbatch -N {need + k}) or the layout")


# ---------------------------------------------------------------- loading

def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(path: str, typ: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {type(value).__name__}")
        return _build(typ, value, path)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{path} must be an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path} must be a number, got {value!r}") from None
        if not math.isfinite(f):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        return f
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return str(value)
    if typ is Ranks:
        return _ranks(path, value)
    if typ is tuple:
        if isinstance(value, str):
            return tuple(value.split())
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        return tuple(str(v) for v in value)
    raise ConfigError(f"{path}: unsupported type {typ}")  # pragma: no cover - schema bug


def _ranks(path: str, value: Any) -> str:
    """`output.ranks` as "all", "none" or its distinct ranks in order, joined by commas."""
    if isinstance(value, str) and value.strip().lower() in ("all", "none"):
        return value.strip().lower()
    items = value.replace(",", " ").split() if isinstance(value, str) else \
        value if isinstance(value, (list, tuple)) else [value]
    ranks = {_rank(r) for r in items}
    if not ranks or None in ranks:
        raise ConfigError(f"{path} must be a rank, a list of ranks (0,8 or [0, 8]), all or none; "
                          f"got {value!r}")
    return ",".join(map(str, sorted(ranks)))


def _rank(value: Any) -> int | None:
    """A rank >= 0 from an int or its digits (YAML's true is no rank); None if it is none."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    return int(value) if isinstance(value, str) and value.strip().isdecimal() else None


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        where = prefix or "top level"
        raise ConfigError(f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; "
                          f"valid keys: {', '.join(types)}")
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, types[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {p} is not a section")
    node[parts[-1]] = value


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load a YAML file (may be None) and apply dotted overrides like {"layout.dp": 2}."""
    tree: dict = {}
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level")
        tree = loaded
    for k, v in (overrides or {}).items():
        _set_path(tree, k, v)
    cfg = _build(Config, tree)
    cfg.check()
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` from the command line; the value is parsed as YAML (so 3, 0.5, true work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), yaml.safe_load(v) if v.strip() else ""


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: Mapping[str, Any]) -> Config:
    """Inverse of to_dict (used to ship the config to agents and workers)."""
    return _build(Config, data)
