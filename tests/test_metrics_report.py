"""The run report (summary.json, report.md, plots) from a log folder, and the TensorBoard
event-file writer read back by an independent decoder."""

from __future__ import annotations

import json
import re
import socket
import struct
from pathlib import Path

import pytest

from libra_hpc.metrics.prediction import by_term
from libra_hpc.metrics.report import eval_points, fmt, gpus_of, step_ranges, write_report
from libra_hpc.metrics.tensorboard import TensorBoardWriter, crc32c, masked_crc32c

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ["gpu_allocation.png", "throughput.png", "reward.png", "queues.png", "prediction.png"]
PREDICTED_OVER_MEASURED = {1: 1.0, 2: 2.0, 3: 1.0, 4: 0.4, 5: 1.25}
"""The step time the planner predicted over the measured one at steps 1-5 (step 0: none)."""


def write_jsonl(path: Path, records: list[dict], torn_tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)


def step_row(step: int, **fields) -> dict:
    return {"t": 1.7e9 + 10 * step, "elapsed_s": 10.0 * (step + 1), "kind": "step", "step": step, **fields}


def full_step(step: int) -> dict:
    hybrid = {"hybrid_training": 1} if step >= 3 else {"hybrid_rollout": 1}
    return step_row(
        step, version=step + 1, reward=0.3 + 0.1 * step, tokens_per_s=1500.0 + 100 * step,
        rollout_s=6.25, train_s=2.5, step_s=9.0, gpus={"training": 4, "rollout": 3, **hybrid},
        queue_depth={"short": 12 - step, "long": 3}, migrations=step % 2, staleness_max=2,
        staleness_mean=0.75, logprob_gap_kl=0.002, tool_calls=40 + step, tool_s=1.2, idle_s={"training": 0.5},
        trajectories=64, scheduler_policy="cmlfq",
        **({"planner_terms": {"step_s": [9.0 * PREDICTED_OVER_MEASURED[step], 9.0], "rollout_s": [6.25, 6.25],
                              "train_s": [2.0, 2.5]}} if step in PREDICTED_OVER_MEASURED else {}))


def event(elapsed_s: float, kind: str, **fields) -> dict:
    return {"t": 1.7e9 + elapsed_s, "elapsed_s": elapsed_s, "kind": kind, **fields}


@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    """Six steps; step 2 lost its reward and tokens/s, steps 4-5 their tool calls; a
    layout change, a rejected plan, a hybrid replica joining, a failure, and both evals."""
    folder = tmp_path / "agentic-4242"
    folder.mkdir()
    rows = [full_step(s) for s in range(6)]
    del rows[2]["reward"], rows[2]["tokens_per_s"]
    del rows[4]["tool_calls"], rows[5]["tool_calls"]
    write_jsonl(folder / "metrics.jsonl", rows, torn_tail='{"t": 1.7e9, "kind": "st')
    write_jsonl(folder / "events.jsonl", [
        event(0.5, "world_started", nodes=2),
        event(1.0, "eval", phase="warmstart", success=0.43, prompts=200),
        event(25.0, "layout_applied", version=2, reason="planner: lend hybrid to training",
              gpus={"training": 5, "rollout": 3}, predicted_gain_s=3.5),
        event(26.0, "plan_considered", predicted_gain_s=0.25, decision="rejected", reason="gain below the 1 s bar"),
        event(31.0, "hybrid", replica=1, state="syncing", direction="join", pause_s=0.8),
        event(44.0, "failure", rank=3, error="RuntimeError: CUDA out of memory"),
        event(61.0, "eval", phase="final", success=0.87, prompts=200),
    ])
    return folder


SUMMARY = {"steps": 6, "tokens_per_s": 1765.4321, "scheduler_policy": "cmlfq", "heldout_gain": 0.44,
           "layout": {"training": 4, "rollout": 3}}


def test_a_finished_run_gets_summary_plots_and_report(finished_run: Path):
    paths = write_report(finished_run, SUMMARY)

    assert paths == [finished_run / "summary.json", *(finished_run / "plots" / p for p in PLOTS),
                     finished_run / "report.md"]
    for png in paths[1:-1]:
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, png
    text = (finished_run / "summary.json").read_text()
    assert json.loads(text) == SUMMARY
    assert text.index('"heldout_gain"') < text.index('"layout"') < text.index('"steps"')  # sorted keys


def test_report_md_says_what_happened(finished_run: Path):
    write_report(finished_run, SUMMARY)
    report = (finished_run / "report.md").read_text()

    assert report.startswith("# Run report: agentic-4242\n")
    assert "Scheduler policy: **cmlfq**" in report
    assert "| tokens_per_s | 1,765 |" in report and "| heldout_gain | 0.44 |" in report
    assert "Warm start **0.43 → final 0.87**: gain **+0.44** on 200 prompts." in report
    assert "| 2 | – | – | 6.25 | 2.5 | 4/4 | 0 | 2 | 0.002 | 42 |" in report  # the row that lost fields
    assert "| 4 | 0.7 | 1,900 | 6.25 | 2.5 | 5/3 | 0 | 2 | 0.002 | – |" in report  # hybrid GPU counted as training
    assert "Missing: `reward` at step 2; `tokens_per_s` at step 2; `tool_calls` at steps 4–5." in report
    assert "| 25 | layout v2 applied (training 5, rollout 3): planner: lend hybrid to training | 3.5 | – |" in report
    assert "| 26 | plan considered, rejected: gain below the 1 s bar | 0.25 | – |" in report
    assert "| 31 | hybrid replica 1: syncing (join) | – | 0.8 |" in report
    assert "## Failures\n\n- at 44 s, rank 3: RuntimeError: CUDA out of memory" in report
    for name in PLOTS:
        assert f"(plots/{name})" in report
    assert "### layout\n\n| key | value |\n|---|---|\n| rollout | 3 |\n| training | 4 |" in report  # not raw JSON


def test_report_md_says_which_term_of_the_planners_prediction_missed(finished_run: Path):
    terms = {"step_s": {"mean": 1.13}}  # what summary.json holds is shown once: the section reads the rows
    write_report(finished_run, {**SUMMARY, "planner_terms_over_measured": terms})
    report = (finished_run / "report.md").read_text()
    section = report[report.index("## Planner prediction"):report.index("## Failures")]
    assert "| term | mean | geometric mean | steps in 0.8–1.25 | worst step (ratio) |" in section
    assert "| `step_s` | 1.13 | 1 | 3 of 5 | 4 (0.4) |" in section
    assert "| `rollout_s` | 1 | 1 | 5 of 5 |" in section and "| `train_s` | 0.8 | 0.8 | 5 of 5 |" in section
    assert "train_tail_s" not in section and "planner_terms_over_measured" not in report


def test_the_planners_prediction_per_term_over_the_last_steps():
    rows = [{"step": 0}, {"step": 1, "planner_terms": {"step_s": [5.0, 0.0]}},  # nothing measured: left out
            {"step": 2, "planner_terms": {"step_s": [None, 4.0], "rollout_s": [3.0, 1.0]}}]
    rows += [{"step": k, "planner_terms": {"step_s": [10.0, 5.0 if k == 3 else 10.0]}} for k in range(3, 15)]
    out = by_term(rows, last=10)
    assert out["step_s"] == {"mean": 1.0, "geometric": 1.0, "in_band": 10, "steps": 10, "worst": [5, 1.0]}
    assert by_term(rows, last=12)["step_s"]["worst"] == [3, 2.0]  # step 3 inside the window
    assert by_term(rows, last=12)["step_s"]["mean"] == pytest.approx((2.0 + 11) / 12, abs=1e-3)
    assert out["rollout_s"] == {"mean": 3.0, "geometric": 3.0, "in_band": 0, "steps": 1, "worst": [2, 3.0]}
    assert set(out) == {"step_s", "rollout_s"} and by_term([{"step": 0}]) == {}


def test_a_list_of_records_in_the_summary_gets_a_table_of_its_own(finished_run: Path):
    pauses = [{"direction": "join", "pause_s": 1.25, "all_ranks_back_s": 3.5},
              {"direction": "leave", "pause_s": 0.5, "all_ranks_back_s": 2.0}]
    write_report(finished_run, {**SUMMARY, "hybrid_pauses_s": pauses, "layout_gains": []})
    report = (finished_run / "report.md").read_text()
    assert ("### hybrid_pauses_s\n\n| direction | pause_s | all_ranks_back_s |\n|---|---|---|\n"
            "| join | 1.25 | 3.5 |\n| leave | 0.5 | 2 |") in report
    assert "| layout_gains | [] |" in report and '"pause_s"' not in report


def test_an_early_stopped_old_run_still_gets_a_report(tmp_path: Path):
    """No final eval, no GPU or queue fields, a policy only in the rows: nothing raises,
    plots without data are skipped and report.md says so."""
    folder = tmp_path / "stopped-7"
    folder.mkdir()
    write_jsonl(folder / "metrics.jsonl", [step_row(0, reward=0.2, step_s=8.0, scheduler_policy="fifo"),
                                           step_row(1, step_s=8.5, scheduler_policy="fifo")])
    write_jsonl(folder / "events.jsonl", [event(1.0, "eval", phase="warmstart", success=0.4, prompts=50),
                                          event(19.0, "stop_requested", step=2)])
    paths = write_report(folder, {})

    assert [p.name for p in paths] == ["summary.json", "throughput.png", "reward.png", "report.md"]
    assert not (folder / "plots" / "gpu_allocation.png").exists()
    report = (folder / "report.md").read_text()
    assert "Scheduler policy: **fifo**" in report
    assert "Warm start 0.4 → final not recorded (no final eval: the run stopped before it) on 50 prompts." in report
    assert "`reward` at step 1;" in report and "`gpus` not recorded" in report
    assert "- gpu_allocation.png: not drawn (no `gpus` recorded)" in report
    assert "- queues.png: not drawn" in report
    assert "No layout, plan or hybrid-pool events." in report and "## Failures" not in report
    assert "## Planner prediction" not in report and "- prediction.png: not drawn (no `planner_terms` recorded)" in report
    assert json.loads((folder / "summary.json").read_text()) == {}


def test_an_empty_folder_gets_a_report_that_says_nothing_was_recorded(tmp_path: Path):
    paths = write_report(tmp_path, {"steps": 0})
    report = (tmp_path / "report.md").read_text()
    assert [p.name for p in paths] == ["summary.json", "report.md"]
    assert "No step metrics recorded" in report and "No held-out evaluation recorded." in report
    assert "Scheduler policy: **not recorded**" in report


def test_eval_points_put_warm_start_at_step_0_and_others_at_the_nearest_step():
    steps = [step_row(s) for s in range(5)]  # rows written at 10, 20, ... 50 s
    events = [event(99.0, "eval", phase="warmstart", success=0.4), event(33.0, "eval", phase="mid", success=0.6),
              event(70.0, "eval", phase="final", success=0.8), event(71.0, "eval", phase="final")]
    assert eval_points(steps, events) == [("warmstart", 0, 0.4), ("mid", 2, 0.6), ("final", 4, 0.8)]
    assert eval_points([], events) == [("warmstart", 0, 0.4)]


def test_gpus_come_from_the_dict_or_the_older_flat_fields():
    assert gpus_of({"gpus": {"training": 4, "rollout": None}}) == {"training": 4}
    assert gpus_of({"gpus_training": 2, "gpus_rollout": 6, "gpus_other": "x"}) == {"training": 2, "rollout": 6}
    assert gpus_of({"step": 1}) == {}


def test_cells_and_step_ranges():
    assert [fmt(0.123456), fmt(12345.6), fmt(None), fmt(7), fmt({"b": 1, "a": "x|y"})] == \
        ["0.123", "12,346", "–", "7", '{"a": "x\\|y", "b": 1}']
    assert step_ranges([7, 1, 2, 3, 9, 10]) == "1–3, 7, 9–10"


# ---------------------------------------------------------------- TensorBoard


def bitwise_crc32c(data: bytes) -> int:
    """CRC-32C computed bit by bit, independently of the writer's table."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


def masked(crc: int) -> int:
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) % 2**32


def read_records(path: Path) -> list[bytes]:
    """The data of each TFRecord, both CRCs checked."""
    blob, records, at = path.read_bytes(), [], 0
    while at < len(blob):
        (length,), (length_crc,) = struct.unpack_from("<Q", blob, at), struct.unpack_from("<I", blob, at + 8)
        assert length_crc == masked(bitwise_crc32c(blob[at:at + 8])), f"length CRC of the record at byte {at}"
        data = blob[at + 12:at + 12 + length]
        (data_crc,) = struct.unpack_from("<I", blob, at + 12 + length)
        assert data_crc == masked(bitwise_crc32c(data)), f"data CRC of the record at byte {at}"
        records.append(data)
        at += 16 + length
    assert at == len(blob)
    return records


def read_varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def decode(buf: bytes) -> dict[int, list]:
    """A protobuf message as field number -> values (varints as ints, fixed64 as double,
    fixed32 as float, length-delimited as bytes)."""
    fields: dict[int, list] = {}
    at = 0
    while at < len(buf):
        key, at = read_varint(buf, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = read_varint(buf, at)
        elif wire == 1:
            (value,), at = struct.unpack_from("<d", buf, at), at + 8
        elif wire == 5:
            (value,), at = struct.unpack_from("<f", buf, at), at + 4
        elif wire == 2:
            size, at = read_varint(buf, at)
            value, at = buf[at:at + size], at + size
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields


def scalars_in(path: Path) -> list[tuple[float, int, str, float]]:
    """(wall_time, step, tag, value) of every scalar event after the version event."""
    out = []
    for data in read_records(path)[1:]:
        event = decode(data)
        for value in decode(event[5][0])[1]:
            fields = decode(value)
            out.append((event[1][0], event[2][0], fields[1][0].decode(), fields[2][0]))
    return out


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283 == bitwise_crc32c(b"123456789")
    assert crc32c(b"") == 0
    assert masked_crc32c(b"libra") == masked(bitwise_crc32c(b"libra"))


def test_tensorboard_scalars_round_trip(tmp_path: Path):
    clock = iter([1_700_000_000.25, 1_700_000_001.5, 1_700_000_002.0]).__next__
    with TensorBoardWriter(tmp_path, clock=clock) as tb:
        tb.scalar("loss", 0.5, step=3, wall_time=1_700_000_010.0)
        tb.scalar("tokens_per_s", 1765, step=2**40)
        written = tb.scalars(7, {"reward": 0.25, "gpus": {"training": 4, "rollout": 3}, "policy": "cmlfq",
                                 "stopped": True, "staleness_max": None}, prefix="train")
    assert written == 3
    [path] = tmp_path.iterdir()
    assert re.fullmatch(rf"events\.out\.tfevents\.1700000000\.{re.escape(socket.gethostname())}", path.name)

    first = read_records(path)[0]
    assert first == b"\x09" + struct.pack("<d", 1_700_000_000.25) + b"\x1a\x0dbrain.Event:2"
    assert scalars_in(path) == [
        (1_700_000_010.0, 3, "loss", 0.5),
        (1_700_000_001.5, 2**40, "tokens_per_s", 1765.0),
        (1_700_000_002.0, 7, "train/reward", 0.25),
        (1_700_000_002.0, 7, "train/gpus/training", 4.0),
        (1_700_000_002.0, 7, "train/gpus/rollout", 3.0),
    ]


def test_a_metrics_row_goes_to_tensorboard(tmp_path: Path):
    """What a run would log per step: every number of its metrics row, nothing else."""
    row = full_step(4)
    with TensorBoardWriter(tmp_path) as tb:
        tb.scalars(row["step"], {k: v for k, v in row.items() if k not in ("t", "kind", "step")})
    tags = {tag: value for _, step, tag, value in scalars_in(next(tmp_path.iterdir())) if step == 4}
    assert tags["reward"] == pytest.approx(0.7)
    assert tags["queue_depth/short"] == 8 and tags["idle_s/training"] == 0.5
    assert "scheduler_policy" not in tags and len(tags) == 20
