"""The MPI control plane: who is where, the layout's communicators, commands and reports.

One process per GPU slot plus the controller (rank 0). :meth:`World.connect` is the only
world-wide collective (the topology is discovered once). After it, the controller talks
to each rank point to point (:mod:`.messages`: tag ``COMMAND`` out, ``REPORT`` back) and
every wait sleeps between probes: a rank waiting for its next command costs no CPU.

Applying a :class:`Layout` gives each training group / rollout instance its own MPI
communicator, made with ``Comm.Create_group`` by the members alone: a rank whose group
keeps its members (same slots, role and shape) keeps its communicator, so a relayout
involves only the ranks that change roles, and the controller takes no part.

No torch here. Torch worlds belong to the roles that need one, each started on its
group's communicator with :func:`.rendezvous.rendezvous`: the training ranks' default
group (``engines/train/parallel.py``), the one a vLLM instance makes for itself; the
controller has none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from mpi4py import MPI

from libra_hpc.cluster.env import ProcessEnv
from libra_hpc.cluster.layout import Group, Layout
from libra_hpc.cluster.messages import COMMAND, REPORT, Backoff, wait_message, wait_sent
from libra_hpc.cluster.topology import Topology, TopologyError, discover

log = logging.getLogger(__name__)

CONTROLLER = 0
FORM_TAG = 0x3000
"""Base tag of ``Comm.Create_group`` (plus the layout version modulo 0x1000)."""


@dataclass(frozen=True)
class GroupHandle:
    """This rank's membership in the current layout.

    ``ranks``: the members' world ranks in group order (= rank in ``comm``); ``formed_at``:
    the layout version that made ``comm`` (older than the layout's when the group kept its
    members through a relayout)."""

    group: Group
    comm: Any  # MPI.Intracomm over exactly the group's ranks
    rank: int  # rank inside the group
    ranks: tuple[int, ...]
    formed_at: int


def keeps_members(old: Group | None, new: Group) -> bool:
    """Whether a rank that was in ``old`` and is in ``new`` keeps its group as it is (its
    communicator and the state built on it: a torch world, an engine): same role, same
    slots in the same order, same TP/PP/DP. The group id may differ (layouts renumber)."""
    return old is not None and (old.role, old.slots, old.tp, old.pp, old.dp) == (new.role, new.slots, new.tp, new.pp, new.dp)


class World:
    """The MPI world (rank 0: the controller), its topology and this rank's group."""

    def __init__(self, comm: Any, topology: Topology, backend: str):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.topology = topology
        self.backend = backend
        """Backend of the training ranks' torch world (``nccl`` or ``gloo``), resolved
        from ``cluster.torch_backend``; the world itself starts none."""
        self.layout: Layout | None = None
        self.handle: GroupHandle | None = None

    @classmethod
    def connect(cls, env: ProcessEnv, nodes: int, gpus_per_node: int, backend: str = "auto",
                cuda: bool | None = None) -> World:
        """Collective over MPI.COMM_WORLD: discover the topology (one place per worker
        rank). ``cuda``: whether the nodes have CUDA devices; None asks torch on the
        controller (the only rank that imports it here)."""
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        envs = comm.gather(env, root=CONTROLLER)
        # The controller decides and everyone raises the same error, so rank 0 gets to
        # record it before any rank aborts the world.
        found: tuple[Topology, str] | TopologyError | None = None
        if rank == CONTROLLER:
            if cuda is None:
                cuda = _cuda_present()
            try:
                topology = discover(envs, nodes, gpus_per_node, cuda)
                found = (topology, _resolve_backend(backend, cuda))
            except TopologyError as exc:
                found = exc
        found = comm.bcast(found, root=CONTROLLER)
        if isinstance(found, TopologyError):
            raise found
        topology, resolved = found
        return cls(comm, topology, resolved)

    # ----------------------------------------------------------------- control plane

    @property
    def workers(self) -> list[int]:
        return list(range(1, self.size))

    def command(self, message: Any, ranks: list[int] | None = None, timeout_s: float | None = None) -> None:
        """Controller → ``ranks`` (default: every worker), point to point with tag
        ``COMMAND``; returns once every copy has left (sleeping, not polling)."""
        self._controller_only("command")
        requests = [self.comm.isend(message, dest=r, tag=COMMAND) for r in (self.workers if ranks is None else ranks)]
        wait_sent(requests, timeout_s=timeout_s)

    def reports(self, ranks: list[int] | None = None, timeout_s: float | None = None) -> list[Any]:
        """Controller: one ``REPORT`` from each of ``ranks`` (default: every worker), in
        that order. Raises TimeoutError naming the rank that did not answer."""
        self._controller_only("reports")
        backoff = Backoff()
        return [wait_message(self.comm, r, REPORT, backoff=backoff, timeout_s=timeout_s)
                for r in (self.workers if ranks is None else ranks)]

    def next_command(self, timeout_s: float | None = None) -> Any:
        """Worker: the controller's next command, waited for without spinning."""
        return wait_message(self.comm, CONTROLLER, COMMAND, timeout_s=timeout_s)

    def report(self, message: Any, timeout_s: float | None = None) -> None:
        """Worker → controller, tag ``REPORT``."""
        wait_sent([self.comm.isend(message, dest=CONTROLLER, tag=REPORT)], timeout_s=timeout_s)

    # ----------------------------------------------------------------------- layouts

    def apply(self, layout: Layout) -> GroupHandle | None:
        """Take ``layout`` as the current one. On a worker, collective over the members
        of its new group only, and only when the group changed (see :func:`keeps_members`):
        free the old communicator, form the new one. The controller only records it."""
        self.layout = layout
        if self.rank == CONTROLLER:
            return None
        group = layout.group_of(self.topology.place_of(self.rank).slot)
        old = self.handle
        if old is not None and keeps_members(old.group, group):
            self.handle = replace(old, group=group)
            return self.handle
        self._release()
        ranks = tuple(self.topology.rank_of(s) for s in group.slots)
        world_group = self.comm.Get_group()
        members = world_group.Incl(list(ranks))
        try:
            comm = self.comm.Create_group(members, tag=FORM_TAG + layout.version % 0x1000)
        finally:
            members.Free()
            world_group.Free()
        self.handle = GroupHandle(group, comm, comm.Get_rank(), ranks, layout.version)
        log.debug("layout v%d: %s formed over ranks %s", layout.version, group.name, ranks)
        return self.handle

    def probe(self) -> dict:
        """The MPI half of a group check: an all-reduce of ones over this rank's group
        communicator must equal the group size. Collective over the group. Returns a
        report for the controller (the training role adds its torch world's check)."""
        handle = self.handle
        if handle is None:
            raise RuntimeError(f"rank {self.rank}: probe() before apply(): no layout yet")
        start = time.perf_counter()
        mpi_sum = handle.comm.allreduce(1)
        mpi_s = time.perf_counter() - start
        place = self.topology.place_of(self.rank)
        device = "cpu" if place.device_index is None else f"cuda:{place.device_index}"
        return {
            "rank": self.rank,
            "slot": str(place.slot),
            "group": handle.group.name,
            "role": handle.group.role,
            "group_rank": handle.rank,
            "size": len(handle.group.slots),
            "formed_at": handle.formed_at,
            "mpi_sum": mpi_sum,
            "mpi_ms": round(mpi_s * 1e3, 3),
            "device": device if place.physical_gpu is None else f"{device} (gpu {place.physical_gpu})",
        }

    def close(self) -> None:
        """Free this rank's group communicator (local)."""
        self._release()

    def _release(self) -> None:
        if self.handle is not None:
            self.handle.comm.Free()
            self.handle = None

    def _controller_only(self, what: str) -> None:
        if self.rank != CONTROLLER:
            raise RuntimeError(f"World.{what}() is the controller's (rank {CONTROLLER}); rank {self.rank} called it")


def _resolve_backend(backend: str, cuda: bool) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"cluster.torch_backend: {backend!r} is not one of auto, gloo, nccl")
    if backend == "nccl" and not cuda:
        raise TopologyError("cluster.torch_backend is nccl but the controller sees no CUDA device; use auto or gloo")
    return ("nccl" if cuda else "gloo") if backend == "auto" else backend


def _cuda_present() -> bool:
    """Whether this process sees a CUDA device (torch answers; imported only to ask)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())

