"""Topology discovery from what every rank reports (ProcessEnv), without MPI."""
from __future__ import annotations

import socket

import pytest

from libra_hpc.cluster.env import ProcessEnv
from libra_hpc.cluster.layout import Slot
from libra_hpc.cluster.topology import TopologyError, discover


def emulated_envs(nodes: int, gpus: int, **kw) -> list[ProcessEnv]:
    """mpiexec on one host, outside Slurm."""
    return [ProcessEnv(hostname="laptop", **kw) for _ in range(nodes * gpus + 1)]


def slurm_envs(nodes: int, gpus: int, visible: str | None = None) -> list[ProcessEnv]:
    """srun --nodes=N --ntasks=N·G+1 (block distribution): node 0 runs the controller and
    G workers (SLURM_LOCALID 0..G), every other node G workers (LOCALID 0..G-1)."""
    envs = []
    for node in range(nodes):
        for local in range(gpus + 1 if node == 0 else gpus):
            env = {"SLURM_JOB_ID": "77", "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local)}
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            envs.append(_with_host(ProcessEnv.read(env), f"gpu-node{node:02d}"))
    return envs


def _with_host(env: ProcessEnv, host: str) -> ProcessEnv:
    return ProcessEnv(**{**env.__dict__, "hostname": host})


# ------------------------------------------------------------------ ProcessEnv.read


def test_read_parses_slurm_and_cuda_variables():
    env = ProcessEnv.read({
        "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "libra-a800", "SLURM_NODEID": "3",
        "SLURM_LOCALID": "7", "CUDA_VISIBLE_DEVICES": "4,5", "SLURM_STEP_GPUS": "4,5",
        "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_SUBMIT_DIR": "/home/me/libra",
    })
    assert env.hostname == socket.gethostname()
    assert (env.job_id, env.job_name, env.node_id, env.local_id) == ("1234", "libra-a800", 3, 7)
    assert env.visible_gpus == ("4", "5")
    assert env.step_gpus == ("4", "5")  # the step's GPUs win over the job's
    assert env.under_slurm


def test_read_outside_slurm():
    env = ProcessEnv.read({"PATH": "/usr/bin"})
    assert (env.job_id, env.job_name, env.node_id, env.local_id) == (None, None, None, None)
    assert env.visible_gpus is None and env.step_gpus is None
    assert not env.under_slurm


def test_read_edge_values():
    env = ProcessEnv.read({"SLURM_NODEID": "", "CUDA_VISIBLE_DEVICES": "", "SLURM_JOB_GPUS": "2,3"})
    assert env.node_id is None
    assert env.visible_gpus == ()  # set but empty: GPUs hidden, not "all visible"
    assert env.step_gpus == ("2", "3")  # falls back to SLURM_JOB_GPUS


# -------------------------------------------------------------------- emulated nodes


def test_a_rank_waits_passively_in_openmp_unless_the_user_chose():
    from libra_hpc.cluster.env import set_rank_defaults

    env = {"SLURM_JOB_ID": "7"}
    assert set_rank_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"} and env["OMP_WAIT_POLICY"] == "PASSIVE"
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_rank_defaults(mine) == {} and mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_rank_entry_sets_the_defaults_before_anything_loads_torch():
    """libgomp reads its wait policy once, when torch loads it: the rank entry's imports
    must not load torch before :func:`set_rank_defaults` runs."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import libra_hpc.run; "
             "print('torch' in sys.modules, os.environ['OMP_WAIT_POLICY'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["False", "PASSIVE"]


def test_emulated_nodes_on_one_host():
    topo = discover(emulated_envs(3, 2), nodes=3, gpus_per_node=2, cuda=False)
    assert topo.emulated
    assert topo.world_size == 7
    assert [p.rank for p in topo.places] == list(range(1, 7))
    assert [p.slot for p in topo.places] == [Slot(n, g) for n in range(3) for g in range(2)]
    assert all(p.device_index is None and p.physical_gpu is None for p in topo.places)
    assert topo.rank_of(Slot(1, 1)) == 4
    assert topo.place_of(5).slot == Slot(2, 0)
    assert topo.describe()["emulated_nodes"] is True
    with pytest.raises(KeyError):
        topo.rank_of(Slot(3, 0))


def test_single_node_on_one_host_is_not_emulated():
    topo = discover(emulated_envs(1, 4), nodes=1, gpus_per_node=4, cuda=False)
    assert not topo.emulated
    assert [p.slot for p in topo.places] == [Slot(0, g) for g in range(4)]


# ------------------------------------------------------------------- real Slurm


@pytest.mark.parametrize("nodes, gpus", [(2, 2), (6, 8), (4, 1)])
def test_slurm_block_distribution(nodes, gpus):
    envs = slurm_envs(nodes, gpus)
    topo = discover(envs, nodes, gpus, cuda=False)
    assert not topo.emulated
    assert len(topo.places) == nodes * gpus
    for place in topo.places:
        env = envs[place.rank]
        assert place.slot.node == env.node_id
        assert place.host == env.hostname
        # on node 0 LOCALID 0 is the controller, so worker LOCALIDs are shifted by one
        assert place.slot.gpu == env.local_id - (1 if env.node_id == 0 else 0)
    assert sorted(p.slot for p in topo.places) == [Slot(n, g) for n in range(nodes) for g in range(gpus)]


def test_slurm_cyclic_distribution():
    # rank r on node r % N: the controller and rank 2 on node 0, ranks 1 and 3 on node 1
    envs = [_with_host(ProcessEnv.read({"SLURM_JOB_ID": "1", "SLURM_NODEID": str(r % 2)}), f"h{r % 2}")
            for r in range(5)]
    topo = discover(envs, nodes=2, gpus_per_node=2, cuda=False)
    assert {p.rank: p.slot for p in topo.places} == {
        1: Slot(1, 0), 2: Slot(0, 0), 3: Slot(1, 1), 4: Slot(0, 1)}


# ----------------------------------------------------------------------- devices


def test_cuda_one_visible_gpu_per_task():
    envs = slurm_envs(2, 2)
    bound = ["7", "0", "1", "2", "3"]  # what Slurm bound to each rank (controller: 7)
    envs = [ProcessEnv(**{**e.__dict__, "visible_gpus": (gpu,)}) for e, gpu in zip(envs, bound)]
    topo = discover(envs, 2, 2, cuda=True)
    for place in topo.places:
        assert place.device_index == 0
        assert place.physical_gpu == bound[place.rank]


def test_cuda_several_visible_gpus():
    topo = discover(slurm_envs(2, 4, visible="4,5,6,7"), 2, 4, cuda=True)
    for place in topo.places:
        assert place.device_index == place.slot.gpu
        assert place.physical_gpu == str(4 + place.slot.gpu)


def test_cuda_without_visible_devices_uses_step_gpus_then_slot():
    envs = [ProcessEnv("h", job_id="1", node_id=0, step_gpus=("2", "3")) for _ in range(3)]
    topo = discover(envs, 1, 2, cuda=True)
    assert [(p.device_index, p.physical_gpu) for p in topo.places] == [(0, "2"), (1, "3")]
    topo = discover([ProcessEnv("h", job_id="1", node_id=0) for _ in range(3)], 1, 2, cuda=True)
    assert [(p.device_index, p.physical_gpu) for p in topo.places] == [(0, "0"), (1, "1")]


def test_cpu_records_slurm_binding_but_opens_nothing():
    topo = discover(slurm_envs(2, 2, visible="0,1"), 2, 2, cuda=False)
    for place in topo.places:
        assert place.device_index is None
        assert place.physical_gpu == str(place.slot.gpu)


def test_cpu_with_hidden_gpus():
    topo = discover(slurm_envs(2, 2, visible=""), 2, 2, cuda=False)
    assert all(p.device_index is None and p.physical_gpu is None for p in topo.places)


# ------------------------------------------------------------------------ errors


def test_wrong_world_size():
    with pytest.raises(TopologyError, match=r"has 6 ranks but 2 nodes × 2 GPUs \+ 1 controller = 5"):
        discover(emulated_envs(1, 5), nodes=2, gpus_per_node=2, cuda=False)


def test_node_with_wrong_number_of_workers():
    envs = slurm_envs(2, 2)
    # move rank 3 (node 1) onto node 0: node 0 has 3 workers, node 1 one
    envs[3] = envs[1]
    with pytest.raises(TopologyError, match=r"node 0 \(gpu-node00\) has 3 worker ranks \[1, 2, 3\], cluster.gpus_per_node is 2"):
        discover(envs, 2, 2, cuda=False)


def test_more_nodes_than_configured():
    envs = [ProcessEnv(hostname=f"host{r % 3}") for r in range(5)]
    with pytest.raises(TopologyError, match=r"ranks run on 3 distinct nodes .* the config asks for 2"):
        discover(envs, nodes=2, gpus_per_node=2, cuda=False)


def test_fewer_nodes_than_configured_under_slurm():
    envs = [ProcessEnv("h", job_id="1", node_id=0) for _ in range(5)]  # a one-node allocation
    with pytest.raises(TopologyError, match=r"1 distinct nodes"):
        discover(envs, nodes=2, gpus_per_node=2, cuda=False)


def test_slot_beyond_visible_gpus():
    with pytest.raises(TopologyError, match=r"GPU slot 2 but .* shows only 0,1"):
        discover(slurm_envs(1, 4, visible="0,1"), 1, 4, cuda=True)
