"""Rank 0's event loop (libra_hpc/runtime/loop.py): in-process with a stand-in
communicator (dispatch, errors, timers, idle sleeps, the order clients are served in) on a
virtual clock, and on real MPI worlds (tests/loop_world.py): a queue client and a control
client served at once, errors that do not stop the loop, an idle loop that sleeps and
still answers.

No assertion here depends on how fast this machine is or how its cores are shared: the
loop reads a virtual clock (``clock=``) and its sleeps (its own naps and its Backoff's, both
``time.sleep`` of their modules) move that clock instead of waiting, so timers, sleeps and
turns are asserted exactly; the MPI worlds are asserted on counts and on the order rank 0
served messages in. What takes how long (tick gaps on a real clock, an idle loop's share of
a core, the control client's latency beside a busy queue) is measured by
benchmarks/bench_runtime.py."""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
import types
from collections import deque
from pathlib import Path

import pytest
from mpi4py import MPI

import libra_hpc.cluster.messages as messages_module
import libra_hpc.runtime.loop as loop_module
from libra_hpc.cluster.messages import COMMAND, QUEUE_REPLY, QUEUE_REQUEST, REPORT, TOOL_DONE
from libra_hpc.runtime.loop import EventLoop
from libra_hpc.scheduler.mpi_service import QueueHandler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import loop_world  # noqa: E402
from mpi_worlds import run_world  # noqa: E402


class VirtualTime:
    """The loop's clock in virtual seconds: ``clock()`` reads ``now``; ``sleep(s)`` (what
    the loop's naps and Backoff's sleeps call, see :func:`vtime`) notes the sleep with the
    probes made since the one before and moves ``now`` on without waiting; ``advance(s)``
    stands for work that takes ``s`` (a handler)."""

    def __init__(self):
        self.now, self.probes = 0.0, 0
        self.sleeps: list[tuple[float, int]] = []  # (seconds, probes since the previous sleep)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((seconds, self.probes))
        self.probes = 0
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def vtime(monkeypatch) -> VirtualTime:
    """A :class:`VirtualTime`; ``time.sleep`` as the loop's module and the messages module
    (Backoff) see it sleeps on it (the rest of ``time`` is the real one)."""
    virtual = VirtualTime()
    patched = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    patched.sleep = virtual.sleep
    monkeypatch.setattr(loop_module, "time", patched)
    monkeypatch.setattr(messages_module, "time", patched)
    return virtual


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

    def __init__(self, inbox=(), forever=None, vtime: VirtualTime | None = None):
        self.inbox, self.forever, self.sent, self.vtime = deque(inbox), forever, [], vtime

    def improbe(self, source, tag, status):
        if self.vtime is not None:
            self.vtime.probes += 1
        entry = self.inbox.popleft() if self.inbox else self.forever
        if entry is None:
            return None
        assert tag in (MPI.ANY_TAG, entry[0]), "the loop probed a tag it does not serve"
        status.Set_tag(entry[0])
        status.Set_source(entry[1])
        return Message(entry[2])

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))

    def isend(self, obj, dest, tag):
        self.send(obj, dest, tag)
        return Taken()


class Taken:
    """A send its receiver took."""

    def Test(self):
        return True


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


def test_timers_run_in_idle_moments_at_their_period_and_a_failing_one_stays_scheduled(vtime):
    loop = EventLoop(Comm(vtime=vtime), clock=vtime.clock, idle_sleep_s=1e-4, max_sleep_s=1e-3, collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    ticks, once, broken = [], [], []

    def fail():
        broken.append(vtime.now)
        return 1 / 0

    loop.every(0.02, lambda: ticks.append(vtime.now), name="tick")
    loop.after(0.05, lambda: once.append(vtime.now), name="once")
    loop.after(0.05, lambda: once.append("cancelled"), name="cancelled").cancel()
    loop.every(0.03, fail, name="broken")
    counters = loop.run(stop_when=lambda: vtime.now > 0.3)
    # Each runs at the first idle moment after it is due: within one sleep (at most
    # max_sleep_s, the idle loop's reaction time) of it; a period counts from the last run.
    eps, slack = 1e-9, 1e-3  # eps: float sums of virtual seconds
    assert len(once) == 1 and 0.05 - eps <= once[0] <= 0.05 + slack + eps, once
    gaps = [b - a for a, b in zip([0.0, *ticks], ticks)]
    assert all(0.02 - eps <= gap <= 0.02 + slack + eps for gap in gaps), gaps
    assert 14 <= len(ticks) <= 15  # 0.3 s / (20 to 21 ms)
    failed_gaps = [b - a for a, b in zip([0.0, *broken], broken)]
    assert all(0.03 - eps <= gap <= 0.03 + slack + eps for gap in failed_gaps) and len(broken) >= 9, failed_gaps
    assert counters["timer_errors"] == len(broken) and counters["timer_runs"] == len(ticks) + 1
    assert counters["sleeps"] == len(vtime.sleeps) > 0 and counters["messages"] == 0


@pytest.mark.parametrize("message_s", [0.004, 0.05])
def test_under_constant_load_an_overdue_timer_runs_between_two_messages(vtime, message_s):
    """The loop never idles (a message always waits); a timer runs between two messages
    once overdue by ``busy_after_s``, however long each message takes (4 ms, or more than
    the period)."""
    loop = EventLoop(Comm(forever=(REPORT, 1, {}), vtime=vtime), clock=vtime.clock, idle_sleep_s=1e-4,
                     collect_every_s=None)
    loop.on(REPORT, lambda report, source: vtime.advance(message_s))
    loop.when_idle(lambda now: pytest.fail("the loop never idles here"))
    ticks = []
    loop.every(0.02, lambda: ticks.append(vtime.now), name="tick", busy_after_s=0.01)
    counters = loop.run(stop_when=lambda: vtime.now > 0.6)
    # due 20 ms after the last run, overdue 10 ms later: it runs after the first message
    # that ends past that
    gaps = [b - a for a, b in zip([0.0, *ticks], ticks)]
    assert all(0.03 - 1e-9 <= gap <= 0.03 + message_s + 1e-9 for gap in gaps), gaps
    assert len(ticks) >= 0.6 / (0.03 + message_s) - 1
    assert counters["sleeps"] == 0 and vtime.sleeps == [] and counters["messages"] >= 0.6 / message_s - 1


def test_an_idle_loop_naps_then_backs_off_to_its_longest_sleep_with_one_probe_between(vtime):
    """Within ``short_idle_s`` of the last message: naps of ``idle_sleep_s``, ``spin``
    probes between two; then sleeps doubling up to ``max_sleep_s``, one probe between two:
    an idle controller wakes every ``max_sleep_s`` and probes once (its share of a core is
    measured by benchmarks/bench_runtime.py)."""
    loop = EventLoop(Comm(vtime=vtime), clock=vtime.clock, spin=200, idle_sleep_s=2e-4, short_idle_s=0.01,
                     max_sleep_s=5e-3, collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    counters = loop.run(stop_when=lambda: vtime.now > 0.5)
    spins = next(i for i, sleep in enumerate(vtime.sleeps) if sleep != (2e-4, 200))
    # 10 ms of 0.2 ms naps, and the first backoff sleep (as long, after spin probes too)
    assert 50 <= spins <= 52, vtime.sleeps[:60]
    backoff = vtime.sleeps[spins:]
    assert [s for s, _ in backoff[:4]] == pytest.approx([4e-4, 8e-4, 1.6e-3, 3.2e-3])
    assert all(s == 5e-3 for s, _ in backoff[4:]) and all(probes == 1 for _, probes in backoff)
    assert len(backoff) == pytest.approx(4 + (0.5 - 0.0162) / 5e-3, abs=2)  # ~100 wake-ups in 0.5 s
    assert counters["sleeps"] == len(vtime.sleeps)


# ------------------------------------------------------------- the order clients are served in


class ArrivalOrder(Comm):
    """MPI's matching as the event loop relies on it (MPICH keeps one queue of arrived,
    unmatched messages): a probe for any tag gets the oldest arrived message, a probe for
    one tag the oldest with that tag. Closed-loop clients: each has one message in flight
    and sends its next as soon as its reply comes (queue clients ask, the control client
    reports), ``rounds`` messages each; the loop is stopped once every client is done and
    nothing is left. ``served``: the sources in the order their messages were received;
    ``ahead``: per control report, the queue requests received between its arrival and its
    own."""

    def __init__(self, clients: dict[int, int], rounds: int, first: list[int]):
        super().__init__()
        self.clients, self.rounds, self.loop = clients, rounds, None
        self.left = {rank: rounds for rank in clients}
        self.served: list[int] = []
        self.ahead: list[int] = []
        self.arrived: deque = deque()
        for rank in first:
            self._arrive(rank)

    def _arrive(self, rank: int) -> None:
        self.left[rank] -= 1
        tag = self.clients[rank]
        self.arrived.append((tag, rank, {"op": "ask", "instance": rank, "max": 1} if tag == QUEUE_REQUEST
                             else {"seq": self.rounds - self.left[rank]}, len(self.served)))

    def improbe(self, source, tag, status):
        for i, (entry_tag, rank, payload, arrived_at) in enumerate(self.arrived):
            if tag in (MPI.ANY_TAG, entry_tag):
                del self.arrived[i]
                if entry_tag == REPORT:
                    self.ahead.append(sum(self.clients[r] == QUEUE_REQUEST for r in self.served[arrived_at:]))
                self.served.append(rank)
                status.Set_tag(entry_tag)
                status.Set_source(rank)
                return Message(payload)
        if not self.arrived and not any(self.left.values()):
            self.loop.stop("every client is done")
        return None

    def send(self, obj, dest, tag):
        super().send(obj, dest, tag)
        if self.left[dest]:
            self._arrive(dest)


def serve_four_clients(rule: str, rounds: int = 20, first: tuple = (4, 1, 2, 3)) -> ArrivalOrder:
    """Queue clients 1-3 and control client 4 (REPORT, acked with COMMAND) served by the
    event loop (``rule`` "loop") or by the wrong rule of tests/loop_world.py that reads other
    messages only when the queue is idle ("control-when-idle")."""
    comm = ArrivalOrder({1: QUEUE_REQUEST, 2: QUEUE_REQUEST, 3: QUEUE_REQUEST, 4: REPORT}, rounds, list(first))
    comm.loop = loop = EventLoop(comm, idle_sleep_s=0, collect_every_s=None)
    service = Service()

    def control(report, source):
        comm.send({"ack": report["seq"]}, dest=source, tag=COMMAND)

    if rule == "loop":
        QueueHandler(comm, service).attach(loop)
        loop.on(REPORT, control)
        loop.on(TOOL_DONE, lambda completion, source: None)
        loop.run()
    else:
        loop_world.run_control_when_idle(comm, loop, service, control, lambda completion, source: None)
    assert sorted(comm.served) == sorted([1, 2, 3, 4] * rounds) and loop.stopped == "every client is done"
    return comm


@pytest.mark.parametrize("first", [(1, 2, 3, 4), (4, 1, 2, 3), (2, 4, 3, 1)])
def test_arrival_order_gives_each_client_one_turn_per_round_whatever_the_queue_load(first):
    """The fairness the loop owes its control client: served in arrival order, each of the
    four clients (one message in flight each) gets exactly one turn in every round of four,
    and a control report waits behind at most one request per queue client."""
    comm = serve_four_clients("loop", first=first)
    rounds = [comm.served[i:i + 4] for i in range(0, len(comm.served), 4)]
    assert all(sorted(r) == [1, 2, 3, 4] for r in rounds), rounds
    assert comm.served[:4] == list(first) and len(comm.ahead) == 20 and max(comm.ahead) <= 3, comm.ahead


def test_the_fairness_check_catches_a_loop_that_reads_control_messages_only_when_idle():
    comm = serve_four_clients("control-when-idle")
    control_turns = [r.count(4) for r in (comm.served[i:i + 4] for i in range(0, 60, 4))]
    assert control_turns == [0] * 15  # starved while the queue is busy: 60 queue requests first
    assert comm.served[:60].count(4) == 0 and comm.served[60:] == [4] * 20 and max(comm.ahead) == 60


# ------------------------------------------------------------------- real MPI worlds

def run_loop_world(scenario: str, ranks: int, tmp_path: Path) -> dict:
    out = tmp_path / f"{scenario}.json"
    run_world("loop_world.py", ranks, scenario, out, timeout=120, what=f"the loop world {scenario}")
    return json.loads(out.read_text())


@pytest.mark.mpi
def test_the_loop_serves_queue_and_control_clients_at_once_and_goes_on_after_errors(tmp_path):
    summary = run_loop_world("mixed", 6, tmp_path)
    clients, order = summary["clients"], summary["order"]
    served = lambda kind, rank: sum(1 for k, r in order if (k, r) == (kind, rank))
    # Every round trip of every client answered, through one loop serving both kinds; the
    # control client was served while queue requests were still being served (its rate
    # beside a busy queue, and the fairness of the order, are benchmarks/bench_runtime.py's
    # and the in-process tests' above).
    rounds = loop_world.ROUNDS
    askers = (*loop_world.QUEUE_CLIENTS, loop_world.CONTROL_CLIENT)
    assert [clients[str(rank)]["count"] for rank in askers] == [rounds] * 4
    assert [served("queue", rank) for rank in loop_world.QUEUE_CLIENTS] == [rounds] * 3
    assert served("control", loop_world.CONTROL_CLIENT) == rounds + 1  # and its done report
    # Timers fire while requests flow (serving takes 3 × ROUNDS × SERVICE_S of rank 0's
    # time, many tick periods: an overdue tick runs between two messages) and in the idle
    # stretch after the clients are done (a tick is due before the loop's stop).
    last_queue = max(i for i, (kind, _) in enumerate(order) if kind == "queue")
    ticks_after = summary["ticks_after"]
    assert any(0 < n <= last_queue for n in ticks_after), (ticks_after, last_queue)
    assert ticks_after[-1] == len(order), (ticks_after, len(order))
    # Errors: each named with rank 5 and counted; the loop went on serving rank 5.
    counters, errors = summary["counters"], clients[str(loop_world.ERROR_CLIENT)]
    assert counters["bad_payloads"] == 2 and counters["handler_errors"] == 1 and counters["unexpected"] == 1
    assert len(summary["log"]) == 4 and all("rank 5" in line for line in summary["log"]), summary["log"]
    assert errors["malformed_reply"]["reason"] == "malformed" and "rank 5" in errors["malformed_reply"]["error"]
    assert errors["after_errors"] == "answered" and errors["completions_sent"] == loop_world.COMPLETIONS
    assert summary["tools"] == list(range(loop_world.COMPLETIONS)) and served("queue", loop_world.ERROR_CLIENT) == 1
    assert counters["messages"] == len(order) + 3  # the two that did not unpickle and the stray one
    assert summary["stopped"] == "every client is done"


@pytest.mark.mpi
def test_an_idle_loop_sleeps_runs_its_timers_and_still_answers(tmp_path):
    summary = run_loop_world("idle", 2, tmp_path)
    # Rank 1 slept IDLE_S (ten tick periods) before its report: rank 0 slept and ran its
    # timer meanwhile, then answered. How much of a core it used and how late it saw the
    # report are benchmarks/bench_runtime.py's.
    assert summary["stopped"] == "the report came" and summary["order"] == [["control", 1]]
    assert summary["counters"]["sleeps"] > 0 and summary["counters"]["messages"] == 1
    assert summary["ticks_after"] and all(n == 0 for n in summary["ticks_after"])


@pytest.mark.mpi
def test_rank_0_never_waits_for_a_worker_that_takes_no_message(tmp_path):
    """A trainer inside a four-pass step takes no command for tens of seconds; rank 0 sent
    it commands with blocking sends and stopped routing turns until the step ended (every
    default run: one 12-28 s stall). Through the outbox the handler returns at once, though
    the big command (and the small ones past MPICH's queue) are still untaken when the go
    leaves; everything arrives, in order, once the worker takes it."""
    summary = run_loop_world("busy-worker", 2, tmp_path)
    busy, burst = summary["busy"], loop_world.BURST
    assert summary["stopped"] == "the worker took its commands"
    assert busy["untaken_at_go"] >= 1  # the sends returned before their receiver took them
    assert busy["received"] == list(range(burst + 1)) and busy["big"] == loop_world.BIG
    assert summary["outbox"] == {"sent": burst + 2, "left": {}}

