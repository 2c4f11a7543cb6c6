"""The rollout/training pipeline's step time, the formulas every valuation shares (pure).

With staleness ``k`` (``rl.max_staleness``) up to ``k + 1`` batches are in flight: rollout
of the next batches overlaps training of this one, so a step is set by the slower side
once the other is divided over the overlap. Units: seconds, GPUs, DP replicas.
"""

from __future__ import annotations


def streamed_tail_s(t_train: float, stream_groups: int = 0, tail_s: float = 0.0) -> float:
    """What a step trains after its batch's last trajectory: with ``stream_groups`` > 0
    (``rl.stream_training``) its last group's share of the pass, T_train / groups, plus
    ``tail_s`` (``Calibration.stream_tail_s``: the optimizer step, the all-reduce, the wait
    for the last replica; 0 in the simulator, fitted by the job), at most T_train; without
    streaming, all of T_train."""
    return min(t_train, t_train / stream_groups + tail_s) if stream_groups > 0 else t_train


def pipelined_step_s(t_train: float, t_rollout: float, k: int, stream_groups: int = 0, tail_s: float = 0.0) -> float:
    """Steady-state step time of the rollout/training pipeline with staleness ``k``:
    training step ``s`` ends at max(end(s - k - 1) + T_rollout, end(s - 1)) + T_train, so
    a step takes max(T_train, (T_rollout + T_train) / (k + 1)) (k = 0: their sum).

    ``stream_groups`` > 0 (``rl.stream_training``, that many GRPO groups a step): the
    trainers work through a batch's groups as they finish, so only the step's tail
    (:func:`streamed_tail_s`: T_train / groups + ``tail_s``) follows the batch's slowest
    trajectory: max(T_train, (T_rollout + tail) / (k + 1))."""
    return max(t_train, (t_rollout + streamed_tail_s(t_train, stream_groups, tail_s)) / (k + 1))


def rollout_side_s(makespan_s: float, k: int, stream_groups: int = 0, tail_s: float = 0.0) -> float:
    """The rollout time to weigh against the training time: in steady state a step
    takes max(T, (M + T) / (k + 1)), which is T exactly when T >= M / k; training
    streamed over G groups with a tail T / G + c (``tail_s``), max(T, (M + T / G + c) / (k + 1)):
    T when T >= (M + c) / (k + 1 - 1 / G) (while that tail is shorter than T)."""
    if stream_groups <= 0:
        return makespan_s / max(1, k)
    side = (makespan_s + tail_s) / (k + 1 - 1 / stream_groups)
    return side if side / stream_groups + tail_s <= side else makespan_s / max(1, k)


def switch_drain_s(t_train: float, t_rollout: float, k: int, stream_groups: int = 0, tail_s: float = 0.0) -> float:
    """Seconds a layout change costs the pipeline besides its pause: no batch is submitted
    until the batches in flight are rolled out and trained (rollout idles through the last
    one's training), and the first batch on the new layout rolls out before anything
    trains (training idles): one rollout makespan and one training step (its tail,
    streamed) in series where the pipeline overlaps them in one step,
    ``T_rollout + tail - pipelined_step_s`` (0 synchronously, k = 0: nothing overlaps)."""
    tail = streamed_tail_s(t_train, stream_groups, tail_s)
    return max(0.0, t_rollout + tail - pipelined_step_s(t_train, t_rollout, k, stream_groups, tail_s))


def moved_times(t_train: float, t_roll: float, dp: int, rollout_gpus: int, size: int,
                replicas: int) -> tuple[float, float]:
    """Training and rollout time once ``replicas`` hybrid replicas of ``size`` GPUs move
    to training (negative: back to rollout): training time scales with 1/DP, rollout time
    with 1/rollout GPUs."""
    return t_train * dp / (dp + replicas), t_roll * rollout_gpus / (rollout_gpus - replicas * size)
