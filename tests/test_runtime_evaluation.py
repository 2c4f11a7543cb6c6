"""What summary.json says of the held-out evaluations and of the GPUs (issue 32, item 4):
answers split by whether they called a tool, the evaluations' tool calls apart from the
training rollouts', GPU-seconds per role as an admin accounts for them. Pure: no MPI."""

from __future__ import annotations

from types import SimpleNamespace

from libra_hpc.runtime.evaluation import HeldOut, tool_use
from libra_hpc.runtime.records import gpu_seconds_by_role


class _Log:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))


def _heldout(prompts: int = 10) -> tuple[HeldOut, dict]:
    summary = {}
    cfg = SimpleNamespace(job=SimpleNamespace(eval_prompts=prompts))
    task = SimpleNamespace(splits=SimpleNamespace(heldout=list(range(prompts)), entity_overlap=lambda: 0))
    return HeldOut(cfg, task, _Log(), summary), summary


def test_answers_are_split_by_tool_use_per_phase_and_the_evaluations_calls_are_counted():
    held, summary = _heldout(5)
    sends = held.start("warmstart", {0: 1, 1: 2})
    assert [m["indices"] for _, m in sends] == [[0, 2, 4], [1, 3]]
    held.got({"phase": "warmstart", "rewards": [1.0, 0.0, 1.0], "tool_calls": [2, 0, 0], "wall_s": 1.0})
    assert held.got({"phase": "warmstart", "rewards": [0.0, 0.0], "tool_calls": [1, 0], "wall_s": 2.0})
    held.result("warmstart", version=0)
    assert summary["eval_success_warmstart"] == 0.4 and summary["eval_prompts"] == 5
    assert summary["heldout_entity_overlap"] == 0  # the split's own recount
    assert (summary["success_tool_warmstart"], summary["success_no_tool_warmstart"], summary["tool_share_warmstart"]) \
        == (0.5, 0.3333, 0.4)
    held.start("final", {0: 1})
    held.got({"phase": "final", "rewards": [1.0] * 5, "tool_calls": [1] * 5, "wall_s": 1.0})
    held.result("final", version=3)
    assert summary["success_tool_rl"] == 1.0 and summary["success_no_tool_rl"] is None and summary["tool_share_rl"] == 1.0
    assert summary["eval_tool_calls"] == 3 + 5  # both evaluations' calls, none of the training rollouts'


def test_no_tool_split_without_the_calls_or_the_answers():
    assert tool_use([1.0, 0.0], [None, None], "rl") == {}  # a leader that did not report them
    assert tool_use([], [], "rl") == {}


def test_gpu_seconds_per_role_and_the_rest_of_the_allocation_idle():
    rows = [{"step_s": 10.0, "gpus": {"training": 4, "rollout": 2, "hybrid_rollout": 2}},
            {"step_s": 20.0, "gpus": {"training": 4, "rollout": 2, "hybrid_training": 2}},
            {"step_s": 5.0}]  # a row from before the GPUs were recorded
    assert gpu_seconds_by_role(rows, total_gpus=8, wall_s=100.0) == {
        "training": 120.0, "rollout": 60.0, "hybrid": 60.0, "idle": 560.0}
    assert gpu_seconds_by_role(rows, total_gpus=8, wall_s=10.0)["idle"] == 0.0  # a resumed run's earlier steps
