"""Topology discovery: which world rank is the controller, and which (node, GPU) slot every
other rank drives.

Pure: it takes what every rank reported about itself (gathered over MPI by the caller) and
the cluster shape from the config. Rules:
- rank 0 is the controller and drives no GPU;
- a rank's node is its SLURM_NODEID under Slurm, else its hostname; when every rank runs
  on one host outside Slurm (a laptop, CI) nodes are *emulated*: ranks 1.. fill node 0,
  then node 1, ..., ``gpus_per_node`` ranks each;
- on a node, worker ranks in world-rank order take GPU slots 0, 1, ...; the device a rank
  opens honours CUDA_VISIBLE_DEVICES (one visible GPU per task → that one; several → the
  slot's index into them).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra_hpc.cluster.env import ProcessEnv
from libra_hpc.cluster.layout import Slot


@dataclass(frozen=True)
class RankPlace:
    """Where one worker rank runs."""

    rank: int
    slot: Slot
    host: str
    device_index: int | None
    """CUDA device ordinal to open inside this process (None on CPU)."""
    physical_gpu: str | None
    """The GPU id as Slurm / the driver names it, for logs."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    nodes: int
    gpus_per_node: int
    emulated: bool
    places: tuple[RankPlace, ...]  # one per worker rank, sorted by rank

    def rank_of(self, slot: Slot) -> int:
        for place in self.places:
            if place.slot == slot:
                return place.rank
        raise KeyError(f"no rank drives slot {slot}")

    def place_of(self, rank: int) -> RankPlace:
        return self.places[rank - 1]

    def describe(self) -> dict:
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "emulated_nodes": self.emulated,
            "ranks": {p.rank: {"slot": str(p.slot), "host": p.host, "gpu": p.physical_gpu} for p in self.places},
        }


class TopologyError(RuntimeError):
    """The MPI world does not match the cluster shape the config asks for."""


def discover(envs: list[ProcessEnv], nodes: int, gpus_per_node: int, cuda: bool) -> Topology:
    """Map every worker rank (1..) to a slot. ``envs[r]`` is what rank r reported."""
    want = nodes * gpus_per_node + 1
    if len(envs) != want:
        raise TopologyError(
            f"the MPI world has {len(envs)} ranks but {nodes} nodes × {gpus_per_node} GPUs + 1 controller = {want}; "
            "start it with launch.py or sbatch/libra.sh, or fix cluster.nodes / cluster.gpus_per_node"
        )
    keys = [_node_key(e) for e in envs]
    emulated = len(set(keys)) == 1 and nodes > 1 and envs[0].node_id is None
    if emulated:
        node_of = {r: (r - 1) // gpus_per_node for r in range(1, len(envs))}
    else:
        order = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # first seen = node 0 (rank 0's node)
        if len(order) != nodes:
            raise TopologyError(f"ranks run on {len(order)} distinct nodes {list(order)}, the config asks for {nodes}")
        node_of = {r: order[keys[r]] for r in range(1, len(envs))}
    places = []
    for node in range(nodes):
        ranks = sorted(r for r, n in node_of.items() if n == node)
        if len(ranks) != gpus_per_node:
            raise TopologyError(
                f"node {node} ({envs[ranks[0]].hostname if ranks else '?'}) has {len(ranks)} worker ranks "
                f"{ranks}, cluster.gpus_per_node is {gpus_per_node}"
            )
        for gpu, rank in enumerate(ranks):
            device, physical = _device(envs[rank], gpu, cuda)
            places.append(RankPlace(rank, Slot(node, gpu), envs[rank].hostname, device, physical))
    places.sort(key=lambda p: p.rank)
    return Topology(len(envs), nodes, gpus_per_node, emulated, tuple(places))


def _node_key(env: ProcessEnv) -> str:
    return f"slurm-node-{env.node_id}" if env.node_id is not None else env.hostname


def _device(env: ProcessEnv, gpu: int, cuda: bool) -> tuple[int | None, str | None]:
    """(CUDA ordinal to open, GPU id as Slurm names it). Slurm's binding is recorded even
    on CPU-only machines (emulated GPUs declared as GRES), where nothing is opened."""
    visible = env.visible_gpus if env.visible_gpus is not None else env.step_gpus
    visible = visible or None  # CUDA_VISIBLE_DEVICES="" hides GPUs: nothing to bind
    if visible is not None and len(visible) == 1:
        return (0 if cuda else None), visible[0]  # Slurm bound exactly one GPU to this task
    if visible is not None and gpu >= len(visible):
        raise TopologyError(
            f"rank on {env.hostname} drives GPU slot {gpu} but Slurm/CUDA_VISIBLE_DEVICES shows only "
            f"{','.join(visible)}; request --gpus-per-node to match cluster.gpus_per_node"
        )
    physical = visible[gpu] if visible is not None else (str(gpu) if cuda else None)
    return (gpu if cuda else None), physical
