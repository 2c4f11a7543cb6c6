"""Tool replay's trace is a view of the shared synthetic workload's trajectories."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.envs.synthetic import SyntheticWorkload
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context
from libra_hpc.tools.replay import TraceShape, make_trace, trace_of

SWE = Path(__file__).resolve().parents[1] / "configs" / "sim" / "a800-swe.yaml"


def test_the_trace_is_the_simulators_trajectories_on_a_clock():
    cfg = load_sim_config(SWE, {"rl.prompts_per_step": 3, "rl.group_size": 2})
    simulated = [t for step in (0, 1) for t in Context(cfg).batch(step)]
    shape = TraceShape(waves=2, wave_gap_s=100.0, decode_tokens_per_s=50.0, reward_s=2.0)
    trace = make_trace(SyntheticWorkload(cfg.workload, cfg.rl, cfg.rl.seed, cfg.training.seq_len), shape)
    assert [t.tid for t in trace] == [t.tid for t in simulated] and len(trace) == 12
    for tt, t in zip(trace, simulated):
        assert tt.start_s == 100.0 * t.step
        *tools, reward = tt.calls
        assert [(c.tool, c.resource, c.duration_s) for c in tools] == [(c.tool, "cpu", c.latency_s) for c in t.calls]
        assert [c.gap_s for c in tt.calls] == [tokens / 50.0 for tokens in t.turns]  # the turn before each call
        assert (reward.tool, reward.resource, reward.duration_s, tt.tail_s) == ("reward", "reward", 2.0, 0.0)


def test_hangs_cost_the_tools_time_limit_and_no_reward_call_leaves_the_last_turn_as_tail():
    cfg = load_sim_config(SWE, {"rl.prompts_per_step": 40})
    batch = Context(cfg).batch(0)
    trace = trace_of(batch, TraceShape(reward_s=0.0))
    limit = {t.name: t.timeout_s for t in cfg.workload.tools}
    hangs = [(c, tc) for t, tt in zip(batch, trace) for c, tc in zip(t.calls, tt.calls) if c.status == "timeout"]
    assert hangs and all(tc.duration_s == limit[c.tool] for c, tc in hangs)
    assert all(len(tt.calls) == len(t.calls) and tt.tail_s == t.turns[-1] / 40.0 for t, tt in zip(batch, trace))


def test_a_bad_shape_names_the_field():
    with pytest.raises(ValueError, match="TraceShape.decode_tokens_per_s"):
        TraceShape(decode_tokens_per_s=0)
    with pytest.raises(ValueError, match="TraceShape.reward_s"):
        TraceShape(reward_s=-1)
