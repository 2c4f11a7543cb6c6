"""Routing rules of C-MLFQ and the baselines, load accounting, fallbacks, the registry."""

from __future__ import annotations

import pytest

from libra_hpc.config import SchedulerConfig
from libra_hpc.scheduler.routers import (
    ROUTERS,
    CmlfqRouter,
    FifoRouter,
    LeastLoadRouter,
    LengthAwareRouter,
    OracleRouter,
    buckets_from_instances,
    make_router,
    outward_order,
    router_from_config,
    validate_buckets,
)
from libra_hpc.scheduler.types import (
    BucketSpec,
    FinishedTrajectory,
    ToolState,
    TrajectoryView,
)

OK = ToolState("python", "S", "success")
FAIL = ToolState("python", "L", "failure")
HANG = ToolState("bash", "S", "timeout")


def buckets(cap: int = 1 << 30, empty: str | None = None) -> list[BucketSpec]:
    """tp1 ≤1000 (instances 0, 1), tp2 ≤4000 (2, 3), tp4 ≤16000 (4), tp8 beyond (5); given out of order."""
    spec = [("tp8", 8, 1 << 30, (5,)), ("tp2", 2, 4000, (2, 3)), ("tp1", 1, 1000, (0, 1)), ("tp4", 4, 16000, (4,))]
    return [BucketSpec(n, tp, lim, () if n == empty else ids, cap) for n, tp, lim, ids in spec]


def cmlfq(**kw) -> CmlfqRouter:
    kw.setdefault("window", 16)
    kw.setdefault("min_samples", 2)
    kw.setdefault("rebuild_every", 1000)
    return CmlfqRouter(kw.pop("buckets", None) or buckets(), **kw)


def teach(router, states, remaining_now: list[int], prompt: str = "p") -> None:
    """One finished trajectory per value: after ``states`` it still generated that many tokens."""
    for tokens in remaining_now:
        router.observe(FinishedTrajectory(prompt, tuple(states), (tokens + 10 * len(states),) * len(states) + (tokens,)))


def view(states=(), bucket=None, prompt="p", true_remaining=None) -> TrajectoryView:
    return TrajectoryView("t", prompt, tuple(states), 0, bucket, true_remaining)


# --- buckets and registry ---

def test_buckets_are_sorted_by_token_limit():
    assert [b.name for b in cmlfq().buckets] == ["tp1", "tp2", "tp4", "tp8"]


@pytest.mark.parametrize(("spec", "message"), [
    ([BucketSpec("a", 1, 10, (0,)), BucketSpec("a", 2, 20, (1,))], "'a' appears twice"),
    ([BucketSpec("a", 1, 10, (0,)), BucketSpec("b", 2, 20, (0,))], "instance 0 is in both"),
    ([BucketSpec("a", 1, 10, ()), BucketSpec("b", 2, 20, ())], "no rollout instance"),
    ([BucketSpec("a", 1, 10, (0,)), BucketSpec("b", 2, 10, (1,))], "share token_limit=10"),
    ([BucketSpec("a", 1, 0, (0,))], "must be positive"),
])
def test_bad_buckets_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        validate_buckets(spec)


def test_make_router_builds_every_registered_policy_and_refuses_unknown_names():
    assert set(ROUTERS) == {"cmlfq", "fifo", "least_load", "length_aware", "oracle"}
    for name, cls in ROUTERS.items():
        router = make_router(name, buckets(), window=8, min_samples=2, rebuild_every=10)
        assert type(router) is cls and router.name == name
    with pytest.raises(ValueError, match=r"'mlfq'.*\['cmlfq', 'fifo', 'least_load', 'length_aware', 'oracle'\]"):
        make_router("mlfq", buckets(), window=8, min_samples=2, rebuild_every=10)


def test_router_from_config_uses_the_scheduler_section():
    cfg = SchedulerConfig(tree_window=32, min_samples=4, rebuild_every=7)
    router = router_from_config(cfg, buckets())
    assert isinstance(router, CmlfqRouter)
    assert (router.index.window, router.index.min_samples, router.rebuild_every) == (32, 4, 7)
    noisy = router_from_config(SchedulerConfig(policy="length_aware", predictor_noise=0.25), buckets(), seed=3)
    assert isinstance(noisy, LengthAwareRouter) and noisy.noise == 0.25


def test_buckets_from_instances_groups_by_tp():
    made = buckets_from_instances([(7, 2), (3, 1), (9, 2), (4, 8)], {1: 100, 2: 400, 8: 10**9})
    assert made == [BucketSpec("tp1", 1, 100, (3,)), BucketSpec("tp2", 2, 400, (7, 9)), BucketSpec("tp8", 8, 10**9, (4,))]
    with pytest.raises(ValueError, match=r"TP=4.*configured TPs: \[1, 2, 8\]"):
        buckets_from_instances([(0, 4)], {1: 100, 2: 400, 8: 10**9})
    with pytest.raises(ValueError, match="instance 3 is listed twice"):
        buckets_from_instances([(3, 1), (3, 2)], {1: 100, 2: 400})


def test_outward_order_prefers_the_longer_neighbour():
    assert outward_order(1, 4) == (1, 2, 0, 3)
    assert outward_order(0, 3) == (0, 1, 2)
    assert outward_order(3, 4) == (3, 2, 1, 0)


# --- load accounting ---

def test_load_accounting_and_its_errors():
    router = cmlfq()
    router.turn_started(2, 300)
    router.turn_started(2, 200)
    router.turn_ended(2, 300)
    assert router.outstanding[2] == 200
    with pytest.raises(KeyError, match="unknown rollout instance 42"):
        router.turn_started(42, 1)
    with pytest.raises(KeyError, match="42"):
        router.turn_ended(42, 1)
    with pytest.raises(ValueError, match="ended twice"):
        router.turn_ended(2, 300)
    with pytest.raises(ValueError, match="must be >= 0"):
        router.turn_started(2, -1)


# --- C-MLFQ ---

def test_new_trajectories_start_in_the_top_level_even_when_the_tree_says_long():
    router = cmlfq()
    teach(router, [], [50_000] * 4)
    placed = router.place(view())
    assert (placed.bucket, placed.migrated) == ("tp1", False)
    assert (router.decisions, router.migrations) == (1, 0)


def test_moves_down_when_mean_and_p90_agree():
    router = cmlfq()
    teach(router, [FAIL], [2000, 3000, 3500])
    placed = router.place(view([FAIL], "tp1"))
    assert (placed.bucket, placed.migrated) == ("tp2", True)
    assert placed.instance in (2, 3) and router.migrations == 1


def test_moves_up_when_mean_and_p90_agree():
    router = cmlfq()
    teach(router, [FAIL, OK], [100, 200, 300])
    placed = router.place(view([FAIL, OK], "tp4"))
    assert (placed.bucket, placed.migrated) == ("tp1", True)


def test_no_move_when_mean_and_p90_disagree():
    router = cmlfq()
    teach(router, [FAIL], [100] * 8 + [3000] * 2)  # mean 680 → tp1, p90 3000 → tp2
    stats = router.index.lookup("p", (FAIL,))[0]
    assert router.level_for(stats.mean) == 0 and router.level_for(stats.p90) == 1
    for current in ("tp1", "tp2", "tp4"):
        placed = router.place(view([FAIL], current))
        assert (placed.bucket, placed.migrated) == (current, False)
        assert "disagree" in placed.reason
    assert router.migrations == 0


def test_no_move_when_the_agreed_level_is_the_current_one_or_nothing_is_trusted():
    router = cmlfq(min_samples=3)
    teach(router, [FAIL], [2000, 3000, 3500])
    placed = router.place(view([FAIL], "tp2"))
    assert (placed.bucket, placed.migrated) == ("tp2", False) and placed.reason.startswith("stay")
    assert router.place(view((), "tp4")).bucket == "tp4"  # no tool return yet: stay
    sparse = cmlfq(min_samples=3)
    teach(sparse, [HANG], [50_000] * 2)  # two samples, even at the root: nothing trusted
    placed = sparse.place(view([HANG], "tp1"))
    assert (placed.bucket, placed.reason) == ("tp1", "no trusted node")


def test_beyond_the_largest_limit_maps_to_the_last_bucket():
    router = cmlfq()
    teach(router, [FAIL], [10**10, 10**10])
    assert router.place(view([FAIL], "tp1")).bucket == "tp8"


def test_per_prompt_tree_decides_before_the_global_one():
    router = cmlfq()
    teach(router, [FAIL], [200, 300, 200, 300], prompt="easy")
    teach(router, [FAIL], [9000, 9000], prompt="hard")
    assert router.place(view([FAIL], "tp2", prompt="easy")).bucket == "tp1"
    assert router.place(view([FAIL], "tp1", prompt="hard")).bucket == "tp4"
    assert router.place(view([FAIL], "tp1", prompt="new")).bucket == "tp1"  # global: mean 3167, p90 9000 disagree


def test_least_outstanding_instance_inside_the_bucket_ties_to_the_first():
    router = cmlfq()
    assert router.place(view()).instance == 0
    router.turn_started(0, 500)
    assert router.place(view()).instance == 1
    router.turn_started(1, 800)
    assert router.place(view()).instance == 0


def test_fallback_to_the_longer_neighbour_when_a_bucket_is_empty():
    router = cmlfq(buckets=buckets(empty="tp1"))
    placed = router.place(view())
    assert placed.bucket == "tp2" and "fell back from tp1" in placed.reason
    assert router.fallbacks == 1 and not placed.migrated  # a new trajectory does not migrate


def test_fallback_when_saturated_goes_longer_first_then_shorter_and_counts_migrations():
    router = cmlfq(buckets=buckets(cap=1000))
    teach(router, [FAIL], [2000, 3000, 3500])
    for instance in (2, 3):
        router.turn_started(instance, 1000)  # tp2 saturated
    placed = router.place(view([FAIL], "tp1"))
    assert (placed.bucket, placed.migrated) == ("tp4", True)
    router.turn_started(4, 5000)  # tp4 saturated too: the shorter neighbour
    assert router.place(view([FAIL], "tp1")).bucket == "tp1"
    for instance in (0, 1, 5):
        router.turn_started(instance, 1000)  # everything saturated: the target anyway
    placed = router.place(view([FAIL], "tp1"))
    assert (placed.bucket, placed.instance) == ("tp2", 2)
    assert router.fallbacks == 2 and router.migrations == 2 and router.decisions == 3


def test_a_bucket_that_left_the_layout_restarts_at_the_top_as_a_migration():
    placed = cmlfq().place(view([FAIL], "tp16"))
    assert (placed.bucket, placed.migrated) == ("tp1", True)


def test_rebuild_falls_due_every_n_finishes_and_runs_only_in_maintenance():
    router = cmlfq(rebuild_every=3, window=4)
    calls, trees = [], [router.index.global_tree]

    def rebuilds() -> list[int]:  # a rebuild replaces the trees (the compiled router cannot be patched)
        if router.index.global_tree is not trees[-1]:
            trees.append(router.index.global_tree)
            calls.append(router.observed)
        return calls

    teach(router, [OK], [1] * 2)
    assert not router.maintain() and rebuilds() == []  # not due yet
    teach(router, [OK], [1])
    assert rebuilds() == []  # observe never rebuilds: it is on the request path
    assert router.maintain() and rebuilds() == [3]
    assert not router.maintain() and rebuilds() == [3]  # done until the next period
    teach(router, [OK], [1] * 4)
    assert not router.maintain(busy=True) and rebuilds() == [3]  # busy: only when a period overdue
    teach(router, [OK], [1] * 2)
    assert router.maintain(busy=True) and rebuilds() == [3, 9]
    assert router.index.retain == 4  # at least a node window


def test_state_dict_round_trip_keeps_decisions():
    router = cmlfq()
    teach(router, [FAIL], [2000, 3000, 3500])
    twin = cmlfq()
    twin.load_state_dict(router.state_dict())
    assert twin.place(view([FAIL], "tp1")).bucket == "tp2"
    other_window = cmlfq(window=8)
    other_window.load_state_dict(router.state_dict())  # rebuilt with its own window
    assert other_window.index.window == 8 and other_window.place(view([FAIL], "tp1")).bucket == "tp2"


def test_min_samples_larger_than_the_window_is_refused():
    with pytest.raises(ValueError, match="min_samples=9"):
        cmlfq(window=8, min_samples=9)


# --- baselines ---

def test_fifo_round_robins_over_all_instances_then_inside_the_bucket():
    router = FifoRouter(buckets())
    assert [router.place(view()).instance for _ in range(7)] == [0, 1, 2, 3, 4, 5, 0]
    later = [router.place(view([FAIL], "tp2")) for _ in range(3)]
    assert [p.instance for p in later] == [2, 3, 2]
    assert all(p.bucket == "tp2" and not p.migrated for p in later)
    router.turn_started(2, 10**6)  # load-blind
    assert router.place(view([FAIL], "tp2")).instance == 3 and router.migrations == 0


def test_least_load_picks_the_least_loaded_of_all_then_stays_in_its_bucket():
    router = LeastLoadRouter(buckets(cap=1000))
    for instance, load in [(0, 50), (1, 40), (2, 30), (3, 20), (5, 10)]:
        router.turn_started(instance, load)
    assert router.place(view()).instance == 4
    router.turn_started(4, 5000)  # saturated: the least loaded unsaturated one
    assert router.place(view()).instance == 5
    placed = router.place(view([FAIL], "tp1"))
    assert (placed.bucket, placed.instance, placed.migrated) == ("tp1", 1, False)
    router.turn_started(0, 2000)
    router.turn_started(1, 2000)
    assert router.place(view([FAIL], "tp1")).bucket == "tp1"  # saturated, still never migrates
    assert router.migrations == 0


@pytest.mark.parametrize(("remaining", "bucket"), [(0, "tp1"), (1000, "tp1"), (1001, "tp2"), (16000, "tp4"),
                                                   (16001, "tp8"), (10**12, "tp8")])
def test_oracle_maps_the_true_remaining_length(remaining, bucket):
    assert OracleRouter(buckets()).place(view(true_remaining=remaining)).bucket == bucket


def test_oracle_migrates_when_the_true_level_changes():
    router = OracleRouter(buckets())
    placed = router.place(view([OK], "tp4", true_remaining=100))
    assert (placed.bucket, placed.migrated) == ("tp1", True)


def test_length_aware_is_seeded_noisy_and_exact_without_noise():
    exact = LengthAwareRouter(buckets(), noise=0.0)
    assert [exact.place(view(true_remaining=r)).bucket for r in (900, 3000, 20_000)] == ["tp1", "tp2", "tp8"]

    def run(seed):
        router = LengthAwareRouter(buckets(), noise=1.0, seed=seed)
        return [router.place(view(true_remaining=3000)).bucket for _ in range(50)]
    assert run(1) == run(1)
    assert run(1) != run(2)
    assert {"tp1", "tp2", "tp4"} <= set(run(1))


def test_true_length_routers_need_the_true_remaining_length():
    for cls in (OracleRouter, LengthAwareRouter):
        with pytest.raises(ValueError, match="true_remaining"):
            cls(buckets()).place(view())


def test_a_shallower_match_is_conditioned_on_tokens_generated_since():
    router = cmlfq()
    # After one failure, trajectories went on for 1500–2500 tokens (the tp2 level).
    teach(router, [FAIL], [1500, 2000, 2500])
    deeper = (FAIL, OK)  # never seen: the match is the depth-1 node
    fresh = TrajectoryView("t", "p", deeper, 0, "tp1", None, (50, 0))
    assert router.place(fresh).bucket == "tp2"  # nothing generated since the node: as the node says
    # 1,600 tokens since that failure (the turn between the two tool returns): only the
    # 2000 and 2500 samples lasted that long, leaving 400 and 900 tokens: the top level.
    late = TrajectoryView("t", "p", deeper, 0, "tp2", None, (50, 1600))
    placed = router.place(late)
    assert (placed.bucket, placed.migrated) == ("tp1", True)
    # Longer than every sample: no evidence left, stay.
    outlived = TrajectoryView("t", "p", deeper, 0, "tp2", None, (50, 2600))
    placed = router.place(outlived)
    assert placed.bucket == "tp2" and "outlived" in placed.reason


# --- prefix affinity inside a bucket ---

def _prev(instance, bucket="tp2", states=()) -> TrajectoryView:
    return TrajectoryView("t", "p", tuple(states), 0, bucket, 2000, (), instance)  # true length: tp2's range


@pytest.mark.parametrize("policy", ["cmlfq", "least_load", "oracle", "length_aware"])
def test_a_turn_stays_where_its_kv_prefix_is_within_the_affinity_slack(policy):
    router = make_router(policy, buckets(cap=5000), window=8, min_samples=2, rebuild_every=10, affinity_tokens=300,
                         predictor_noise=0.0)
    router.turn_started(3, 300)  # instance 3 (tp2) holds 300 more outstanding tokens than 2
    placed = router.place(_prev(3))
    assert (placed.bucket, placed.instance, placed.migrated) == ("tp2", 3, False)
    router.turn_started(3, 1)  # 301 more: the least loaded sibling wins
    assert router.place(_prev(3)).instance == 2
    assert router.place(_prev(None)).instance == 2  # a first turn has no prefix anywhere


def test_affinity_never_keeps_a_silent_saturated_or_other_bucket_instance():
    router = make_router("least_load", buckets(cap=1000), window=8, min_samples=2, rebuild_every=10,
                         affinity_tokens=10_000)
    router.turn_started(3, 500)
    assert router.place(_prev(3)).instance == 3
    router.set_down(3, True)
    assert router.place(_prev(3)).instance == 2  # silent
    router.set_down(3, False)
    router.turn_started(3, 500)  # 1000 outstanding: saturated at cap 1000
    assert router.place(_prev(3)).instance == 2
    assert router.place(_prev(4)).instance == 2  # its prefix is in tp4, the turn stays in tp2: no affinity there


def test_no_affinity_by_default_in_the_router_and_fifo_keeps_round_robin():
    router = LeastLoadRouter(buckets())
    router.turn_started(3, 1)
    assert router.place(_prev(3)).instance == 2
    fifo = make_router("fifo", buckets(), window=8, min_samples=2, rebuild_every=10, affinity_tokens=10_000)
    assert [fifo.place(_prev(3)).instance for _ in range(3)] == [2, 3, 2]
    with pytest.raises(ValueError, match="affinity_tokens=-1"):
        LeastLoadRouter(buckets(), affinity_tokens=-1)


def test_the_service_tells_the_router_where_the_previous_turn_ran():
    from libra_hpc.scheduler.service import QueueService

    router = make_router("least_load", buckets(), window=8, min_samples=2, rebuild_every=10, affinity_tokens=10_000)
    service = QueueService(router, lease_s=60.0, max_batch=4, size_thresholds=[256], error_markers=["Error"])
    service.submit("a", "p")
    first = service.handle({"op": "ask", "instance": 0, "max": 1}, 0.0)["turns"][0]
    router.turn_started(0, 5000)  # instance 0 is now far busier than its sibling 1
    placed = service.handle({"op": "tool_return", "lease": first["lease"], "tool": "python", "size": "S",
                             "status": "success", "tokens": 10}, 0.0)
    assert (placed["bucket"], placed["instance"]) == ("tp1", 0)  # stays with its prefix (slack 10k)


@pytest.mark.parametrize("policy", ["oracle", "least_load"])
def test_affinity_holds_when_every_instance_of_the_bucket_is_saturated(policy):
    router = make_router(policy, buckets(cap=100), window=8, min_samples=2, rebuild_every=10, affinity_tokens=500,
                         predictor_noise=0.0)
    for instance in range(6):
        router.turn_started(instance, 200)  # everything saturated (cap 100)
    router.turn_started(3, 100)  # 3 holds 100 more than its sibling 2, within the slack
    placed = router.place(_prev(3))
    assert (placed.bucket, placed.instance) == ("tp2", 3)
