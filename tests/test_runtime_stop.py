"""Slurm's time-limit warning during the first step (``CheckpointDriver.on_stop``): the
step in flight finishes and its version is saved before the run ends. Ending at once left
the trainers posting a policy that no leader took, and the world's exit waited on them
until the heartbeat timeout (seen in the requeue test when the warning came at step 0)."""

from __future__ import annotations

from types import SimpleNamespace

from libra_hpc.runtime.checkpointing import CheckpointDriver


def _driver(tmp_path, **job):
    cfg = SimpleNamespace(job=SimpleNamespace(**{"checkpoint_keep": 2, "checkpoint_every_steps": 0,
                                                 "checkpoint_on_stop": True, "stop_grace_s": 60, **job}),
                          cluster=SimpleNamespace(requeue=True, max_requeues=3))
    clock = SimpleNamespace(now=1000.0)
    stop = SimpleNamespace(at=1000.0, clock=lambda: clock.now, signal="SIGUSR2")
    service = SimpleNamespace(stats=lambda: {"leased": 5, "active": 9})
    events = []
    runlog = SimpleNamespace(folder=tmp_path, event=lambda kind, **kw: events.append((kind, kw)))
    c = SimpleNamespace(cfg=cfg, runlog=runlog, phase="rl", version=0, training=False, stop=stop, service=service,
                        clock=clock, events=events)
    d = CheckpointDriver(c)
    d.saves = []

    def stop_now():  # what the controller does with the answer (JobController._stop_now)
        what = d.on_stop(c.phase, relaying=False)
        if what == "save":
            d.saves.append(c.version)
            d.pending = {"version": c.version}
        return what == "done"

    d.stop_now = stop_now
    return c, d


def test_a_stop_during_the_first_steps_training_waits_for_it_and_saves_its_version(tmp_path):
    c, d = _driver(tmp_path)
    c.training = True
    assert not d.stop_now()  # the trainers are in step 0: it finishes first
    c.training, c.version = False, 1
    assert not d.stop_now() and d.saves == [1]  # then version 1 is saved ...
    d.pending, d.saved_version = None, 1
    assert d.stop_now()  # ... and the run ends


def test_a_stop_before_anything_trained_ends_at_once_without_a_checkpoint(tmp_path):
    c, d = _driver(tmp_path)
    assert d.stop_now() and d.saves == []  # rollouts of step 0 only: resume from the start
    c.phase = "eval:warmstart"
    assert not d.stop_now()  # the held-out evaluation before the first step: its shares come back first
    c.clock.now += 61  # ... unless they outlast job.stop_grace_s
    assert d.stop_now() and d.saves == []


def test_without_checkpoint_on_stop_a_step_in_flight_still_finishes(tmp_path):
    c, d = _driver(tmp_path, checkpoint_on_stop=False)
    c.version, c.training = 3, True
    assert not d.stop_now()
    c.training, c.version = False, 4
    assert d.stop_now() and d.saves == []


def test_a_step_that_outlasts_the_grace_is_abandoned_and_the_job_requeues_from_its_newest_checkpoint(
        tmp_path, monkeypatch):
    """job.stop_grace_s: the step in flight when the warning came (TP-2 instances busy, the
    trainers in step 5) has not ended 60 s later: the run ends there, says what was going
    on when the stop came, and asks Slurm to requeue it from the newest checkpoint."""
    from libra_hpc.runtime.resume import REQUEUE_FILE

    c, d = _driver(tmp_path)
    stage = d.store.staging(4)
    d.store.commit(stage, 4, {})  # a periodic save of an earlier step
    c.version, c.training = 5, True
    c.clock.now = 1060.0
    assert not d.stop_now() and d.abandoned is None  # 60 s: not past the grace
    c.clock.now = 1060.5
    assert d.stop_now() and d.abandoned == 60.5 and d.saves == []
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    d.after_stop("SIGUSR2", "rl")
    [(kind, said), (asked, _)] = c.events
    assert kind == "stop_requested" and asked == "requeue_requested"
    assert said == {"signal": "SIGUSR2", "phase": "rl", "version": 5, "training": True, "rollout_turns_running": 5,
                    "rollout_trajectories_in_flight": 9, "abandoned_after_s": 60.5}
    assert (tmp_path / REQUEUE_FILE).read_text().endswith(f"resume from {d.store.path(4)}\n")


def test_a_step_that_ends_within_the_grace_is_saved_and_the_stop_says_so(tmp_path, monkeypatch):
    c, d = _driver(tmp_path)
    c.version, c.training = 5, True
    assert not d.stop_now()
    c.clock.now, c.version, c.training = 1030.0, 6, False  # the step ended 30 s after the warning
    assert not d.stop_now() and d.saves == [6] and d.abandoned is None
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    d.after_stop("SIGUSR2", "rl")
    assert c.events[0][1]["training"] is True and "abandoned_after_s" not in c.events[0][1]
    assert c.events[1][0] == "requeue_not_requested"


def test_a_stop_in_the_final_evaluation_saves_the_last_version_so_the_resume_only_evaluates(tmp_path):
    """Seen in the soak: the warning came during the final evaluation (every step trained,
    the newest checkpoint two steps back); the requeued run trained those steps again and
    met the (cut) limit in the evaluation again, until it ran out of requeues."""
    c, d = _driver(tmp_path)
    c.phase, c.version, d.saved_version = "eval:final", 12, 10
    assert not d.stop_now() and d.saves == []  # the evaluation's shares come back first,
    c.phase = "export"
    assert not d.stop_now() and d.saves == []  # the export too (then the run is complete)
    c.clock.now += 61  # past job.stop_grace_s: the last version is saved
    assert not d.stop_now() and d.saves == [12]
    assert not d.stop_now()  # the save in flight finishes first
    d.pending, d.saved_version = None, 12
    assert d.stop_now() and d.saves == [12]
    c2, d2 = _driver(tmp_path, checkpoint_on_stop=False)
    c2.phase, c2.version = "export", 12
    c2.clock.now += 61
    assert d2.stop_now() and d2.saves == []
