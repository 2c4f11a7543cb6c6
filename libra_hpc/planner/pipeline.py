"""The rollout/training pipeline's step time, the formulas every valuation shares (pure).

With staleness ``k`` (``rl.max_staleness``) up to ``k + 1`` batches are in flight: rollout
of the next batches overlaps training of this one, so a step is set by the slower side
once the other is divided over the overlap. Units: seconds, GPUs, DP replicas.
"""

from __future__ import annotations


def pipelined_step_s(t_train: float, t_rollout: float, k: int, stream_groups: int = 0) -> float:
    """Steady-state step time of the rollout/training pipeline with staleness ``k``:
    training step ``s`` ends at max(end(s - k - 1) + T_rollout, end(s - 1)) + T_train, so
    a step takes max(T_train, (T_rollout + T_train) / (k + 1)) (k = 0: their sum).

    ``stream_groups`` > 0 (``rl.stream_training``, that many GRPO groups a step): the
    trainers work through a batch's groups as they finish, so only the last group's share
    of the step, T_train / groups, follows the batch's slowest trajectory:
    max(T_train, (T_rollout + T_train / groups) / (k + 1))."""
    tail = t_train / stream_groups if stream_groups > 0 else t_train
    return max(t_train, (t_rollout + tail) / (k + 1))


def rollout_side_s(makespan_s: float, k: int, stream_groups: int = 0) -> float:
    """The rollout time to weigh against the training time: in steady state a step
    takes max(T, (M + T) / (k + 1)), which is T exactly when T >= M / k; training
    streamed over G groups, max(T, (M + T / G) / (k + 1)): T when T >= M / (k + 1 - 1 / G)."""
    return makespan_s / (k + 1 - 1 / stream_groups) if stream_groups > 0 else makespan_s / max(1, k)


def switch_drain_s(t_train: float, t_rollout: float, k: int, stream_groups: int = 0) -> float:
    """Seconds a layout change costs the pipeline besides its pause: no batch is submitted
    until the batches in flight are rolled out and trained (rollout idles through the last
    one's training), and the first batch on the new layout rolls out before anything
    trains (training idles): one rollout makespan and one training step (its last group's
    share, streamed) in series where the pipeline overlaps them in one step,
    ``T_rollout + tail - pipelined_step_s`` (0 synchronously, k = 0: nothing overlaps)."""
    tail = t_train / stream_groups if stream_groups > 0 else t_train
    return max(0.0, t_rollout + tail - pipelined_step_s(t_train, t_rollout, k, stream_groups))


def moved_times(t_train: float, t_roll: float, dp: int, rollout_gpus: int, size: int,
                replicas: int) -> tuple[float, float]:
    """Training and rollout time once ``replicas`` hybrid replicas of ``size`` GPUs move
    to training (negative: back to rollout): training time scales with 1/DP, rollout time
    with 1/rollout GPUs."""
    return t_train * dp / (dp + replicas), t_roll * rollout_gpus / (rollout_gpus - replicas * size)
