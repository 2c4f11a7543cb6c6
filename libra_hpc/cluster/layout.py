"""Layouts: which GPU slot of which node plays which role, in which group.

Pure data and functions (no MPI, no torch): the planner produces layouts, the runtime
applies them by splitting communicators, the launcher prints them in ``--dry-run``.

Invariants (checked by :func:`check_layout`):
- every slot (node, gpu) of the cluster belongs to exactly one group;
- the slots of a tensor-parallel group lie on one node;
- a training group holds TP×PP×DP slots, a rollout instance TP slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from libra_hpc.config import ExperimentConfig

Role = Literal["training", "rollout"]


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU of one node (both 0-based)."""

    node: int
    gpu: int

    def __str__(self) -> str:
        return f"n{self.node}g{self.gpu}"


@dataclass(frozen=True)
class Group:
    """A set of slots that run as one unit: the training group or one rollout instance.

    ``slots`` are in rank order inside the group: for training, Megatron order (TP fastest,
    then DP, then PP), so consecutive chunks of ``tp`` slots are the TP groups.
    """

    gid: int
    role: Role
    slots: tuple[Slot, ...]
    tp: int
    pp: int = 1
    dp: int = 1
    hybrid: bool = False  # made of hybrid-pool slots

    @property
    def name(self) -> str:
        return "training" if self.role == "training" else f"rollout-{self.gid}"

    def tp_groups(self) -> list[tuple[Slot, ...]]:
        return [self.slots[i : i + self.tp] for i in range(0, len(self.slots), self.tp)]

    def replica_slots(self, d: int) -> tuple[Slot, ...]:
        """The slots of DP replica ``d`` (all its pipeline stages), by Megatron order:
        rank = pp·(TP·DP) + dp·TP + tp."""
        if not 0 <= d < self.dp:
            raise IndexError(f"{self.name} has DP replicas 0..{self.dp - 1}, not {d}")
        return tuple(self.slots[p * self.tp * self.dp + d * self.tp + t] for p in range(self.pp) for t in range(self.tp))


@dataclass(frozen=True)
class Layout:
    """A whole-cluster assignment of slots to groups; ``version`` grows with each change."""

    nodes: int
    gpus_per_node: int
    groups: tuple[Group, ...]
    hybrid: frozenset[Slot] = field(default_factory=frozenset)
    version: int = 0
    reason: str = "initial"

    def group_of(self, slot: Slot) -> Group:
        for group in self.groups:
            if slot in group.slots:
                return group
        raise KeyError(f"slot {slot} is in no group of layout v{self.version}")

    def slots_of(self, role: Role) -> list[Slot]:
        return [s for g in self.groups if g.role == role for s in g.slots]

    @property
    def training(self) -> Group | None:
        return next((g for g in self.groups if g.role == "training"), None)

    @property
    def rollout_instances(self) -> list[Group]:
        return [g for g in self.groups if g.role == "rollout"]

    def summary(self) -> dict:
        """Plain-data description for events.jsonl."""
        train = self.training
        return {
            "version": self.version,
            "reason": self.reason,
            "training": None if train is None else {"tp": train.tp, "pp": train.pp, "dp": train.dp, "gpus": len(train.slots)},
            "rollout_tp": [g.tp for g in self.rollout_instances],
            "gpus": {"training": len(self.slots_of("training")), "rollout": len(self.slots_of("rollout"))},
            "groups": {g.name: [str(s) for s in g.slots] for g in self.groups},
        }

    def table(self) -> str:
        """A node × GPU grid of roles, for humans (``launch.py --dry-run``)."""
        width = max(len(self._cell(s)) for n in range(self.nodes) for s in self._node_slots(n)) + 1
        head = "node  " + "".join(f"gpu{g}".ljust(width) for g in range(self.gpus_per_node))
        rows = [head]
        for n in range(self.nodes):
            rows.append(f"{n:<6}" + "".join(self._cell(s).ljust(width) for s in self._node_slots(n)))
        return "\n".join(rows)

    def _node_slots(self, node: int) -> list[Slot]:
        return [Slot(node, g) for g in range(self.gpus_per_node)]

    def _cell(self, slot: Slot) -> str:
        group = self.group_of(slot)
        mark = "*" if slot in self.hybrid else ""
        if group.role == "training":
            return f"T(tp{group.tp}){mark}"
        return f"R{group.gid}(tp{group.tp}){mark}"


class LayoutError(ValueError):
    """A layout that breaks an invariant; the message names the slot or group."""


def initial_layout(
    nodes: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    dp: int,
    rollout_patterns: list[list[int]],
    hybrid_nodes: int = 0,
) -> Layout:
    """Training on the first TP×PP×DP slots (node-major from node 0), rollout instances on
    the rest: whole rollout nodes take the ``rollout_patterns`` of instance TP sizes in
    turn; the free slots of a node
    that training fills only partly become TP-1 instances. The last ``hybrid_nodes`` nodes
    form the hybrid pool."""
    all_slots = [Slot(n, g) for n in range(nodes) for g in range(gpus_per_node)]
    n_train = tp * pp * dp
    if n_train > len(all_slots):
        raise LayoutError(f"training needs {n_train} slots, the cluster has {len(all_slots)}")
    # Node-major slots keep each chunk of `tp` consecutive slots on one node (tp divides G).
    groups = [Group(0, "training", tuple(all_slots[:n_train]), tp, pp, dp)]
    hybrid = frozenset(s for s in all_slots if s.node >= nodes - hybrid_nodes) if hybrid_nodes else frozenset()
    if hybrid and n_train and min(hybrid) <= all_slots[n_train - 1]:
        raise LayoutError(f"hybrid_nodes={hybrid_nodes} reaches into the training nodes (training ends at {all_slots[n_train - 1]})")
    free = all_slots[n_train:]
    whole_nodes = 0
    for node in sorted({s.node for s in free}):
        node_free = [s for s in free if s.node == node]
        if len(node_free) == gpus_per_node:
            sizes = rollout_patterns[whole_nodes % len(rollout_patterns)]
            whole_nodes += 1
        else:
            sizes = [1] * len(node_free)
        start = 0
        for size in sizes:
            members = tuple(node_free[start : start + size])
            groups.append(Group(len(groups), "rollout", members, size, hybrid=bool(hybrid) and members[0] in hybrid))
            start += size
    layout = Layout(nodes, gpus_per_node, tuple(groups), hybrid)
    check_layout(layout)
    return layout


def layout_from_config(cfg: ExperimentConfig) -> Layout:
    """The initial layout an experiment config asks for."""
    c, t = cfg.cluster, cfg.training
    return initial_layout(
        c.nodes, c.gpus_per_node, t.tensor_parallel, t.pipeline_parallel, t.data_parallel,
        cfg.rollout.node_patterns, cfg.planner.hybrid_nodes,
    )


def lend_hybrid_to_training(layout: Layout, reason: str, only: frozenset[Slot] | None = None) -> Layout:
    """The hybrid pool's rollout instances become extra training DP replicas (borrow);
    ``only``: just the instances on these slots (one replica of several)."""
    train = layout.training
    if train is None or not layout.hybrid:
        raise LayoutError("nothing to lend: the layout has no training group or no hybrid pool")
    lent = sorted(s for g in layout.rollout_instances if g.hybrid and (only is None or set(g.slots) <= only)
                  for s in g.slots)
    if not lent:
        raise LayoutError(f"the hybrid pool is already lent to training (layout v{layout.version})")
    replica = train.tp * train.pp
    if len(lent) % replica:
        raise LayoutError(f"{len(lent)} hybrid slots do not form whole replicas of TP×PP = {replica}")
    # Megatron order is TP fastest, then DP, then PP: per pipeline stage, the core
    # replicas' block then the new replicas' block. Each new replica is a run of TP×PP
    # node-major hybrid slots (stage by stage, TP chunk by TP chunk), so a rollout
    # instance of up to TP×PP slots lies in one replica and a TP chunk on one node.
    # (Strided over the stages before: with PP 4 a replica took every other slot of the
    # node, and no TP4 or TP8 instance there could form a pool.)
    extra_dp = len(lent) // replica
    core_stages = _stage_blocks(train.slots, train.tp * train.dp)
    new_stages = [tuple(lent[r * replica + p * train.tp + t] for r in range(extra_dp) for t in range(train.tp))
                  for p in range(train.pp)]
    slots = tuple(s for core, new in zip(core_stages, new_stages) for s in core + new)
    new_train = replace(train, slots=slots, dp=train.dp + extra_dp)
    keep = [g for g in layout.rollout_instances if not (g.hybrid and set(g.slots) <= set(lent))]
    return _renumbered(layout, [new_train, *keep], reason)


def return_hybrid_to_rollout(layout: Layout, base: Layout, reason: str, only: frozenset[Slot] | None = None) -> Layout:
    """Give the hybrid slots back to rollout, with the instance shapes they had in ``base``;
    ``only``: just these slots (one replica of several)."""
    train = layout.training
    lent = [s for s in layout.hybrid if train is not None and s in train.slots and (only is None or s in only)]
    if not lent:
        raise LayoutError(f"the hybrid pool is not lent to training in layout v{layout.version}")
    core = tuple(s for s in train.slots if s not in lent)  # stage-major order survives filtering
    new_train = replace(train, slots=core, dp=len(core) // (train.tp * train.pp))
    back = [g for g in base.rollout_instances if g.hybrid and set(g.slots) <= set(lent)]
    return _renumbered(layout, [new_train, *layout.rollout_instances, *back], reason)


def _stage_blocks(slots: tuple[Slot, ...], per_stage: int) -> list[tuple[Slot, ...]]:
    return [slots[i : i + per_stage] for i in range(0, len(slots), per_stage)]


def _renumbered(layout: Layout, groups: list[Group], reason: str) -> Layout:
    ordered = sorted(groups, key=lambda g: (g.role != "training", min(g.slots)))
    new = replace(
        layout,
        groups=tuple(replace(g, gid=i) for i, g in enumerate(ordered)),
        version=layout.version + 1,
        reason=reason,
    )
    check_layout(new)
    return new


def check_layout(layout: Layout) -> None:
    """Raise LayoutError naming the first broken invariant."""
    expected = {Slot(n, g) for n in range(layout.nodes) for g in range(layout.gpus_per_node)}
    seen: dict[Slot, str] = {}
    for group in layout.groups:
        want = group.tp * group.pp * group.dp
        if len(group.slots) != want:
            raise LayoutError(f"{group.name}: {len(group.slots)} slots but TP×PP×DP = {want}")
        for slot in group.slots:
            if slot not in expected:
                raise LayoutError(f"{group.name}: slot {slot} is outside the {layout.nodes}×{layout.gpus_per_node} cluster")
            if slot in seen:
                raise LayoutError(f"slot {slot} is in both {seen[slot]} and {group.name}")
            seen[slot] = group.name
        for chunk in group.tp_groups():
            if len({s.node for s in chunk}) > 1:
                raise LayoutError(f"{group.name}: TP group {[str(s) for s in chunk]} crosses nodes")
    missing = expected - seen.keys()
    if missing:
        raise LayoutError(f"slots {[str(s) for s in sorted(missing)]} are in no group")
