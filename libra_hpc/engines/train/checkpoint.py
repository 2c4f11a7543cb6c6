"""Training checkpoints with resharding (megatron ``dist_checkpointing``).

A checkpoint holds the model's sharded state (every tensor with its global shape and
this rank's slice), the optimizer's state mapped onto the same global tensors, and the
step counter. Because tensors are stored by global coordinates, a checkpoint written at
one TP/PP/DP shape loads at another (TP=2 → TP=1 and TP=2 → PP=2 are tested). Collective
over the training ranks; ``directory`` must be on a file system every training rank sees.
Exception: the distributed optimizer's Adam state does not load on CPU (see
:func:`_refuse_unloadable_optimizer`); its weights do.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from libra_hpc.engines.train.cpu_shims import megatron_on_cpu

if TYPE_CHECKING:
    from libra_hpc.engines.train.engine import MegatronTrainEngine

log = logging.getLogger(__name__)


def _state(engine: MegatronTrainEngine, *, with_optimizer: bool, loading: bool) -> dict:
    model_state = engine.model.module.sharded_state_dict()
    state = {"model": model_state, "steps": engine.steps}
    if with_optimizer:
        # the distributed optimizer's default format (fully_sharded_model_space) is refused by
        # this megatron's own ShardedTensor checks; fully_reshardable loads at any TP/PP/DP
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model_state, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return state


def _refuse_unloadable_optimizer(engine: MegatronTrainEngine, directory: Path) -> None:
    """Megatron 0.16.1's distributed optimizer cannot load its Adam state without Apex or
    Transformer Engine (CPU here): a fresh one has no state to load into, and once it has
    one the torch Adam ``step`` entry breaks the copy. Say so instead of failing inside."""
    from megatron.core.optimizer import distrib_optimizer

    chained = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    if not distrib_optimizer.HAVE_APEX_OR_TE and any(
            isinstance(o, distrib_optimizer.DistributedOptimizer) for o in chained):
        raise NotImplementedError(
            f"load_checkpoint({directory}): the distributed optimizer's state cannot be loaded without Apex or "
            "Transformer Engine in megatron-core 0.16.1; load with with_optimizer=False (weights only, Adam "
            "moments restart) or train with training.distributed_optimizer: false")


def save_checkpoint(engine: MegatronTrainEngine, directory: str | Path, *, with_optimizer: bool = True) -> Path:
    """Write the engine's state to ``directory`` (created; must be empty or absent); with
    ``with_optimizer`` the Adam moments too, so a resumed run steps exactly as this one."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"save_checkpoint: {directory} is not empty; give a new directory per checkpoint "
                              "(dist_checkpointing does not overwrite one in place)")
    directory.mkdir(parents=True, exist_ok=True)
    _in_process_results_queue()
    with megatron_on_cpu():
        dist_checkpointing.save(_state(engine, with_optimizer=with_optimizer, loading=False), str(directory))
    log.info("checkpoint saved: %s (step %d)", directory, engine.steps)
    return directory


def _in_process_results_queue() -> None:
    """Synchronous saves write from this process (megatron forks one writer per bucket
    and collects their results here), so the results queue need not be a
    ``multiprocessing.Manager`` queue — which megatron starts with the *spawn* method, i.e.
    by re-importing ``__main__``: that fails for scripts without a ``__main__`` guard and
    costs seconds of imports at every first save. A thread queue does the same job."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_checkpoint(engine: MegatronTrainEngine, directory: str | Path, *, with_optimizer: bool = True) -> int:
    """Load ``directory`` into the engine whatever TP/PP/DP it was saved at; returns the
    restored step counter."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        raise FileNotFoundError(f"load_checkpoint: {directory} is not a dist_checkpointing checkpoint "
                                "(no metadata.json); give the directory save_checkpoint wrote")
    if with_optimizer:
        _refuse_unloadable_optimizer(engine, directory)
    with megatron_on_cpu():
        state = dist_checkpointing.load(_state(engine, with_optimizer=with_optimizer, loading=True), str(directory))
        engine.model.module.load_state_dict(state["model"])
        if with_optimizer:
            engine.optimizer.load_state_dict(state["optimizer"])
    engine.steps = int(state["steps"])
    log.info("checkpoint loaded: %s (step %d)", directory, engine.steps)
    return engine.steps
