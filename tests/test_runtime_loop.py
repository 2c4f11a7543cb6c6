"""Rank 0's event loop (libra_hpc/runtime/loop.py): in-process with a stand-in
communicator (dispatch, errors, timers, idle sleeps), and on real MPI worlds
(tests/loop_world.py): a queue client and a control client served at once, errors that do
not stop the loop, an idle loop's CPU time."""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
from collections import deque
from pathlib import Path

import pytest
from mpi4py import MPI

from libra_hpc.cluster.messages import QUEUE_REPLY, QUEUE_REQUEST, REPORT, TOOL_DONE
from libra_hpc.runtime.loop import EventLoop
from libra_hpc.scheduler.mpi_service import QueueHandler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import loop_world  # noqa: E402
from mpi_worlds import run_world  # noqa: E402


class Message:
    def __init__(self, payload):
        self.payload = payload

    def recv(self):
        if isinstance(self.payload, Exception):
            raise self.payload
        return self.payload


class Comm:
    """Stands in for an MPI communicator: ``improbe`` hands out ``inbox`` entries (tag,
    source, payload; a payload that is an exception fails to unpickle), ``forever`` one
    entry again and again; ``send`` records."""

    def __init__(self, inbox=(), forever=None):
        self.inbox, self.forever, self.sent = deque(inbox), forever, []

    def improbe(self, source, tag, status):
        entry = self.inbox.popleft() if self.inbox else self.forever
        if entry is None:
            return None
        assert tag in (MPI.ANY_TAG, entry[0]), "the loop probed a tag it does not serve"
        status.Set_tag(entry[0])
        status.Set_source(entry[1])
        return Message(entry[2])

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))


class Service:
    def handle(self, request, now):
        return {"ok": True, "echo": request}

    def maintain(self, now, *, busy=False):
        return False


def test_messages_go_to_their_tags_handler_and_errors_name_the_rank_without_stopping_the_loop(caplog):
    comm = Comm([(REPORT, 3, {"step": 1}), (TOOL_DONE, 4, "boom"), (QUEUE_REQUEST, 5, ValueError("truncated")),
                 (0x7777, 6, {"stray": 1}), (TOOL_DONE, 4, ValueError("truncated")), (QUEUE_REQUEST, 2, {"op": "ask"}),
                 (REPORT, 3, {"step": 2})])
    loop, reports, tools = EventLoop(comm, idle_sleep_s=0), [], []
    QueueHandler(comm, Service()).attach(loop)
    loop.on(REPORT, lambda report, source: reports.append((source, report)))

    def tool_done(completion, source):
        if completion == "boom":
            raise ValueError("a tool completion this handler cannot read")
        tools.append(completion)

    loop.on(TOOL_DONE, tool_done)
    with caplog.at_level(logging.WARNING, logger="libra_hpc.runtime.loop"):
        counters = loop.run(stop_when=lambda: not comm.inbox)
    assert reports == [(3, {"step": 1}), (3, {"step": 2})] and tools == []
    assert counters["messages"] == 7 and counters["handler_errors"] == 1
    assert counters["bad_payloads"] == 2 and counters["unexpected"] == 1
    assert comm.sent[0][:2] == (5, QUEUE_REPLY) and comm.sent[0][2]["reason"] == "malformed"
    assert "rank 5" in comm.sent[0][2]["error"]
    assert comm.sent[1] == (2, QUEUE_REPLY, {"ok": True, "echo": {"op": "ask"}})  # the queue goes on
    logged = [r.getMessage() for r in caplog.records]
    assert any("tool_done handler failed" in line and "rank 4" in line and "goes on" in line for line in logged)
    assert any("queue request message from rank 5 could not be unpickled" in line for line in logged)
    assert any("tag 0x7777 from rank 6" in line for line in logged)
    assert any("tool_done message from rank 4 could not be unpickled" in line for line in logged)


def test_a_fatal_handler_ends_the_loop_and_the_collector_is_restored():
    comm = Comm([(REPORT, 1, {}), (QUEUE_REQUEST, 2, {"op": "ask"})])
    loop = EventLoop(comm, idle_sleep_s=0)
    loop.on(REPORT, lambda report, source: None)
    QueueHandler(comm, type("Broken", (Service,), {"handle": lambda self, r, now: 1 / 0})()).attach(loop)  # fatal
    thresholds = gc.get_threshold()
    with pytest.raises(ZeroDivisionError):
        loop.run()
    assert comm.sent[0][:2] == (2, QUEUE_REPLY) and comm.sent[0][2]["reason"] == "server_error"
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0


def test_a_shutdown_request_stops_only_a_loop_that_lets_clients_stop_it():
    comm = Comm([(QUEUE_REQUEST, 1, {"op": "shutdown"})])
    loop = EventLoop(comm, idle_sleep_s=0)
    QueueHandler(comm, Service()).attach(loop)  # no on_shutdown: the controller decides
    loop.run(stop_when=lambda: not comm.inbox)
    assert loop.stopped is None and comm.sent[0][2]["reason"] == "refused"
    comm = Comm([(QUEUE_REQUEST, 1, {"op": "shutdown"})], forever=(QUEUE_REQUEST, 1, {"op": "ask"}))
    loop = EventLoop(comm, idle_sleep_s=0)
    QueueHandler(comm, Service(), on_shutdown=lambda source: loop.stop(f"rank {source}")).attach(loop)
    loop.run()
    assert loop.stopped == "rank 1" and comm.sent == [(1, QUEUE_REPLY, {"ok": True})]


def test_timers_run_when_idle_and_under_constant_load():
    # No garbage collections here: in a long test process a full one can outlast the run.
    loop = EventLoop(Comm(), idle_sleep_s=1e-4, max_sleep_s=1e-3, collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    ticks, once = [], []
    loop.every(0.02, lambda: ticks.append(time.monotonic()), name="tick")
    loop.after(0.05, lambda: once.append(1), name="once")
    loop.after(0.05, lambda: once.append("cancelled"), name="cancelled").cancel()
    loop.every(0.03, lambda: 1 / 0, name="broken")
    started = time.monotonic()
    # Until both timers have shown themselves, or 10 s (a loaded machine may stall the run).
    counters = loop.run(stop_when=lambda: (once and len(ticks) >= 10) or time.monotonic() - started > 10)
    gaps = sorted(b - a for a, b in zip(ticks, ticks[1:]))
    assert once == [1] and len(ticks) >= 10, (once, ticks)
    assert 0.02 <= gaps[len(gaps) // 2] < 0.04, gaps  # every 20 ms (and a little more) when idle
    assert counters["timer_errors"] >= 5 and counters["sleeps"] > 0  # a failing timer stays scheduled

    # Constant load: the loop never idles; a timer runs between two messages once overdue
    # by busy_after_s, however long each message takes.
    loop = EventLoop(Comm(forever=(REPORT, 1, {})), idle_sleep_s=1e-4, collect_every_s=None)
    loop.on(REPORT, lambda report, source: time.sleep(0.004))
    loop.when_idle(lambda now: pytest.fail("the loop never idles here"))
    busy_ticks = []
    loop.every(0.02, lambda: busy_ticks.append(time.monotonic()), name="tick", busy_after_s=0.01)
    started = time.monotonic()
    counters = loop.run(stop_when=lambda: time.monotonic() - started > 0.3)
    gaps = [b - a for a, b in zip(busy_ticks, busy_ticks[1:])]
    assert counters["sleeps"] == 0 and len(busy_ticks) >= 5 and max(gaps) < 0.1, gaps


def test_an_idle_loop_backs_off_to_its_longest_sleep():
    loop = EventLoop(Comm(), idle_sleep_s=2e-4, short_idle_s=0.01, max_sleep_s=5e-3, collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    started, cpu = time.monotonic(), time.process_time()
    counters = loop.run(stop_when=lambda: time.monotonic() - started > 0.5)
    # 10 ms of naps (at most 50), then 0.2, 0.4, ... ms up to 5 ms: about 100 sleeps in the
    # rest of the 0.5 s (2,000 at the first sleep's length)
    assert 60 <= counters["sleeps"] <= 160
    assert time.process_time() - cpu < 0.5 * 0.25


# ------------------------------------------------------------------- real MPI worlds

def run_loop_world(scenario: str, ranks: int, tmp_path: Path) -> dict:
    out = tmp_path / f"{scenario}.json"
    run_world("loop_world.py", ranks, scenario, out, timeout=90, what=f"the loop world {scenario}")
    return json.loads(out.read_text())


def fairness(summary: dict) -> tuple[list[dict], dict]:
    clients = summary["clients"]
    return [clients[str(rank)] for rank in loop_world.QUEUE_CLIENTS], clients[str(loop_world.CONTROL_CLIENT)]


@pytest.mark.mpi
def test_the_loop_serves_queue_and_control_clients_at_once_and_goes_on_after_errors(tmp_path):
    summary = run_loop_world("mixed", 6, tmp_path)
    queue, control = fairness(summary)
    # Both kinds active the whole time: round trips in every half second of the run.
    assert all(min(client["windows"]) > 0 for client in [*queue, control]), [c["windows"] for c in [*queue, control]]
    # Comparable rates: arrival order gives each client one turn per round.
    mean_queue = sum(c["count"] for c in queue) / len(queue)
    assert 0.5 * mean_queue <= control["count"] <= 2 * mean_queue, (control["count"], mean_queue)
    # Bounded latency while three clients keep the queue busy: about three requests of 10 ms ahead.
    assert control["p50_s"] < 0.1 and control["max_s"] < 1.0, control
    # Timers fire while requests flow and in the idle stretch after the clients are done.
    ticks, run_s = summary["ticks"], loop_world.RUN_S
    during = [t for t in ticks if t < run_s]
    assert len(during) >= run_s / loop_world.TICK_S / 4 and max(b - a for a, b in zip(during, during[1:])) < 0.5
    assert len([t for t in ticks if t > run_s + 0.1]) >= 3
    # Errors: each named with rank 5 and counted; the loop went on serving rank 5.
    counters, errors = summary["counters"], summary["clients"][str(loop_world.ERROR_CLIENT)]
    assert counters["bad_payloads"] == 2 and counters["handler_errors"] == 1 and counters["unexpected"] == 1
    assert len(summary["log"]) == 4 and all("rank 5" in line for line in summary["log"]), summary["log"]
    assert errors["malformed_reply"]["reason"] == "malformed" and "rank 5" in errors["malformed_reply"]["error"]
    assert errors["after_errors"] == "answered" and summary["tools"] == list(range(errors["completions_sent"]))
    assert summary["stopped"] == "every client is done"


@pytest.mark.mpi
def test_the_fairness_check_catches_a_loop_that_reads_control_messages_only_when_idle(tmp_path):
    queue, control = fairness(run_loop_world("control-when-idle", 6, tmp_path))
    mean_queue = sum(c["count"] for c in queue) / len(queue)
    assert control["count"] < 0.25 * mean_queue and control["max_s"] > 1.0, (control, mean_queue)


@pytest.mark.mpi
def test_an_idle_loop_leaves_the_core_and_still_answers_within_milliseconds(tmp_path):
    summary = run_loop_world("idle", 2, tmp_path)
    idle = summary["idle"]
    share = (idle["cpu"] - idle["cpu0"]) / (idle["wall"] - idle["wall0"])
    assert share < 0.05, f"rank 0 idle in its loop used {share:.1%} of a core"
    assert idle["seen_late_s"] < 0.1 and summary["counters"]["sleeps"] > 100
    assert len(summary["ticks"]) >= loop_world.IDLE_S / loop_world.TICK_S / 2  # timers run while idle
