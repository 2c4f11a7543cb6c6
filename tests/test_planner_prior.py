"""The planner's assumed length distribution before anything is observed."""

from __future__ import annotations

import pytest

from libra_hpc.planner.prior import prior_lengths


def _prior(**kw):
    args = dict(prompt_tokens=1000, gen_tokens_median=2000, tail_shape=1.2, turns=4, tool_s_per_turn=2.0,
                seq_len=40_000, batch_size=256, seed=0, samples=4000)
    return prior_lengths(**{**args, **kw})


def test_median_tail_and_cap():
    profile = _prior()
    longest = profile.max_seq_tokens - 1000
    assert longest == 39_000  # the heaviest draws are capped at seq_len - prompt
    # A Pareto tail: the longest bucket is far beyond the mean generated length.
    mean_gen = profile.mean_seq_tokens - 1000
    assert 2000 < mean_gen < 8000 and longest > 5 * mean_gen
    assert all(t == pytest.approx(8.0) for t in profile.tool_s)  # 4 turns × 2 s


def test_deterministic_from_the_seed_and_heavier_with_a_smaller_shape():
    assert _prior() == _prior()
    assert _prior(tail_shape=0.9).mean_seq_tokens > _prior(tail_shape=3.0).mean_seq_tokens


def test_nonsense_is_refused():
    with pytest.raises(ValueError, match="tail_shape"):
        _prior(tail_shape=0)
