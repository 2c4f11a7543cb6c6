"""The job's checkpoints on disk: written atomically, verified on load, the last few kept.

A checkpoint of the RL job at policy version ``v`` (batches ``0 .. v-1`` trained) is a
folder ``<log folder>/checkpoints/step-<v>`` holding

- ``train/``: the training ranks' Megatron state (model, optimizer, step counter;
  :mod:`libra_hpc.engines.train.checkpoint`), and ``rng/`` their RNG states;
- ``state.json``: the controller's state: the version, the prompt sampler's position at
  batch ``v`` (batches ``v ..`` were in flight and are drawn again: the same prompts,
  regenerated from scratch; their ids are listed under ``regenerate``), the trajectories
  trained so far (the books that say none is lost or trained twice), the summary so far,
  the C-MLFQ router's learned state;
- ``MANIFEST.json``, written last: every other file's size and SHA-256.

It is built in a hidden staging folder and renamed into place only when complete, so a
half-written checkpoint is never seen under its final name; on load every file is checked
against the manifest, and a checkpoint that fails (a file truncated, a bit flipped, the
manifest missing) is reported and the previous one used. Pure file handling: no MPI, no
torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "MANIFEST.json"
STATE = "state.json"
PREFIX = "step-"
REQUEUE_FILE = "REQUEUE"


def restart_count(environ: dict) -> int:
    """How many times Slurm has requeued this job (``SLURM_RESTART_COUNT``; 0 if unset)."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0)


def requeue_refusal(environ: dict, requeue: bool, max_requeues: int) -> str | None:
    """Why this job must not ask Slurm for a requeue now, or None when it may: it runs
    under Slurm (``SLURM_JOB_ID``), ``cluster.requeue`` is on, and ``SLURM_RESTART_COUNT``
    is below ``cluster.max_requeues`` (a job that fails the same way every time stops)."""
    restarts = restart_count(environ)
    if environ.get("SLURM_JOB_ID") is None:
        return "not under Slurm"
    if not requeue:
        return "cluster.requeue is off"
    if restarts >= max_requeues:
        return f"requeued {restarts} times already (cluster.max_requeues={max_requeues})"
    return None


def ask_requeue(folder: Path, why: str) -> Path:
    """The marker ``sbatch/libra.sh`` (and the submitit step) read after the world ends:
    ``scontrol requeue`` this job."""
    marker = Path(folder) / REQUEUE_FILE
    marker.write_text(why.rstrip() + "\n")
    return marker


RELAYOUT_PREFIX = "relayout-v"


def remove_leftover_relayouts(folder: Path | str) -> list[str]:
    """Remove the ``relayout-v<N>/`` folders a killed run left in its log folder (the
    policy handed between ranks during a layout change: a run that resumes starts its
    layout versions over, and its next change would find the folder taken). The names
    removed."""
    gone = []
    for path in sorted(Path(folder).glob(f"{RELAYOUT_PREFIX}*")):
        if path.is_dir() and path.name[len(RELAYOUT_PREFIX):].isdigit():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path.name)
    return gone


class CheckpointInvalid(ValueError):
    """A checkpoint folder that must not be loaded; the message says which file and why."""


@dataclass(frozen=True)
class Loaded:
    """A checkpoint that verified: its folder, version and ``state.json``."""

    path: Path
    version: int
    state: dict


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """``<folder>/checkpoints``: stage, commit, find the newest valid, prune to ``keep``."""

    def __init__(self, folder: Path | str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        self.root = Path(folder) / "checkpoints"
        self.keep = keep

    def path(self, version: int) -> Path:
        return self.root / f"{PREFIX}{version:06d}"

    def staging(self, version: int) -> Path:
        """An empty hidden folder the training ranks write into; replaces a leftover one
        (a save cut short by a kill)."""
        stage = self.root / f".{PREFIX}{version:06d}.partial"
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        return stage

    def commit(self, stage: Path, version: int, state: dict) -> Path:
        """Write ``state.json`` and the manifest into ``stage``, flush every file, and
        rename it to ``step-<version>``; then keep only the newest ``keep``."""
        (stage / STATE).write_text(json.dumps({**state, "version": version}, sort_keys=True))
        files = _files(stage)
        manifest = {"version": version,
                    "files": {str(p.relative_to(stage)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}}
        for p in files:
            _fsync(p)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync(stage / MANIFEST)
        final = self.path(version)
        if final.exists():  # the same version saved again (a stop right after a periodic save)
            shutil.rmtree(final)
        os.replace(stage, final)
        _fsync(self.root)
        self.prune()
        return final

    def versions(self) -> list[int]:
        """Committed checkpoint versions, newest first (valid or not)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
                out.append(int(p.name[len(PREFIX):]))
        return sorted(out, reverse=True)

    def prune(self) -> None:
        for version in self.versions()[self.keep:]:
            shutil.rmtree(self.path(version), ignore_errors=True)

    def verify(self, version: int) -> dict:
        """The checkpoint's ``state.json`` if every file matches the manifest; else raise
        :class:`CheckpointInvalid` naming the file."""
        folder = self.path(version)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            listed = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointInvalid(f"{folder / MANIFEST}: missing or unreadable ({exc})") from None
        present = {str(p.relative_to(folder)) for p in _files(folder)}
        if missing := sorted(set(listed) - present):
            raise CheckpointInvalid(f"{folder}: {len(missing)} file(s) of the manifest missing, e.g. {missing[0]}")
        for name, want in sorted(listed.items()):
            path = folder / name
            size = path.stat().st_size
            if size != want["bytes"]:
                raise CheckpointInvalid(f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated?)")
            if _sha256(path) != want["sha256"]:
                raise CheckpointInvalid(f"{path}: SHA-256 differs from the manifest (corrupted)")
        try:
            state = json.loads((folder / STATE).read_text())
        except ValueError as exc:
            raise CheckpointInvalid(f"{folder / STATE}: not JSON ({exc})") from None
        if state.get("version") != version or manifest.get("version") != version:
            raise CheckpointInvalid(f"{folder}: its state says version {state.get('version')}, its name {version}")
        return state

    def latest(self) -> tuple[Loaded | None, list[tuple[Path, str]]]:
        """The newest checkpoint that verifies (None if none does), and the newer ones
        that did not, each with the reason."""
        rejected = []
        for version in self.versions():
            try:
                state = self.verify(version)
            except CheckpointInvalid as exc:
                rejected.append((self.path(version), str(exc)))
                continue
            return Loaded(self.path(version), version, state), rejected
        return None, rejected
