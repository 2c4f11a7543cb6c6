"""The Megatron-Core training engine: exact HF⇄Megatron conversion, the CPU shims, the
policy-gradient loss, and the real engine on the tiny model — in-process at TP=1 and in a
2-rank MPI world at TP=2 (tests/train_world.py) — against a plain transformers forward."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from libra_hpc.engines.train import convert
from libra_hpc.engines.train.convert import ModelShape

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import itertools

import train_world
from train_world import STEPS, fixed_batch, hf_logprobs

TOL = 1e-4  # fp32 log-prob agreement the acceptance asks for
RESHARD_TOL = 1e-5  # across a re-shard of the same weights (issue 17)


# ------------------------------------------------------------------ conversion (pure)

def _shape(**kw) -> ModelShape:
    base = {"vocab_size": 16, "hidden_size": 8, "ffn_hidden_size": 12, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                "head_dim": 4, "qkv_bias": True, "tied_embeddings": False, "norm_eps": 1e-6, "rope_theta": 1e4, "max_positions": 64}
    return ModelShape(**{**base, **kw})


def _hf_weights(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (shape.vocab_size, h), "model.norm.weight": (h,)}
    if not shape.tied_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if shape.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if shape.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return {name: torch.randn(s, generator=gen) for name, s in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tied,bias,qk_norm", [(False, True, False), (True, False, True)])
def test_conversion_round_trip_is_bit_exact(tp, pp, tied, bias, qk_norm):
    shape = _shape(tied_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm)
    hf = _hf_weights(shape)
    per_stage = shape.num_layers // pp
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        where = {"layer_offset": stage * per_stage, "first_stage": stage == 0, "last_stage": stage == pp - 1}
        shards = [convert.megatron_shard(hf, shape, tp_rank=r, tp=tp, num_layers=per_stage, **where)
                  for r in range(tp)]
        assert all(s.keys() == shards[0].keys() for s in shards)
        back.update(convert.hf_from_shards(shards, shape, **where))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_shard_holds_each_kv_group_after_its_query_heads():
    shape = _shape()  # 8 query heads, 4 KV groups, head_dim 4
    d, per = shape.head_dim, shape.num_heads // shape.num_kv_heads
    rows = lambda heads, tag: torch.cat([torch.full((d, 1), tag + h, dtype=torch.float) for h in range(heads)])
    q, k, v = rows(shape.num_heads, 0), rows(shape.num_kv_heads, 100), rows(shape.num_kv_heads, 200)
    fused = convert.fuse_qkv(q, k, v, shape)
    rank1 = fused.chunk(2)[1][::d, 0].tolist()  # TP=2, rank 1: groups 2 and 3, one value per head
    assert rank1 == [4, 5, 102, 202, 6, 7, 103, 203]
    assert all(torch.equal(a, b) for a, b in zip(convert.split_qkv(fused, shape), (q, k, v)))
    assert per == 2


def test_fc1_shard_is_the_ranks_gate_rows_then_its_up_rows():
    shape = _shape(num_layers=1)
    hf = _hf_weights(shape)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    fc1 = convert.megatron_shard(hf, shape, tp_rank=1, tp=2)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[6:], up[6:]]))


def test_shape_refuses_what_it_cannot_convert_and_says_which_field():
    config = {
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    shape = ModelShape.from_hf_config(config)
    assert shape.head_dim == 32 and shape.qkv_bias and shape.rope_theta == 10000.0
    with pytest.raises(ValueError, match="vocab_size=1000"):
        shape.check_tp(3)
    with pytest.raises(ValueError, match=r"x\.json: model_type='gpt2'"):
        ModelShape.from_hf_config({**config, "model_type": "gpt2"}, "x.json")
    with pytest.raises(ValueError, match="RoPE scaling"):
        ModelShape.from_hf_config({**config, "rope_scaling": {"type": "yarn"}})
    with pytest.raises(ValueError, match="RoPE scaling"):
        ModelShape.from_hf_config({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    qwen3 = ModelShape.from_hf_config({**config, "model_type": "qwen3", "rope_parameters": {"rope_theta": 1e6}})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.rope_theta == 1e6
    with pytest.raises(KeyError, match="model.embed_tokens.weight"):
        convert.megatron_shard({}, shape)


# ------------------------------------------------------------------------ CPU shims

def test_shims_refuse_another_megatron_version(monkeypatch):
    import megatron.core

    from libra_hpc.engines.train import cpu_shims

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(cpu_shims.ShimVersionError, match=r"megatron-core==0\.16\.1 but 0\.17\.0"), \
            cpu_shims.megatron_on_cpu():
        pass
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_shims_rewrite_cuda_only_inside_their_scope():
    from libra_hpc.engines.train.cpu_shims import megatron_on_cpu

    current = torch.cuda.current_device
    with megatron_on_cpu():
        with megatron_on_cpu():  # re-entrant
            x = torch.zeros(2, device="cuda")
            y = torch.ones(1, device=torch.cuda.current_device()).cuda().to("cuda:0")
        assert x.device.type == y.device.type == "cpu" and x.type() == "torch.cuda.FloatTensor"
        torch.cuda.synchronize()
    assert torch.cuda.current_device is current and torch.zeros(1).type() == "torch.FloatTensor"


def test_shims_apply_in_every_thread_that_enters_them():
    import threading

    from libra_hpc.engines.train.cpu_shims import megatron_on_cpu

    seen = {}

    def worker():
        with megatron_on_cpu():  # while the main thread is inside too
            seen["inside"] = torch.zeros(1, device="cuda").device.type
        try:
            torch.zeros(1, device="cuda")
            seen["outside"] = "cpu"
        except (RuntimeError, AssertionError):
            seen["outside"] = "refused"

    with megatron_on_cpu():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == {"inside": "cpu", "outside": "refused"}


def test_cpu_rng_tracker_forks_named_streams_and_restores_the_outer_one():
    from libra_hpc.engines.train.cpu_shims import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(5)
    expected_outer = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("a"):
        a1 = torch.rand(3)
    with tracker.fork("b"):
        b1 = torch.rand(3)
    with tracker.fork("a"):
        a2 = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_outer)  # outer stream untouched
    assert torch.equal(a1, torch.manual_seed(1) and torch.rand(3)) and not torch.equal(a1, b1)
    assert not torch.equal(a1, a2)  # the named stream advances
    with pytest.raises(ValueError):
        tracker.add("c", 1)
    with pytest.raises(KeyError, match="never added"), tracker.fork("zzz"):
        pass


# --------------------------------------------------------------------------- loss

def test_policy_gradient_loss_is_reinforce_on_policy_and_clips_off_policy():
    from libra_hpc.engines.train.loss import policy_gradient_loss

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, tokens, _ = policy_gradient_loss(logp, adv, mask)
    loss.backward()
    assert tokens.item() == 2 and loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist() == [[-2.0, 1.0, 0.0]]  # -A·∇logp on masked tokens only
    # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient; with A < 0 the unclipped term wins
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.5, -0.5]])
    loss, _, report = policy_gradient_loss(logp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), old, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 + torch.e ** 0.5, rel=1e-6)
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(torch.e ** 0.5, rel=1e-6)
    assert report["clipped"].item() == 2


def test_policy_batch_refuses_misaligned_per_token_arrays():
    from libra_hpc.engines.train.loss import PolicyBatch

    with pytest.raises(ValueError, match=r"advantages has shape \(2, 5\).*2×4"):
        PolicyBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4), torch.ones(2, 5))


# ------------------------------------------------------------- the engine, for real

@pytest.fixture(scope="module")
def tp2_world(tiny, tmp_path_factory):
    """Run tests/train_world.py tp2 on 2 MPI ranks once; its result and checkpoint."""
    from mpi_worlds import run_world

    out = tmp_path_factory.mktemp("tp2")
    run_world("train_world.py", 2, "tp2", tiny, out, timeout=240, what="the TP=2 training world")
    return json.loads((out / "result.json").read_text()), out / "ckpt"


def _engine(tiny, **kw):
    from libra_hpc.engines.train.engine import MegatronTrainEngine

    return MegatronTrainEngine(tiny, **{"tp": 1, "lr": train_world.LR, "micro_batch_size": 2, **kw})


@pytest.mark.mpi
def test_tp2_logprobs_match_transformers_before_and_after_training(tp2_world):
    result, _ = tp2_world
    assert result["placement"]["tp"] == 2 and result["placement"]["dp"] == 1
    assert result["init_vs_hf"] < TOL
    assert result["export_vs_hf"] < TOL
    assert result["moved"] > 100 * TOL  # the steps changed the policy: the comparison after them means something
    losses = result["losses"]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


@pytest.mark.mpi
def test_tp1_matches_transformers_and_tp2_and_lowers_the_loss(tiny, torch_world, tp2_world):
    result, _ = tp2_world
    engine = _engine(tiny)
    try:
        tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
        before, stats, after = train_world.train(engine, tokens, mask, advantages)
        exported = engine.export_hf()
    finally:
        engine.shutdown()
    assert (before - hf_logprobs(tiny, tokens)).abs().max() < TOL
    assert (after - hf_logprobs(tiny, tokens, exported)).abs().max() < TOL
    losses = [s.loss for s in stats]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert [s.tokens for s in stats] == [int(mask.sum())] * STEPS
    # TP=2 is the same model split two ways: same losses, gradient norms and policy, up to
    # float reassociation (the norm covers every TP shard once: megatron skips shards it
    # thinks are duplicates, see engines/train/model.py)
    assert losses == pytest.approx(result["losses"], abs=TOL)
    assert [s.grad_norm for s in stats] == pytest.approx(result["grad_norms"], rel=TOL)
    assert (after - torch.tensor(result["after"])).abs().max() < 1e-3
    # DP=2 (two ranks, half the batch each, one micro-batch of 1 at a time) takes the same
    # first step: the per-token mean is over the global batch
    dp2 = result["dp2"]
    assert dp2["dp"] == 2 and dp2["tokens"] == stats[0].tokens
    assert dp2["loss"] == pytest.approx(losses[0], abs=1e-6)
    assert dp2["grad_norm"] == pytest.approx(stats[0].grad_norm, rel=TOL)
    # the distributed optimizer (Adam state sharded over DP) takes the same steps; its
    # checkpoint's weights load, its Adam state is refused on CPU with what to do instead
    assert dp2["distopt_grad_norms"] == pytest.approx(dp2["grad_norms"], rel=1e-6)
    assert dp2["distopt_restored_vs_saved"] < TOL
    assert "with_optimizer=False" in dp2["distopt_refusal"]


@pytest.mark.mpi
def test_a_step_accumulated_in_parts_is_the_step_on_the_whole_batch(tp2_world):
    """Training each group as it arrives (``accumulate``, then ``train_step`` on the rest):
    the same loss, tokens, gradient norm and policy as the step on the whole batch, with
    DP=2 replicas accumulating different numbers of parts and with PP=2 (whose first stage
    has no loss reports)."""
    result, _ = tp2_world
    dp2 = result["dp2"]
    streamed = dp2["streamed"]
    assert streamed["tokens"] == dp2["tokens"]
    assert streamed["loss"] == pytest.approx(dp2["loss"], abs=1e-6)
    assert streamed["grad_norm"] == pytest.approx(dp2["grad_norm"], rel=1e-5)
    assert streamed["after_vs_whole"] < TOL
    pp2 = result["pp2_streamed"]
    assert pp2["tokens"] == pp2["tokens_whole"]
    assert pp2["loss"] == pytest.approx(result["pp2_loss"], abs=1e-6)
    assert pp2["grad_norm"] == pytest.approx(pp2["grad_norm_whole"], rel=1e-5)
    assert pp2["after_vs_whole"] < TOL


def test_accumulated_parts_make_one_step_like_the_whole_batch(tiny, torch_world):
    """One rank: three parts (two accumulated) give the whole batch's step; a part alone
    would give another (the check can fail)."""
    from libra_hpc.engines.train.loss import PolicyBatch

    tokens, mask, advantages = fixed_batch(1024)
    batch = PolicyBatch(tokens, mask, advantages)
    out = []
    for parts in ((0, 4), (0, 1, 3, 4), (3, 4)):
        engine = _engine(tiny, micro_batch_size=1)
        try:
            for a, b in itertools.pairwise(parts[:-1]):
                assert engine.accumulate(batch.slice(a, b)) >= 1
            stats = engine.train_step(batch.slice(parts[-2], parts[-1]))
            assert engine.accumulated == 0
            out.append((stats, engine.logprobs(tokens)))
        finally:
            engine.shutdown()
    (whole, after), (streamed, streamed_after), (alone, alone_after) = out
    assert streamed.tokens == whole.tokens == int(mask.sum())
    assert streamed.loss == pytest.approx(whole.loss, abs=1e-6)
    assert streamed.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert (streamed_after - after).abs().max() < TOL
    assert (alone_after - after).abs().max() > 100 * TOL


@pytest.mark.mpi
def test_pp2_restores_the_tp2_checkpoint_and_exports_per_stage(tp2_world):
    result, _ = tp2_world
    assert result["pp2_restored_vs_tp2"] < TOL  # TP=2 checkpoint → PP=2 model, same policy
    assert result["pp2_loss"] == pytest.approx(result["losses"][0], abs=TOL)  # ratio 1 at the restored policy
    assert result["pp2_stage_tensors"] == [1 + 12, 12 + 2]  # embedding + layer 0 | layer 1 + norm + head
    assert result["pp2_export_vs_hf"] < TOL


@pytest.mark.mpi
def test_checkpoint_saved_at_tp2_loads_at_tp1(tiny, torch_world, tp2_world):
    from libra_hpc.engines.train.checkpoint import load_checkpoint

    """A re-shard (EARL's selector moves training to another TP size through the dist
    checkpoint): the step counter is kept, the log-probs of a fixed batch agree within
    1e-5, and so do they after one more step, which needs the Adam moments and step
    count carried (a load without the optimizer state steps elsewhere)."""
    from libra_hpc.engines.train.loss import PolicyBatch

    result, ckpt = tp2_world
    before, continued = torch.tensor(result["before"]), torch.tensor(result["continued"])
    moved = {}
    for with_optimizer in (True, False):
        engine = _engine(tiny)
        try:
            tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
            assert load_checkpoint(engine, ckpt, with_optimizer=with_optimizer) == STEPS
            restored = engine.logprobs(tokens)
            engine.train_step(PolicyBatch(tokens, mask, advantages, old_logprobs=before))
            moved[with_optimizer] = (engine.logprobs(tokens) - continued).abs().max().item()
        finally:
            engine.shutdown()
        assert (restored - torch.tensor(result["after"])).abs().max() < RESHARD_TOL
    assert moved[True] < RESHARD_TOL, moved
    assert moved[False] > 10 * RESHARD_TOL, moved  # the comparison can tell a lost optimizer state


def test_resumed_run_steps_exactly_like_the_original(tiny, torch_world, tmp_path):
    from libra_hpc.engines.train.checkpoint import load_checkpoint, save_checkpoint
    from libra_hpc.engines.train.loss import PolicyBatch

    tokens, mask, advantages = fixed_batch(1024)
    batch = PolicyBatch(tokens, mask, advantages)
    engine = _engine(tiny)
    try:
        engine.train_step(batch)
        save_checkpoint(engine, tmp_path / "ckpt")
        with pytest.raises(FileExistsError, match="not empty"):
            save_checkpoint(engine, tmp_path / "ckpt")
        original = [engine.train_step(batch).grad_norm for _ in range(2)]
    finally:
        engine.shutdown()
    engine = _engine(tiny)
    try:
        assert load_checkpoint(engine, tmp_path / "ckpt") == 1
        resumed = [engine.train_step(batch).grad_norm for _ in range(2)]
    finally:
        engine.shutdown()
    assert resumed == original
    with pytest.raises(FileNotFoundError, match="no metadata.json"):
        load_checkpoint(engine, tmp_path)


def test_micro_batching_does_not_change_the_step(tiny, torch_world):
    """The loss is a per-token mean over the whole batch however it is cut: one
    micro-batch of 4 and four of 1 give the same loss and gradient norm."""
    from libra_hpc.engines.train.loss import PolicyBatch

    tokens, mask, advantages = fixed_batch(1024)
    stats = []
    for mbs in (4, 1):
        engine = _engine(tiny, micro_batch_size=mbs)
        try:
            stats.append(engine.train_step(PolicyBatch(tokens, mask, advantages)))
        finally:
            engine.shutdown()
    assert stats[0].tokens == stats[1].tokens == int(mask.sum())
    assert stats[0].loss == pytest.approx(stats[1].loss, abs=1e-6)
    assert stats[0].grad_norm == pytest.approx(stats[1].grad_norm, rel=1e-5)



@pytest.mark.mpi
def test_padding_and_row_order_do_not_change_the_step(tiny, torch_world):
    """A training step runs micro-batches of rows sorted by length, each cut after its last
    trained token: rows of very different lengths, shuffled and padded 40 tokens wider,
    step exactly like the compact batch (same loss, gradient norm and new weights)."""
    from libra_hpc.engines.train.loss import PolicyBatch

    tokens, mask, advantages = fixed_batch(1024)
    mask[0, 8:] = 0  # row 0 trains on 3 tokens, row 2 on 10: the batch is ragged
    mask[2, 15:] = 0
    compact = PolicyBatch(tokens, mask, advantages)
    assert compact.trained_widths().tolist() == [9, tokens.shape[1], 16, tokens.shape[1] - 2]
    order = torch.tensor([2, 0, 3, 1])
    wide = PolicyBatch(torch.cat([tokens, torch.zeros(4, 40, dtype=tokens.dtype)], 1),
                       torch.cat([mask, torch.zeros(4, 40)], 1), torch.cat([advantages, torch.ones(4, 40)], 1)).take(order)
    results = []
    for batch in (compact, wide):
        engine = _engine(tiny, micro_batch_size=2)
        try:
            results.append((engine.train_step(batch), engine.export_hf()))
        finally:
            engine.shutdown()
    (a, weights_a), (b, weights_b) = results
    assert a.tokens == b.tokens == int(mask.sum())
    assert a.loss == pytest.approx(b.loss, abs=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)

def test_engine_refuses_bad_shapes_with_the_reason(tiny, torch_world):
    from libra_hpc.engines.train.loss import PolicyBatch

    with pytest.raises(ValueError, match="training world of 1 ranks is not a multiple of .* 2 × 1"):
        _engine(tiny, tp=2)
    shape = ModelShape.from_hf_config(json.loads((tiny / "config.json").read_text()))
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide the model's num_key_value_heads=2"):
        shape.check_tp(4)
    engine = _engine(tiny, micro_batch_size=3)
    try:
        tokens, mask, advantages = fixed_batch(1024)
        with pytest.raises(ValueError, match="does not split into micro-batches of 3"):
            engine.train_step(PolicyBatch(tokens, mask, advantages))
        with pytest.raises(ValueError, match="token id 1024 is outside the vocabulary of 1024"):
            engine.logprobs(torch.full((3, 4), 1024))
        with pytest.raises(ValueError, match="max_position_embeddings=2048"):
            engine.logprobs(torch.zeros(3, 2050, dtype=torch.long))
    finally:
        engine.shutdown()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        _engine(tiny.parent)


def test_engine_from_the_experiment_config(tiny, torch_world):
    from pydantic import ValidationError

    from libra_hpc.config import ModelConfig, TrainingConfig
    from libra_hpc.engines.train.engine import MegatronTrainEngine

    training = TrainingConfig(lr=2e-5, grad_clip=0.5, ppo_clip=0.3, micro_batch_size=2)
    engine = MegatronTrainEngine.from_config(tiny, ModelConfig(), training)
    try:
        assert engine.clip_eps == 0.3 and engine.micro_batch_size == 2
        assert engine.optimizer.config.clip_grad == 0.5 and engine.optimizer.config.lr == 2e-5
        assert engine.placement.tp == engine.placement.pp == engine.placement.dp == 1
    finally:
        engine.shutdown()
    with pytest.raises(ValidationError, match="ppo_clip"):
        TrainingConfig(ppo_clip=1.5)


def test_bf16_parameters_step_through_the_mixed_precision_optimizer(tiny, torch_world):
    """bf16 weights with fp32 main weights in the optimizer: on CPU this path runs the
    optimizer's CUDA type-name checks through the shims."""
    from libra_hpc.engines.train.loss import PolicyBatch

    tokens, mask, advantages = fixed_batch(1024)
    norms = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = _engine(tiny, dtype=dtype)
        try:
            inner = engine.optimizer.chained_optimizers[0]
            norms[dtype] = engine.train_step(PolicyBatch(tokens, mask, advantages)).grad_norm
            exported = engine.export_hf()
        finally:
            engine.shutdown()
    assert type(inner).__name__ == "Float16OptimizerWithFloat16Params"
    assert norms[torch.bfloat16] == pytest.approx(norms[torch.float32], rel=0.02)
    assert exported["lm_head.weight"].dtype == torch.bfloat16


def test_tied_embeddings_train_and_export_like_transformers(tmp_path, torch_world):
    """A tied head is the embedding itself on a single stage: nothing separate to load or
    export, and the log-probs still match transformers before and after steps."""
    from libra_hpc.engines.tiny import build_tiny_model

    tied = build_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    engine = _engine(tied)
    try:
        assert engine._gpt().output_layer.weight is None  # shares the embedding's parameter
        tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
        before, _, after = train_world.train(engine, tokens, mask, advantages)
        exported = engine.export_hf()
    finally:
        engine.shutdown()
    assert "lm_head.weight" not in exported
    assert (before - hf_logprobs(tied, tokens)).abs().max() < TOL
    assert (after - hf_logprobs(tied, tokens, exported)).abs().max() < TOL
    assert (after - before).abs().max() > 100 * TOL


def _random_hf_checkpoint(kind: str, out: Path) -> Path:
    """A small random checkpoint of another architecture, written by transformers itself
    (all weights, norms included, drawn from one seeded generator so no norm is all-ones)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                                  max_position_embeddings=128, tie_word_embeddings=False, rope_theta=5e5)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise / param.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_other_architectures_match_transformers(kind, tmp_path, torch_world):
    """Llama (no biases) and Qwen3 (per-head q/k RMSNorm, no biases, the family real runs use)."""
    path = _random_hf_checkpoint(kind, tmp_path / kind)
    engine = _engine(path)
    try:
        assert engine.shape.qk_norm == (kind == "qwen3") and not engine.shape.qkv_bias
        assert engine.shape.rope_theta == 5e5  # not the default: RoPE must follow the config
        tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
        before, _, after = train_world.train(engine, tokens, mask, advantages)
        exported = engine.export_hf()
    finally:
        engine.shutdown()
    assert (before - hf_logprobs(path, tokens)).abs().max() < TOL
    assert (after - hf_logprobs(path, tokens, exported)).abs().max() < TOL
    assert (after - before).abs().max() > 100 * TOL


def test_engine_cycles_do_not_leak_process_group_sockets(tiny, torch_world):
    """Relayouts start and stop engines in a live process: every cycle must give back the
    sockets of the gloo groups megatron created."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts = []
    for _ in range(3):
        _engine(tiny).shutdown()
        counts.append(open_fds())
    assert counts[2] == counts[1] == counts[0], counts


def test_export_is_a_copy_not_a_view_of_the_parameters(tiny, torch_world):
    from libra_hpc.engines.train.loss import PolicyBatch

    engine = _engine(tiny)
    try:
        exported = engine.export_hf()
        frozen = {k: v.clone() for k, v in exported.items()}
        tokens, mask, advantages = fixed_batch(engine.shape.vocab_size)
        engine.train_step(PolicyBatch(tokens, mask, advantages))
        moved = engine.export_hf()
    finally:
        engine.shutdown()
    assert all(torch.equal(exported[k], frozen[k]) for k in frozen)  # training did not reach into it
    assert any(not torch.equal(moved[k], frozen[k]) for k in frozen)
