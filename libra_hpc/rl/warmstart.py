"""Warm start: a short supervised pass on demonstrations the project generates, so that RL
starts from a policy that knows the chat and tool-call format and succeeds sometimes.

The demonstrations are episodes of the task's scripted noisy solver
(:mod:`libra_hpc.envs.solvers`) on the *training* split, with real tool returns (the
executor runs the calls, as in RL). They are imperfect on purpose: malformed calls and
misspelt queries the solver then recovers from, wrong final answers, and, with
``warmstart.guess``, problems answered at once without any tool (multi-step ones, or
the kinds ``warmstart.guess_on`` names; the model copies this over-confidence, RL has to
unlearn it). Their prompt texts are checked
against the held-out split by text hash (:meth:`~libra_hpc.envs.task.Splits.check_disjoint`).

Training is plain supervised learning (mean negative log-likelihood, Adam, gradient
clipping at norm 1, bfloat16 mixed precision where the CPU has it) of the Hugging Face
model in one process with transformers: a one-time build step like the tiny model's,
which needs no torch world and runs about twice as fast on CPU as the Megatron engine
does for this model (RL then trains on Megatron). The demonstrations' common prefix (the
system prompt and tool descriptions) runs once per batch (:func:`nll_shared`).
``warmstart.loss_on`` picks the tokens: the solver's turns (supervised fine-tuning), or
the whole transcript, from which a model this small learns to copy names and numbers out
of questions and tool outputs in far fewer steps.

The result is a Hugging Face checkpoint (the base's config and tokenizer, the trained
weights) published like the tiny model build (:func:`libra_hpc.engines.tiny.publish_build`)
in a folder named by a fingerprint of everything that made it (base build, task and its
options, warm-start options): an identical request reuses it.

Pure at import time (torch, transformers and safetensors are imported inside the calls).
``options`` is the ``warmstart`` config section (:class:`libra_hpc.config.WarmStartConfig`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from libra_hpc.config import WarmStartConfig
from libra_hpc.envs.solvers import AnswerPrior, ArithmeticSolver, SearchSolver, run_episode
from libra_hpc.envs.task import Episode, Executor, Task
from libra_hpc.envs.toolcall import IM_END

log = logging.getLogger(__name__)

_VERSION = 8  # bump when the same options produce different weights (a solver or encoding change)
_BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def solver_for(task: Task, options: WarmStartConfig) -> Callable[[Episode], str]:
    """The task's noisy scripted solver: the built-in tasks' own, or a plugin task's
    ``solver(seed=..., guess=...)`` method (``guess_on=...`` too, when it is set). Raises
    ValueError naming ``warmstart.guess_on`` if it names a kind no training prompt has."""
    if options.guess_on is not None:
        kinds = {p.meta.get("kind") for p in task.splits.train} - {None}
        unknown = sorted(set(options.guess_on) - kinds)
        if unknown:
            raise ValueError(f"warmstart.guess_on: task {task.name!r} has no prompts of kind {unknown} "
                             f"(its training prompts' kinds: {sorted(kinds) or 'none recorded'})")
    if task.name in ("arithmetic", "search"):
        make = ArithmeticSolver if task.name == "arithmetic" else SearchSolver
        return make(seed=options.seed, guess=options.guess, guess_on=options.guess_on,
                    prior=AnswerPrior(task.splits.train))
    make = getattr(task, "solver", None)
    if make is None:
        raise ValueError(f"warm start: task {task.name!r} has no scripted solver; give the task a "
                         "solver(seed, guess) method returning a policy(episode) -> text, or start from a "
                         "checkpoint that already knows the task (model.path)")
    extra = {} if options.guess_on is None else {"guess_on": options.guess_on}
    return make(seed=options.seed, guess=options.guess, **extra)


def demonstrations(task: Task, solver: Callable[[Episode], str], executor: Executor, count: int, *,
                   threads: int = 8) -> list[Episode]:
    """``count`` solver episodes on the training split (cycling through it with fresh
    episode ids, so the noise differs, when ``count`` exceeds it), tools run by
    ``executor``. Raises SplitLeak if a held-out prompt would be among them. An episode
    whose transcript names a held-out entity (a vague search showed a held-out person's
    passage) is left out: no held-out fact is in any demonstration."""
    train = task.splits.train
    prompts = [train[i % len(train)] for i in range(count)]
    task.splits.check_disjoint((p.text for p in prompts), "the warm-start demonstrations")
    with ThreadPoolExecutor(threads) as pool:
        episodes = list(pool.map(lambda ip: run_episode(task, ip[1], solver, executor, f"demo/{ip[0]}"),
                                 enumerate(prompts)))
    if not task.splits.heldout_entities():
        return episodes
    kept = [e for e in episodes if task.splits.leaking("".join(t for t, _ in demonstration_pieces(e))) is None]
    if len(kept) < len(episodes):
        log.info("warm start: %d of %d demonstrations left out: their searches showed a held-out person's passage",
                 len(episodes) - len(kept), len(episodes))
    return kept


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


def fingerprint(base_model: Path, task: Task, task_options: dict[str, Any], options: WarmStartConfig) -> dict:
    """What names a warm-start build: the base checkpoint's own fingerprint (its
    ``build.json``) or path, the task and its options, and the warm-start options."""
    marker = base_model / "build.json"
    base = json.loads(marker.read_text()).get("fingerprint") if marker.is_file() else str(base_model.resolve())
    spec = {"version": _VERSION, "base": base, "task": task.name, "task_options": task_options,
            "options": options.model_dump(), "precision": resolve_precision(options.precision)}
    spec["fingerprint"] = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return spec


def resolve_precision(choice: str) -> str:
    """``warmstart.precision`` on this machine: `auto` is `bf16` where the CPU computes
    bfloat16 natively (oneDNN says so), else `fp32`."""
    if choice != "auto":
        return choice
    import torch

    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN
        native = False
    return "bf16" if native else "fp32"


def lr_factor(step: int, total: int, warmup: float = 0.03, floor: float = 0.05) -> float:
    """Learning-rate multiplier of supervised step ``step`` of ``total``: linear warm-up
    over the first ``warmup`` share of the steps, then a cosine decay from 1 to ``floor``
    (the last steps refine instead of jumping around the minimum they found)."""
    ramp = max(1, round(warmup * total))
    if step < ramp:
        return (step + 1) / ramp
    done = min(1.0, (step - ramp) / max(1, total - ramp))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))


def sft_batches(sequences: Sequence[tuple[list[int], list[bool]]], batch_size: int, seed: int,
                epoch: int) -> list[list[int]]:
    """One epoch's batches (indices into ``sequences``): shuffled, then sorted by length
    inside windows of 64 batches so that a batch pads little (on the default task's
    demonstrations, windows of 8 batches ran 1.46x the real tokens and 2x the attention
    work; 64 about 1.05x), the batches then shuffled again."""
    order = list(range(len(sequences)))
    random.Random(f"{seed}/sft/{epoch}").shuffle(order)
    window = 64 * batch_size
    out = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(sequences[i][0]))
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    random.Random(f"{seed}/sft/{epoch}/batches").shuffle(out)
    return out


def _padded(rows: Sequence[tuple[list[int], list[bool]]], pad_id: int):
    """(tokens [B, S], loss mask [B, S-1]) of ``rows`` right-padded with ``pad_id``."""
    import torch

    width = max(len(t) for t, _ in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (ids, trained) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids) - 1] = torch.tensor(trained[1:], dtype=torch.float32)
    return tokens, mask


def nll(model: Any, rows: Sequence[tuple[list[int], list[bool]]], pad_id: int):
    """Mean negative log-likelihood per trained token of ``rows`` under ``model`` (a
    transformers causal LM), as a tensor that can be back-propagated."""
    import torch

    tokens, mask = _padded(rows, pad_id)
    logits = model(tokens).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def shared_prefix(sequences: Sequence[tuple[list[int], list[bool]]]) -> int:
    """How many leading tokens every sequence has in common (the system prompt and the
    tool descriptions: about two thirds of a demonstration), leaving each at least two
    tokens of its own."""
    if not sequences:
        return 0
    first = sequences[0][0]
    n = min(len(t) for t, _ in sequences) - 2
    for tokens, _ in sequences[1:]:
        k = 0
        while k < n and tokens[k] == first[k]:
            k += 1
        n = k
    return max(0, n)


def nll_shared(model: Any, rows: Sequence[tuple[list[int], list[bool]]], prefix: int, pad_id: int):
    """:func:`nll` of ``rows`` whose first ``prefix`` tokens are the same in every row,
    computed with that prefix run once: its keys and values are repeated over the batch
    and each row's own tokens attend to them (the same causal attention, the same
    positions). The loss is the same quantity as :func:`nll`'s (the prefix's trained
    tokens count once per row, as there), to float rounding; the forward and backward
    pass cost a third of the tokens on demonstrations whose prefix is two thirds."""
    import torch
    from transformers import DynamicCache

    if prefix < 1:
        return nll(model, rows, pad_id)
    batch = len(rows)
    head_ids = torch.tensor([rows[0][0][:prefix]])
    cache = DynamicCache()
    head = model(head_ids, past_key_values=cache, use_cache=True).logits[0].float()  # [P, V]
    cache.batch_repeat_interleave(batch)
    tails = [(ids[prefix:], trained[prefix:]) for ids, trained in rows]
    width = max(len(t) for t, _ in tails)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width)
    present = torch.zeros(batch, width, dtype=torch.long)
    for i, (ids, trained) in enumerate(tails):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = torch.tensor(trained, dtype=torch.float32)
        present[i, :len(ids)] = 1
    attention = torch.cat([torch.ones(batch, prefix, dtype=torch.long), present], dim=1)
    positions = torch.arange(prefix, prefix + width).expand(batch, width)
    tail = model(tokens, past_key_values=cache, attention_mask=attention, position_ids=positions).logits.float()
    # token j of a tail is predicted by the position before it: the prefix's last for j = 0
    logits = torch.cat([head[-1:].expand(batch, 1, -1), tail[:, :-1]], dim=1)
    tail_lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
    head_mask = torch.tensor(rows[0][1][1:prefix], dtype=torch.float32)
    head_lp = torch.log_softmax(head[:-1], dim=-1).gather(-1, head_ids[0, 1:, None])[..., 0]
    total = (tail_lp * mask).sum() + batch * (head_lp * head_mask).sum()
    return -total / (mask.sum() + batch * head_mask.sum()).clamp(min=1)


def build_warmstart(path: Path, base_model: Path, task: Task, spec: dict, options: WarmStartConfig,
                    executor: Executor, *, progress: Callable[[str], None] = log.info,
                    tick: Callable[[int, int, str], None] | None = None) -> Path:
    """The warm-start checkpoint at ``path`` (:func:`fingerprint`'s ``spec``): reused when
    already built, else demonstrations, ``options.epochs`` of supervised steps of
    ``base_model`` in this process (transformers, fp32 weights, ``spec['precision']``
    arithmetic, the caller's torch threads) and publish. ``progress`` gets one line per
    stage and per epoch; ``tick(step, total, note)`` is called after every supervised step
    (the total known before the first)."""
    from libra_hpc.engines.tiny import publish_build

    if (path / "build.json").is_file():
        return publish_build(path, spec, lambda _: None, "warm start")

    def write(staging: Path) -> None:
        from safetensors.torch import save_file

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
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        positions = int(model.config.max_position_embeddings)
        fits = [s for s in sequences if len(s[0]) <= positions]
        if len(fits) < len(sequences):
            progress(f"warm start: {len(sequences) - len(fits)} demonstrations longer than the model's "
                     f"{positions} positions left out")
        sequences = fits
        torch.manual_seed(options.seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
        total = options.epochs * -(-len(sequences) // options.batch_size)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: lr_factor(k, total) if options.schedule == "cosine" else 1.0)
        held = sequences[:: max(1, len(sequences) // 32)][:32]
        prefix = shared_prefix(sequences)
        if len({tuple(trained[:prefix]) for _, trained in sequences}) > 1:
            prefix = 0  # the same tokens trained in some rows and not in others: no sharing
        bf16 = spec.get("precision", resolve_precision(options.precision)) == "bf16"
        progress(f"warm start: {prefix} leading tokens shared by every demonstration, run once per batch; "
                 f"{'bf16 mixed' if bf16 else 'fp32'} precision")
        step = 0
        for epoch in range(options.epochs):
            model.train()
            for batch in sft_batches(sequences, options.batch_size, options.seed, epoch):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = nll_shared(model, [sequences[i] for i in batch], prefix, codec.pad_id)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if tick is not None:
                    tick(step, total, f"epoch {epoch + 1}/{options.epochs}, loss {loss.item():.3f}")
            model.eval()
            with torch.no_grad():
                held_nll = sum(float(nll(model, held[i:i + 8], codec.pad_id)) for i in range(0, len(held), 8))
            progress(f"warm start: epoch {epoch + 1} done, NLL per trained token {held_nll / -(-len(held) // 8):.3f}")
        for name in _BASE_FILES:
            if (base_model / name).is_file():
                shutil.copy(base_model / name, staging / name)
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})
        progress(f"warm start: {step} steps, built in {time.perf_counter() - started:.0f} s")

    return publish_build(path, spec, write, "warm start")
