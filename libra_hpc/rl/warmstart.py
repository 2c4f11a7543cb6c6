"""Warm start: a short supervised pass on demonstrations the project generates, so that RL
starts from a policy that knows the chat and tool-call format and succeeds sometimes.

The demonstrations are episodes of the task's scripted noisy solver
(:mod:`libra_hpc.envs.solvers`) on the *training* split, with real tool returns (the
executor runs the calls, as in RL). They are imperfect on purpose: malformed calls and
misspelt queries the solver then recovers from, wrong final answers, and, with
``warmstart.guess``, multi-step problems answered at once without any tool (the model
copies this over-confidence; RL has to unlearn it). Their prompt texts are checked
against the held-out split by text hash (:meth:`~libra_hpc.envs.task.Splits.check_disjoint`).

Training is the policy-gradient engine's own loss with advantage 1, no behaviour policy
(ratio 1) and the loss mask on the solver's tokens: exactly the negative log-likelihood
gradient of supervised fine-tuning, on the same Megatron engine that RL then uses.

The result is a Hugging Face checkpoint (the base's config and tokenizer, the trained
weights) published like the tiny model build (:func:`libra_hpc.engines.tiny.publish_build`)
in a folder named by a fingerprint of everything that made it (base build, task and its
options, warm-start options): an identical request reuses it.

Pure at import time (torch, safetensors and the engine are imported inside the calls).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from libra_hpc.envs.solvers import ArithmeticSolver, SearchSolver, run_episode
from libra_hpc.envs.task import Episode, Executor, Task
from libra_hpc.envs.toolcall import IM_END

log = logging.getLogger(__name__)

_VERSION = 1  # bump when the same options produce different weights
_BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class WarmStartOptions:
    """The ``warmstart`` config section (:class:`libra_hpc.config.WarmStartConfig`)."""

    demonstrations: int = 2000
    epochs: int = 2
    batch_size: int = 16
    lr: float = 1e-3
    guess: float = 0.75
    seed: int = 0
    loss_on: str = "turns"

    @classmethod
    def from_config(cls, section: Any) -> WarmStartOptions:
        return cls(**{k: getattr(section, k) for k in cls.__dataclass_fields__})


def solver_for(task: Task, options: WarmStartOptions) -> Callable[[Episode], str]:
    """The task's noisy scripted solver: the built-in tasks' own, or a plugin task's
    ``solver(seed=..., guess=...)`` method."""
    if task.name == "arithmetic":
        return ArithmeticSolver(seed=options.seed, guess=options.guess)
    if task.name == "search":
        return SearchSolver(seed=options.seed, guess=options.guess)
    make = getattr(task, "solver", None)
    if make is None:
        raise ValueError(f"warm start: task {task.name!r} has no scripted solver; give the task a "
                         "solver(seed, guess) method returning a policy(episode) -> text, or start from a "
                         "checkpoint that already knows the task (model.path)")
    return make(seed=options.seed, guess=options.guess)


def demonstrations(task: Task, solver: Callable[[Episode], str], executor: Executor, count: int, *,
                   threads: int = 8) -> list[Episode]:
    """``count`` solver episodes on the training split (cycling through it with fresh
    episode ids, so the noise differs, when ``count`` exceeds it), tools run by
    ``executor``. Raises SplitLeak if a held-out prompt would be among them."""
    train = task.splits.train
    prompts = [train[i % len(train)] for i in range(count)]
    task.splits.check_disjoint((p.text for p in prompts), "the warm-start demonstrations")
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda ip: run_episode(task, ip[1], solver, executor, f"demo/{ip[0]}"),
                             enumerate(prompts)))


def demonstration_pieces(episode: Episode) -> list[tuple[str, bool]]:
    """The episode as (text, trained) pieces in token order: every model turn ends with
    ``<|im_end|>`` (trained: stopping is part of the turn) and the observations after it
    drop theirs, which is how :func:`libra_hpc.rl.rollout.rollout` records a trajectory."""
    pieces: list[tuple[str, bool]] = []
    for text, trained in episode.segments():
        if trained:
            pieces.append((text + IM_END, True))
        else:
            pieces.append((text[len(IM_END):] if pieces and text.startswith(IM_END) else text, False))
    return pieces


def encode_demonstration(episode: Episode, encode: Callable[[str], list[int]]) -> tuple[list[int], list[bool]]:
    """Token ids of the episode and, per token, whether it is trained on."""
    tokens: list[int] = []
    trained: list[bool] = []
    for text, is_model in demonstration_pieces(episode):
        ids = encode(text)
        tokens += ids
        trained += [is_model] * len(ids)
    return tokens, trained


def fingerprint(base_model: Path, task: Task, task_options: dict[str, Any], options: WarmStartOptions) -> dict:
    """What names a warm-start build: the base checkpoint's own fingerprint (its
    ``build.json``) or path, the task and its options, and the warm-start options."""
    marker = base_model / "build.json"
    base = json.loads(marker.read_text()).get("fingerprint") if marker.is_file() else str(base_model.resolve())
    spec = {"version": _VERSION, "base": base, "task": task.name, "task_options": task_options,
            "options": asdict(options)}
    spec["fingerprint"] = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return spec


def sft_batches(sequences: Sequence[tuple[list[int], list[bool]]], batch_size: int, seed: int,
                epoch: int) -> list[list[int]]:
    """One epoch's batches (indices into ``sequences``): shuffled, then sorted by length
    inside windows of 8 batches so that a batch pads little."""
    order = list(range(len(sequences)))
    random.Random(f"{seed}/sft/{epoch}").shuffle(order)
    window = 8 * batch_size
    out = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(sequences[i][0]))
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    random.Random(f"{seed}/sft/{epoch}/batches").shuffle(out)
    return out


def sft_step(engine: Any, rows: Sequence[tuple[list[int], list[bool]]], pad_id: int) -> Any:
    """One supervised step of ``engine`` (:class:`~libra_hpc.engines.train.MegatronTrainEngine`)
    on ``rows`` (token ids, trained mask): the engine's loss with advantage 1 on trained
    tokens and no behaviour policy, i.e. ``-Σ log p`` over them. Returns its StepStats."""
    import torch

    from libra_hpc.engines.train.loss import PolicyBatch

    width = max(len(t) for t, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (ids, trained) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids) - 1] = torch.tensor(trained[1:], dtype=torch.float32)
    return engine.train_step(PolicyBatch(tokens, mask, mask.clone()))


def mean_nll(engine: Any, rows: Sequence[tuple[list[int], list[bool]]], pad_id: int) -> float:
    """Mean negative log-likelihood per trained token of ``rows`` under the engine."""
    import torch

    width = max(len(t) for t, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (ids, trained) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids) - 1] = torch.tensor(trained[1:], dtype=torch.float32)
    logprobs = engine.logprobs(tokens)
    return float(-(logprobs * mask).sum() / mask.sum().clamp(min=1))


def build_warmstart(path: Path, base_model: Path, task: Task, spec: dict, options: WarmStartOptions,
                    executor: Executor, *, micro_batch_size: int = 4,
                    progress: Callable[[str], None] = log.info) -> Path:
    """The warm-start checkpoint at ``path`` (:func:`fingerprint`'s ``spec``): reused when
    already built, else demonstrations, ``options.epochs`` of supervised steps on a fresh
    Megatron engine of ``base_model`` (TP=1, this process's torch world, which must be
    started), export and publish. ``progress`` gets one line per stage and every 20 steps."""
    from libra_hpc.engines.tiny import publish_build

    if (path / "build.json").is_file():
        return publish_build(path, spec, lambda _: None, "warm start")

    def write(staging: Path) -> None:
        from safetensors.torch import save_file

        from libra_hpc.engines.train.engine import MegatronTrainEngine
        from libra_hpc.rl.rollout import TextCodec

        started = time.perf_counter()
        episodes = demonstrations(task, solver_for(task, options), executor, options.demonstrations)
        codec = TextCodec(base_model)
        sequences = [encode_demonstration(e, codec.encode) for e in episodes]
        if options.loss_on == "transcript":  # every token: tool outputs and questions teach copying too
            sequences = [(tokens, [True] * len(tokens)) for tokens, _ in sequences]
        solved = sum(e.reward or 0.0 for e in episodes) / len(episodes)
        progress(f"warm start: {len(episodes)} demonstrations ({solved:.2f} solved, "
                 f"{sum(map(sum, (m for _, m in sequences)))} trained tokens) in {time.perf_counter() - started:.0f} s")
        engine = MegatronTrainEngine(base_model, lr=options.lr, micro_batch_size=micro_batch_size,
                                     seed=options.seed)
        fits = [s for s in sequences if len(s[0]) <= engine.shape.max_positions]
        if len(fits) < len(sequences):
            progress(f"warm start: {len(sequences) - len(fits)} demonstrations longer than the model's "
                     f"{engine.shape.max_positions} positions left out")
        sequences = fits
        held = sequences[:: max(1, len(sequences) // 64)][:64]
        step = 0
        for epoch in range(options.epochs):
            for batch in sft_batches(sequences, options.batch_size, options.seed, epoch):
                rows = [sequences[i] for i in batch]
                rows += rows[:(-len(rows)) % micro_batch_size]  # whole micro-batches
                stats = sft_step(engine, rows, codec.pad_id)
                step += 1
                if step % 20 == 0:
                    progress(f"warm start: epoch {epoch + 1}/{options.epochs} step {step} "
                             f"grad norm {stats.grad_norm:.2f}, {time.perf_counter() - started:.0f} s")
            progress(f"warm start: epoch {epoch + 1} done, NLL per trained token "
                     f"{mean_nll(engine, held + held[:(-len(held)) % micro_batch_size], codec.pad_id):.3f}")
        weights = engine.export_hf()
        engine.shutdown()
        for name in _BASE_FILES:
            if (base_model / name).is_file():
                shutil.copy(base_model / name, staging / name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        progress(f"warm start: {step} steps, built in {time.perf_counter() - started:.0f} s")

    return publish_build(path, spec, write, "warm start")
