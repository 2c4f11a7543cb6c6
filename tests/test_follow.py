"""events.jsonl: writing it, reading it while it grows, and printing it for a person."""
from __future__ import annotations

import io
import json

import pytest

from libra_hpc.cluster.follow import follow, format_event
from libra_hpc.cluster.layout import initial_layout, lend_hybrid_to_training
from libra_hpc.metrics.runlog import JsonlWriter, RunLog, read_jsonl


def fake_clock(*times: float):
    it = iter(times)
    return lambda: next(it)


def one_line(text: str) -> str:
    assert "\n" not in text
    return text


# ------------------------------------------------------------------- format_event


def test_world_started():
    event = {"t": 1.0, "elapsed_s": 0.5, "kind": "world_started", "world_size": 13, "nodes": 6,
             "gpus_per_node": 2, "emulated_nodes": True, "ranks": {"1": {"slot": "n0g0"}}, "backend": "gloo"}
    line = one_line(format_event(event))
    assert line.startswith("[    0.50s] world_started")
    for fact in ("13 ranks", "6 nodes × 2", "(emulated nodes)", "gloo"):
        assert fact in line
    assert "emulated" not in format_event({**event, "emulated_nodes": False})


@pytest.mark.parametrize("kind", ["layout_planned", "layout_applied"])
def test_layout_events(kind):
    base = initial_layout(6, 2, 2, 1, 2, [[1, 1], [2]], hybrid_nodes=1)
    layout = lend_hybrid_to_training(base, "lend the hybrid pool") if kind == "layout_applied" else base
    event = {"t": 5.0, "elapsed_s": 12.5, "kind": kind, "step": 2, "apply_s": 0.01, **layout.summary()}
    event = json.loads(json.dumps(event))  # as read back from events.jsonl
    line = one_line(format_event(event))
    assert line.startswith(f"[   12.50s] {kind}: v{layout.version} ")
    train = layout.training
    assert f"training {len(train.slots)} GPUs (TP{train.tp}×PP{train.pp}×DP{train.dp})" in line
    assert f"rollout {len(layout.slots_of('rollout'))} GPUs as TP {[g.tp for g in layout.rollout_instances]}" in line
    assert line.endswith(layout.reason)


@pytest.mark.parametrize("ok, word", [(True, "ok"), (False, "FAILED")])
def test_group_check(ok, word):
    groups = {"training": {"size": 4}, "rollout-1": {"size": 1}, "rollout-2": {"size": 2}}
    line = one_line(format_event({"elapsed_s": 3, "kind": "group_check", "step": 7, "ok": ok, "groups": groups}))
    assert line.endswith(f"group_check: step 7 {word}, 3 groups")


def test_failure():
    line = one_line(format_event({"elapsed_s": 9, "kind": "failure", "rank": 3,
                                  "error": "TopologyError: node 1 has 3 worker ranks"}))
    assert line.endswith("failure: rank 3: TopologyError: node 1 has 3 worker ranks")


def test_shutdown_and_unknown_kinds_show_their_fields():
    line = one_line(format_event({"t": 1, "elapsed_s": 20, "kind": "shutdown", "steps": 6, "final_layout_version": 2}))
    assert "shutdown" in line and "'steps': 6" in line and "'final_layout_version': 2" in line
    assert "'t'" not in line and "elapsed_s" not in line
    assert format_event({"kind": "tick"}) == "[    0.00s] tick"  # no fields, no elapsed_s
    assert "'x': 1" in format_event({"kind": "something_new", "x": 1})


# ----------------------------------------------------------------- writer / reader


def test_jsonl_writer(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(path, clock=fake_clock(100.0, 101.5, 103.25))
    first = writer.write("world_started", world_size=5)
    writer.write("shutdown", steps=2, where=tmp_path)  # non-JSON values become strings
    # flushed after each record: readable before close
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert records[0] == first == {"t": 101.5, "elapsed_s": 1.5, "kind": "world_started", "world_size": 5}
    assert records[1] == {"t": 103.25, "elapsed_s": 3.25, "kind": "shutdown", "steps": 2, "where": str(tmp_path)}
    writer.close()
    # a second writer (a requeued job) appends
    again = JsonlWriter(path, clock=fake_clock(200.0, 200.0))
    again.write("world_started")
    again.close()
    assert [r["kind"] for r in read_jsonl(path)] == ["world_started", "shutdown", "world_started"]


def test_runlog_folder(tmp_path):
    log = RunLog(tmp_path / "libra-42", "cluster: {}\n")
    log.event("failure", rank=1, error="boom")
    log.metric(0, step_s=0.5)
    log.close()
    assert (tmp_path / "libra-42" / "config.yaml").read_text() == "cluster: {}\n"
    assert [e["kind"] for e in read_jsonl(tmp_path / "libra-42" / "events.jsonl")] == ["failure"]
    assert read_jsonl(tmp_path / "libra-42" / "metrics.jsonl")[0]["step"] == 0


def test_read_jsonl_skips_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "a"}\n{"kind": "b"}\n{"kind": "c", "elap')
    assert read_jsonl(path) == [{"kind": "a"}, {"kind": "b"}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


# ------------------------------------------------------------------------- follow


def _append(path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def _event(kind: str, **fields) -> str:
    return json.dumps({"elapsed_s": 1.0, "kind": kind, **fields}) + "\n"


def test_follow_prints_events_as_they_arrive(tmp_path):
    path = tmp_path / "events.jsonl"  # does not exist yet when following starts
    script = [
        lambda: None,
        lambda: _append(path, _event("a", x=1)),
        lambda: _append(path, _event("b", x=2) + '{"kind": "c", "x"'),  # c is being written
        lambda: _append(path, ': 3, "elapsed_s": 1.0}\n'),
        lambda: _append(path, _event("d", x=4)),  # written as the job ends: still shown
    ]
    calls = {"n": 0}
    printed_before = []
    out = io.StringIO()

    def finished() -> bool:
        printed_before.append(out.getvalue().count("\n"))
        script[calls["n"]]()
        calls["n"] += 1
        return calls["n"] == len(script)

    events = follow(path, finished, out, poll_s=0)
    assert calls["n"] == len(script)  # stopped at the first True
    assert [e["kind"] for e in events] == ["a", "b", "c", "d"]
    lines = out.getvalue().splitlines()
    assert lines == [format_event(e) for e in events]  # each event once, in order
    # printed while running, not all at the end
    assert printed_before == [0, 0, 1, 2, 3]


def test_follow_when_already_finished(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_event("shutdown", steps=1))
    out = io.StringIO()
    events = follow(path, lambda: True, out, poll_s=0)
    assert [e["kind"] for e in events] == ["shutdown"]
    assert out.getvalue().count("\n") == 1
