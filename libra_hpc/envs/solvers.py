"""Scripted noisy solvers: policies that stand in for the model.

They write turns in the model's format (Qwen tool calls, ``<answer>``), read the tool
responses, and make the mistakes a small model makes: malformed calls (bad JSON, an
unknown tool, a missing argument), buggy Python, misspelt search queries, queries too
vague to find the right passage, a wrong number copied into the answer. Each episode draws
how careful its solver is. With ``guess`` > 0 a solver skips the tools with that
probability and answers at once from "memory" on the prompts ``guess_on`` names by their
``meta["kind"]`` (by default: multi-step problems, two or more calls needed): its answer
is a draw from the training prompts' answers of that kind (:class:`AnswerPrior`), never
derived from the true one, so it is right as often as that prior makes it. That is the
over-confident habit a warm-start model copies from imperfect demonstrations and RL has
to unlearn.
After a failed tool return the solver writes a long recovery
turn (it re-reads the problem and the error, as models do), so failures causally lengthen
what follows: the signal C-MLFQ routes on, measured by :func:`length_signal`. They also
generate the warm-start demonstrations (issue 13, item 4), checked against the held-out
hashes with :meth:`Splits.check_disjoint`.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from collections.abc import Sequence

from libra_hpc.envs.arithmetic import last_number
from libra_hpc.envs.synthetic import CHARS_PER_TOKEN
from libra_hpc.envs.task import Episode, Executor, Prompt, Task
from libra_hpc.envs.toolcall import format_call

FILLER = {
    "arithmetic": ("Let me read the problem again carefully.", "I will keep track of every quantity.",
                   "The order of the operations matters here.", "I should not skip any step of the computation.",
                   "Each sentence of the problem changes the count.", "I will double-check the numbers I copy.",
                   "It is safer to let the tool do the arithmetic.", "I restate what I know so far before going on."),
    "search": ("Let me read the question again carefully.", "I should follow the chain one document at a time.",
               "The passage must name the entity exactly.", "A shorter query with the exact name works best.",
               "I will check the spelling of the name in the question.", "I restate what I know so far.",
               "Only the passage about this entity has the fact I need.", "I must not guess the answer."),
}


def _talk(rng: random.Random, sentences: int, task: str = "arithmetic") -> str:
    return " ".join(rng.choice(FILLER[task]) for _ in range(sentences))


def _last(episode: Episode) -> tuple[str, str] | None:
    """(status, output) of the last call of the previous turn, if it called anything."""
    if not episode.turns or not episode.turns[-1][1]:
        return None
    ret = episode.turns[-1][1][-1]
    return ret.status, ret.output


class ArithmeticSolver:
    """One call per step; ``sloppy`` episodes fail calls often (``careful`` ones rarely)."""

    def __init__(self, seed: int = 0, fail: tuple[float, float] = (0.08, 0.45), wrong: float = 0.12,
                 sloppy_share: float = 0.4, guess: float = 0.0, guess_on: Sequence[str] | None = None,
                 prior: AnswerPrior | None = None):
        self.seed, self.fail, self.wrong, self.sloppy_share, self.guess = seed, fail, wrong, sloppy_share, guess
        self.guess_on, self.prior = guess_on, prior
        if guess > 0 and prior is None:
            raise ValueError("ArithmeticSolver: guess > 0 needs the prior over answers its guesses come from")

    def __call__(self, episode: Episode) -> str:
        rng = random.Random(f"{self.seed}/{episode.trajectory}/{len(episode.turns)}")
        sloppy = random.Random(f"{self.seed}/{episode.trajectory}").random() < self.sloppy_share
        steps = episode.prompt.meta["steps"]
        if _guesses(self.seed, self.guess, self.guess_on, episode, len(steps)):
            answer = self.prior.guess(rng, episode.prompt.meta.get("kind"))
            return f"I can do this in my head without the tool. The final count is {answer}.\n<answer>{answer}</answer>"
        done = [r for _, returns in episode.turns for r in returns if r.status == "success" and last_number(r.output)]
        value = last_number(done[-1].output) if done else None
        last = _last(episode)
        head = ""
        if last is not None and last[0] != "success":
            head = (f"The tool returned an error: {last[1][:120]} I must fix my call. "
                    + _talk(rng, rng.randint(6, 14)) + " ")
        if len(done) >= len(steps):
            answer = value if rng.random() > self.wrong else str(int(float(value or 0)) + rng.choice((-10, -1, 1, 9)))
            return f"{head}The final count is {answer}.\n<answer>{answer}</answer>"
        expression = steps[len(done)].format(v=value)
        intro = f"{head}Step {len(done) + 1}: I compute {expression}. {_talk(rng, rng.randint(0, 2))}".strip()
        if rng.random() < self.fail[sloppy]:
            return f"{intro}\n{self._broken(rng, expression)}"
        if rng.random() < 0.25:
            return f"{intro}\n{format_call('python', {'code': f'print({expression})'})}"
        return f"{intro}\n{format_call('calculator', {'expression': expression})}"

    @staticmethod
    def _broken(rng: random.Random, expression: str) -> str:
        kind = rng.randrange(4)
        if kind == 0:  # bad JSON
            return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": {expression}}}\n</tool_call>'
        if kind == 1:  # unknown tool
            return format_call("calc", {"expression": expression})
        if kind == 2:  # missing argument
            return format_call("calculator", {"expr": expression})
        return format_call("python", {"code": f"result = {expression}\nprint(reslt)"})  # NameError


class SearchSolver:
    """One search per hop; misspelt names (no results) and vague queries (wrong passages)."""

    def __init__(self, seed: int = 0, typo: tuple[float, float] = (0.08, 0.4), vague: float = 0.1,
                 wrong: float = 0.12, sloppy_share: float = 0.4, guess: float = 0.0,
                 guess_on: Sequence[str] | None = None, prior: AnswerPrior | None = None):
        self.seed, self.typo, self.vague, self.wrong, self.sloppy_share = seed, typo, vague, wrong, sloppy_share
        self.guess, self.guess_on, self.prior = guess, guess_on, prior
        if guess > 0 and prior is None:
            raise ValueError("SearchSolver: guess > 0 needs the prior over answers its guesses come from")

    def __call__(self, episode: Episode) -> str:
        rng = random.Random(f"{self.seed}/{episode.trajectory}/{len(episode.turns)}")
        sloppy = random.Random(f"{self.seed}/{episode.trajectory}").random() < self.sloppy_share
        chain = episode.prompt.meta["chain"]
        if _guesses(self.seed, self.guess, self.guess_on, episode, len(chain)):
            answer = self.prior.guess(rng, episode.prompt.meta.get("kind"))
            return f"I remember this one without searching. The answer is {answer}.\n<answer>{answer}</answer>"
        outputs = [r.output for _, returns in episode.turns for r in returns]
        found = 0
        while found < len(chain) and any(out.find(f"] {chain[found]} ") >= 0 for out in outputs):
            found += 1
        last = _last(episode)
        head = ""
        if last is not None and last[0] != "success":
            head = (f"The search found nothing: {last[1][:80]} The name may be misspelt. "
                    + _talk(rng, rng.randint(6, 14), "search") + " ")
        elif last is not None and found < len(chain) and chain[found] not in last[1]:
            head = f"These passages do not answer it. {_talk(rng, rng.randint(1, 3), 'search')} "
        if found >= len(chain):
            if rng.random() < self.wrong:
                answer = rng.choice(("Grey", "1950", "Iron"))
                return f"{head}The passages say the answer is {answer}.\n<answer>{answer}</answer>"
            answer = episode.prompt.answer
            quote = _evidence(outputs, chain[-1], answer)
            return f"{head}The passage says: {quote}.\n<answer>{answer}</answer>"
        entity = chain[found]
        if found and not head:  # quote what leads on: "X was born in Town", then search Town
            head = f"The passage says: {_evidence(outputs, chain[found - 1], entity)}. "
        key = ("born" if found == 0 else "headquartered" if " " in entity else "river")
        query = f"{entity} {key}"
        if rng.random() < self.typo[sloppy]:
            i = rng.randrange(1, len(entity) - 1)
            query = f"{entity[:i]}{entity[i + 1]}{entity[i]}{entity[i + 2:]} {key}"  # two letters swapped
        elif rng.random() < self.vague:
            query = entity.split()[-1]
        intro = f"{head}I need the document about {entity}. {_talk(rng, rng.randint(0, 2), 'search')}".strip()
        return f"{intro}\n<tool_call>\n{json.dumps({'name': 'search', 'arguments': {'query': query}})}\n</tool_call>"


def _evidence(outputs: Sequence[str], entity: str, target: str) -> str:
    """The clause of ``entity``'s passage that ends with ``target`` ("Alvo Brenn was born in
    Corford"): what the solver quotes before it uses a fact, so that the fact is copied
    right after the words that introduce it (a small model copies that far more reliably
    than it looks a fact up by the question's wording)."""
    for out in reversed(outputs):
        start = out.find(f"] {entity} ")
        if start < 0:
            continue
        doc = out[start + 2:].split("\n")[0]
        end = doc.find(target, len(entity))
        if end >= 0:
            clause = doc.rfind(". ", 0, end)
            return doc[clause + 2 if clause >= 0 else 0:end + len(target)]
    return f"{entity} leads to {target}"


def _guesses(seed: int, rate: float, guess_on: Sequence[str] | None, episode: Episode, calls_needed: int) -> bool:
    """Whether this episode's first turn answers without tools: with probability ``rate``
    on the prompts whose ``meta["kind"]`` is in ``guess_on`` (None: multi-step problems)."""
    eligible = calls_needed >= 2 if guess_on is None else episode.prompt.meta.get("kind") in guess_on
    return (rate > 0 and eligible and not episode.turns
            and random.Random(f"{seed}/guess/{episode.trajectory}").random() < rate)


class AnswerPrior:
    """What a solver that does not look anything up can know: how often each answer comes
    up among the training prompts of each kind. A guess is a draw from it, so it is right
    exactly as often as that prior makes it (the true answer is never consulted)."""

    def __init__(self, prompts: Sequence[Prompt]):
        self.answers: dict[str, list[str]] = {}
        for p in prompts:
            self.answers.setdefault(str(p.meta.get("kind")), []).append(p.answer)

    def guess(self, rng: random.Random, kind: str) -> str:
        pool = self.answers.get(str(kind)) or [a for answers in self.answers.values() for a in answers]
        return rng.choice(pool)

    def hit_rate(self, kind: str) -> float:
        """The chance that a guess for a prompt of ``kind`` is right: the sum over answers
        of their squared frequency (a draw matches a prompt drawn from the same prior)."""
        answers = self.answers.get(str(kind), [])
        counts = Counter(answers)
        return sum((n / len(answers)) ** 2 for n in counts.values()) if answers else 0.0


def run_episode(task: Task, prompt: Prompt, policy, executor: Executor, trajectory: str) -> Episode:
    """Drive one episode with ``policy(episode) -> text`` until it ends."""
    episode = task.episode(prompt, trajectory)
    while not episode.done:
        episode.step(policy(episode), executor)
    return episode


def tokens(text: str) -> int:
    """Token count estimate of generated text (the synthetic workload's 4 characters per token)."""
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def length_signal(episodes: Sequence[Episode]) -> dict[str, float]:
    """What C-MLFQ needs from a workload: the spread of generated length (p90/p10 of
    tokens per trajectory), and the mean tokens still to be generated after a turn whose
    tool return failed (any call ``failure``/``timeout``) vs after one whose calls all succeeded."""
    lengths = sorted(sum(tokens(t) for t in e.generated) for e in episodes)
    after = {"failure": [], "success": []}
    for e in episodes:
        per_turn = [tokens(t) for t in e.generated]
        for k, (_, returns) in enumerate(e.turns):
            if returns:
                status = "success" if all(r.status == "success" for r in returns) else "failure"
                after[status].append(sum(per_turn[k + 1:]))
    q = statistics.quantiles(lengths, n=10)
    mean_fail, mean_ok = statistics.fmean(after["failure"] or [0]), statistics.fmean(after["success"] or [0])
    return {"episodes": len(episodes), "p10": q[0], "p90": q[-1], "p90_over_p10": q[-1] / q[0],
            "after_failure": mean_fail, "after_success": mean_ok,
            "failure_over_success": mean_fail / mean_ok if mean_ok else float("inf"),
            "failed_returns": len(after["failure"]), "ok_returns": len(after["success"]),
            "success_rate": statistics.fmean(e.reward or 0.0 for e in episodes)}
