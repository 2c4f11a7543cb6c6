"""What megatron-core 0.16.1 needs to run on a machine without CUDA, in one place.

Megatron-Core is written for GPUs. On CPU (CI, laptops) it runs unchanged once a few
CUDA assumptions are answered, without editing any of its files:

* ``torch.cuda.current_device()`` (used as a ``device=`` argument) → 0, and every
  ``device=`` that names CUDA (``'cuda'``, ``'cuda:N'``, an int, ``torch.device('cuda')``)
  is rewritten to CPU by a :class:`~torch.overrides.TorchFunctionMode`, as is
  ``Tensor.cuda()`` (a no-op) — the optimizer, gradient clipping, the schedules, the causal
  mask and dist_checkpointing hard-code ``device='cuda'``;
* ``Tensor.type()`` answers ``'torch.cuda.FloatTensor'`` for a CPU float tensor (the
  optimizer and clip-grad assert the CUDA type names);
* ``torch.cuda.synchronize()`` is a no-op;
* the CUDA RNG tracker (``model_parallel_cuda_manual_seed``) is replaced by
  :class:`CpuRNGStatesTracker`, which forks the CPU generator with the same names and
  the same seed arithmetic (TP ranks differ, DP ranks share).

Everything is applied inside :func:`megatron_on_cpu` (a re-entrant context manager) and
only when CUDA is absent; with CUDA it does nothing, so the GPU path is megatron's own.
The shims were written against megatron-core |VERSION| and refuse any other version:
upgrading megatron means re-reading the call sites listed above.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_VERSION = "0.16.1"
__doc__ = (__doc__ or "").replace("|VERSION|", MEGATRON_VERSION)

_lock = threading.Lock()
_depth = 0  # live megatron_on_cpu scopes, all threads
_thread = threading.local()  # .depth: this thread's scopes (the mode is entered at the outermost)
_saved: dict[str, Any] = {}


class ShimVersionError(RuntimeError):
    """The installed megatron-core is not the one these shims were written for."""


def needed() -> bool:
    """True when CUDA is absent, i.e. when megatron must be shimmed to run."""
    return not torch.cuda.is_available()


def check_version() -> str:
    """Return the installed megatron-core version; raise if it is not the pinned one."""
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found != MEGATRON_VERSION:
        raise ShimVersionError(
            f"libra_hpc/engines/train/cpu_shims.py was written for megatron-core=={MEGATRON_VERSION} "
            f"but {found} is installed: pip install megatron-core=={MEGATRON_VERSION} "
            "(or re-check the CUDA call sites listed in that module against the new version)")
    return found


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
              "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE.get(out, out)
        return out


def _patch_cuda_calls() -> None:
    check_version()
    _saved["current_device"] = torch.cuda.current_device
    _saved["synchronize"] = torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None


def _restore_cuda_calls() -> None:
    torch.cuda.current_device = _saved.pop("current_device")
    torch.cuda.synchronize = _saved.pop("synchronize")


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run the body with the CPU shims in force (re-entrant; a no-op when CUDA exists).

    The ``torch.cuda`` patches are process-wide and counted across threads; the
    device-rewriting mode is per thread (torch function modes are thread-local), so every
    thread that calls megatron enters this itself (autograd on CPU runs backward in the
    calling thread)."""
    global _depth
    if not needed():
        yield
        return
    with _lock:
        if _depth == 0:
            _patch_cuda_calls()
        _depth += 1
    outermost = getattr(_thread, "depth", 0) == 0
    _thread.depth = getattr(_thread, "depth", 0) + 1
    mode = _CpuDeviceMode() if outermost else None
    try:
        if mode is not None:
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
    finally:
        _thread.depth -= 1
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore_cuda_calls()


class CpuRNGStatesTracker:
    """Megatron's RNG tracker API (add / fork / get_states / set_states / reset) over
    the CPU generator. ``fork(name)`` swaps the named state in and out of the global CPU
    generator, as the CUDA tracker does with the device generator."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG tracker: seed {seed} or state {name!r} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG tracker: state {name!r} was never added (known: {sorted(self.states_)})")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def seed_model_parallel(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` for this machine: on CUDA megatron's own; on CPU
    the same three named states (data-parallel, model-parallel, expert-parallel) and the
    same seed offsets, held by a :class:`CpuRNGStatesTracker`. Call after
    ``parallel_state.initialize_model_parallel``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not needed():
        mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    check_version()
    tracker = CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
                + parallel_state.get_expert_tensor_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
