"""The training ranks' torch world and Megatron's process groups (TP × PP × DP) over it.

Megatron-Core 0.16.1 builds its groups from ``torch.distributed``'s default group and
``dist_checkpointing`` coordinates over it, so the training ranks own the default group:
every rank of the torch world is a training rank, and ``world = tp × pp × dp``.
:func:`start_torch_world` starts it over the training group's MPI communicator
(:mod:`libra_hpc.cluster.rendezvous`), :class:`TrainingWorld` is what the worker keeps
per training layout (destroyed and started again, on a new port, when the training
group changes). Other roles (rollout instances, the controller) start no torch world
here and talk to training over MPI (weights: :mod:`libra_hpc.engines.sync`).
Re-initialising megatron (another TP size, a relayout) first destroys every group
megatron made: ``destroy_model_parallel`` forgets them without freeing them, which leaks
gloo threads and sockets at every cycle.
"""

from __future__ import annotations

import logging
import sys
import time
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


def start_torch_world(comm: Any, *, backend: str = "auto", device_index: int | None = None,
                      timeout_s: float = 300.0) -> str:
    """Collective over the MPI communicator ``comm`` of the training ranks: start the torch
    default group over exactly those ranks, rank = rank in ``comm``, meeting at a fresh
    store on ``comm`` rank 0's host (:func:`libra_hpc.cluster.rendezvous.rendezvous`).
    ``backend``: ``auto`` (NCCL with CUDA, else gloo), ``nccl`` or ``gloo``;
    ``device_index``: the CUDA device this rank drives, selected first (None: leave the
    current one). Returns the backend."""
    from libra_hpc.cluster.rendezvous import init_method, rendezvous

    if dist.is_initialized():
        raise RuntimeError(f"start_torch_world: this process already has a torch world (size "
                           f"{dist.get_world_size()}); stop it first (stop_torch_world)")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if device_index is not None:
        torch.cuda.set_device(device_index)
    address = rendezvous(comm)
    dist.init_process_group(backend, init_method=init_method(address), rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout_s))
    log.debug("training torch world: rank %d of %d at %s:%d (%s)", comm.Get_rank(), comm.Get_size(), *address, backend)
    return backend


def stop_torch_world() -> None:
    """Destroy megatron's groups (if any, see :func:`destroy_model_parallel`), then the
    default group. Local to this rank; a later :func:`start_torch_world` meets on a new
    port, so the old store's keys are never seen again."""
    ps = sys.modules.get("megatron.core.parallel_state")  # not imported: megatron made no groups
    if ps is not None and ps.model_parallel_is_initialized():
        destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class TrainingWorld:
    """The training ranks' torch world over their MPI communicator ``comm``, with what is
    built on it. The worker starts one when its rank joins the training group and closes
    it when the training group changes (another layout: new members, another shape); a
    new one is then started over the new group. ``own(engine)`` ties an engine (anything
    with ``shutdown()``, collective over the training ranks) to this world: ``close``
    shuts the owned engines down, newest first, before the groups go."""

    def __init__(self, comm: Any, *, backend: str = "auto", device_index: int | None = None,
                 timeout_s: float = 300.0):
        self.comm = comm
        self.backend = start_torch_world(comm, backend=backend, device_index=device_index, timeout_s=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self._owned: list[Any] = []

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def own(self, engine: Any) -> Any:
        self._owned.append(engine)
        return engine

    def check(self) -> tuple[int, float]:
        """An all-reduce of ones over the default group (collective): (sum, seconds). The
        sum must be the number of training ranks."""
        ones = torch.ones(1, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(ones)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return int(ones.item()), time.perf_counter() - start

    def close(self) -> None:
        while self._owned:
            self._owned.pop().shutdown()
        stop_torch_world()


def init_model_parallel(tp: int, pp: int = 1, *, timeout_s: float = 300.0) -> Placement:
    """Collective over the torch world: build megatron's groups for TP=``tp``, PP=``pp``
    and DP = world / (tp·pp). torch.distributed must already be initialised."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel: torch.distributed is not initialised; start it over the "
                           "training ranks first (start_torch_world or TrainingWorld)")
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


