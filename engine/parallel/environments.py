"""Cluster environments: who each process of a distributed run is, read from its variables.

A :class:`ClusterEnvironment` answers the questions a process group needs before it can form:
how many processes there are (``world_size``), which one this is (``global_rank``, and its
``local_rank`` on its node and its ``node_rank``), where rank 0 listens (``main_address``,
``main_port``), and whether something outside the Trainer started the processes
(``creates_processes_externally``: then the Trainer only joins, it launches nothing).

Every implementation here reads environment variables, and says which in its docstring:

* :class:`TorchElasticEnvironment`: ``torchrun`` (or any torchelastic launcher);
* :class:`SLURMEnvironment`: tasks started by ``srun``;
* :class:`LocalEnvironment`: processes the Trainer launches itself (the variables are those
  :mod:`engine.parallel.launch` sets for the processes it starts).

:func:`select_environment` picks one: a user's instance in ``plugins`` first, then torchelastic,
then SLURM, then local; and checks it against ``devices`` and ``num_nodes``.

Example:
    >>> env = LocalEnvironment(devices=2, num_nodes=1)
    >>> env.world_size(), env.global_rank()
    (2, 0)
"""

from __future__ import annotations

import abc
import itertools
import os
import re
import socket
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "LAUNCHED_BY_VAR",
    "ClusterEnvironment",
    "LocalEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "expand_slurm_nodelist",
    "find_free_port",
    "select_environment",
]

#: Set by :mod:`engine.parallel.launch` in every process it starts (``"script:<pid>"`` or
#: ``"spawn:<pid>"``, the launching process's id): such a process was created externally to its
#: own Trainer, and is never mistaken for a torchrun or SLURM task.
LAUNCHED_BY_VAR = "ENGINE_LAUNCHED_BY"

# The launcher records here, in the launching process, the (devices, num_nodes) it started
# children for: a later Trainer call in the same script finds them running (they re-ran the
# script and meet it at the same call), so it must not start more.
_launched_here: dict[str, tuple[int, int]] = {}


def _launched_by_engine() -> bool:
    """This process was started by our launcher, or has started its children already."""
    return LAUNCHED_BY_VAR in os.environ or "script" in _launched_here


def _int_var(name: str, default: int | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise KeyError(f"the environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"the environment variable {name} must be an integer (got {raw!r}): fix or unset it"
        ) from None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (got {value!r})")
    return value


class ClusterEnvironment(abc.ABC):
    """Who this process is in a distributed run. Subclass it for a cluster of your own and pass
    an instance in ``Trainer(plugins=[...])``.

    A subclass implements the four rank methods, the two address properties,
    ``creates_processes_externally`` and :meth:`detect`. :meth:`validate` checks the world size
    against the Trainer's ``devices * num_nodes``; override it to check more.

    Example:
        >>> class Fixed(ClusterEnvironment):
        ...     creates_processes_externally = True
        ...     main_address, main_port = "10.0.0.1", 29500
        ...     def world_size(self): return 4
        ...     def global_rank(self): return 3
        ...     def local_rank(self): return 1
        ...     def node_rank(self): return 1
        ...     @classmethod
        ...     def detect(cls): return False
        >>> Fixed().validate(devices=2, num_nodes=2)
        >>> try:
        ...     Fixed().validate(devices=2, num_nodes=1)
        ... except ValueError as e:
        ...     print(e)
        Fixed: the cluster says world size 4, but the Trainer was given devices=2 * num_nodes=1
        = 2: pass devices and num_nodes whose product is 4
    """

    plugin_kind = "cluster environment"

    @property
    @abc.abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when something outside the Trainer started every process (torchrun, srun, our
        launcher in a child): the Trainer then joins the group and launches nothing."""

    @property
    @abc.abstractmethod
    def main_address(self) -> str:
        """The host rank 0 listens on (``MASTER_ADDR``)."""

    @property
    @abc.abstractmethod
    def main_port(self) -> int:
        """The port rank 0 listens on (``MASTER_PORT``)."""

    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of processes in the run, over all nodes."""

    @abc.abstractmethod
    def global_rank(self) -> int:
        """This process's rank in ``range(world_size())``."""

    @abc.abstractmethod
    def local_rank(self) -> int:
        """This process's rank among those on its node."""

    @abc.abstractmethod
    def node_rank(self) -> int:
        """The index of this process's node."""

    @classmethod
    @abc.abstractmethod
    def detect(cls) -> bool:
        """Whether this process runs under this environment (read from its variables)."""

    def _mismatch_hint(self, devices: int, num_nodes: int) -> str:
        return f"pass devices and num_nodes whose product is {self.world_size()}"

    def validate(self, *, devices: int, num_nodes: int) -> None:
        """Check the environment against the Trainer's ``devices`` and ``num_nodes``.

        Raises:
            ValueError: the world size is not ``devices * num_nodes``, or a rank is out of range.
        """
        world = self.world_size()
        name = type(self).__name__
        if world != devices * num_nodes:
            raise ValueError(
                f"{name}: the cluster says world size {world}, but the Trainer was given "
                f"devices={devices} * num_nodes={num_nodes} = {devices * num_nodes}: "
                f"{self._mismatch_hint(devices, num_nodes)}"
            )
        rank = self.global_rank()
        if not 0 <= rank < world:
            raise ValueError(
                f"{name}: global rank {rank} is outside range({world}): check the launcher's "
                "rank variables"
            )

    def __repr__(self) -> str:
        try:
            return (
                f"{type(self).__name__}(world_size={self.world_size()}, "
                f"global_rank={self.global_rank()}, local_rank={self.local_rank()}, "
                f"node_rank={self.node_rank()})"
            )
        except (KeyError, ValueError):  # variables missing: say so rather than fail in a repr
            return f"{type(self).__name__}(<variables not set>)"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it: bind to port 0).

    Another process may take it before it is used; pass ``MASTER_PORT`` to be certain.

    Example:
        >>> 0 < find_free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalEnvironment(ClusterEnvironment):
    """Processes the Trainer launches itself (``devices`` per node, ``num_nodes`` nodes).

    Reads ``MASTER_ADDR`` (default ``127.0.0.1``), ``MASTER_PORT`` (default: a free port,
    chosen once per instance), ``NODE_RANK`` (default 0) and ``LOCAL_RANK`` (default 0): the
    variables :mod:`engine.parallel.launch` sets in the processes it starts. A process it started
    carries :data:`LAUNCHED_BY_VAR`, and there ``creates_processes_externally`` is True; in the
    launching process it is False until the launcher has started the others.

    Args:
        devices: processes per node.
        num_nodes: nodes (each runs one launching process: give every node the same
            ``MASTER_ADDR`` and ``MASTER_PORT``, and its own ``NODE_RANK``).

    Example:
        >>> env = LocalEnvironment(devices=4, num_nodes=2)
        >>> env.world_size(), env.node_rank(), env.main_address
        (8, 0, '127.0.0.1')
    """

    def __init__(self, devices: int = 1, num_nodes: int = 1) -> None:
        self.devices = _positive("devices", devices)
        self.num_nodes = _positive("num_nodes", num_nodes)
        self._port: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return _launched_by_engine()

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return _int_var("MASTER_PORT")
        if self._port is None:
            self._port = find_free_port()
        return self._port

    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def global_rank(self) -> int:
        return self.node_rank() * self.devices + self.local_rank()

    def local_rank(self) -> int:
        return _int_var("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        return _int_var("NODE_RANK", 0)

    @classmethod
    def detect(cls) -> bool:
        return True  # the fallback: any process can launch its own

    def validate(self, *, devices: int, num_nodes: int) -> None:
        """Check ``devices``/``num_nodes`` against this environment's and the variables.

        Raises:
            ValueError: they differ from the environment's; ``LOCAL_RANK``/``NODE_RANK`` out of
                range; a launched process whose ``WORLD_SIZE`` disagrees (the script gave the
                Trainer other arguments in another process); several nodes without
                ``MASTER_PORT``.
        """
        if (devices, num_nodes) != (self.devices, self.num_nodes):
            raise ValueError(
                f"LocalEnvironment(devices={self.devices}, num_nodes={self.num_nodes}) was "
                f"given to a Trainer with devices={devices}, num_nodes={num_nodes}: build the "
                "environment with the Trainer's values"
            )
        local, node = self.local_rank(), self.node_rank()
        if not 0 <= local < devices:
            raise ValueError(
                f"LOCAL_RANK={local} is outside range(devices={devices}): unset LOCAL_RANK, or "
                "launch with a devices that covers it"
            )
        if not 0 <= node < num_nodes:
            raise ValueError(
                f"NODE_RANK={node} is outside range(num_nodes={num_nodes}): set NODE_RANK to "
                f"0..{num_nodes - 1}, a different one on each node"
            )
        if LAUNCHED_BY_VAR in os.environ and "WORLD_SIZE" in os.environ:
            launched = _int_var("WORLD_SIZE")
            if launched != self.world_size():
                raise ValueError(
                    f"this process was launched into a world of {launched} processes "
                    f"(WORLD_SIZE), but its Trainer has devices={devices} * "
                    f"num_nodes={num_nodes} = {self.world_size()}: every process of the script "
                    "must build its Trainer with the same devices and num_nodes"
                )
        if num_nodes > 1 and "MASTER_PORT" not in os.environ:
            raise ValueError(
                f"num_nodes={num_nodes} without MASTER_PORT: the nodes cannot find each other. "
                "Set MASTER_ADDR (node 0's address), MASTER_PORT (a free port on it) and "
                "NODE_RANK on every node, or launch with torchrun or srun"
            )


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by ``torchrun`` (or another torchelastic launcher).

    Detected by ``TORCHELASTIC_RUN_ID``, or by ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` all set (a launcher of the same convention), unless
    our own launcher started the process. Ranks from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
    and ``GROUP_RANK`` (the node); the address from ``MASTER_ADDR`` and ``MASTER_PORT``.

    Example:
        >>> env = TorchElasticEnvironment()
        >>> env.creates_processes_externally
        True
    """

    _VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return _int_var("MASTER_PORT")

    def world_size(self) -> int:
        return _int_var("WORLD_SIZE")

    def global_rank(self) -> int:
        return _int_var("RANK")

    def local_rank(self) -> int:
        return _int_var("LOCAL_RANK")

    def node_rank(self) -> int:
        return _int_var("GROUP_RANK", 0)

    @classmethod
    def detect(cls) -> bool:
        if _launched_by_engine():
            return False
        return "TORCHELASTIC_RUN_ID" in os.environ or all(v in os.environ for v in cls._VARS)

    def _mismatch_hint(self, devices: int, num_nodes: int) -> str:
        per_node = os.environ.get("LOCAL_WORLD_SIZE")
        launched = f" --nproc_per_node={per_node}" if per_node is not None else ""
        return (
            f"pass the Trainer devices and num_nodes that match torchrun's{launched} --nnodes "
            f"(their product must be {self.world_size()}), or run torchrun with "
            f"--nproc_per_node={devices} --nnodes={num_nodes}"
        )


def _expand_item(item: str) -> list[str]:
    """``rack[1-2]-n[01,03]`` -> every name the brackets describe, in order (zero padding of a
    range's bounds kept)."""
    parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
            continue
        names: list[str] = []
        for piece in part.split(","):
            lo, sep, hi = piece.strip().partition("-")
            if not sep:
                names.append(lo)
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {piece!r} in the SLURM node list entry {item!r}")
            width = len(lo)
            names.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
        choices.append(names)
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Every host name of a SLURM node list (``SLURM_NODELIST``'s compressed form), in order.

    Entries are separated by commas outside brackets (or spaces); brackets hold numbers and
    ranges, comma-separated, whose zero padding is kept.

    Raises:
        ValueError: unbalanced brackets, a bad range, or no host at all.

    Example:
        >>> expand_slurm_nodelist("node[001-003,007],other")
        ['node001', 'node002', 'node003', 'node007', 'other']
        >>> expand_slurm_nodelist("gpu[9-10]")
        ['gpu9', 'gpu10']
    """
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        if depth == 0 and ch in ", ":
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    if depth != 0:
        raise ValueError(f"unbalanced brackets in the SLURM node list {nodelist!r}")
    hosts = [h for item in items if item for h in _expand_item(item)]
    if not hosts:
        raise ValueError(f"the SLURM node list {nodelist!r} names no host")
    return hosts


class SLURMEnvironment(ClusterEnvironment):
    """Tasks started by ``srun`` (one process per task).

    Detected when ``SLURM_NTASKS`` is set, the job is not interactive (``SLURM_JOB_NAME`` is not
    ``bash`` or ``interactive``: there you launch processes yourself, as Lightning lets you) and
    our own launcher did not start the process. Ranks from ``SLURM_PROCID``, ``SLURM_LOCALID``,
    ``SLURM_NODEID`` and ``SLURM_NTASKS``. The main address is ``MASTER_ADDR`` if set, else the
    first host of ``SLURM_NODELIST``; the port is ``MASTER_PORT`` if set, else
    ``10000 + SLURM_JOB_ID % 10000``, the same on every task of the job.

    Example:
        >>> SLURMEnvironment.port_for_job("4242")
        14242
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_NODELIST", os.environ.get("SLURM_JOB_NODELIST"))
        if nodelist is None:
            raise KeyError(
                "neither MASTER_ADDR nor SLURM_NODELIST is set: set MASTER_ADDR to the first "
                "node's address"
            )
        return expand_slurm_nodelist(nodelist)[0]

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return _int_var("MASTER_PORT")
        return self.port_for_job(os.environ.get("SLURM_JOB_ID", ""))

    @staticmethod
    def port_for_job(job_id: str) -> int:
        """The port every task of job ``job_id`` derives alike: ``10000 + id % 10000`` (a
        non-numeric id is hashed with CRC-32, which does not vary between processes as
        ``hash`` does)."""
        n = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
        return 10000 + n % 10000

    def world_size(self) -> int:
        return _int_var("SLURM_NTASKS")

    def global_rank(self) -> int:
        return _int_var("SLURM_PROCID")

    def local_rank(self) -> int:
        return _int_var("SLURM_LOCALID")

    def node_rank(self) -> int:
        return _int_var("SLURM_NODEID")

    @classmethod
    def detect(cls) -> bool:
        if _launched_by_engine():
            return False
        interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
        return "SLURM_NTASKS" in os.environ and not interactive

    def validate(self, *, devices: int, num_nodes: int) -> None:
        """Check SLURM's tasks per node, nodes and tasks against ``devices``/``num_nodes``.

        Raises:
            ValueError: naming SLURM's value, the Trainer's, and the flag to change.
        """
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        if per_node.isdigit() and int(per_node) != devices:
            raise ValueError(
                f"SLURM runs {per_node} tasks per node (--ntasks-per-node={per_node}), but the "
                f"Trainer was given devices={devices}: pass devices={per_node}, or submit with "
                f"--ntasks-per-node={devices}"
            )
        nodes = os.environ.get("SLURM_NNODES", "")
        if nodes.isdigit() and int(nodes) != num_nodes:
            raise ValueError(
                f"SLURM allocated {nodes} nodes (--nodes={nodes}), but the Trainer was given "
                f"num_nodes={num_nodes}: pass num_nodes={nodes}, or submit with "
                f"--nodes={num_nodes}"
            )
        super().validate(devices=devices, num_nodes=num_nodes)

    def _mismatch_hint(self, devices: int, num_nodes: int) -> str:
        return (
            f"pass devices and num_nodes whose product is SLURM's {self.world_size()} tasks "
            f"(SLURM_NTASKS), or submit with --nodes={num_nodes} --ntasks-per-node={devices}"
        )


def select_environment(
    plugins: Iterable[Any] | None, *, devices: int, num_nodes: int
) -> ClusterEnvironment:
    """The environment of this process, checked against ``devices`` and ``num_nodes``.

    A :class:`ClusterEnvironment` instance in ``plugins`` wins; then torchelastic (torchrun),
    then SLURM, then :class:`LocalEnvironment` (the Trainer launches the processes itself).

    Raises:
        TypeError: a ClusterEnvironment class (not an instance) in ``plugins``.
        ValueError: two environments in ``plugins``, or one that disagrees with ``devices`` /
            ``num_nodes`` (see each environment's ``validate``).

    Example:
        >>> type(select_environment([], devices=1, num_nodes=1)).__name__
        'LocalEnvironment'
    """
    devices, num_nodes = _positive("devices", devices), _positive("num_nodes", num_nodes)
    given = []
    for plugin in plugins or ():
        if isinstance(plugin, type) and issubclass(plugin, ClusterEnvironment):
            raise TypeError(
                f"plugins holds the class {plugin.__name__}: pass an instance, "
                f"plugins=[{plugin.__name__}()]"
            )
        if isinstance(plugin, ClusterEnvironment):
            given.append(plugin)
    if len(given) > 1:
        names = ", ".join(type(e).__name__ for e in given)
        raise ValueError(f"plugins holds {len(given)} cluster environments ({names}): keep one")
    env: ClusterEnvironment
    if given:
        env = given[0]
    elif TorchElasticEnvironment.detect():
        env = TorchElasticEnvironment()
    elif SLURMEnvironment.detect():
        env = SLURMEnvironment()
    else:
        env = LocalEnvironment(devices, num_nodes)
    env.validate(devices=devices, num_nodes=num_nodes)
    return env


def process_rank() -> int:
    """This process's global rank: ``torch.distributed``'s once a process group is up, else
    the ``RANK`` variable torchrun and engine's launchers set (``SLURM_PROCID`` under srun),
    else 0. For code outside the strategies that must act on one rank only, whatever calls it
    (a remote logger never starts a run on another rank).

    Example:
        >>> from engine.parallel.environments import process_rank
        >>> process_rank()  # one process, no launcher
        0
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.strip().isdigit():
            return int(value)
    return 0
