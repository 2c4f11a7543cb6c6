"""The live planner's predictions against what the job measured, per term (pure: reads
step rows of ``metrics.jsonl``).

Each step row the planner priced holds ``planner_terms``: for ``rollout_s``, ``train_s``,
``train_tail_s``, ``step_s`` and ``steady_step_s``, the pair [predicted, measured] seconds
(``runtime/planning.py``, ``predict``). ``summary.json``'s
``planner_predicted_over_measured`` is one number, the mean of the step's ratio over the
last :data:`LAST` steps; this module says which term moved it: the same mean per term, its
geometric mean (a mean of ratios reads high when the measured side is noisy: with a
log-normal spread σ of the measured times, a prediction right on average reads about e^σ²
and its geometric mean e^(σ²/2); one right in the median reads e^(σ²/2) and 1), the steps
inside :data:`BAND` and the worst one.
"""

from __future__ import annotations

import math
import statistics

TERMS = ("step_s", "rollout_s", "train_s", "train_tail_s")
"""The terms reported, the step first (the one ``planner_predicted_over_measured`` reads)."""
LAST = 10
"""Steps (the last ones with a prediction) each mean is taken over."""
BAND = (0.8, 1.25)
"""The band a prediction counts as right in (issue 30's bar for the step's mean)."""


def term_ratios(rows: list[dict], term: str) -> list[tuple[int, float]]:
    """(step, predicted / measured) of ``term`` for every row whose ``planner_terms`` has
    both sides positive, in step order."""
    out = []
    for r in rows:
        pair = (r.get("planner_terms") or {}).get(term)
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_positive(v) for v in pair):
            out.append((r.get("step"), pair[0] / pair[1]))
    return out


def by_term(rows: list[dict], last: int = LAST) -> dict[str, dict]:
    """Per term with at least one priced step, over its last ``last`` ratios: ``mean``,
    ``geometric``, ``in_band`` (how many inside :data:`BAND`), ``steps`` (how many) and
    ``worst`` ([step, ratio] farthest from 1 in log terms)."""
    out = {}
    for term in TERMS:
        pairs = term_ratios(rows, term)[-last:]
        if not pairs:
            continue
        ratios = [x for _, x in pairs]
        step, worst = max(pairs, key=lambda p: abs(math.log(p[1])))
        out[term] = {"mean": round(statistics.fmean(ratios), 3),
                     "geometric": round(math.exp(statistics.fmean(math.log(x) for x in ratios)), 3),
                     "in_band": sum(BAND[0] <= x <= BAND[1] for x in ratios), "steps": len(ratios),
                     "worst": [step, round(worst, 3)]}
    return out


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
