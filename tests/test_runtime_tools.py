"""Tool actions between a rollout leader and the controller's shared pool over MPI
(libra_hpc/runtime/tools.py, tests/world_tools.py): a tool that hangs ends its action with
an error naming the tool, at the sandbox's wall time; a malformed request is answered
with an error naming the rank, or dropped and counted when it cannot even be read; the
service goes on serving."""

from __future__ import annotations

import json

import pytest
from mpi_worlds import run_world

pytestmark = pytest.mark.mpi


def test_a_hanging_tool_and_malformed_requests_end_the_action_not_the_service():
    wall = 5.0  # the good calls share this limit with the hanging one: room for a slow start on busy cores
    output = run_world("world_tools.py", 2, wall, timeout=120, what="the tool world")
    client = json.loads(next(l for l in output.splitlines() if l.startswith("CLIENT "))[7:])
    service = json.loads(next(l for l in output.splitlines() if l.startswith("SERVICE "))[8:])
    hang = client["hang"]  # the episode reads the sandbox's verdict: killed at the wall time
    assert hang["ok"] is True and "timed_out=True" in hang["value"] and "tool='python'" in hang["value"], hang
    assert "wall-time limit" in hang["value"], hang  # the sandbox's own verdict, not a stopwatch
    assert client["good"]["ok"] is True and "42" in client["good"]["value"], client["good"]
    assert client["missing"]["ok"] is False and "rank 1" in client["missing"]["error"], client["missing"]
    assert "tool" in client["missing"]["error"] and "payload" in client["missing"]["error"]
    assert client["after_garbage"]["ok"] is True and "still served" in client["after_garbage"]["value"]
    assert service["bad_payloads"] == 1 and service["calls"] == 3
