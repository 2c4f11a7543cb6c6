"""The world's parting before ``MPI_Finalize`` (libra_hpc/cluster/parting.py), on real MPI
worlds (tests/parting_world.py): sends a stop left stranded no longer keep the world alive,
and a rank that never arrives is reported, not waited on."""

from __future__ import annotations

import json

import mpi_worlds
import pytest


def run(scenario: str, tmp_path) -> list[dict]:
    mpi_worlds.run_world("parting_world.py", 3, scenario, tmp_path, timeout=120, what=f"the parting world {scenario}")
    return sorted(json.loads((tmp_path / "result.json").read_text()), key=lambda r: r["rank"])


@pytest.mark.mpi
def test_sends_a_stop_left_posted_complete_and_the_world_exits(tmp_path):
    ranks = run("stranded", tmp_path)
    # the premise: a 4 MB send nobody receives does not complete by itself
    assert ranks[1]["sent_before"] is False and ranks[2]["sent_before"] is False
    assert all(r["complete"] and r["after"] for r in ranks)
    # each message was received once, by its addressee, and dropped
    assert ranks[0]["dropped"] == {"12": 1}
    assert ranks[1]["dropped"] == {"13": 1}
    assert ranks[2]["dropped"] == {"11": 1}


@pytest.mark.mpi
def test_a_rank_that_does_not_arrive_makes_the_others_report_an_incomplete_parting(tmp_path):
    ranks = run("late", tmp_path)
    assert [r["complete"] for r in ranks] == [False, False, True]
    assert "did not reach the end of its loop" in ranks[0]["line"]
