"""New policy weights from the training holders to the rollout leaders, point to point
and without a collective: a push never waits for the slowest leader.

The holder of each pipeline stage (:class:`~libra_hpc.runtime.roles.Roles`) packs its
stage's Hugging Face tensors into one buffer (:func:`libra_hpc.engines.sync.buckets`'s
aligned layout) and posts a non-blocking send of the manifest and of the bytes to every
leader (:class:`WeightSender`); it keeps the buffer until every leader took it, testing
the sends between its other work. A leader looks for a version between two engine steps
(:class:`WeightReceiver`); when every stage of a version is in, it drains its running
turns and loads it (``VllmRolloutEngine.update_weights``). A leader that is behind skips
to the newest complete version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from libra_hpc.cluster.messages import WEIGHTS, WEIGHTS_BYTES

log = logging.getLogger(__name__)


class WeightSender:
    """The holder side: :meth:`post` a version, :meth:`progress` until it is out."""

    def __init__(self, comm: Any, leaders: Iterable[int], stage: int, stages: int):
        self.comm, self.leaders = comm, list(leaders)
        self.stage, self.stages = stage, stages
        self._out: list[tuple[Any, list[Any]]] = []  # (buffer kept alive, its requests)
        self.bytes_sent = 0

    def post(self, version: int, weights: Iterable[tuple[str, Any]], leaders: Iterable[int] | None = None) -> float:
        """Pack ``weights`` and start sending them to ``leaders`` (default: all this sender
        was made with; the controller names the leaders in rollout now); returns the packing
        seconds."""
        import torch

        from libra_hpc.engines.sync import buckets

        started = time.perf_counter()
        entries, parts = [], []
        offset = 0
        for bucket in buckets(weights, bucket_bytes=1 << 62):  # one bucket: one contiguous buffer
            for entry, tensor in bucket:
                entries.append((entry.name, entry.dtype, entry.shape, offset + entry.offset, entry.nbytes))
                parts.append((offset + entry.offset, tensor))
            offset += bucket[-1][0].offset + bucket[-1][0].nbytes
        buffer = torch.zeros(offset, dtype=torch.uint8)
        for start, tensor in parts:
            raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            buffer[start:start + raw.numel()].copy_(raw)
        array = buffer.numpy()
        manifest = {"version": version, "stage": self.stage, "stages": self.stages, "entries": entries,
                    "nbytes": offset}
        requests = []
        leaders = self.leaders if leaders is None else list(leaders)
        for leader in leaders:
            requests.append(self.comm.isend(manifest, dest=leader, tag=WEIGHTS))
            requests.append(self.comm.Isend(array, dest=leader, tag=WEIGHTS_BYTES))
        self._out.append((array, requests))
        self.bytes_sent += offset * len(leaders)
        return time.perf_counter() - started

    def progress(self) -> int:
        """Test the posted sends; drop the versions every leader took. Returns how many
        versions are still going out."""
        from mpi4py import MPI

        self._out = [(buf, reqs) for buf, reqs in self._out if not MPI.Request.Testall(reqs)]
        return len(self._out)

    def outstanding(self) -> tuple[list[Any], list[Any]]:
        """The requests still going out and the buffers they read from; this sender forgets
        them (for a stop: the world's parting completes them)."""
        requests = [r for _, reqs in self._out for r in reqs]
        buffers = [buf for buf, _ in self._out]
        self._out = []
        return requests, buffers

    def finish(self, timeout_s: float) -> None:
        """Wait (sleeping) until every posted version has left; TimeoutError after ``timeout_s``."""
        from libra_hpc.cluster.messages import wait_sent

        for _, requests in self._out:
            wait_sent(requests, timeout_s=timeout_s)
        self._out = []


class WeightReceiver:
    """The leader side: :meth:`poll` between engine steps."""

    def __init__(self, comm: Any):
        self.comm = comm
        self._parts: dict[int, list[tuple[dict, Any]]] = {}

    def poll(self) -> tuple[int, list[tuple[str, Any]]] | None:
        """The newest version whose every stage has arrived, as (version, named tensors),
        or None; older complete versions are dropped."""
        import numpy as np
        import torch
        from mpi4py import MPI

        status = MPI.Status()
        while (message := self.comm.improbe(source=MPI.ANY_SOURCE, tag=WEIGHTS, status=status)) is not None:
            manifest = message.recv()
            array = np.empty(manifest["nbytes"], dtype=np.uint8)
            self.comm.Recv(array, source=status.Get_source(), tag=WEIGHTS_BYTES)
            self._parts.setdefault(manifest["version"], []).append((manifest, array))
        complete = [v for v, parts in self._parts.items() if len(parts) == parts[0][0]["stages"]]
        if not complete:
            return None
        version = max(complete)
        parts = self._parts.pop(version)
        for old in [v for v in self._parts if v < version]:
            del self._parts[old]
        tensors = []
        for manifest, array in parts:
            buffer = torch.from_numpy(array)
            for name, dtype, shape, start, nbytes in manifest["entries"]:
                tensors.append((name, buffer[start:start + nbytes].view(getattr(torch, dtype)).reshape(shape)))
        return version, tensors
