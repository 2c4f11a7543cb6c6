"""The vLLM rollout engine on CPU, checked against a plain transformers forward in fp32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libra_hpc.cluster.layout import Group, Slot
from libra_hpc.config import ModelConfig, RolloutConfig, TrainingConfig
from libra_hpc.engines.rollout.options import (
    check_options,
    check_prompts,
    check_weights,
    checkpoint_shapes,
    default_cpus,
    engine_env,
    instance_devices,
)

TOL = 1e-4  # fp32 log-probabilities, vLLM vs transformers


@pytest.fixture(scope="module")
def hf(tiny):
    """The transformers reference, a ``score`` like the engine's and the checkpoint's weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def score(seqs, weights):
        model.load_state_dict(weights)
        out = []
        with torch.no_grad():
            for seq in seqs:
                logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
                out.append([logp[i, seq[i + 1]].item() for i in range(len(seq) - 1)])
        return out

    def greedy(prompt, n, weights):
        model.load_state_dict(weights)
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()

    return score, greedy, load_file(str(tiny / "model.safetensors"))


@pytest.fixture(scope="module")
def engine(tiny):
    from libra_hpc.engines.rollout import VllmRolloutEngine

    eng = VllmRolloutEngine(tiny, max_model_len=512, kv_cache_gib=0.25, seed=0)
    yield eng
    eng.shutdown()


def _seqs(seed, lengths=(1, 2, 9, 33, 130)):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 1024, (n,), generator=gen).tolist() for n in lengths]


def _perturbed(weights, seed, scale=0.05):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in weights.items()}


def _max_diff(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


# --- pure parts: no engine ---------------------------------------------------------------

def test_options_are_checked_with_the_option_named():
    ok = {"tp": 1, "device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.25,
          "max_positions": 2048, "cpus": None, "devices": None}
    check_options(**ok)
    for bad, match in [({"device": "tpu"}, "device='tpu'"), ({"dtype": "int8"}, "dtype='int8'"),
                       ({"tp": 0}, "tp=0"), ({"max_model_len": 4096}, "max_position_embeddings=2048"),
                       ({"kv_cache_gib": 0}, "kv_cache_gib=0"), ({"tp": 2, "cpus": [[0]]}, "cpus="),
                       ({"devices": [0]}, "devices="), ({"cpu_threads": 0}, "cpu_threads=0")]:
        with pytest.raises(ValueError, match=match):
            check_options(**{**ok, **bad})


def test_cpu_workers_get_disjoint_cores_and_the_env_says_so():
    assert default_cpus(2, [3, 0, 1, 2, 4]) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="tp=4 on cpu needs one core per TP rank"):
        default_cpus(4, [0, 1])
    env = engine_env(device="cpu", tp=2, cpus=[[0, 1], [2]], devices=None)
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0,1|2",
                   "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800")}
    assert engine_env(device="cuda", tp=2, cpus=None, devices=[4, 5])["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(device="cpu", tp=1, cpus=None, devices=None)


def test_an_instance_runs_on_the_gpus_of_its_layout_slots():
    tp2 = Group(gid=2, role="rollout", slots=(Slot(3, 2), Slot(3, 3)), tp=2)
    assert instance_devices(tp2, "cuda") == [2, 3] and instance_devices(tp2, "cpu") is None
    with pytest.raises(ValueError, match="rollout-2 spans nodes \\[3, 4\\]"):
        instance_devices(Group(gid=2, role="rollout", slots=(Slot(3, 3), Slot(4, 0)), tp=2), "cuda")
    with pytest.raises(ValueError, match="training group of 2 slots"):
        instance_devices(Group(gid=0, role="training", slots=(Slot(0, 0), Slot(0, 1)), tp=2), "cuda")


def test_prompts_and_weight_sets_are_checked(tiny):
    check_prompts([[1, 2], [3]], vocab_size=10, max_model_len=8, what="generate")
    for prompts, match in [([[]], r"generate\[0\] is empty"), ([[1], [10]], r"generate\[1\] holds token ids"),
                           ([list(range(8))], "max_model_len is 8"), ("text", "list of token-id lists")]:
        with pytest.raises((ValueError, TypeError), match=match):
            check_prompts(prompts, vocab_size=10, max_model_len=8, what="generate")
    from safetensors.torch import load_file

    shapes = {n: tuple(t.shape) for n, t in load_file(str(tiny / "model.safetensors")).items()}
    assert checkpoint_shapes(tiny) == shapes
    check_weights(shapes, shapes)
    with pytest.raises(ValueError, match="missing.*lm_head.weight.*nothing was applied"):
        check_weights({n: s for n, s in shapes.items() if n != "lm_head.weight"}, shapes)
    with pytest.raises(ValueError, match=r"wrong shapes \['model.norm.weight: \(3,\)"):
        check_weights({**shapes, "model.norm.weight": (3,)}, shapes)


def test_importing_the_engines_loads_neither_vllm_nor_torch():
    code = ("import sys, libra_hpc.engines, libra_hpc.engines.rollout; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_bad_model_path_is_named(tmp_path):
    from libra_hpc.engines.rollout import VllmRolloutEngine

    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path / 'nope'} does not exist"):
        VllmRolloutEngine(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path} has no config.json"):
        VllmRolloutEngine(tmp_path)


def test_an_existing_torch_world_is_refused(tiny, tmp_path):
    """vLLM would take the caller's torch world over and destroy it at shutdown."""
    import torch.distributed as dist

    from libra_hpc.engines.rollout import VllmRolloutEngine

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"torch.distributed is already initialised .*world size 1"):
            VllmRolloutEngine(tiny)
    finally:
        dist.destroy_process_group()


# --- one engine for the module -----------------------------------------------------------

def test_score_matches_transformers(engine, hf):
    score, _, weights = hf
    seqs = _seqs(1)
    got = engine.score(seqs)
    assert got[0] == [] and [len(s) for s in got] == [len(s) - 1 for s in seqs]
    assert _max_diff(got, score(seqs, weights)) < TOL
    assert engine.score(seqs) == got  # the prefix cache does not change prompt log-probs


def test_generate_is_reproducible_and_its_logprobs_are_the_models(engine, hf):
    _, greedy, weights = hf
    prompts = _seqs(2, (5, 12, 12))
    out = engine.generate(prompts, max_tokens=24, temperature=0.7, top_p=0.9, seed=5)
    assert all(len(g.tokens) == len(g.logprobs) and 1 <= len(g.tokens) <= 24 for g in out)
    assert all(g.finish_reason in ("stop", "length") for g in out)
    assert engine.generate(prompts, max_tokens=24, temperature=0.7, top_p=0.9, seed=5) == out
    assert out[1].tokens != out[2].tokens  # equal prompts, seeds 6 and 7
    # Whatever the temperature and top-p, the log-probs are those score() gives the same tokens.
    rescored = engine.score([p + g.tokens for p, g in zip(prompts, out)])
    assert _max_diff([g.logprobs for g in out], [r[len(p) - 1:] for p, r in zip(prompts, rescored)]) < TOL
    stop = engine.generate(prompts[:1], max_tokens=24, temperature=0.0, stop_token_ids=[])[0]
    assert stop.tokens == greedy(prompts[0], len(stop.tokens), weights)  # greedy = transformers' argmax path


def test_weight_updates_in_place_match_transformers_each_time(engine, hf):
    score, _, weights = hf
    seqs = _seqs(3)
    before = engine.score(seqs)
    version = engine.stats().weight_version
    for step in range(3):
        new = _perturbed(weights, seed=100 + step)
        engine.update_weights(new.items())
        got = engine.score(seqs)
        assert _max_diff(got, score(seqs, new)) < TOL
        assert _max_diff(got, before) > 0.1  # the update changed the outputs
    import torch

    engine.update_weights((n, t.to(torch.bfloat16)) for n, t in weights.items())  # cast to the engine's dtype
    assert _max_diff(engine.score(seqs), score(seqs, {n: t.bfloat16().float() for n, t in weights.items()})) < TOL
    assert engine.stats().weight_version == version + 4
    engine.update_weights(weights.items())
    assert _max_diff(engine.score(seqs), before) < 1e-6  # back to the checkpoint


def test_a_bad_update_is_refused_and_leaves_the_weights(engine, hf):
    _, _, weights = hf
    seqs = _seqs(4)
    before = engine.score(seqs)
    partial = _perturbed({n: t for n, t in weights.items() if n != "model.norm.weight"}, seed=9)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        engine.update_weights(partial.items())
    with pytest.raises(ValueError, match="twice"):
        engine.update_weights([*weights.items(), ("lm_head.weight", weights["lm_head.weight"])])
    assert engine.score(seqs) == before


def test_stats_report_kv_and_throughput(engine, hf):
    score, _, weights = hf
    long_prompt = _seqs(5, (300,))[0]
    engine.generate([long_prompt], max_tokens=8, temperature=1.0, seed=1)
    out = engine.generate([long_prompt, long_prompt[:20]], max_tokens=16, temperature=1.0, seed=2)
    stats = engine.stats()
    per_token = 2 * 2 * 2 * 32 * 4  # layers × (K, V) × KV heads × head size × fp32 bytes
    assert stats.kv_capacity_tokens == pytest.approx(0.25 * (1 << 30) / per_token, rel=0.02)
    assert stats.kv_usage == 0.0  # nothing running between calls
    assert stats.last_generated_tokens == sum(len(g.tokens) for g in out)
    assert stats.last_tokens_per_s == pytest.approx(stats.last_generated_tokens / stats.last_wall_s)
    assert stats.last_batch_kv_fraction == pytest.approx((320 + stats.last_generated_tokens)
                                                         / stats.kv_capacity_tokens)
    assert 0.5 < stats.last_prefix_cached_fraction < 1  # the long prompt's first blocks were cached
    assert _max_diff(engine.score([long_prompt]), score([long_prompt], weights)) < TOL  # cached or not


def test_turns_join_and_leave_a_running_batch(engine):
    long_prompt, short, late = _seqs(9, (200, 6, 4))
    engine.submit("a", long_prompt, max_tokens=30, seed=1)
    engine.submit("b", short, max_tokens=5, seed=2)
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.submit("a", short, max_tokens=5)
    with pytest.raises(RuntimeError, match="score while 2 submitted turns are unfinished"):
        engine.score([short])
    done, usage = {}, []
    for step in range(200):
        if step == 2:
            engine.submit("late", late, max_tokens=8, seed=3)  # joins while "a" decodes
            engine.submit("dropped", late, max_tokens=50, seed=4)
        if step == 4:
            engine.abort(["dropped", "never-submitted"])
        usage.append(engine.stats().kv_usage)
        done.update(engine.step())
        if not engine.unfinished():
            break
    assert sorted(done) == ["a", "b", "late"] and engine.unfinished() == 0
    assert max(usage) > 0  # the running turns held KV blocks
    caps = {"a": 30, "b": 5, "late": 8}
    assert all(len(g.tokens) == caps[k] if g.finish_reason == "length" else len(g.tokens) < caps[k]
               for k, g in done.items())
    prompts = {"a": long_prompt, "b": short, "late": late}
    rescored = engine.score([prompts[k] + done[k].tokens for k in sorted(done)])
    expect = [r[len(prompts[k]) - 1:] for k, r in zip(sorted(done), rescored)]
    assert _max_diff([done[k].logprobs for k in sorted(done)], expect) < TOL
    assert engine.stats().kv_usage == 0.0


def test_a_group_rollout_with_tool_turns_records_the_engines_own_logprobs(engine, tiny):
    """libra_hpc/rl/rollout.py on vLLM: the search task with the live orchestrator; every
    generated token's recorded log-prob is what the engine scores for it in the whole
    trajectory, tool-output tokens are not generated, and no record outgrows the context."""
    from libra_hpc.envs import SearchTask
    from libra_hpc.rl.rollout import TextCodec, rollout
    from libra_hpc.tools.orchestrator import ToolOrchestrator
    from libra_hpc.tools.pool import ResourceSpec
    from libra_hpc.tools.scheduling import make_scheduler

    task = SearchTask(seed=1, entities=60, max_hops=1, train_prompts=20, heldout_prompts=5, max_turns=3)
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("search", 2)]), task.runners())
    codec = TextCodec(tiny)
    try:
        out = rollout(engine, task, task.splits.train[:2], orch, codec, group_size=2, version=3, tag="t", seed=4,
                      max_turn_tokens=24)
        again = rollout(engine, task, task.splits.train[:2], orch, codec, group_size=2, version=3, tag="t", seed=4,
                        max_turn_tokens=24)
    finally:
        orch.close()
    assert [t.tokens for t in out.trajectories] == [t.tokens for t in again.trajectories]  # seeded
    assert len({tuple(t.tokens) for t in out.trajectories}) == 4  # the samples of a group differ
    assert [t.group_id for t in out.trajectories] == ["t/" + task.splits.train[0].pid] * 2 + [
        "t/" + task.splits.train[1].pid] * 2
    scored = engine.score([t.tokens for t in out.trajectories])
    for t, score in zip(out.trajectories, scored):
        assert len(t.tokens) <= engine.max_model_len and t.num_generated > 0
        got = [lp for lp, g in zip(t.logprobs[1:], t.generated[1:]) if g]
        want = [s for s, g in zip(score, t.generated[1:]) if g]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
        assert {v for v, g in zip(t.versions, t.generated) if g} == {3}


def test_one_engine_per_process(engine, tiny):
    from libra_hpc.engines.rollout import VllmRolloutEngine

    with pytest.raises(RuntimeError, match="already running in this process"):
        VllmRolloutEngine(tiny)


def test_shutdown_frees_memory_and_a_new_engine_starts(engine, tiny, hf):
    import psutil

    from libra_hpc.engines.rollout import VllmRolloutEngine

    score, _, weights = hf
    engine.update_weights(_perturbed(weights, seed=7).items())
    rss = psutil.Process().memory_info().rss
    engine.shutdown()
    engine.shutdown()  # harmless twice
    assert rss - psutil.Process().memory_info().rss > 0.8 * 0.25 * (1 << 30)  # the KV cache went back
    import torch

    assert not torch.distributed.is_initialized()  # vLLM's world is gone with it
    assert torch.set_num_threads.__name__ == "set_num_threads"  # vLLM's no-op replacement undone
    with pytest.raises(RuntimeError, match="shut down"):
        engine.score([[1, 2]])
    seqs = _seqs(6)
    yaml = {"model_cfg": ModelConfig(), "rollout_cfg": RolloutConfig(kv_cache_gib=0.125),
            "training_cfg": TrainingConfig(seq_len=256)}
    instance = Group(gid=3, role="rollout", slots=(Slot(1, 0),), tp=1)
    with VllmRolloutEngine.from_config(tiny, **yaml, instance=instance) as again:
        assert again.max_model_len == 256 and again.stats().weight_version == 0
        assert again.kv_capacity_tokens == pytest.approx(engine.kv_capacity_tokens / 2, rel=0.02)
        assert _max_diff(again.score(seqs), score(seqs, weights)) < TOL  # the checkpoint, not the update
    with pytest.raises(ValueError, match="kv cache"):  # vLLM's own check, after it set up its torch world
        VllmRolloutEngine(tiny, max_model_len=256, kv_cache_gib=10_000)
    assert not torch.distributed.is_initialized()  # a failed start cleans up: the next one can start


def test_tensor_parallel_two_on_cpu(engine, tiny, hf):
    """TP = 2 on CPU: one vLLM worker process per TP rank, each on its own cores."""
    from libra_hpc.engines.rollout import VllmRolloutEngine

    score, _, weights = hf
    engine.shutdown()
    if len(os.sched_getaffinity(0)) < 2:
        with pytest.raises(ValueError, match="tp=2 on cpu needs one core per TP rank"):
            VllmRolloutEngine(tiny, tp=2)
        return
    seqs = _seqs(8, (4, 40))
    new = _perturbed(weights, seed=11)
    with VllmRolloutEngine(tiny, tp=2, max_model_len=256, kv_cache_gib=0.125) as tp2:
        tp2.update_weights(new.items())  # each TP worker takes its shard of the full tensors
        assert _max_diff(tp2.score(seqs), score(seqs, new)) < TOL
