"""The queue service over real MPI: ``mpiexec -n 3`` runs tests/sched_mpi_world.py (rank 0
serves, ranks 1-2 are rollout instance leaders) and rank 0 reports what it saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpi_worlds import run_world

HERE = Path(__file__).resolve().parent


@pytest.mark.mpi
def test_three_rank_queue_completes_every_trajectory_exactly_once(tmp_path):
    summary_file = tmp_path / "summary.json"
    run_world("sched_mpi_world.py", 3, summary_file, timeout=60, what="the queue world")
    summary = json.loads(summary_file.read_text())
    assert summary["completed"] == sorted(f"t{i}" for i in range(12)) and summary["unique"] == 12
    assert summary["wrong_tokens"] == [] and summary["audit"] == {}
    stats = summary["stats"]
    assert stats["completed"] == 12 and stats["active"] == 0 and stats["leased"] == 0
    assert stats["decisions"] == sum(i % 3 + 1 for i in range(12))  # one per accepted tool return
    assert stats["migrations"] == 12  # every trajectory's second turn moved to tp4
    assert stats["duplicate_reports"] == 1 and stats["rejected"]["malformed"] == 1
    assert stats["late_reports"] >= 1 and stats["requeued_on_expiry"] >= 1
    assert summary["requeues"] == stats["requeued_on_expiry"]
    assert summary["transport"]["bad_payloads"] == 1 and summary["saves"] >= 1
    clients = dict(enumerate(summary["clients"], start=1))
    assert clients[1]["malformed"] == 1 and clients[2]["malformed"] == 1 and clients[2]["duplicate_report"] == 1
    assert clients[1].get("late_report", 0) + clients[2]["late_report"] == stats["late_reports"]


def test_serve_keeps_collections_off_the_request_path_and_restores_the_collector():
    import gc

    from libra_hpc.runtime.loop import Collector as _Collector
    clock = iter([0.0, 5.0, 20.0, 20.0]).__next__
    thresholds, counters = gc.get_threshold(), {"full_collections": 0}
    with pytest.raises(RuntimeError), _Collector(10.0, clock, counters) as collector:
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[2] == 1 << 30
        assert gc.get_threshold()[0] >= 20_000  # young collections made rarer too
        assert not collector.due(idle=True)  # t=5: not yet
        assert collector.due(idle=False)  # t=20: twice the period, even between requests
        raise RuntimeError("a router bug")
    assert counters["full_collections"] == 1
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    gc.freeze()  # frozen by someone else: left frozen
    try:
        frozen = gc.get_freeze_count()
        with _Collector(10.0, lambda: 0.0, counters):
            pass
        # still frozen (an unfreeze empties it); objects of other tests frozen with ours may die meanwhile
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
