"""Per-role torch worlds over the MPI control plane.

Pure parts alone (where a torch world meets, when a group keeps its members), one real
torch world started, stopped and started again in this process, then two 13-rank MPI
worlds of the default shape (tests/role_world.py): idle ranks cost no CPU, and training
steps in its own torch world beside a live vLLM engine, through a training relayout that
rebuilds only the training world.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import mpi_worlds

from libra_hpc.cluster.layout import Group, Slot
from libra_hpc.cluster.rendezvous import LOOPBACK, init_method, rendezvous, store_host
from libra_hpc.cluster.world import keeps_members

HERE = Path(__file__).resolve().parent
IDLE_LIMIT = 0.05  # share of one core a rank waiting for its next command may use


# ------------------------------------------------------------------------ pure parts

def test_store_host_is_loopback_on_one_host_and_the_roots_host_otherwise():
    assert store_host(["node1", "node1", "node1"]) == LOOPBACK  # emulated names need not resolve
    assert store_host(["localhost", "elsewhere.invalid"], root=0) == socket.gethostbyname("localhost")
    with pytest.raises(OSError, match=r"'nowhere\.invalid' \(member 1\) does not resolve"):
        store_host(["localhost", "nowhere.invalid"], root=1)
    with pytest.raises(ValueError, match="root 2 is not a member of a world of 2"):
        store_host(["a", "b"], root=2)
    assert init_method(("127.0.0.1", 29500)) == "tcp://127.0.0.1:29500"


def test_a_group_keeps_its_members_only_with_the_same_slots_role_and_shape():
    slots = (Slot(0, 0), Slot(0, 1))
    group = Group(3, "rollout", slots, tp=2)
    assert keeps_members(group, Group(7, "rollout", slots, tp=2))  # renumbered only
    assert not keeps_members(None, group)
    assert not keeps_members(group, Group(3, "rollout", slots[::-1], tp=2))  # another rank order
    assert not keeps_members(group, Group(3, "training", slots, tp=2))
    assert not keeps_members(group, Group(3, "rollout", slots, tp=1, dp=2))
    assert not keeps_members(group, Group(3, "rollout", slots + (Slot(1, 0),), tp=3))


@pytest.mark.parametrize("module, allowed", [("libra_hpc.cluster.rendezvous", set()),
                                             ("libra_hpc.cluster.world", {"mpi4py"}),
                                             ("libra_hpc.runtime.worker", {"mpi4py"}),
                                             ("libra_hpc.runtime.check", {"mpi4py"}),
                                             ("libra_hpc.runtime.controller", {"mpi4py"}),
                                             ("libra_hpc.runtime.rollout", {"mpi4py"}),
                                             ("libra_hpc.runtime.job", {"mpi4py"})])
def test_the_control_plane_does_not_import_torch(module, allowed):
    """The controller and the rollout ranks never load torch for the control plane."""
    code = (f"import sys, {module}; print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} "
            "& {'torch', 'mpi4py'})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(filter(None, done.stdout.strip().split(","))) <= allowed, done.stdout


def test_rendezvous_and_a_training_world_started_again_on_a_new_port():
    """Over MPI.COMM_SELF: the store address, then a real gloo default group started,
    checked, stopped and started again (a relayout's rebuild, in one process)."""
    import torch.distributed as dist
    from mpi4py import MPI

    from libra_hpc.engines.train.parallel import TrainingWorld

    assert not dist.is_initialized(), "another test left torch.distributed initialised"
    host, port = rendezvous(MPI.COMM_SELF)
    assert host == LOOPBACK and 0 < port < 65536
    worlds = []
    for _ in range(2):
        world = TrainingWorld(MPI.COMM_SELF)
        worlds.append((world.backend, world.size, world.check()[0]))
        with pytest.raises(RuntimeError, match="already has a torch world"):
            TrainingWorld(MPI.COMM_SELF)
        world.close()
        assert not dist.is_initialized()
    assert worlds == [("gloo", 1, 1)] * 2


def test_training_world_rebuilds_give_back_their_sockets_and_threads(tiny):
    """A relayout closes the training world with the engine built on it (megatron's groups,
    the default group) and starts both again: nothing may pile up per cycle (the first
    cycle opens a few for good: torch's and megatron's one-time setup)."""
    import threading

    import torch.distributed as dist
    from mpi4py import MPI

    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import TrainingWorld

    counts = []
    for _ in range(4):
        world = TrainingWorld(MPI.COMM_SELF)
        engine = world.own(MegatronTrainEngine(tiny, tp=1, micro_batch_size=1))
        assert engine.placement.dp == 1 and world.check()[0] == 1
        world.close()
        assert engine.model is None and not dist.is_initialized()  # the engine went first
        counts.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
    assert counts[3] == counts[2] == counts[1], counts


# --------------------------------------------------------------------- MPI worlds

def run_world(scenario: str, out: Path, *args: str, timeout: float) -> dict:
    """``mpiexec -n 13`` tests/role_world.py; its result.json."""
    mpi_worlds.run_world("role_world.py", 13, scenario, out, *args, timeout=timeout, what=f"the {scenario} world")
    return json.loads((out / "result.json").read_text())


@pytest.mark.mpi
def test_ranks_waiting_for_a_command_do_not_spin(tmp_path):
    """12 workers on this machine's cores wait for their next command: each uses under 5%
    of a core. The control: the same ranks waiting in MPICH's bcast (what the control plane
    used before) are measured busy by the same measure."""
    result = run_world("idle", tmp_path, timeout=300)
    assert result["world_size"] == 13 and result["checks_ok"] and result["training_torch"] == [1]
    waiting, spinning = result["waiting"], result["bcast"]
    assert len(waiting) == 12
    assert max(waiting.values()) < IDLE_LIMIT, waiting
    # 12 spinners share the cores: each gets cores/12 at most, still far above the limit
    assert sum(spinning.values()) / len(spinning) > IDLE_LIMIT, (spinning, result["cores"])


@pytest.mark.mpi
def test_training_relayout_rebuilds_only_the_training_world_beside_a_live_vllm_engine(tiny, tmp_path):
    result = run_world("engines", tmp_path, str(tiny), timeout=900)
    before, after, leader = result["before"], result["after"], result["leader"]
    # the default layout: one training rank, then the hybrid node's two ranks join it
    assert [t["rank"] for t in before["train"]] == [1] and [t["rank"] for t in after["train"]] == [1, 11, 12]
    assert [(t["dp"], t["torch_world"]) for t in before["train"]] == [(1, 1)]
    assert [(t["dp"], t["torch_world"], t["torch_rank"]) for t in after["train"]] == [(3, 3, 0), (3, 3, 1), (3, 3, 2)]
    assert after["train"][0]["trainings_started"] == 2  # rank 1's world was torn down and started again
    # the same global batch from the same weights: DP=3 computes the DP=1 step
    (first,) = before["train"]
    assert first["loss"] != 0 and first["tokens"] > 0
    for step in after["train"]:
        assert step["tokens"] == first["tokens"]
        assert step["loss"] == pytest.approx(first["loss"], rel=1e-5, abs=1e-7)
        assert step["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4)
    # the rollout leader kept its engine (the same object, started once) and its group
    gen0, gen1 = before["generate"], after["generate"]
    assert gen0["rank"] == gen1["rank"] == leader
    assert gen1["engine"] == gen0["engine"] and gen1["engines_started"] == 1
    assert gen1["formed_at"] == gen0["formed_at"] == 0
    assert gen1["tokens"] == gen0["tokens"] and all(len(t) == 8 for t in gen0["tokens"])  # greedy, same weights
    assert gen0["vllm_torch_world"] == 1  # vLLM's own world, not the training ranks'
    # communicators: only the training group was formed again
    formed = {c["rank"]: (c["group"], c["formed_at"]) for c in after["checks"]}
    assert {r for r, (_, v) in formed.items() if v == 1} == {1, 11, 12}
    assert all(c["mpi_sum"] == c["size"] for c in before["checks"] + after["checks"])
    assert [c.get("torch_sum") for c in after["checks"] if c["role"] == "training"] == [3, 3, 3]
    assert all("torch_sum" not in c for c in after["checks"] if c["role"] == "rollout")
    # rollout ranks start no torch world and, but for the vLLM leader, never import torch
    imported = {s["rank"]: s["torch_imported"] for s in result["torch_state"]}
    assert {r for r, yes in imported.items() if yes} == {1, leader, 11, 12}
