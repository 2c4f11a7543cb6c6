"""Who does what in the job, from a layout: rollout leaders and members, training ranks by
DP replica, the weight-export holders. Pure data (no MPI, no torch): the controller
sends it to every rank with the layout, each rank reads its own part.

Training ranks are in Megatron order inside the training group (rank = pp·TP·DP +
dp·TP + tp, :class:`~libra_hpc.cluster.layout.Group`): DP replica ``d`` is every rank
with that ``dp`` (all its TP ranks and pipeline stages), and it consumes the
trajectories the controller routes to it. The holders are TP rank 0 of DP replica 0 on
each pipeline stage: :meth:`MegatronTrainEngine.iter_hf` yields that stage's weights
there, and each holder sends them to every rollout leader.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra_hpc.cluster.layout import Group, Layout, Slot
from libra_hpc.scheduler.types import BucketSpec


@dataclass(frozen=True)
class Roles:
    """The job's roles under one layout; ranks are MPI world ranks."""

    layout: Layout
    leaders: dict[int, int]
    """Rollout instance id (its group id) → its leader's rank."""
    members: dict[int, tuple[int, ...]]
    """Rollout instance id → all its ranks, the leader first."""
    tps: dict[int, int]
    """Rollout instance id → its TP size."""
    replicas: tuple[tuple[int, ...], ...]
    """DP replica → its training ranks (every TP rank and stage)."""
    holders: tuple[int, ...]
    """The ranks that send each pipeline stage's weights to the leaders."""
    groups: dict[int, Group]
    """Rollout instance id → its group in the layout."""

    @property
    def trainers(self) -> tuple[int, ...]:
        return tuple(r for replica in self.replicas for r in replica)

    def role_of(self, rank: int) -> str:
        """``leader``, ``member`` (a rollout rank whose instance's engine runs on its
        leader), ``trainer`` or ``controller``."""
        if rank in self.leaders.values():
            return "leader"
        if any(rank in ranks for ranks in self.members.values()):
            return "member"
        if rank in self.trainers:
            return "trainer"
        return "controller"

    def instance_of(self, rank: int) -> int:
        return next(gid for gid, leader in self.leaders.items() if leader == rank)

    def replica_of(self, rank: int) -> int:
        return next(d for d, ranks in enumerate(self.replicas) if rank in ranks)

    def buckets(self, token_limits: dict[int, int]) -> list[BucketSpec]:
        """The C-MLFQ buckets: the instances grouped by TP, with the configured limits."""
        from libra_hpc.scheduler.routers import buckets_from_instances

        return buckets_from_instances(sorted(self.tps.items()), token_limits)


def roles_from_layout(layout: Layout, rank_of: dict[Slot, int] | callable,
                      ids: dict[tuple[Slot, ...], int] | None = None) -> Roles:
    """The roles of ``layout``; ``rank_of(slot)`` gives a slot's world rank. ``ids``: the
    instance id of each rollout group by its slots (default: its group id). The job keeps
    the ids of its first layout, so that an instance keeps its id in the queue service when
    a later layout renumbers the groups (the hybrid pool lent and given back)."""
    find = rank_of if callable(rank_of) else rank_of.__getitem__
    leaders, members, tps, groups = {}, {}, {}, {}
    for group in layout.rollout_instances:
        ranks = tuple(find(s) for s in group.slots)
        gid = group.gid if ids is None else ids[group.slots]
        leaders[gid], members[gid], tps[gid], groups[gid] = ranks[0], ranks, group.tp, group
    train = layout.training
    if train is None:
        raise ValueError(f"layout v{layout.version} has no training group: the job needs one")
    replicas = tuple(tuple(find(s) for s in train.replica_slots(d)) for d in range(train.dp))
    holders = tuple(find(train.slots[p * train.tp * train.dp]) for p in range(train.pp))
    return Roles(layout, leaders, members, tps, replicas, holders, groups)
