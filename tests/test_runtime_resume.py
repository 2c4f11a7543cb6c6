"""The job's checkpoint files (libra_hpc/runtime/resume.py): atomic commit, verification
against the manifest, fallback to the previous checkpoint, pruning; the prompt stream's
position and the metrics rewind a resumed run relies on. Pure: no MPI, no torch."""

from __future__ import annotations

import json

import pytest

from libra_hpc.runtime.resume import CheckpointInvalid, CheckpointStore, remove_leftover_relayouts


def _save(store: CheckpointStore, version: int, payload: bytes = b"weights" * 100) -> None:
    stage = store.staging(version)
    (stage / "train").mkdir()
    (stage / "train" / "shard.bin").write_bytes(payload)
    store.commit(stage, version, {"note": f"v{version}"})


def test_a_committed_checkpoint_verifies_and_the_newest_is_found(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for v in (2, 4, 6):
        _save(store, v)
    loaded, rejected = store.latest()
    assert loaded.version == 6 and loaded.state == {"note": "v6", "version": 6} and rejected == []
    assert loaded.path == tmp_path / "checkpoints" / "step-000006"
    assert not list((tmp_path / "checkpoints").glob(".*"))  # nothing left staged


def test_only_the_newest_keep_are_kept(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for v in (1, 2, 3, 4):
        _save(store, v)
    assert store.versions() == [4, 3]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "delete"])
def test_a_damaged_checkpoint_is_rejected_and_the_previous_one_used(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 3)
    _save(store, 5)
    newest = store.path(5)
    shard = newest / "train" / "shard.bin"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        data[17] ^= 0x04
        shard.write_bytes(bytes(data))
    elif damage == "manifest":
        (newest / "MANIFEST.json").unlink()
    else:
        shard.unlink()
    with pytest.raises(CheckpointInvalid) as caught:
        store.verify(5)
    assert str(newest) in str(caught.value)
    loaded, rejected = store.latest()
    assert loaded.version == 3
    assert [p for p, _ in rejected] == [newest]
    said = rejected[0][1]
    assert {"truncate": "truncated", "flip": "SHA-256", "manifest": "MANIFEST.json", "delete": "missing"}[damage] in said


def test_a_save_cut_short_is_never_loaded(tmp_path):
    """A kill while the trainers write leaves only the hidden staging folder: invisible
    to latest(), replaced by the next save of that version."""
    store = CheckpointStore(tmp_path)
    _save(store, 2)
    stage = store.staging(4)
    (stage / "half.bin").write_bytes(b"x")
    loaded, rejected = store.latest()
    assert loaded.version == 2 and rejected == []
    again = store.staging(4)
    assert again == stage and list(again.iterdir()) == []


def test_a_checkpoint_renamed_to_another_version_is_rejected(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 2)
    store.path(2).rename(store.path(7))
    with pytest.raises(CheckpointInvalid, match="version 2, its name 7"):
        store.verify(7)


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert CheckpointStore(tmp_path).latest() == (None, [])


def test_the_prompt_stream_continues_where_its_state_was_taken():
    from libra_hpc.config import load_config
    from libra_hpc.envs.registry import task_from_config
    from libra_hpc.rl.rollout import PromptSampler

    cfg = load_config(None, ["rl.task=search", "tasks.search.train_prompts=7", "tasks.search.heldout_prompts=3",
                             "tasks.search.entities=40"])
    task = task_from_config(cfg)
    straight = PromptSampler(task.splits, seed=3)
    drawn = [[p.pid for p in straight.next(3)] for _ in range(2)]
    state = json.loads(json.dumps(straight.state()))  # through JSON, as state.json holds it
    rest = [[p.pid for p in straight.next(3)] for _ in range(4)]  # crosses into a new pass
    resumed = PromptSampler(task.splits, seed=3)
    resumed.restore(state)
    assert [[p.pid for p in resumed.next(3)] for _ in range(4)] == rest
    assert drawn  # the first draws happened before the state was taken
    with pytest.raises(ValueError, match="not in the training split"):
        resumed.restore({"epoch": 1, "left": ["nope"]})


def test_rewinding_the_metrics_keeps_earlier_steps_and_other_rows(tmp_path):
    from libra_hpc.metrics.runlog import RunLog, read_jsonl

    log = RunLog(tmp_path, "x: 1\n")
    for b in range(5):
        log.metric(b, version=b + 1)
    log.metrics.write("note", what="not a step")
    log.metrics._file.write('{"kind": "step", "step": 5, "tor')  # a line cut by a kill
    log.metrics._file.flush()
    assert log.rewind_metrics(3) == 2  # steps 3 and 4; the torn line is not a record
    log.metric(3, version=4)
    log.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r.get("step")) for r in rows] == [("step", 0), ("step", 1), ("step", 2), ("note", None), ("step", 3)]


def test_steps_and_events_share_one_time_origin_across_a_rewind(tmp_path):
    """A fresh run rewinds its metrics once it knows there is no checkpoint (after the warm
    start): the step rows' ``elapsed_s`` must still count from the run's start, as the
    events' do, or the plots place the events against the wrong steps."""
    from libra_hpc.metrics.runlog import RunLog, read_jsonl

    now = [1000.0]
    log = RunLog(tmp_path, "x: 1\n", clock=lambda: now[0])
    now[0] = 1190.0  # the warm start
    log.rewind_metrics(0)
    log.event("hybrid", what="lend")
    log.metric(0, version=1)
    log.close()
    (event,), (step,) = read_jsonl(tmp_path / "events.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    assert event["elapsed_s"] == step["elapsed_s"] == 190.0


def test_a_killed_runs_relayout_folders_are_removed_and_nothing_else(tmp_path):
    """A run killed during a hybrid join leaves ``relayout-v1/`` (the policy handed between
    ranks); the resumed run starts its layout versions over, and its first join found the
    folder taken ("save_checkpoint: relayout-v1 is not empty")."""
    for name in ("relayout-v1", "relayout-v12"):
        (tmp_path / name / "train").mkdir(parents=True)
        (tmp_path / name / "train" / "shard.bin").write_bytes(b"x")
    for keep in ("relayout-notes", "checkpoints", "relayout-v3.txt"):
        (tmp_path / keep).mkdir() if "." not in keep else (tmp_path / keep).write_text("mine")
    assert remove_leftover_relayouts(tmp_path) == ["relayout-v1", "relayout-v12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "relayout-notes", "relayout-v3.txt"]
    assert remove_leftover_relayouts(tmp_path) == []


def test_a_job_starting_in_a_killed_runs_folder_removes_its_relayouts_and_says_so(tmp_path):
    from types import SimpleNamespace

    from libra_hpc.runtime.checkpointing import CheckpointDriver

    (tmp_path / "relayout-v1").mkdir()
    events = []
    cfg = SimpleNamespace(job=SimpleNamespace(checkpoint_keep=2, checkpoint_every_steps=1, eval_checkpoint=None),
                          rl=SimpleNamespace(partial_rollout=False, steps=4))
    runlog = SimpleNamespace(folder=tmp_path, event=lambda kind, **kw: events.append((kind, kw)),
                             rewind_metrics=lambda step: 0)
    assert CheckpointDriver(SimpleNamespace(cfg=cfg, runlog=runlog)).find() is None
    assert not (tmp_path / "relayout-v1").exists()
    assert events == [("leftovers_removed", {"what": ["relayout-v1"],
                                             "why": "layout changes of a run that did not finish"})]


def test_a_run_that_died_before_its_first_checkpoint_starts_over_without_its_rows(tmp_path):
    """Requeued before any checkpoint was saved: the next run starts from step 0 in the same
    log folder; the dead run's step rows go, or those steps would be counted twice."""
    from libra_hpc.config import load_config
    from libra_hpc.metrics.runlog import RunLog, read_jsonl
    from libra_hpc.runtime.checkpointing import CheckpointDriver
    from libra_hpc.runtime.state import JobState

    first = RunLog(tmp_path, "x: 1\n")
    for b in range(2):
        first.metric(b, version=b + 1)
    first.close()
    log = RunLog(tmp_path, "x: 1\n")
    driver = CheckpointDriver(JobState(load_config(None, []), log, rank_of=lambda slot: 0))
    assert driver.find() is None
    log.metric(0, version=1)
    log.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "step"] == [0]
    restarted = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "restarted"]
    assert len(restarted) == 1 and restarted[0]["metric_rows_dropped"] == 2
