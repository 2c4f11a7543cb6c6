"""The control loop's decision state as plain data (lists, dicts, numbers, strings: what
``json.dumps`` writes), and back: layouts, plans, the hybrid pool with its replicas'
states, the calibration, the length window (:meth:`~libra_hpc.planner.control.ControlLoop.state_dict`).

Every ``*_state`` function returns lists, never tuples, so that a state survives a JSON
round trip unchanged and a restored loop's state compares equal to the saved one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

from libra_hpc.cluster.layout import Group, Layout, Slot
from libra_hpc.planner.calibration import Calibration
from libra_hpc.planner.costs import LengthSample, TrainShape
from libra_hpc.planner.gate import ReplanGate
from libra_hpc.planner.hybrid import HybridPool, HybridReplica, PhaseTimeouts
from libra_hpc.planner.search import Plan
from libra_hpc.planner.search import RolloutInstance as PlanInstance


def plain(value: Any) -> Any:
    """``value`` with every tuple turned into a list, recursively (JSON's form)."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def tuples(value: Any) -> Any:
    """The inverse of :func:`plain` for values made of tuples: every list a tuple."""
    return tuple(tuples(v) for v in value) if isinstance(value, list) else value


def gate_state(gate: ReplanGate) -> dict:
    """The replanning gate's checks and confirmation count (its options are the config's)."""
    return plain({"last_check": gate.last_check, "last_apply": gate.last_apply, "pending": gate.pending,
                  "streak": gate.streak, "moved": gate.moved})


def load_gate(gate: ReplanGate, data: dict) -> None:
    gate.last_check, gate.last_apply = data["last_check"], data["last_apply"]
    gate.pending, gate.streak = tuples(data["pending"]), data["streak"]
    gate.moved = tuples(data.get("moved"))  # absent from a checkpoint older than it: the dwell holds every change


def slots_state(slots: Iterable[Slot]) -> list[list[int]]:
    return [[s.node, s.gpu] for s in slots]


def slots_from(data: Sequence[Sequence[int]]) -> tuple[Slot, ...]:
    return tuple(Slot(node, gpu) for node, gpu in data)


def samples_state(samples: Iterable[LengthSample]) -> list[list[float]]:
    return [list(s) for s in samples]


def samples_from(data: Iterable[Sequence[float]]) -> list[LengthSample]:
    return [LengthSample(*s) for s in data]


def calibration_state(cal: Calibration) -> dict:
    return plain(asdict(cal))


def calibration_from(data: dict) -> Calibration:
    return Calibration(**{**data, "fit_errors": tuples(data["fit_errors"])})


def layout_state(layout: Layout | None) -> dict | None:
    if layout is None:
        return None
    return {"nodes": layout.nodes, "gpus_per_node": layout.gpus_per_node, "version": layout.version,
            "reason": layout.reason, "hybrid": slots_state(sorted(layout.hybrid)),
            "groups": [{"gid": g.gid, "role": g.role, "slots": slots_state(g.slots), "tp": g.tp, "pp": g.pp,
                        "dp": g.dp, "hybrid": g.hybrid} for g in layout.groups]}


def layout_from(data: dict | None) -> Layout | None:
    if data is None:
        return None
    groups = tuple(Group(g["gid"], g["role"], slots_from(g["slots"]), g["tp"], g["pp"], g["dp"], g["hybrid"])
                   for g in data["groups"])
    return Layout(data["nodes"], data["gpus_per_node"], groups, frozenset(slots_from(data["hybrid"])),
                  data["version"], data["reason"])


def plan_state(p: Plan | None) -> dict | None:
    if p is None:
        return None
    return {"train": plain(asdict(p.train)), "train_slots": slots_state(p.train_slots),
            "rollout": [{"tp": i.tp, "slots": slots_state(i.slots)} for i in p.rollout],
            "t_train": p.t_train, "t_rollout": p.t_rollout, "objective": p.objective, "mode": p.mode}


def plan_from(data: dict | None) -> Plan | None:
    if data is None:
        return None
    train = {**data["train"], "shares": tuples(data["train"].get("shares", []))}  # JSON lists; absent before 12-07
    return Plan(TrainShape(**train), slots_from(data["train_slots"]),
                tuple(PlanInstance(i["tp"], slots_from(i["slots"])) for i in data["rollout"]),
                data["t_train"], data["t_rollout"], data["objective"], data["mode"])


def pool_state(pool: HybridPool | None) -> dict | None:
    """The pool's sizes, clock, phase timeouts and every replica with its state and times."""
    if pool is None:
        return None
    return {"min_rollout_gpus": pool.min_rollout_gpus, "rollout_core_gpus": pool.rollout_core_gpus,
            "training_core_gpus": pool.training_core_gpus, "timeouts": asdict(pool.timeouts), "now": pool.now,
            "replicas": [{"rid": r.rid, "slots": slots_state(r.slots), "state": r.state, "since": r.since,
                          "requested_at": r.requested_at, "activated_at": r.activated_at}
                         for r in pool.all_replicas()]}


def pool_from(data: dict | None) -> HybridPool | None:
    """The pool :func:`pool_state` describes, its replicas in their recorded states."""
    if data is None:
        return None
    replicas = [HybridReplica(r["rid"], slots_from(r["slots"]), r["state"], r["since"], r["requested_at"],
                              r["activated_at"]) for r in data["replicas"]]
    return HybridPool.restored(replicas, min_rollout_gpus=data["min_rollout_gpus"],
                               rollout_core_gpus=data["rollout_core_gpus"], training_core_gpus=data["training_core_gpus"],
                               timeouts=PhaseTimeouts(**data["timeouts"]), now=data["now"])


def settled(state: dict, running: dict | None) -> dict:
    """A control loop's :meth:`~libra_hpc.planner.control.ControlLoop.state_dict` made fit
    to run a world started in the layout ``running`` (:func:`layout_state` of the job's
    layout when it was saved, hybrid lends included; a resumed job starts in it): a hybrid
    replica mid-way through a lend or a return is put where that layout has it, ``active``
    when its slots train there and ``rollout`` when they serve rollout, so that a
    transition is finished or undone, never half-applied; a lend trial on a replica put
    back to rollout is dropped (the lend it judged was undone). A copy; ``state`` is left
    as it was."""
    state = copy.deepcopy(state)
    layout, pool = layout_from(running), state["pool"]
    if layout is None or pool is None:
        return state
    training = set(layout.training.slots) if layout.training is not None else set()
    undone = set()
    for replica in pool["replicas"]:
        lent = set(slots_from(replica["slots"])) <= training
        if replica["state"] != ("active" if lent else "rollout"):
            replica["state"], replica["since"] = ("active" if lent else "rollout"), pool["now"]
            if not lent:
                undone.add(replica["rid"])
        if lent and replica["activated_at"] is None:
            replica["activated_at"] = pool["now"]
    trial = state["lending"]["trial"]
    if trial is not None and trial.get("rid") in undone:
        state["lending"]["trial"] = None
    return state
