"""MPI worlds for the training-engine tests: ``mpiexec -n N python -m mpi4py tests/train_world.py SCENARIO MODEL OUT``.

``tp2`` (2 ranks): both ranks form the training torch world at TP=2. Log-probs of a fixed
batch before and after ``STEPS`` policy-gradient steps, the step losses, and the
exported HF weights' log-probs under plain transformers (rank 0); then a dist checkpoint
(OUT/ckpt) that the test loads at TP=1, and the log-probs after one more step from it. The same processes then re-initialise megatron as
PP=2 (load that checkpoint, one step, per-stage export) and as DP=2 (half the batch per
rank, with the plain and with the distributed optimizer, whose checkpoint is reloaded).

``sync`` (3 ranks): ranks 0-1 train at PP=2 (one stage each), rank 2 is a rollout
instance leader. After the steps each stage holder pushes its stage's HF weights to rank
2 over its own MPI communicator {holder, 2}; rank 2 chains both streams into one
``update_weights`` of its vLLM engine (started while 0-1 train) and scores the batch;
then a mixed-dtype push with tiny buckets checks the wire format bit for bit.

Rank 0 writes OUT/result.json. Helpers used by both this script and the tests live here
(no MPI import at module level, so the tests can import them).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # libra_hpc without an installed package

STEPS = 3
LR = 1e-5
BATCH, SEQ = 4, 24


def fixed_batch(vocab: int, seed: int = 1):
    """(tokens [B, S], loss mask [B, S-1], advantages [B, S-1]): random tokens, the first 5
    positions as prompt (mask 0), the last 2 of row 3 as padding, advantages ±1 and ±0.5 per
    sequence (GRPO-style: one value per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ - 1)
    mask[:, :5] = 0
    mask[3, -2:] = 0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(BATCH, SEQ - 1).contiguous()
    return tokens, mask, advantages


def hf_logprobs(model_dir, tokens: torch.Tensor, state: dict | None = None) -> torch.Tensor:
    """Per-token log-probs [B, S-1] from a plain transformers forward in float32
    (optionally after loading ``state``, HF-named weights, strictly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        if model.config.tie_word_embeddings:  # the export has no lm_head: it is the embedding
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def train(engine, tokens, mask, advantages):
    """``STEPS`` steps against the initial policy (old log-probs fixed): returns
    (initial log-probs, step stats, final log-probs)."""
    from libra_hpc.engines.train.loss import PolicyBatch

    before = engine.logprobs(tokens)
    stats = [engine.train_step(PolicyBatch(tokens, mask, advantages, old_logprobs=before)) for _ in range(STEPS)]
    return before, stats, engine.logprobs(tokens)


def _training(comm, model_dir: Path, *, tp: int = 2, pp: int = 1):
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import start_torch_world

    start_torch_world(comm)
    engine = MegatronTrainEngine(model_dir, tp=tp, pp=pp, lr=LR, micro_batch_size=2)
    tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
    before, stats, after = train(engine, tokens, mask, advantages)
    return engine, tokens, before, stats, after


def _one_more_step(engine, tokens: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """One more step on the fixed batch (old log-probs ``before``); the log-probs after it.
    Its update depends on the Adam moments and step count: a load that lost either gives
    other log-probs."""
    from libra_hpc.engines.train.loss import PolicyBatch

    _, mask, advantages = fixed_batch(engine.shape.vocab_size)
    engine.train_step(PolicyBatch(tokens, mask, advantages, old_logprobs=before))
    return engine.logprobs(tokens)


def scenario_tp2(comm, model_dir: Path, out: Path) -> None:
    from libra_hpc.engines.train.checkpoint import save_checkpoint

    engine, tokens, before, stats, after = _training(comm, model_dir)
    exported = engine.export_hf()
    save_checkpoint(engine, out / "ckpt")
    continued = _one_more_step(engine, tokens, before)  # what a re-sharded load must reproduce
    placement = engine.placement
    engine.shutdown()
    pp2 = _pp2(model_dir, out / "ckpt", tokens, after)
    dp2 = _dp2(model_dir, tokens, out)
    if comm.Get_rank() == 0:
        result = {**pp2, **dp2,
            "placement": placement.__dict__,
            "losses": [s.loss for s in stats], "grad_norms": [s.grad_norm for s in stats],
            "tokens": [s.tokens for s in stats], "step_s": [s.seconds for s in stats],
            "init_vs_hf": (before - hf_logprobs(model_dir, tokens)).abs().max().item(),
            "export_vs_hf": (after - hf_logprobs(model_dir, tokens, exported)).abs().max().item(),
            "moved": (after - before).abs().max().item(),
            "before": before.tolist(), "after": after.tolist(), "continued": continued.tolist(),
        }
        (out / "result.json").write_text(json.dumps(result))


def _pp2(model_dir: Path, ckpt: Path, tokens: torch.Tensor, trained: torch.Tensor) -> dict:
    """Re-initialised in the same processes as PP=2 (one layer per stage): load the TP=2
    checkpoint (resharded across stages), then one step; each stage exports its own
    layers and rank 0 joins them for transformers."""
    import torch.distributed as dist

    from libra_hpc.engines.train.checkpoint import load_checkpoint
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.loss import PolicyBatch

    engine = MegatronTrainEngine(model_dir, tp=1, pp=2, lr=LR, micro_batch_size=2)
    load_checkpoint(engine, ckpt)
    restored = engine.logprobs(tokens)
    _, mask, advantages = fixed_batch(engine.shape.vocab_size)
    stats = engine.train_step(PolicyBatch(tokens, mask, advantages, old_logprobs=restored))
    after = engine.logprobs(tokens)
    parts = [None, None]
    dist.all_gather_object(parts, engine.export_hf())
    engine.shutdown()
    # the same step in two parts: half accumulated while the rest "arrives", then the step
    # (the first stage holds no loss reports: it must keep its gradients all the same)
    engine = MegatronTrainEngine(model_dir, tp=1, pp=2, lr=LR, micro_batch_size=2)
    load_checkpoint(engine, ckpt)
    batch = PolicyBatch(tokens, mask, advantages, old_logprobs=restored)
    engine.accumulate(batch.slice(0, 2))
    streamed = engine.train_step(batch.slice(2, 4))
    streamed_after = engine.logprobs(tokens)
    engine.shutdown()
    if dist.get_rank() != 0:
        return {}
    joined = {**parts[0], **parts[1]}
    return {"pp2_restored_vs_tp2": (restored - trained).abs().max().item(), "pp2_loss": stats.loss,
            "pp2_streamed": {"loss": streamed.loss, "tokens": streamed.tokens, "tokens_whole": stats.tokens,
                             "grad_norm": streamed.grad_norm, "grad_norm_whole": stats.grad_norm,
                             "after_vs_whole": (streamed_after - after).abs().max().item()},
            "pp2_stage_tensors": [len(p) for p in parts],
            "pp2_export_vs_hf": (after - hf_logprobs(model_dir, tokens, joined)).abs().max().item()}


def _dp2(model_dir: Path, tokens: torch.Tensor, out: Path) -> dict:
    """DP=2: each rank steps on half the batch; the step must be the full batch's. Then the
    same with megatron's distributed optimizer (Adam state sharded over DP): two steps
    with a checkpoint between them, whose weights a fresh engine loads (its Adam state
    cannot be loaded on CPU: the refusal is recorded)."""
    from libra_hpc.engines.train.checkpoint import load_checkpoint, save_checkpoint
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.loss import PolicyBatch

    def engine(distributed: bool) -> MegatronTrainEngine:
        return MegatronTrainEngine(model_dir, tp=1, pp=1, lr=LR, micro_batch_size=1,
                                   distributed_optimizer=distributed)

    plain = engine(False)
    _, mask, advantages = fixed_batch(plain.shape.vocab_size)
    half = slice(2 * plain.placement.dp_rank, 2 * plain.placement.dp_rank + 2)
    batch = PolicyBatch(tokens[half], mask[half], advantages[half])
    stats = [plain.train_step(batch)]
    whole_after = plain.logprobs(tokens)
    stats.append(plain.train_step(batch))
    dp = plain.placement.dp
    plain.shutdown()
    # the first step again, with replica 0 accumulating its first row before the rest comes
    # and replica 1 taking its rows at once: no DP collective until the step
    streaming = engine(False)
    if streaming.placement.dp_rank == 0:
        streaming.accumulate(batch.slice(0, 1))
        streamed = streaming.train_step(batch.slice(1, 2))
    else:
        streamed = streaming.train_step(batch)
    streamed_after = streaming.logprobs(tokens)
    streaming.shutdown()
    sharded = engine(True)
    sharded_stats = [sharded.train_step(batch)]
    saved = sharded.logprobs(tokens)
    save_checkpoint(sharded, out / "ckpt-distopt")
    sharded_stats.append(sharded.train_step(batch))
    sharded.shutdown()
    resumed = engine(True)
    try:
        load_checkpoint(resumed, out / "ckpt-distopt")
        refusal = None
    except NotImplementedError as exc:
        refusal = str(exc)
    load_checkpoint(resumed, out / "ckpt-distopt", with_optimizer=False)
    restored = resumed.logprobs(tokens)
    resumed.shutdown()
    return {"dp2": {"dp": dp, "loss": stats[0].loss, "grad_norm": stats[0].grad_norm, "tokens": stats[0].tokens,
                    "grad_norms": [s.grad_norm for s in stats],
                    "streamed": {"loss": streamed.loss, "tokens": streamed.tokens, "grad_norm": streamed.grad_norm,
                                 "after_vs_whole": (streamed_after - whole_after).abs().max().item()},
                    "distopt_grad_norms": [s.grad_norm for s in sharded_stats],
                    "distopt_refusal": refusal, "distopt_restored_vs_saved": (restored - saved).abs().max().item()}}


def _wait(comm) -> None:
    """A barrier that sleeps instead of spinning (MPICH polls a core while it waits, and
    this machine has two)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def _as_tensor(scores) -> torch.Tensor:
    return torch.stack([torch.as_tensor(row, dtype=torch.float32) for row in scores])


def _mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"a.float32": torch.randn(3, 5, generator=gen), "b.bfloat16": torch.randn(17, generator=gen).bfloat16(),
            "c.int64": torch.arange(-4, 9), "d.empty": torch.empty(0, 4), "e.bool": torch.tensor([True, False, True]),
            "f.float16": torch.randn(2, 2, 2, generator=gen).half(), "g.big": torch.randn(300, generator=gen)}


def scenario_sync(comm, model_dir: Path, out: Path) -> None:
    import itertools

    from mpi4py import MPI

    from libra_hpc.engines.sync import pull_weights, push_weights

    rank = comm.Get_rank()
    training = rank < 2
    train_comm = comm.Split(0 if training else 1, rank)
    # one sync communicator per stage holder: {holder, leader}, the holder is rank 0 in it
    stage_comms = [comm.Split(0 if rank in (holder, 2) else MPI.UNDEFINED, 0 if rank == holder else 1)
                   for holder in (0, 1)]
    if training:
        engine, tokens, before, stats, after = _training(train_comm, model_dir, tp=1, pp=2)
        sync_comm = stage_comms[rank]
        _wait(sync_comm)  # the leader's engine is up
        sync = push_weights(sync_comm, engine.iter_hf(), root=0)  # this stage's layers, streamed
        if rank == 0:
            comm.send({"after": after}, dest=2)
            mixed = push_weights(sync_comm, _mixed_tensors(), root=0, bucket_bytes=128)
            result = comm.recv(source=2)
            result.update({"placement": engine.placement.__dict__, "push_mixed_buckets": mixed.buckets,
                           "losses": [s.loss for s in stats]})
        pushes = comm.gather(sync.__dict__, root=0) if rank < 2 else None
        if rank == 0:
            result["pushes"] = pushes[:2]  # rank 2 gathers None
            (out / "result.json").write_text(json.dumps(result))
        engine.shutdown()
        return
    from libra_hpc.engines.rollout import VllmRolloutEngine

    engine = VllmRolloutEngine(str(model_dir), tp=1, dtype="float32", seed=0)  # starts while ranks 0-1 train
    tokens, _, _ = fixed_batch(engine.vocab_size)
    before = _as_tensor(engine.score(tokens.tolist()))
    for sync_comm in stage_comms:
        _wait(sync_comm)
    pulled: list = []
    engine.update_weights(itertools.chain(*(pull_weights(c, root=0, stats=pulled) for c in stage_comms)))
    after = _as_tensor(engine.score(tokens.tolist()))
    engine.shutdown()
    got = comm.recv(source=0)
    mixed = dict(pull_weights(stage_comms[0], root=0))
    expected = _mixed_tensors()
    exact = sorted(k for k in expected if mixed[k].dtype == expected[k].dtype and torch.equal(mixed[k], expected[k]))
    comm.send({"rollout": type(engine).__name__, "rollout_vs_trained": (after - got["after"]).abs().max().item(),
               "rollout_before_vs_trained": (before - got["after"]).abs().max().item(),
               "pulls": [p.__dict__ for p in pulled], "mixed_exact": exact, "mixed_names": sorted(mixed)}, dest=0)
    comm.gather(None, root=0)


def main() -> None:
    from mpi4py import MPI

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    scenario, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    start = time.perf_counter()
    {"tp2": scenario_tp2, "sync": scenario_sync}[scenario](MPI.COMM_WORLD, model_dir, out)
    print(f"rank {MPI.COMM_WORLD.Get_rank()} done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
