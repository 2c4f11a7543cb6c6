"""The Megatron-Core training engine: log-probs, a policy-gradient step, HF export.

One object per training rank; every method is collective over the training ranks (the
torch default group, see :mod:`.parallel`). On a GPU node the same code runs with CUDA
tensors and NCCL; without CUDA, megatron runs under :func:`.cpu_shims.megatron_on_cpu`.

A step: the rank's :class:`~.loss.PolicyBatch` is cut into micro-batches and run through
megatron's forward/backward schedule (1F1B when PP > 1); the loss of every micro-batch is
a *sum* over its tokens and megatron divides the gradients by the token count of the
whole global batch (all DP replicas); megatron DDP reduces the gradients over DP into
``param.main_grad``; the Megatron optimizer (Adam, gradient clipping by global norm)
applies them. A plain torch optimizer would see ``grad is None`` and silently do nothing.

Export: :meth:`MegatronTrainEngine.iter_hf` gathers the TP shards of one layer at a time
onto the stage's holder and converts them to HF names and layouts (exact, see
:mod:`.convert`), for :mod:`libra_hpc.engines.sync` to stream to the rollout leaders.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from libra_hpc.engines.train import convert, parallel
from libra_hpc.engines.train.cpu_shims import megatron_on_cpu, seed_model_parallel
from libra_hpc.engines.train.loss import PolicyBatch, policy_gradient_loss
from libra_hpc.engines.train.model import build_gpt, transformer_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did, identical on every training rank.

    ``loss``: the surrogate loss per trained token over the global batch; ``grad_norm``:
    global gradient norm before clipping; ``tokens``: trained tokens in the global batch;
    ``seconds``: wall time of the step on this rank; ``kl``: mean k3 estimate of
    KL(policy‖reference) per trained token (0 when the batch has no KL term). The
    rollout-vs-trainer gap on the trained tokens (0 when the batch has no rollout
    log-probs): ``gap_kl``, the mean k3 estimate of KL(behaviour‖trainer), ``gap_max`` the
    largest |log-prob difference|; ``is_capped``: the share of trained tokens whose
    importance weight the off-policy correction truncated."""

    loss: float
    grad_norm: float
    tokens: int
    clipped_fraction: float
    seconds: float
    kl: float = 0.0
    gap_kl: float = 0.0
    gap_max: float = 0.0
    is_capped: float = 0.0


class MegatronTrainEngine:
    """A Megatron-Core GPTModel loaded from a Hugging Face Qwen2/Qwen3/Llama checkpoint.

    ``model_path``: HF checkpoint directory (config.json + *.safetensors). ``tp``, ``pp``:
    tensor/pipeline parallel sizes; DP is the rest of the torch world. ``lr``: Adam
    learning rate; ``clip_grad``: max global gradient L2 norm; ``clip_eps``: the PPO ratio
    clip; ``micro_batch_size``: sequences per forward/backward on this DP replica;
    ``dtype``: parameter dtype (float32 for exact log-prob comparisons; bfloat16 keeps
    fp32 main weights in the optimizer). ``distributed_optimizer``: shard the Adam state
    and fp32 main weights over the DP replicas (megatron's distributed optimizer, ZeRO-1)."""

    def __init__(self, model_path: str | Path, *, tp: int = 1, pp: int = 1, lr: float = 1e-5,
                 clip_grad: float = 1.0, weight_decay: float = 0.0, clip_eps: float = 0.2, micro_batch_size: int = 1,
                 seed: int = 0, dtype: torch.dtype = torch.float32, distributed_optimizer: bool = False):
        self.model_path = Path(model_path)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"MegatronTrainEngine: {config_file} not found; model_path must be a Hugging "
                                    "Face checkpoint directory")
        self.shape = convert.ModelShape.from_hf_config(json.loads(config_file.read_text()), str(config_file))
        self.clip_eps = clip_eps
        self.micro_batch_size = micro_batch_size
        self.steps = 0
        self.accumulated = 0  # accumulate() calls since the last optimizer step
        self._earlier: list = []  # their micro-batch reports (on the last pipeline stage; none elsewhere)
        self.work = dict.fromkeys(("microbatches", "tokens", "forward_tokens"), 0)  # since the last take_work()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        with megatron_on_cpu():
            self.placement = parallel.init_model_parallel(tp, pp)
            seed_model_parallel(seed)
            self.config = transformer_config(self.shape, tp=tp, pp=pp, dtype=dtype, cpu_init=not cuda)
            model = build_gpt(self.shape, self.config, pre_process=self.placement.first_stage,
                              post_process=self.placement.last_stage).to(self.device, dtype)  # the norms too
            self._load_hf(model)
            self.model, self.optimizer = _wrap(model, self.config, lr=lr, clip_grad=clip_grad,
                                               weight_decay=weight_decay, dtype=dtype,
                                               distributed=distributed_optimizer)
        log.info("megatron engine ready: %s, tp=%d pp=%d dp=%d, %s", self.model_path.name, tp, pp,
                 self.placement.dp, self.device)

    @classmethod
    def from_config(cls, model_path: str | Path, model_cfg, training_cfg, *, seed: int = 0, tp: int | None = None,
                    pp: int | None = None) -> MegatronTrainEngine:
        """The engine the experiment YAML describes: ``model.dtype``; ``training.tensor_parallel``,
        ``pipeline_parallel``, ``micro_batch_size``, ``lr``, ``grad_clip``, ``ppo_clip``,
        ``distributed_optimizer``. ``tp``/``pp``: the shape the layout gives instead (a
        planner's layout may differ from the config's)."""
        return cls(model_path, tp=tp or training_cfg.tensor_parallel, pp=pp or training_cfg.pipeline_parallel,
                   lr=training_cfg.lr, clip_grad=training_cfg.grad_clip, clip_eps=training_cfg.ppo_clip,
                   micro_batch_size=training_cfg.micro_batch_size, seed=seed, dtype=getattr(torch, model_cfg.dtype),
                   distributed_optimizer=training_cfg.distributed_optimizer)

    # ------------------------------------------------------------------ public verbs

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs [B, S-1] of ``tokens`` [B, S] under the current weights
        (position t: log p(token t+1 | tokens ≤ t)), in float32, on every rank of the
        pipeline (computed on the last stage, broadcast to the others)."""
        batch = PolicyBatch(tokens, torch.zeros(tokens.shape[0], tokens.shape[1] - 1),
                            torch.zeros(tokens.shape[0], tokens.shape[1] - 1))
        with megatron_on_cpu(), torch.no_grad():
            self.model.eval()
            outputs = self._schedule(batch, forward_only=True)
            self.model.train()
        if self.placement.last_stage:
            result = torch.cat(outputs, dim=0).float()
        else:
            result = torch.empty(tokens.shape[0], tokens.shape[1] - 1, device=self.device)
        if self.placement.pp > 1:
            from megatron.core import parallel_state as ps

            dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return result

    def accumulate(self, batch: PolicyBatch) -> int:
        """Forward and backward on ``batch`` (part of this DP replica's share of the coming
        step: the GRPO groups that have arrived) into the gradient buffer, with neither the
        DP reduction nor the optimizer step: the next :meth:`train_step` adds its own batch
        and takes the one step over all of them, with the same gradient as if they had come
        at once (the per-token mean divides by the tokens of every part, over DP, once).
        Collective over this replica's TP and PP ranks only, so each replica accumulates
        what it has, as often as it likes. Returns the calls since the last step."""
        with megatron_on_cpu():
            if not self.accumulated:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            finalize, self.config.finalize_model_grads_func = self.config.finalize_model_grads_func, None
            try:
                self._earlier += self._schedule(batch, forward_only=False)
            finally:
                self.config.finalize_model_grads_func = finalize
        self.accumulated += 1
        return self.accumulated

    def train_step(self, batch: PolicyBatch) -> StepStats:
        """One optimizer step on this DP replica's share of the global batch (collective),
        together with what :meth:`accumulate` gathered since the last step."""
        start = time.perf_counter()
        earlier, accumulated, self._earlier, self.accumulated = self._earlier, self.accumulated, [], 0
        with megatron_on_cpu():
            if not accumulated:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            finalize = self.config.finalize_model_grads_func
            if accumulated:  # the per-token mean's divisor counts the accumulated tokens too (last stage;
                before = round(float(sum(r["tokens"] for r in earlier)))  # the others take its count)
                self.config.finalize_model_grads_func = \
                    lambda model, num_tokens=None, *a, **kw: finalize(model, None if num_tokens is None else
                                                                      num_tokens + before, *a, **kw)
            try:
                reports = earlier + self._schedule(batch, forward_only=False)
            finally:
                self.config.finalize_model_grads_func = finalize
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError(f"training step {self.steps}: the optimizer skipped the update (inf/nan "
                                     "gradients); lower training.lr or check the advantages")
        keys = ("loss_sum", "tokens", "clipped", "kl", "gap_kl", "is_capped")
        totals = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        largest = torch.zeros(1, dtype=torch.float64, device=self.device)
        for report in reports:
            totals += torch.stack([report[k] for k in keys]).to(totals)
            largest = torch.maximum(largest, report["gap_max"].reshape(1).to(largest))
        from megatron.core import parallel_state as ps

        if self.placement.pp > 1:
            for t in (totals, largest):
                dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        loss_sum, tokens, clipped, kl, gap_kl, capped = totals.tolist()
        self.steps += 1
        per = max(tokens, 1)
        return StepStats(loss=loss_sum / per, grad_norm=float(grad_norm), tokens=int(tokens),
                         clipped_fraction=clipped / per, seconds=time.perf_counter() - start, kl=kl / per,
                         gap_kl=gap_kl / per, gap_max=float(largest.item()), is_capped=capped / per)

    def take_work(self) -> dict[str, int]:
        """What this rank computed since the last call, and reset: the micro-batches its
        forward-and-backward schedules ran, their tokens (rows × width as computed, the
        padding each micro-batch keeps included) and the tokens of forward-only passes
        (:meth:`logprobs`). Each trainer's step report carries it, and the planner's
        ``planner_prediction`` event per DP replica (runtime/planning.py): the job routes
        whole GRPO groups, so the replicas' shares differ."""
        work, self.work = self.work, dict.fromkeys(self.work, 0)
        return work

    def export_hf(self) -> dict[str, torch.Tensor] | None:
        """Full Hugging Face weights of this rank's pipeline stage, gathered over TP, on
        the stage's holder (TP rank 0 of DP replica 0, see ``placement.holds_export``);
        None on every other rank. Collective over the TP group of DP replica 0."""
        weights = dict(self.iter_hf())
        return weights if self.placement.holds_export else None

    def iter_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`export_hf` one piece at a time: the embedding, then each layer, then the
        final norm and head, each gathered over TP and converted just before it is
        yielded, so a sync can send while the rest is still being gathered. Every rank of
        the TP group must iterate it to the end (the gathers are collective); it yields
        nothing except on the holder, and nothing at all on DP replicas other than 0."""
        from megatron.core.transformer.transformer_layer import (
            get_transformer_layer_offset,
        )

        if self.placement.dp_rank != 0:
            return
        local = {k: v.detach() for k, v in self._gpt().state_dict().items() if not k.endswith("_extra_state")}
        offset = get_transformer_layer_offset(self.config)
        for keys, first, last in _export_pieces(local, self.placement):
            shards = self._gather_tp({k: local[k] for k in keys})
            if shards is not None:
                yield from convert.hf_from_shards(shards, self.shape, layer_offset=offset, first_stage=first,
                                                  last_stage=last).items()

    def _gather_tp(self, local: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
        """This TP group's shards of ``local``, one dict per TP rank, on the holder; None
        elsewhere."""
        from megatron.core import parallel_state as ps

        tp, holder = self.placement.tp, self.placement.holds_export
        if tp == 1:  # the conversion copies: the export never aliases the parameters
            return [local]
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name in sorted(local):
            tensor = local[name].contiguous()
            pieces = [torch.empty_like(tensor) for _ in range(tp)] if holder else None
            dist.gather(tensor, pieces, dst=ps.get_tensor_model_parallel_src_rank(),
                        group=ps.get_tensor_model_parallel_group())
            for rank, piece in enumerate(pieces or []):
                shards[rank][name] = piece
        return shards if holder else None

    def shutdown(self) -> None:
        """Drop the model and optimizer and free megatron's process groups (collective).

        The groups' sockets close only once nothing references them; megatron's DDP and
        optimizer sit in reference cycles, so collect them now rather than leave every
        relayout's gloo sockets (64 fds a cycle at TP=1) to a later garbage collection."""
        self.model = self.optimizer = None
        parallel.destroy_model_parallel()
        gc.collect()

    # -------------------------------------------------------------------- internals

    def _gpt(self):
        return self.model.module

    def _load_hf(self, model) -> None:
        from megatron.core.transformer.transformer_layer import (
            get_transformer_layer_offset,
        )
        from safetensors.torch import load_file

        files = sorted(self.model_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"MegatronTrainEngine: no *.safetensors in {self.model_path}")
        hf: dict[str, torch.Tensor] = {}
        for file in files:
            hf.update(load_file(str(file)))
        place = self.placement
        offset = get_transformer_layer_offset(self.config)
        shard = convert.megatron_shard(hf, self.shape, tp_rank=place.tp_rank, tp=place.tp, layer_offset=offset,
                                       num_layers=self.shape.num_layers // place.pp, first_stage=place.first_stage,
                                       last_stage=place.last_stage)
        result = model.load_state_dict(shard, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{self.model_path}: converted weights do not fit the Megatron model "
                               f"(missing {missing[:4]}, unexpected {result.unexpected_keys[:4]})")

    def _schedule(self, batch: PolicyBatch, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._check_tokens(batch.tokens)
        rows = batch.tokens.shape[0]
        mbs = min(self.micro_batch_size, rows)
        if rows % mbs:
            raise ValueError(f"batch of {rows} sequences does not split into micro-batches of {mbs}; "
                             "give a multiple of training.micro_batch_size")
        if forward_only or self.placement.pp > 1:  # one width: pipeline stages exchange fixed-shape activations
            micro = [self._micro(batch.slice(i, i + mbs)) for i in range(0, rows, mbs)]
        else:
            micro = self._trimmed_micro_batches(batch, mbs)
        tokens = sum(int(m["input"].numel()) for m in micro)
        if forward_only:
            self.work["forward_tokens"] += tokens
        else:
            self.work["microbatches"] += len(micro)
            self.work["tokens"] += tokens
        return get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.model],
            num_microbatches=len(micro), seq_length=batch.tokens.shape[1] - 1, micro_batch_size=mbs,
            forward_only=forward_only, collect_non_loss_data=forward_only)

    def _trimmed_micro_batches(self, batch: PolicyBatch, mbs: int) -> list[dict[str, torch.Tensor | float]]:
        """Micro-batches of rows of similar length, each cut to its longest row's last trained
        token: the same loss and gradients as the padded batch (the loss sums over trained
        tokens; attention is causal), without computing the padding. Trajectories of an
        agentic batch differ in length by several times, so this is most of a step on CPU."""
        widths = batch.trained_widths()
        order = torch.argsort(widths, stable=True)
        batch, widths = batch.take(order), widths[order]
        return [self._micro(batch.slice(i, i + mbs).narrow(max(2, int(widths[i:i + mbs].max()))))
                for i in range(0, batch.tokens.shape[0], mbs)]

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse what would fail deep inside megatron (or silently extrapolate RoPE)."""
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must be [batch, seq] with seq >= 2, got shape {tuple(tokens.shape)}")
        if tokens.shape[1] - 1 > self.shape.max_positions:
            raise ValueError(f"sequences of {tokens.shape[1]} tokens exceed the model's max_position_embeddings="
                             f"{self.shape.max_positions} ({self.model_path / 'config.json'})")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.shape.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary of "
                             f"{self.shape.vocab_size} ({self.model_path / 'config.json'})")

    def _micro(self, batch: PolicyBatch) -> dict[str, torch.Tensor | float]:
        tokens = batch.tokens.to(self.device, torch.long)
        s = tokens.shape[1] - 1
        out = {"input": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "position": torch.arange(s, device=self.device).expand(tokens.shape[0], s),
               "mask": batch.loss_mask.to(self.device), "advantages": batch.advantages.to(self.device)}
        for key, value in (("old", batch.old_logprobs), ("weights", batch.weights), ("ref", batch.ref_logprobs),
                           ("prox", batch.prox_logprobs)):
            if value is not None:
                out[key] = value.to(self.device)
        out["kl_coef"], out["is_cap"] = batch.kl_coef, batch.is_cap
        return out

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["input"], mb["position"], None, labels=mb["labels"])
        return output, partial(self._loss, mb)

    def _loss(self, mb: Mapping[str, torch.Tensor | float], output: torch.Tensor, non_loss_data: bool = False):
        logprobs = -output.float()  # megatron returns the per-token cross-entropy [b, s]
        if non_loss_data:
            return logprobs.detach()
        loss_sum, tokens, report = policy_gradient_loss(logprobs, mb["advantages"], mb["mask"], mb.get("old"),
                                                        self.clip_eps, weights=mb.get("weights"),
                                                        ref_logprobs=mb.get("ref"), kl_coef=mb["kl_coef"],
                                                        is_cap=mb["is_cap"], prox_logprobs=mb.get("prox"))
        return loss_sum, tokens, report


def _wrap(model, config, *, lr: float, clip_grad: float, weight_decay: float, dtype: torch.dtype,
          distributed: bool):
    """Megatron DDP (gradients reduced over DP into ``main_grad``) + the Megatron optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_distributed_optimizer=distributed,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8), [ddp], use_gloo_process_groups=False)
    return ddp, optimizer


def _export_pieces(local: Mapping[str, torch.Tensor], placement) -> Iterator[tuple[list[str], bool, bool]]:
    """The stage's megatron names in export order, one piece per layer: (names, first
    stage piece?, last stage piece?) as :func:`convert.hf_from_shards` wants them."""
    layers: dict[int, list[str]] = {}
    for name in local:
        if name.startswith("decoder.layers."):
            layers.setdefault(int(name.split(".")[2]), []).append(name)
    if placement.first_stage:
        yield ["embedding.word_embeddings.weight"], True, False
    for index in sorted(layers):
        yield sorted(layers[index]), False, False
    if placement.last_stage:
        yield sorted(k for k in local if not k.startswith(("decoder.layers.", "embedding."))), False, True
