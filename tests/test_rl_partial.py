"""Tail-decoupled rollout's start rule (libra_hpc/rl/partial.py): the first finished
trajectories train, the staleness bound holds, waste stays in its budget, nothing is
regenerated twice."""

from __future__ import annotations

import pytest

from libra_hpc.rl.partial import TailDecoupler, p90


def _run(d: TailDecoupler, keys, version, tokens=100, now=0.0):
    for key in keys:
        d.started(key, version)
    d.generated(tokens * len(keys))
    for key in keys:
        d.finish(key, tokens, now)


def test_a_step_waits_for_a_full_batch_then_takes_the_oldest_first():
    d = TailDecoupler(batch_size=3, max_staleness=1)
    _run(d, ["a", "b"], version=0)
    assert d.decide(0, lambda k: 0) is None  # two finished, three needed
    _run(d, ["c"], version=1)
    d.started("late", 0)
    _run(d, ["d"], version=0, now=5.0)
    dec = d.decide(1, lambda k: 10)
    # "late" (version 0) expires after step 1: regenerated, its 10 tokens within 5% of 400
    assert dec.train == ("a", "b", "d") and dec.regenerate == ("late",) and dec.max_lag == 1
    assert list(d.finished) == ["c"]


def test_an_expiring_trajectory_is_waited_for_beyond_the_waste_budget():
    d = TailDecoupler(batch_size=2, max_staleness=0, waste_budget=0.05)
    d.started("long", 0)
    _run(d, ["a", "b"], version=0)  # 200 tokens generated
    assert d.decide(0, lambda k: 50) is None  # 50 > 5% of 200: wait
    assert d.stats.waits == 1
    dec = d.decide(0, lambda k: 5)  # 5 <= 10: go, regenerate it
    assert dec.regenerate == ("long",)
    d.aborted("long", 5)
    assert d.stats.wasted_tokens == 5 and d.stats.regenerated == 1
    d.started("long", 1)  # restarted under version 1; it may not be traded away again
    _run(d, ["c", "e"], version=1)
    assert d.decide(1, lambda k: 0) is None
    d.finish("long", 400, 9.0)
    assert d.decide(1, lambda k: 0).train == ("c", "e")


def test_no_trained_trajectory_is_older_than_the_bound():
    d = TailDecoupler(batch_size=2, max_staleness=1)
    _run(d, ["old1", "old2", "old3"], version=0)
    _run(d, ["new1", "new2"], version=2)
    dec = d.decide(2, lambda k: 0)  # versions 0 are too old for step 2
    assert dec.train == ("new1", "new2") and dec.max_lag == 0
    assert sorted(dec.resubmit) == ["old1", "old2", "old3"]
    assert d.stats.wasted_tokens == 300 and not d.finished


def test_a_trajectory_cannot_start_twice_and_bad_arguments_are_named():
    d = TailDecoupler(batch_size=1, max_staleness=0)
    d.started("a", 0)
    with pytest.raises(ValueError, match="started twice"):
        d.started("a", 0)
    with pytest.raises(ValueError, match="waste_budget"):
        TailDecoupler(batch_size=1, max_staleness=0, waste_budget=1.5)


def test_p90():
    assert p90([]) == 0.0 and p90(list(range(1, 11))) == 9.0
