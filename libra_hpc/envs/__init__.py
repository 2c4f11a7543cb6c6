"""Agentic tasks: multi-turn environments with tools and verifiers.

- The synthetic agentic workload (:mod:`libra_hpc.envs.synthetic`) that the simulator, the
  scheduler's routing benchmark and the tool scheduler's replay share.
- Real tasks (docs/tasks.md): :class:`ArithmeticTask` (word problems, calculator/Python
  tools in the sandbox) and :class:`SearchTask` (QA over a generated document collection),
  a user's :class:`JsonlTask` through ``rl.task: package.module:Factory``; the Qwen
  tool-call format (:mod:`~libra_hpc.envs.toolcall`), the episode step
  (:class:`Episode`) and scripted noisy solvers (:mod:`~libra_hpc.envs.solvers`).

Nothing here imports the tools package, MPI or torch: tool calls go to an injected
executor (the :class:`~libra_hpc.tools.ToolOrchestrator`).
"""

from libra_hpc.envs.arithmetic import ArithmeticTask
from libra_hpc.envs.plugin import PYTHON_TOOL, JsonlTask
from libra_hpc.envs.registry import TASKS, make_task, task_from_config
from libra_hpc.envs.search import SearchRunner, SearchTask
from libra_hpc.envs.synthetic import (
    CHARS_PER_TOKEN,
    DriftSpec,
    LogNormal,
    SyntheticWorkload,
    ToolCall,
    ToolSpec,
    Trajectory,
    WorkloadSpec,
    drift,
    summary,
)
from libra_hpc.envs.task import Episode, Prompt, SplitLeak, Splits, StepResult, Task, ToolReturn, text_hash
from libra_hpc.envs.toolcall import CallError, ParsedCall, ToolDef, parse_tool_calls

__all__ = ["CHARS_PER_TOKEN", "PYTHON_TOOL", "TASKS", "ArithmeticTask", "CallError", "DriftSpec", "Episode",
           "JsonlTask", "LogNormal", "ParsedCall", "Prompt", "SearchRunner", "SearchTask", "SplitLeak", "Splits",
           "StepResult", "SyntheticWorkload", "Task", "ToolCall", "ToolDef", "ToolReturn", "ToolSpec", "Trajectory",
           "WorkloadSpec", "drift", "make_task", "parse_tool_calls", "summary", "task_from_config", "text_hash"]
