"""Slurm's time-limit warning during the first step (``CheckpointDriver.on_stop``): the
step in flight finishes and its version is saved before the run ends. Ending at once left
the trainers posting a policy that no leader took, and the world's exit waited on them
until the heartbeat timeout (seen in the requeue test when the warning came at step 0)."""

from __future__ import annotations

from types import SimpleNamespace

from libra_hpc.runtime.checkpointing import CheckpointDriver


def _driver(tmp_path, **job):
    cfg = SimpleNamespace(job=SimpleNamespace(**{"checkpoint_keep": 2, "checkpoint_every_steps": 0,
                                                 "checkpoint_on_stop": True, **job}))
    c = SimpleNamespace(cfg=cfg, runlog=SimpleNamespace(folder=tmp_path), phase="rl", version=0, training=False)
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
    c.phase, c.training = "eval", True
    assert d.stop_now()  # the held-out evaluation before the first step


def test_without_checkpoint_on_stop_a_step_in_flight_still_finishes(tmp_path):
    c, d = _driver(tmp_path, checkpoint_on_stop=False)
    c.version, c.training = 3, True
    assert not d.stop_now()
    c.training, c.version = False, 4
    assert d.stop_now() and d.saves == []
