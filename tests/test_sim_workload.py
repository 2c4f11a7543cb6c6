"""The synthetic workload has the properties the issue asks for, from its seed alone."""

from __future__ import annotations

import statistics
from pathlib import Path

from libra_hpc.sim.config import load_sim_config
from libra_hpc.envs.synthetic import SyntheticWorkload, drift, summary

ROOT = Path(__file__).resolve().parents[1]


def workload(seed=0, **overrides):
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml", overrides)
    return cfg, SyntheticWorkload(cfg.workload, cfg.rl, seed, cfg.training.seq_len)


def test_long_tail_p99_about_ten_times_the_median():
    _, w = workload()
    s = summary([t for step in (0, 50, 99) for t in w.batch(step)])
    assert 6 <= s["p99_over_median"] <= 16, s


def test_grpo_groups_share_a_prompt_and_batches_depend_only_on_seed_and_step():
    cfg, w = workload()
    batch = w.batch(7)
    groups = {}
    for t in batch:
        groups.setdefault(t.prompt_id, []).append(t.sample)
    assert len(groups) == cfg.rl.prompts_per_step
    assert all(sorted(v) == list(range(cfg.rl.group_size)) for v in groups.values())
    assert workload()[1].batch(7) == batch  # same seed: same batch, whatever was generated before
    assert workload(seed=1)[1].batch(7) != batch


def test_failures_lengthen_what_follows():
    _, w = workload()
    after = {"failure": [], "success": []}
    for t in (t for step in range(0, 100, 10) for t in w.batch(step)):
        for call, nxt in zip(t.calls, t.turns[1:]):
            if call.status in after:
                after[call.status].append(nxt)
        # a bug-sensitive failure is followed by more calls more often than a success
    assert statistics.median(after["failure"]) > 2 * statistics.median(after["success"])


def test_drift_rises_to_the_peak_then_declines():
    cfg, w = workload()
    d = cfg.workload.drift
    assert drift(0, 100, d) == 1.0
    assert drift(d.peak_step, 100, d) == 1.0 + d.growth
    assert drift(99, 100, d) == 1.0 + d.growth * (1 - d.decline)
    early = statistics.fmean(t.gen_tokens for s in range(5) for t in w.batch(s))
    peak = statistics.fmean(t.gen_tokens for s in range(d.peak_step - 2, d.peak_step + 3) for t in w.batch(s))
    assert peak > 1.3 * early


def test_context_never_exceeds_seq_len():
    _, w = workload(**{"training.seq_len": 4096})
    assert max(t.total_tokens for s in (0, 60) for t in w.batch(s)) <= 4096
