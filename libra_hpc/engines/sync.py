"""Weight sync, training → rollout: full HF-named weights from the training ranks that
hold them to the rollout instance leaders, in memory.

Training exports on its holders (TP rank 0 of DP replica 0 of each pipeline stage:
:meth:`MegatronTrainEngine.iter_hf`, gathered over TP layer by layer). A holder
broadcasts over an MPI communicator that contains it and the rollout leaders (DESIGN.md:
the data plane for weights is MPI between roles; each role's torch world stays its own).
Wire format, per bucket: a manifest (names, dtypes, shapes, offsets; pickled ``bcast``),
then the bucket's bytes (``Bcast``, at most ``bucket_bytes``); an empty manifest ends the
stream. Buckets are filled as the holder produces tensors, and leaders hand each bucket's
tensors to the rollout engine (``update_weights`` takes an iterable of (name, tensor)) as
they arrive, so neither side needs more than a bucket beyond what it keeps anyway
(``VllmRolloutEngine`` checks the whole set before applying any, so it does hold the
model once; the holder's ``export_hf`` dict does too).

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
from collections.abc import Iterable, Iterator, Mapping
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


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def buckets(weights: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[tuple[_Entry, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into buckets of at most ``bucket_bytes`` with
    every tensor at a 64-byte aligned offset (a larger tensor gets a bucket of its own).
    Lazy: a bucket is yielded as soon as the next tensor does not fit, so a producer that
    gathers tensors one by one is never asked for more than one bucket ahead."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    bucket: list[tuple[_Entry, torch.Tensor]] = []
    used = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-used // _ALIGN) * _ALIGN
        if bucket and start + nbytes > bucket_bytes:
            yield bucket
            bucket, start = [], 0
        bucket.append((_Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start, nbytes),
                       tensor))
        used = start + nbytes
    if bucket:
        yield bucket


def push_weights(comm: Any, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                 root: int, bucket_bytes: int = BUCKET_BYTES) -> SyncStats:
    """Broadcast ``weights`` (a mapping, or (name, tensor) pairs produced while they are
    sent, e.g. :meth:`MegatronTrainEngine.iter_hf`) from ``root`` (this rank) to every
    other rank of ``comm``, which must call :func:`pull_weights` with the same root.
    Collective over ``comm``: per bucket, its manifest (``bcast``) then its bytes
    (``Bcast``); an empty manifest ends the stream."""
    if comm.Get_rank() != root:
        raise ValueError(f"push_weights on rank {comm.Get_rank()} of the sync communicator, but root={root}; "
                         "only the holder pushes, the leaders pull_weights")
    start = time.perf_counter()
    items = weights.items() if isinstance(weights, Mapping) else weights
    tensors = total = count = 0
    for bucket in buckets(items, bucket_bytes):
        entries = [entry for entry, _ in bucket]
        comm.bcast(entries, root=root)
        if len(bucket) == 1:  # a bucket of one tensor goes out from the tensor itself, no copy
            buffer = _bytes(bucket[0][1])
        else:
            buffer = torch.empty(entries[-1].offset + entries[-1].nbytes, dtype=torch.uint8)
            for entry, tensor in bucket:
                buffer[entry.offset:entry.offset + entry.nbytes].copy_(_bytes(tensor))
        comm.Bcast(buffer.numpy(), root=root)
        tensors, total, count = tensors + len(entries), total + sum(e.nbytes for e in entries), count + 1
    comm.bcast([], root=root)
    stats = SyncStats(tensors, total, count, time.perf_counter() - start)
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
    tensors = total = count = 0
    while entries := comm.bcast(None, root=root):
        buffer = torch.empty(entries[-1].offset + entries[-1].nbytes, dtype=torch.uint8)
        comm.Bcast(buffer.numpy(), root=root)
        for entry in entries:
            raw = buffer[entry.offset:entry.offset + entry.nbytes]
            yield entry.name, raw.view(getattr(torch, entry.dtype)).reshape(entry.shape).to(device)
        tensors, total, count = tensors + len(entries), total + sum(e.nbytes for e in entries), count + 1
    if stats is not None:
        stats.append(SyncStats(tensors, total, count, time.perf_counter() - start))
