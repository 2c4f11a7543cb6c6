"""The log folder of one run: ``<logging.dir>/<job name>-<job id>/``.

- ``config.yaml``: the resolved configuration the run used;
- ``events.jsonl``: one JSON object per line for everything that happens (layouts
  planned and applied, group checks, failures, shutdown), each with ``t`` (Unix seconds),
  ``elapsed_s`` since the run started and ``kind``;
- ``metrics.jsonl``: one JSON object per step;
- ``controller.log``: the controller's Python log.

Lines are flushed as they are written, so ``launch.py --wait`` and ``tail -f`` follow them.
Only the controller (rank 0) writes here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


def run_folder(root: str | Path, job_name: str, job_id: str) -> Path:
    """``<root>/<job name>-<job id>``: the same folder sbatch's ``logs/%x-%j`` names."""
    return Path(root) / f"{job_name}-{job_id}"


class JsonlWriter:
    """Append-only JSON-lines file, flushed after every record."""

    def __init__(self, path: Path, clock=time.time, start: float | None = None):
        self.path = path
        self._clock = clock
        self._start = clock() if start is None else start  # ``start``: a reopened file keeps its origin
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> dict:
        now = self._clock()
        record = {"t": round(now, 6), "elapsed_s": round(now - self._start, 6), "kind": kind, **fields}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


class RunLog:
    """The files of one run's log folder."""

    def __init__(self, folder: Path, resolved_config: str, clock=time.time):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(resolved_config)
        self.events = JsonlWriter(folder / "events.jsonl", clock)
        self.metrics = JsonlWriter(folder / "metrics.jsonl", clock, start=self.events._start)  # one time origin

    def event(self, kind: str, **fields: Any) -> dict:
        return self.events.write(kind, **fields)

    def metric(self, step: int, **fields: Any) -> dict:
        return self.metrics.write("step", step=step, **fields)

    def rewind_metrics(self, from_step: int) -> int:
        """Drop the step rows from ``from_step`` on (a resumed run trains them again, so
        each step index appears once) and any torn last line; returns how many rows went."""
        import os

        path = self.metrics.path
        self.metrics.close()
        rows = read_jsonl(path)
        kept = [r for r in rows if r.get("kind") != "step" or r.get("step", -1) < from_step]
        staging = path.with_suffix(".jsonl.rewind")
        staging.write_text("".join(json.dumps(r, default=str) + "\n" for r in kept), encoding="utf-8")
        os.replace(staging, path)
        self.metrics = JsonlWriter(path, self.metrics._clock, start=self.metrics._start)
        return len(rows) - len(kept)

    def close(self) -> None:
        self.events.close()
        self.metrics.close()


def read_jsonl(path: Path) -> list[dict]:
    """Every complete record of a JSON-lines file (a torn last line is skipped)."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
