"""Megatron's process groups (TP × PP × DP) over the torch.distributed default group.

Megatron-Core 0.16.1 builds its groups from ``torch.distributed``'s default group and
``dist_checkpointing`` coordinates over it, so the training ranks must own the default
group: every rank of the torch world is a training rank, and ``world = tp × pp × dp``.
Other roles (rollout instances, the controller) talk to training over MPI (weights:
:mod:`libra_hpc.engines.sync`). Re-initialising (another TP size, a relayout) first
destroys every group megatron made: ``destroy_model_parallel`` forgets them without
freeing them, which leaks gloo threads and sockets at every cycle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in the training layout (all ranks in the torch default group)."""

    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def holds_export(self) -> bool:
        """TP rank 0 of DP replica 0: gathers its stage's full weights on export."""
        return self.tp_rank == 0 and self.dp_rank == 0


def start_torch_world(comm: Any, *, timeout_s: float = 300.0) -> str:
    """Collective over the MPI communicator ``comm`` of the training ranks: start the torch
    default group over exactly those ranks (NCCL with CUDA, else gloo), rank = rank in
    ``comm``. The store listens on ``comm`` rank 0's host (loopback when every rank shares
    one host: emulated node names do not resolve). On GPUs select this rank's device
    (``torch.cuda.set_device``) first. Returns the backend."""
    import socket

    hosts = comm.allgather(socket.gethostname())
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        address = ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0]), port)
    host, port = comm.bcast(address, root=0)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout_s))
    return backend


def init_model_parallel(tp: int, pp: int = 1, *, timeout_s: float = 300.0) -> Placement:
    """Collective over the torch world: build megatron's groups for TP=``tp``, PP=``pp``
    and DP = world / (tp·pp). torch.distributed must already be initialised."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel: torch.distributed is not initialised; start it over the "
                           "training ranks first (libra_hpc.cluster.world or init_process_group)")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"training world of {world} ranks is not a multiple of tensor_parallel × "
                         f"pipeline_parallel = {tp} × {pp}; the torch world must be exactly the training ranks")
    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 distributed_timeout_minutes=max(1, round(timeout_s / 60)),
                                 create_gloo_process_groups=False)
    placement = Placement(rank=dist.get_rank(), tp=tp, pp=pp, dp=ps.get_data_parallel_world_size(),
                          tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                          dp_rank=ps.get_data_parallel_rank())
    log.debug("megatron groups: %s", placement)
    return placement


def destroy_model_parallel() -> None:
    """Free every process group megatron created on this rank, then reset its state."""
    from megatron.core import parallel_state as ps

    for group in getattr(ps, "_global_process_group_list", None) or []:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    ps.destroy_model_parallel()


