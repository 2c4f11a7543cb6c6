"""The length distribution the planner assumes before the run has observed any trajectory.

Generated lengths follow a Pareto tail (agentic rollouts are long-tailed: a few
trajectories dominate the makespan), scaled so that the median is the configured one and
capped by the training sequence length. Deterministic from a seed. During a run, the
observed window of (prompt, generated, turns, tool time) replaces it.
"""

from __future__ import annotations

import random

from libra_hpc.planner.costs import LengthProfile, LengthSample


def prior_lengths(*, prompt_tokens: int, gen_tokens_median: int, tail_shape: float, turns: int, tool_s_per_turn: float,
                  seq_len: int, batch_size: int, seed: int = 0, samples: int = 512) -> LengthProfile:
    """A LengthProfile of ``samples`` draws scaled to ``batch_size`` trajectories.

    ``tail_shape``: the Pareto shape α (smaller is heavier; 1.2 gives p99 ≈ 40× the median
    before the cap). Generated tokens are capped at ``seq_len - prompt_tokens``."""
    if min(prompt_tokens, gen_tokens_median, turns, seq_len, batch_size, samples) < 1 or tail_shape <= 0:
        raise ValueError("prior_lengths: token counts, turns, seq_len, batch_size and samples must be >= 1, "
                         f"tail_shape > 0 (got prompt={prompt_tokens}, median={gen_tokens_median}, "
                         f"tail={tail_shape}, turns={turns}, seq_len={seq_len}, batch={batch_size})")
    cap = max(1, seq_len - prompt_tokens)
    median_of_pareto = 2 ** (1 / tail_shape)  # of paretovariate(α), whose minimum is 1
    rng = random.Random(seed)
    drawn = []
    for _ in range(samples):
        gen = min(cap, max(1, round(gen_tokens_median * rng.paretovariate(tail_shape) / median_of_pareto)))
        drawn.append(LengthSample(prompt_tokens, gen, turns, turns * tool_s_per_turn))
    return LengthProfile.from_samples(drawn, batch_size)
