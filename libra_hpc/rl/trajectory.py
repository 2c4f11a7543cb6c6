"""The trajectory record: what a rollout hands to training.

Plain data (lists, ints, floats, strings) so it crosses MPI as a dict and is written to
logs as JSON; no torch here (DESIGN.md: rl/ is a pure core).

Token convention: every per-token list has one entry per token of ``tokens`` (prompt,
generated and tool-output tokens of every turn, in order). ``logprobs[i]`` is the rollout
policy's log p(token i | tokens < i) and ``versions[i]`` the policy version that sampled
token i; both are meaningful only where ``generated[i]`` is true (elsewhere they are
ignored: write 0.0 and -1). With partial rollout a trajectory interrupted by a weight
update resumes under the new policy, so its generated tokens may carry several versions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

NOT_GENERATED = -1
"""The ``versions`` entry of a prompt or tool-output token (no policy produced it)."""


@dataclass(frozen=True)
class Trajectory:
    """One sampled episode of one prompt.

    ``prompt_id``: the prompt it answers; ``group_id``: its GRPO group (the samples of one
    prompt in one step, compared with each other); ``tokens``: token ids; ``generated``:
    per token, True where the policy sampled it (False for prompt and tool-output tokens:
    never trained on); ``logprobs``: per token, the rollout log-prob (nats, ≤ 0) of
    generated tokens; ``versions``: per token, the policy version that sampled it;
    ``reward``: the verifier's scalar reward; ``finish_reason``: why generation ended
    (vLLM's ``stop``/``length``/``abort``, or the task's, e.g. ``max_turns``)."""

    prompt_id: str
    group_id: str
    tokens: list[int]
    generated: list[bool]
    logprobs: list[float]
    versions: list[int]
    reward: float
    finish_reason: str

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"trajectory {self.name}: " + "; ".join(problems))

    @property
    def name(self) -> str:
        return f"{self.group_id}/{self.prompt_id}"

    def problems(self) -> list[str]:
        """Every inconsistency, one message each naming the field, what was found and what
        is needed."""
        n = len(self.tokens)
        out = [f"{f} has {len(getattr(self, f))} entries but tokens has {n} (one per token)"
               for f in ("generated", "logprobs", "versions") if len(getattr(self, f)) != n]
        if n < 2:
            out.append(f"tokens has {n} entries; a trajectory needs a prompt and at least one more token")
        if n and self.generated and self.generated[0]:
            out.append("generated[0] is True; the first token is the prompt's (nothing to condition it on)")
        if not self.prompt_id or not self.group_id:
            out.append("prompt_id and group_id must be non-empty strings")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            out.append(f"reward is {self.reward!r}; it must be a finite number")
        if not self.finish_reason:
            out.append("finish_reason is empty")
        if out:
            return out
        for i, (gen, lp, v) in enumerate(zip(self.generated, self.logprobs, self.versions)):
            if gen and not (math.isfinite(lp) and lp <= 0.0):
                out.append(f"logprobs[{i}] = {lp!r} on a generated token; a log-prob is finite and <= 0")
            if gen and v < 0:
                out.append(f"versions[{i}] = {v} on a generated token; policy versions are >= 0")
            if len(out) >= 4:
                break
        return out

    @property
    def num_generated(self) -> int:
        return sum(self.generated)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the generated tokens (what staleness is
        measured from); None when the policy produced nothing."""
        generated = [v for g, v in zip(self.generated, self.versions) if g]
        return min(generated) if generated else None

    @property
    def newest_version(self) -> int | None:
        generated = [v for g, v in zip(self.generated, self.versions) if g]
        return max(generated) if generated else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Trajectory:
        """The record :meth:`to_dict` wrote; missing or unknown keys are refused by name."""
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            who = f"{data.get('group_id', '?')}/{data.get('prompt_id', '?')}"
            raise ValueError(f"trajectory {who}: missing fields {missing}, unknown fields {unknown}; "
                             f"a trajectory has exactly {names}")
        return cls(prompt_id=str(data["prompt_id"]), group_id=str(data["group_id"]),
                   tokens=[int(t) for t in data["tokens"]], generated=[bool(g) for g in data["generated"]],
                   logprobs=[float(x) for x in data["logprobs"]], versions=[int(v) for v in data["versions"]],
                   reward=float(data["reward"]), finish_reason=str(data["finish_reason"]))
