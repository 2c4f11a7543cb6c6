"""A user's task loaded from outside the package (``rl.task: package.module:Factory``)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from libra_hpc.config import ConfigError, validate_config
from libra_hpc.envs import JsonlTask, task_from_config
from libra_hpc.envs.plugin import read_prompts
from libra_hpc.envs.toolcall import format_call
from libra_hpc.tools.isolation import SandboxLimits
from libra_hpc.tools.orchestrator import SandboxRunner, ToolOrchestrator
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.scheduling import make_scheduler

UID_BASE = 254000 + os.getpid() % 200 * 4  # apart per process (another checkout's run)

PLUGIN = textwrap.dedent('''
    """My task: squares of numbers, with a python tool (the docs/tasks.md example)."""
    from libra_hpc.envs import PYTHON_TOOL, JsonlTask


    def verify(prompt, answer):
        return float(answer is not None and answer.strip() == prompt.answer)


    def make_task(prompts, heldout_fraction=0.25):
        return JsonlTask(prompts, verify, tools=[PYTHON_TOOL], name="squares", heldout_fraction=heldout_fraction)
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    folder = tmp_path / "userland"
    (folder / "mytasks").mkdir(parents=True)
    (folder / "mytasks" / "__init__.py").write_text("")
    (folder / "mytasks" / "squares.py").write_text(PLUGIN)
    rows = [{"prompt": f"What is {n} squared?", "answer": str(n * n)} for n in range(100, 140)]
    rows.append({"prompt": "What is 7 squared?", "answer": "49", "split": "heldout", "id": "seven"})
    rows.append({"prompt": "what is 100   squared?", "answer": "10000"})  # the same text: kept once
    prompts = tmp_path / "squares.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.syspath_prepend(str(folder))
    yield prompts
    for name in ("mytasks.squares", "mytasks"):
        sys.modules.pop(name, None)


def test_a_task_from_outside_the_package_runs_an_episode(plugin):
    cfg = validate_config({"rl": {"task": "mytasks.squares:make_task"}, "tasks": {"plugin": {"prompts": str(plugin)}}})
    task = task_from_config(cfg)
    assert isinstance(task, JsonlTask) and task.name == "squares"
    splits = task.splits
    assert len(splits.train) + len(splits.heldout) == 41 and splits.heldout  # the duplicate dropped
    assert "seven" in {p.pid for p in splits.heldout}
    assert not {p.hash for p in splits.train} & splits.heldout_hashes()
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("cpu", 1)]),
                            {"cpu": SandboxRunner(SandboxLimits(wall_time_s=5.0), uid_base=UID_BASE)})
    try:
        prompt = splits.train[0]
        n = int(prompt.text.split()[2])
        ep = task.episode(prompt, "u-1")
        assert '"name": "python"' in ep.prompt_text
        res = ep.step("Let me compute.\n" + format_call("python", {"code": f"print({n} ** 2)"}), orch)
        assert res.returns[0].status == "success" and res.returns[0].output == str(n * n)
        bad = ep.step(format_call("python", {"source": "print(1)"}), orch)
        assert "missing argument(s) code" in bad.observation
        end = ep.step(f"The square is <answer>{res.returns[0].output}</answer>", orch)
        assert end.done and end.reward == 1.0
    finally:
        orch.close()


def test_plugin_errors_name_what_is_wrong(tmp_path, plugin):
    with pytest.raises(ConfigError, match="rl.task"):
        validate_config({"rl": {"task": "not a spec"}})
    with pytest.raises(ImportError, match="cannot import 'nowhere_xyz'"):
        task_from_config(validate_config({"rl": {"task": "nowhere_xyz:make"}}))
    with pytest.raises(AttributeError, match="no callable 'missing'"):
        task_from_config(validate_config({"rl": {"task": "mytasks.squares:missing"}}))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "no answer"}\n')
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        read_prompts(broken, 0.1)
