"""A trajectory reported twice reaches the trainers once (libra_hpc/runtime/controller.py
``_on_traj``). A lease that expires under a live leader (it stalled past
``scheduler.lease_s``, or the queue did not know its instance for that long) makes the
queue run the turn again elsewhere, and both copies finish: the first report counts, the
copy is routed nowhere, also when it arrives after its batch trained. The controller's
side only, driven by hand the way the event loop drives it."""

from __future__ import annotations

from types import SimpleNamespace

from libra_hpc.runtime.controller import JobController
from libra_hpc.runtime.partial import PartialDriver
from tests.test_runtime_partial import FakeController, finish, prompts


class WholeStepController(FakeController):
    """What ``_on_traj`` uses of JobController on the whole-batch path."""

    _on_traj = JobController._on_traj
    _first_report = JobController._first_report

    def __init__(self):
        super().__init__(prompts_per_step=1, group_size=2)
        self.cfg.rl.stream_training = False
        self.cfg.batch_size = 2
        self.partial = None
        self.batches = {0: {"done": 0, "tids": set(), "tokens": {}, "rows": [], "groups": {}}}
        self.group_dest: dict[str, int] = {}
        self.duplicate_reports = 0
        self.streamed: list[int] = []

    def _stream(self, b: int) -> None:
        self.streamed.append(b)


def report(tid, leader, instance=1):
    return {"op": "traj", "tid": tid, "instance": instance, "tokens": 12, "gen_tokens": 7}, leader


def routes(c):
    return [(rank, m["tid"], m["dest"]) for rank, m in c.sent if m["op"] == "route"]


def test_a_trajectory_finished_twice_counts_once_and_its_copy_is_routed_nowhere():
    c = WholeStepController()
    c._on_traj(*report("b0/p0/0", leader=10))
    c._on_traj(*report("b0/p0/0", leader=11, instance=2))  # the re-run copy at another leader
    assert c.batches[0]["done"] == 1 and len(c.batches[0]["rows"]) == 1 and c.train_calls == 0
    assert routes(c) == [(10, "b0/p0/0", [20]), (11, "b0/p0/0", [])]
    assert c.duplicate_reports == 1
    [(kind, warning)] = c.events
    assert kind == "warning" and "b0/p0/0" in warning["line"] and warning["rank"] == 11
    c._on_traj(*report("b0/p0/1", leader=11, instance=2))  # the batch completes with its other member
    assert c.batches[0]["done"] == 2 and c.train_calls == 1 and c.streamed == [0]


def test_a_copy_arriving_after_its_batch_trained_is_dropped_not_a_crash():
    c = WholeStepController()
    for k in (0, 1):
        c._on_traj(*report(f"b0/p0/{k}", leader=10))
    del c.batches[0]  # step 0 trained: its books are gone
    c._on_traj(*report("b0/p0/1", leader=12, instance=3))
    assert routes(c)[-1] == (12, "b0/p0/1", []) and c.duplicate_reports == 1


def test_partial_rollout_drops_a_copy_but_still_takes_a_late_finish_of_an_aborted_trajectory():
    c = FakeController(prompts_per_step=1)
    c.partial = d = PartialDriver(c)
    c.duplicate_reports = 0
    first = JobController._first_report.__get__(c)
    d.submit(0, prompts("p0"))
    finish(d, "b0/p0/0")
    assert first({"tid": "b0/p0/1"}, 10)  # not finished yet: the first report
    assert first({"tid": "b0/p0/0"}, 11) is False and c.duplicate_reports == 1
    assert c.sent[-1] == (11, {"op": "route", "tid": "b0/p0/0", "dest": [], "replica": None})
    d.aborting["b0/p0/1"] = SimpleNamespace()  # its group regenerated: an abort is awaited
    assert first({"tid": "b0/p0/1"}, 10)  # the driver counts it as a late finish (wasted), not a copy
    assert d.reported("b9/p9/0")  # a group the driver no longer knows: trained or regenerated
