"""Weight sync, training → rollout: full HF-named weights from the training ranks that
hold them to the rollout instance leaders, in memory.

Training exports on its holders (TP rank 0 of DP replica 0 of each pipeline stage:
:meth:`MegatronTrainEngine.export_hf`, already gathered over TP). A holder broadcasts
over an MPI communicator that contains it and the rollout leaders (DESIGN.md: the data
plane for weights is MPI point-to-point/collectives between roles; each role's torch
world stays its own). The wire format is a manifest (names, dtypes, shapes, offsets;
pickled, one ``bcast``) followed by flat byte buckets (``Bcast``), each at most
``bucket_bytes``: leaders hand each bucket's tensors to the rollout engine
(``update_weights`` takes an iterable of (name, tensor)) as it arrives, so a consumer
that applies tensors as they come holds one bucket at a time (``VllmRolloutEngine``
checks the whole set before applying any, so it holds the whole model once).

With PP > 1 every stage has a holder: give each its own communicator (holder + leaders)
and let the leaders chain the pulls (``itertools.chain(pull_weights(c0, root=0), ...)``)
into one ``update_weights``. Training and rollout never share a process: each needs its
own torch world (megatron builds its groups from the default group; vLLM takes the
default group over and destroys it at shutdown).

No disk round trip. On GPUs the holder stages each bucket through host memory (a CUDA
tensor's bytes are copied to the bucket) and leaders move tensors to their device; a
CUDA-aware MPI or an NCCL group between holders and leaders would skip the host copy
(not done: not testable without GPUs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
"""Default bucket size (bytes): large enough for full-bandwidth Bcasts, small enough that
leaders apply weights while the rest streams."""
_ALIGN = 64  # byte alignment of each tensor in a bucket, so any dtype views it in place


@dataclass(frozen=True)
class SyncStats:
    """One broadcast as seen by the rank that reports it."""

    tensors: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


def plan_buckets(weights: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> tuple[list[_Entry], list[int]]:
    """Place tensors, in the mapping's order, into buckets of at most ``bucket_bytes``
    (a larger tensor gets a bucket of its own). Returns the manifest and bucket sizes."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    entries: list[_Entry] = []
    sizes: list[int] = []
    used = bucket_bytes  # forces a first bucket
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-used // _ALIGN) * _ALIGN
        if sizes and start + nbytes <= bucket_bytes:
            used = start + nbytes
        else:
            sizes.append(0)
            start, used = 0, nbytes
        sizes[-1] = used
        entries.append(_Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), len(sizes) - 1,
                              start, nbytes))
    return entries, sizes


def push_weights(comm: Any, weights: Mapping[str, torch.Tensor], *, root: int,
                 bucket_bytes: int = BUCKET_BYTES) -> SyncStats:
    """Broadcast ``weights`` from ``root`` (this rank) to every other rank of ``comm``,
    which must call :func:`pull_weights` with the same root. Collective over ``comm``."""
    if comm.Get_rank() != root:
        raise ValueError(f"push_weights on rank {comm.Get_rank()} of the sync communicator, but root={root}; "
                         "only the holder pushes, the leaders pull_weights")
    start = time.perf_counter()
    entries, sizes = plan_buckets(weights, bucket_bytes)
    comm.bcast((entries, sizes), root=root)
    for index, size in enumerate(sizes):
        members = [e for e in entries if e.bucket == index]
        if len(members) == 1:  # a bucket of one tensor goes out from the tensor itself, no copy
            buffer = _bytes(weights[members[0].name])
        else:
            buffer = torch.empty(size, dtype=torch.uint8)
            for entry in members:
                buffer[entry.offset:entry.offset + entry.nbytes].copy_(_bytes(weights[entry.name]))
        comm.Bcast(buffer.numpy(), root=root)
    stats = SyncStats(len(entries), sum(e.nbytes for e in entries), len(sizes), time.perf_counter() - start)
    log.debug("pushed %d tensors, %d bytes in %d buckets, %.4f s", stats.tensors, stats.bytes, stats.buckets,
              stats.seconds)
    return stats


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (a view when already contiguous on CPU)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def pull_weights(comm: Any, *, root: int, device: torch.device | str = "cpu",
                 stats: list[SyncStats] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive what ``root`` pushes, yielding (HF name, tensor) bucket by bucket. Consume
    it to the end (``update_weights`` does): the broadcasts happen as it is iterated, so
    stopping early leaves ``comm`` mid-collective. Appends a :class:`SyncStats` to
    ``stats`` when done."""
    start = time.perf_counter()
    entries, sizes = comm.bcast(None, root=root)
    for index, size in enumerate(sizes):
        buffer = torch.empty(size, dtype=torch.uint8)
        comm.Bcast(buffer.numpy(), root=root)
        for entry in entries:
            if entry.bucket == index:
                raw = buffer[entry.offset:entry.offset + entry.nbytes]
                yield entry.name, raw.view(getattr(torch, entry.dtype)).reshape(entry.shape).to(device)
    if stats is not None:
        stats.append(SyncStats(len(entries), sum(e.nbytes for e in entries), len(sizes), time.perf_counter() - start))
