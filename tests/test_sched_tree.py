"""Causal prefix tree: windowed statistics, deepest-trusted lookup, per-prompt vs global,
rebuild from the retained window, JSON round trip and malformed files."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_hpc.scheduler.tree import (
    CausalIndex,
    CausalTree,
    CausalTreeFormatError,
    NodeStats,
)
from libra_hpc.scheduler.types import FinishedTrajectory, ToolState

OK = ToolState("python", "S", "success")
FAIL = ToolState("python", "L", "failure")
HANG = ToolState("bash", "S", "timeout")


def brute(window: list[int]) -> tuple[float, int]:
    ordered = sorted(window)
    return sum(window) / len(window), ordered[math.ceil(0.9 * len(window)) - 1]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 50), min_size=1, max_size=60))
def test_node_stats_match_brute_force_over_the_window(window, values):
    stats = NodeStats(window)
    for i, value in enumerate(values):
        stats.add(value)
        expected = values[max(0, i + 1 - window): i + 1]
        assert stats.samples == tuple(expected)
        assert stats.count == i + 1
        assert stats.n == len(expected) <= window
        mean, p90 = brute(expected)
        assert stats.mean == pytest.approx(mean)
        assert stats.p90 == p90
        assert list(stats._sorted) == sorted(expected) and stats._sum == sum(expected)


def test_window_bound_is_respected_after_many_samples():
    stats = NodeStats(8)
    for value in range(1000):
        stats.add(value)
    assert stats.n == 8 and len(stats._sorted) == 8 and stats.count == 1000
    assert stats.samples == tuple(range(992, 1000))
    assert stats.p90 == 999 and stats.mean == pytest.approx(995.5)


def test_empty_stats_are_zero():
    assert (NodeStats(4).mean, NodeStats(4).p90, NodeStats(4).n) == (0.0, 0, 0)


def test_observe_puts_remaining_after_d_at_depth_d():
    tree = CausalTree(window=4)
    tree.observe((FAIL, OK), (900, 600, 100))
    assert tree.root.stats.samples == (900,)
    assert tree.root.children[FAIL.key()].stats.samples == (600,)
    assert tree.root.children[FAIL.key()].children[OK.key()].stats.samples == (100,)


def test_observe_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="expected 3"):
        CausalTree(4).observe((FAIL, OK), (900, 600))


def test_lookup_returns_the_deepest_trusted_node_on_the_path():
    tree = CausalTree(window=8)
    for _ in range(3):
        tree.observe((FAIL, OK), (900, 600, 100))
    tree.observe((FAIL, HANG), (800, 500, 50))
    assert tree.lookup((FAIL, OK), min_samples=3).samples == (100,) * 3
    assert tree.lookup((FAIL, HANG), min_samples=3).samples == (600, 600, 600, 500)  # HANG child untrusted
    assert tree.lookup((OK,), min_samples=3).n == 4  # no such child: the root
    assert tree.lookup((FAIL, OK, OK, FAIL), min_samples=3).samples == (100,) * 3  # as far as the path goes
    assert tree.lookup((), min_samples=5) is None


def _finished(prompt: str, states, remaining) -> FinishedTrajectory:
    return FinishedTrajectory(prompt, tuple(states), tuple(remaining))


def test_prompt_tree_answers_at_equal_depth_and_global_when_strictly_deeper():
    index = CausalIndex(window=16, min_samples=2, retain=100)
    for _ in range(2):
        index.observe(_finished("a", [FAIL], [5000, 4000]))
    for _ in range(2):
        index.observe(_finished("b", [FAIL, OK], [900, 700, 100]))
    stats, source = index.lookup("a", (FAIL,))
    assert source == "prompt" and stats.samples == (4000, 4000)
    stats, source = index.lookup("a", (FAIL, OK))  # global knows FAIL,OK; prompt a only FAIL
    assert source == "global" and stats.samples == (100, 100)
    assert index.match("a", (FAIL, OK)).depth == 2
    stats, source = index.lookup("unseen", (FAIL,))
    assert source == "global" and stats.n == 4
    assert index.lookup("unseen", (HANG,))[1] == "global"  # root of the global tree
    assert CausalIndex(window=4, min_samples=2, retain=4).lookup("a", (FAIL,)) is None


def test_min_samples_must_fit_in_the_window():
    with pytest.raises(ValueError, match="min_samples"):
        CausalIndex(window=4, min_samples=5, retain=10)


def test_observe_refuses_inconsistent_trajectories_naming_the_prompt():
    index = CausalIndex(window=4, min_samples=1, retain=4)
    with pytest.raises(ValueError, match="'p7'"):
        index.observe(_finished("p7", [FAIL], [10]))
    with pytest.raises(ValueError, match="must lie between 0 and"):
        index.observe(_finished("p7", [FAIL], [10, -1]))


def random_trajectories(n: int, seed: int) -> list[FinishedTrajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        depth = rng.randint(0, 5)
        states = [rng.choice((OK, FAIL, HANG)) for _ in range(depth)]
        remaining = sorted((rng.randint(0, 5000) for _ in range(depth + 1)), reverse=True)
        out.append(_finished(f"p{rng.randrange(6)}", states, remaining))
    return out


def all_lookups(index: CausalIndex, data) -> list:
    answers = []
    for f in data:
        for d in range(len(f.states) + 1):
            found = index.match(f.prompt_id, f.states[:d])
            answers.append(found and (found.source, found.depth, found.stats.samples, found.stats.count))
    return answers


def test_rebuild_equals_an_incremental_build_from_the_same_window():
    data = random_trajectories(300, seed=1)
    index = CausalIndex(window=8, min_samples=3, retain=100)
    for f in data:
        index.observe(f)
    fresh = CausalIndex(window=8, min_samples=3, retain=100)
    for f in data[-100:]:
        fresh.observe(f)
    assert all_lookups(index, data) != all_lookups(fresh, data)  # counts include aged-out samples
    index.rebuild()
    assert all_lookups(index, data) == all_lookups(fresh, data)
    assert index.to_json() == fresh.to_json()


def test_rebuild_forgets_prompts_outside_the_window():
    index = CausalIndex(window=2, min_samples=1, retain=2)
    index.observe(_finished("old", [FAIL], [10, 5]))
    index.observe(_finished("new", [OK], [10, 5]))
    index.observe(_finished("new", [OK], [10, 5]))
    assert "old" in index.prompt_trees
    index.rebuild()
    assert set(index.prompt_trees) == {"new"}
    assert index.global_tree.node_count() == 2


def test_json_round_trip_gives_identical_lookups(tmp_path):
    data = random_trajectories(200, seed=2)
    index = CausalIndex(window=8, min_samples=3, retain=50)
    for f in data:
        index.observe(f)
    copy = CausalIndex.from_json(json.loads(json.dumps(index.to_json())))
    assert all_lookups(copy, data) == all_lookups(index, data)
    path = tmp_path / "trees.json"
    index.save(path)
    loaded = CausalIndex.load(path)
    assert all_lookups(loaded, data) == all_lookups(index, data)
    assert list(loaded.recent) == list(index.recent)
    assert (loaded.window, loaded.min_samples, loaded.retain) == (8, 3, 50)
    assert [p.name for p in tmp_path.iterdir()] == ["trees.json"]  # no temporary file left
    loaded.rebuild()
    index.rebuild()
    assert all_lookups(loaded, data) == all_lookups(index, data)


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "trees.json"
    path.write_text("old")
    index = CausalIndex(window=4, min_samples=1, retain=4)
    index.observe(_finished("a", [OK], [3, 1]))
    index.save(path)
    assert CausalIndex.load(path).lookup("a", (OK,))[0].samples == (1,)


def _valid_json() -> dict:
    index = CausalIndex(window=4, min_samples=1, retain=4)
    index.observe(_finished("a", [FAIL], [30, 20]))
    return index.to_json()


def _corrupt(mutate) -> dict:
    data = _valid_json()
    mutate(data)
    return data


@pytest.mark.parametrize(("data", "message"), [
    ([1, 2], "expected a JSON dict"),
    (_corrupt(lambda d: d.update(format="something else")), "not a causal index"),
    (_corrupt(lambda d: d.update(window=0)), "window"),
    (_corrupt(lambda d: d.update(min_samples=9)), "min_samples"),
    (_corrupt(lambda d: d["global"].update(samples=["x"])), r"global\.samples\[0\]"),
    (_corrupt(lambda d: d["global"].update(samples=[1, 2, 3, 4, 5], count=5)), "window=4"),
    (_corrupt(lambda d: d["global"]["children"].update({"nokey": d["global"]["children"]["python|L|failure"]})),
     "'nokey'"),
    (_corrupt(lambda d: d["prompts"]["a"]["children"]["python|L|failure"].pop("count")),
     r"prompts\['a'\]\.children\['python\|L\|failure'\]\.count"),
    (_corrupt(lambda d: d["recent"][0].update(remaining_after=[30])), r"recent\[0\]"),
    (_corrupt(lambda d: d["recent"][0].update(states=[["python", "L", "crashed"]])), "status"),
    (_corrupt(lambda d: d["recent"].extend([d["recent"][0]] * 4)), "more than retain=4"),
    (_corrupt(lambda d: d.update(retain=1)), r"retain=1 .* >= the tree window"),
])
def test_malformed_json_is_refused_naming_the_field(data, message):
    with pytest.raises(CausalTreeFormatError, match=message):
        CausalIndex.from_json(data)


def test_malformed_file_error_names_the_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": ')
    with pytest.raises(CausalTreeFormatError, match=r"broken\.json: not valid JSON"):
        CausalIndex.load(broken)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(_corrupt(lambda d: d["global"].update(count=-1))))
    with pytest.raises(CausalTreeFormatError, match=r"wrong\.json: global\.count"):
        CausalIndex.load(wrong)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=30), st.integers(-5, 120))
def test_beyond_conditions_the_window_on_tokens_already_generated(values, already):
    stats = NodeStats(16)
    for value in values:
        stats.add(value)
    window = list(stats.samples)
    lasted = [v - already for v in window if v > already] if already > 0 else window
    got = stats.beyond(already)
    if not lasted:
        assert got is None
    else:
        mean, p90 = brute(lasted)
        assert got[0] == pytest.approx(mean) and got[1] == p90


def test_a_saved_trajectory_with_an_unusable_tool_name_is_refused_on_load(tmp_path):
    index = CausalIndex(window=4, min_samples=1, retain=8)
    index.observe(FinishedTrajectory("p", (ToolState("python", "S", "success"),), (10, 5)))
    data = index.to_json()
    data["recent"][0]["states"][0][0] = "a|b"  # would become a broken tree key at the next rebuild
    with pytest.raises(CausalTreeFormatError, match="a|b"):
        CausalIndex.from_json(data)


def test_trees_stop_at_max_depth_so_very_long_trajectories_save_and_load(tmp_path):
    from libra_hpc.scheduler.tree import MAX_DEPTH
    deep = 10 * MAX_DEPTH  # an agent that called tools 640 times
    states = tuple(OK if i % 2 else FAIL for i in range(deep))
    index = CausalIndex(window=4, min_samples=1, retain=8)
    index.observe(FinishedTrajectory("p", states, tuple(range(deep, -1, -1))))
    found = index.match("p", states)
    assert found.depth == MAX_DEPTH and found.stats.samples == (deep - MAX_DEPTH,)
    assert index.match("p", states[:MAX_DEPTH]) == found  # what lies beyond the cap does not matter
    assert index.prompt_trees["p"].node_count() == MAX_DEPTH + 1
    index.save(tmp_path / "index.json")
    loaded = CausalIndex.load(tmp_path / "index.json")
    assert loaded.match("p", states).stats.samples == (deep - MAX_DEPTH,)
    loaded.rebuild()  # the retained trajectory, full length, rebuilds the same capped tree
    assert loaded.prompt_trees["p"].node_count() == MAX_DEPTH + 1


def test_a_saved_tree_nested_beyond_max_depth_is_refused(tmp_path):
    from libra_hpc.scheduler.tree import MAX_DEPTH
    index = CausalIndex(window=4, min_samples=1, retain=8)
    data = index.to_json()
    node = data["global"]
    for _ in range(MAX_DEPTH + 1):
        child = {"count": 1, "samples": [1], "children": {}}
        node["children"][OK.key()] = child
        node = child
    with pytest.raises(CausalTreeFormatError, match="deeper than MAX_DEPTH"):
        CausalIndex.from_json(data)
    (tmp_path / "deep.json").write_text('{"global":' * 5000 + "1" + "}" * 5000)
    with pytest.raises(CausalTreeFormatError, match="nested too deep"):
        CausalIndex.load(tmp_path / "deep.json")


def test_retaining_fewer_trajectories_than_the_window_is_refused():
    with pytest.raises(ValueError, match=r"retain=3 .* >= the tree window \(4\)"):
        CausalIndex(window=4, min_samples=1, retain=3)


def test_a_sample_beyond_64_bits_is_refused_not_overflowed(tmp_path):
    from libra_hpc.scheduler.tree import MAX_SAMPLE
    data = _valid_json()
    data["global"]["samples"] = [MAX_SAMPLE + 1]
    with pytest.raises(CausalTreeFormatError, match="global.samples"):
        CausalIndex.from_json(data)
    data = _valid_json()
    data["recent"][0]["remaining_after"] = [1 << 63, 0]
    with pytest.raises(CausalTreeFormatError, match=r"recent\[0\]"):
        CausalIndex.from_json(data)
    with pytest.raises(ValueError, match="must lie between 0 and"):
        CausalIndex(window=4, min_samples=1, retain=4).observe(FinishedTrajectory("p", (OK,), (1 << 63, 0)))


def test_rebuild_defers_sparse_prompts_without_changing_any_tree():
    rng = random.Random(5)
    data = [_finished(f"p{rng.randrange(60)}", f.states, f.remaining_after) for f in random_trajectories(300, seed=5)]
    lazy = CausalIndex(window=8, min_samples=3, retain=120)  # defers prompts with < 3 retained
    eager = CausalIndex(window=8, min_samples=1, retain=120)  # defers nothing
    for index in (lazy, eager):
        for finished in data[:200]:
            index.observe(finished)
        index.rebuild()
    assert lazy._deferred and not eager._deferred
    materialized = CausalIndex.from_json(json.loads(json.dumps(lazy.to_json())))  # every tree built
    def answer(index, finished):
        found = index.match(finished.prompt_id, finished.states)
        return found and (found.source, found.depth, found.stats.samples)
    assert [answer(lazy, f) for f in data] == [answer(materialized, f) for f in data]
    for index in (lazy, eager):
        for finished in data[200:]:  # deferred prompts that come back are replayed first
            index.observe(finished)
    assert lazy.to_json()["prompts"] == eager.to_json()["prompts"]  # saving replays the rest
    assert lazy.to_json()["global"] == eager.to_json()["global"] and not lazy._deferred


def test_keys_given_by_the_caller_are_the_keys_of_the_states():
    index = CausalIndex(window=8, min_samples=1, retain=8)
    keys = (FAIL.key(), OK.key())
    index.observe(FinishedTrajectory("a", (FAIL, OK), (900, 600, 100), keys))
    index.observe(FinishedTrajectory("a", (FAIL,), (500, 200)))  # computed from the states
    assert index.find("a", (FAIL, OK), keys)[1:] == index.find("a", (FAIL, OK))[1:] == ("prompt", 2)
    assert index.find("a", (FAIL,), (FAIL.key(),))[0].samples == index.find("a", (FAIL,))[0].samples == (600, 200)
    assert index.find("a", (FAIL, OK), ("wrong",))[2] == 2  # not one per state: computed from the states
    with pytest.raises(ValueError, match="1 tree keys for 2 tool returns"):
        index.observe(FinishedTrajectory("a", (FAIL, OK), (900, 600, 100), (FAIL.key(),)))


@given(st.lists(st.integers(-5, 60), max_size=40), st.integers(-10, 70))
def test_native_binary_searches_agree_with_bisect(values, x):
    from bisect import bisect_left, bisect_right

    from libra_hpc.scheduler.tree import _left, _right
    ordered = sorted(values)
    assert (_left(ordered, x), _right(ordered, x)) == (bisect_left(ordered, x), bisect_right(ordered, x))
