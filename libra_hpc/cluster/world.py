"""The MPI world and the groups a layout makes of it.

One process per GPU slot plus the controller (rank 0). Applying a :class:`Layout` is a
collective over the world communicator: ``Comm.Split`` with color = group id gives each
training group / rollout instance its own MPI communicator, and a torch process group with
the same members (gloo on CPU, NCCL on GPU) is created beside it. Applying another layout
frees both and splits again: roles change without restarting the job.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from libra_hpc.cluster.env import ProcessEnv
from libra_hpc.cluster.layout import Group, Layout
from libra_hpc.cluster.topology import Topology, TopologyError, discover

log = logging.getLogger(__name__)

CONTROLLER = 0


@dataclass
class GroupHandle:
    """This rank's membership in the current layout."""

    group: Group
    comm: Any  # MPI.Intracomm
    torch_group: Any  # torch ProcessGroup
    rank: int  # rank inside the group


class World:
    """MPI world + torch default process group; rank 0 is the controller."""

    def __init__(self, comm: Any, topology: Topology, backend: str, device: torch.device):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.topology = topology
        self.backend = backend
        self.device = device
        self.handle: GroupHandle | None = None

    @classmethod
    def connect(cls, env: ProcessEnv, nodes: int, gpus_per_node: int, backend: str = "auto") -> World:
        """Collective over MPI.COMM_WORLD: discover the topology and start torch.distributed."""
        comm = MPI.COMM_WORLD
        cuda = torch.cuda.is_available()
        rank = comm.Get_rank()
        envs = comm.gather(env, root=CONTROLLER)
        # The controller decides and everyone raises the same error, so rank 0 gets to
        # record it before any rank aborts the world.
        found: Topology | TopologyError | None = None
        if rank == CONTROLLER:
            try:
                found = discover(envs, nodes, gpus_per_node, cuda)
            except TopologyError as exc:
                found = exc
        found = comm.bcast(found, root=CONTROLLER)
        if isinstance(found, TopologyError):
            raise found
        topology = found
        device = torch.device("cpu")
        if rank != CONTROLLER and cuda:
            index = topology.place_of(rank).device_index
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        if backend == "auto":
            backend = "nccl" if cuda else "gloo"
        default_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        hosts = [e.hostname for e in envs] if rank == CONTROLLER else []
        addr, port = comm.bcast(_store_address(hosts) if rank == CONTROLLER else None)
        dist.init_process_group(
            default_backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=comm.Get_size(),
            timeout=timedelta(minutes=5),
        )
        return cls(comm, topology, backend, device)

    # ----------------------------------------------------------------- control plane

    def broadcast(self, message: Any) -> Any:
        """Controller → everyone (a command); returns the message on every rank."""
        return self.comm.bcast(message, root=CONTROLLER)

    def gather(self, report: Any) -> list[Any] | None:
        """Everyone → controller; the controller gets one entry per rank (its own first)."""
        return self.comm.gather(report, root=CONTROLLER)

    # ----------------------------------------------------------------------- layouts

    def apply(self, layout: Layout) -> GroupHandle | None:
        """Collective over the world: drop the old groups, split into the new ones."""
        self._release()
        if self.rank == CONTROLLER:
            mine = None
            self.comm.Split(MPI.UNDEFINED, self.rank)
        else:
            slot = self.topology.place_of(self.rank).slot
            mine = layout.group_of(slot)
            comm = self.comm.Split(mine.gid, mine.slots.index(slot))
        # Every rank creates every torch group, in gid order. Member-only creation
        # (use_local_synchronization) names a group by hashing its ranks, so a group re-made
        # with the same members after a relayout reuses the old store keys and hangs on
        # stale gloo addresses; world-wide creation names groups by a counter that never
        # repeats.
        for group in layout.groups:
            members = [self.topology.rank_of(s) for s in group.slots]
            torch_group = dist.new_group(members, backend=self.backend)
            if group is mine:
                self.handle = GroupHandle(mine, comm, torch_group, comm.Get_rank())
        return self.handle

    def probe(self) -> dict:
        """Check collectives in this rank's group: an MPI and a torch all-reduce of ones
        must both equal the group size. Returns a report for the controller."""
        handle = self.handle
        assert handle is not None, "probe() before apply()"
        start = time.perf_counter()
        mpi_sum = handle.comm.allreduce(1)
        mpi_s = time.perf_counter() - start
        ones = torch.ones(1, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(ones, group=handle.torch_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        torch_s = time.perf_counter() - start
        place = self.topology.place_of(self.rank)
        return {
            "rank": self.rank,
            "slot": str(place.slot),
            "group": handle.group.name,
            "group_rank": handle.rank,
            "size": len(handle.group.slots),
            "mpi_sum": mpi_sum,
            "torch_sum": int(ones.item()),
            "mpi_ms": round(mpi_s * 1e3, 3),
            "torch_ms": round(torch_s * 1e3, 3),
            "device": str(self.device) if place.physical_gpu is None else f"{self.device} (gpu {place.physical_gpu})",
        }

    def close(self) -> None:
        """Free every group, then torch.distributed (collective)."""
        self._release()
        dist.destroy_process_group()

    def _release(self) -> None:
        if self.handle is not None:
            dist.destroy_process_group(self.handle.torch_group)
            self.handle.comm.Free()
            self.handle = None


def _store_address(hostnames: list[str]) -> tuple[str, int]:
    """Where the torch rendezvous store listens: the controller's host, a free port.
    One host for every rank (emulated nodes) → loopback, since emulated node names do not
    resolve."""
    addr = "127.0.0.1" if len(set(hostnames)) == 1 else socket.gethostbyname(hostnames[CONTROLLER])
    with socket.socket() as sock:
        sock.bind(("", 0))
        return addr, sock.getsockname()[1]
