"""The context-length-aware TP selector (pure): larger TP as contexts grow, smaller as
they shrink, no flapping at the edge, an immediate move when the current size cannot fit."""

import math

import pytest

from libra_hpc.parallel.selector import TpSelector, TpTable, choose_by_cost, context_percentile


def test_the_table_picks_a_larger_tp_as_contexts_grow_and_a_smaller_one_as_they_shrink():
    table = TpTable.from_mapping({0: 1, 8192: 2, 32768: 4})
    assert table.choose(1000, None, 0.1).tp == 1
    assert table.choose(9000, 1, 0.1).tp == 2
    assert table.choose(40000, 2, 0.1).tp == 4
    assert table.choose(31000, 4, 0.1).tp == 4  # within 10% of the 32768 threshold: stays
    assert table.choose(20000, 4, 0.1).tp == 2
    assert table.choose(2000, 2, 0.1).tp == 1
    assert "the table says TP2 from 8192" in table.choose(9000, 1, 0.1).reason


@pytest.mark.parametrize("rows, match", [({8: 1}, "start at context 0"), ({0: 2, 100: 1}, "do not shrink"),
                                          ({0: 0}, ">= 1")])
def test_a_table_that_makes_no_sense_is_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        TpTable.from_mapping(rows)


def test_by_cost_the_fastest_fitting_size_wins_and_the_current_one_keeps_its_place_within_hysteresis():
    # short contexts: TP1 fastest; long: TP1 does not fit (inf) and TP2 must be taken
    assert choose_by_cost({1: 10.0, 2: 12.0, 4: 15.0}, None, 0.1).tp == 1
    grown = choose_by_cost({1: math.inf, 2: 30.0, 4: 28.0}, 1, 0.1)
    assert grown.tp == 4 and "TP1 does not fit" in grown.reason
    assert choose_by_cost({1: 10.0, 2: 9.5}, 1, 0.1).tp == 1  # 5% better: not worth a re-shard
    assert choose_by_cost({1: 10.0, 2: 8.0}, 1, 0.1).tp == 2
    nothing = choose_by_cost({1: math.inf, 2: math.inf}, 1, 0.1)
    assert not nothing.fits and nothing.tp == 2
    with pytest.raises(ValueError, match="no candidate"):
        choose_by_cost({}, 1, 0.1)


def test_the_selector_waits_for_agreeing_checks_unless_it_must_move():
    table = TpTable.from_mapping({0: 1, 1000: 2})
    sel = TpSelector(current=1, confirm=2)
    assert sel.consider(table.choose(1500, sel.current, 0.1)) is None  # one check is not enough
    assert sel.consider(table.choose(500, sel.current, 0.1)) is None  # and it came back: the streak restarts
    assert sel.consider(table.choose(1500, sel.current, 0.1)) is None
    change = sel.consider(table.choose(1600, sel.current, 0.1))
    assert change is not None and change.tp == 2
    sel.applied(2)
    assert sel.consider(table.choose(1600, sel.current, 0.1)) is None
    # does not fit: at once
    assert sel.consider(choose_by_cost({2: math.inf, 4: 1.0}, 2, 0.1), must=True).tp == 4


def test_context_percentile():
    assert context_percentile([]) == 0.0
    assert context_percentile(list(range(1, 11))) == 9.0
    assert context_percentile([5.0]) == 5.0
