"""Simulator set-ups shared by tests: a hybrid pool that training's bottleneck borrows."""

from __future__ import annotations

from libra_hpc.cluster.layout import Slot
from libra_hpc.planner.costs import TrainShape
from libra_hpc.planner.search import Plan, RolloutInstance
from libra_hpc.sim.config import validate_sim_config
from libra_hpc.sim.context import Context
from libra_hpc.sim.instance import ConstantStepModel
from libra_hpc.sim.trace import write_trace
from libra_hpc.envs.synthetic import Trajectory


def hybrid_case(folder, steps: int = 14) -> tuple[Context, Plan]:
    """Node 0 trains (TP8), nodes 1-2 roll out (one TP8 instance each, 10 ms per decode
    step), node 2 is the hybrid pool; four 100-token trajectories per step (a trace in
    ``folder``). Returns the context and the pinned plan."""
    trajectories = [Trajectory(f"s{s}/p{i}/0", f"p{i}", s, 0, 10, (100,), ()) for s in range(steps) for i in range(4)]
    write_trace(folder / "trace.jsonl", trajectories)
    cfg = validate_sim_config({
        "name": "hybrid", "trace": str(folder / "trace.jsonl"),
        "cluster": {"nodes": 3, "gpus_per_node": 8, "hardware": "a800-80g"},
        "model": {"name": "qwen3-14b"}, "training": {"seq_len": 4096},
        "rl": {"steps": steps, "prompts_per_step": 4, "group_size": 1, "max_staleness": 1},
        "costs": {"weight_sync_s": 0.0, "hybrid_fetch_s": 0.2},
        "scheduler": {"bucket_token_limits": {8: 1 << 30}, "bucket_limits": "fixed"},
        "planner": {"hybrid_nodes": 1, "min_rollout_gpus": 8}})
    ctx = Context(cfg)
    ctx.step_models = {8: ConstantStepModel(0.01)}
    node = lambda n: tuple(Slot(n, g) for g in range(8))
    shape = TrainShape(8, 1, 1, 1, 4, 128)
    plan = Plan(shape, node(0), (RolloutInstance(8, node(1)), RolloutInstance(8, node(2))), 3.0, 1.0, 3.0, "async")
    return ctx, plan
