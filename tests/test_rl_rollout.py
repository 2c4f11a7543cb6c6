"""Group rollouts with tool turns (libra_hpc/rl/rollout.py) and the warm-start
demonstrations (libra_hpc/rl/warmstart.py), with the tiny model's real tokenizer, the real
search task and the live orchestrator. The engine here is a scripted stand-in whose turns
are chosen text (the bookkeeping under test must not depend on what a model happens to
sample); test_engines_rollout.py runs the same rollout on vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from libra_hpc.config import WarmStartConfig
from libra_hpc.engines.rollout.types import Generation
from libra_hpc.envs import ArithmeticTask, SearchTask, SplitLeak
from libra_hpc.envs.solvers import AnswerPrior, ArithmeticSolver, SearchSolver, run_episode
from libra_hpc.envs.toolcall import IM_END, format_call
from libra_hpc.rl.grpo import loss_mask
from libra_hpc.rl.rollout import PromptSampler, TextCodec, rollout
from libra_hpc.rl.trajectory import NOT_GENERATED
from libra_hpc.rl.warmstart import (
    demonstration_pieces,
    demonstrations,
    encode_demonstration,
    fingerprint,
    resolve_precision,
    solver_for,
)
from libra_hpc.tools.orchestrator import ToolOrchestrator
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.scheduling import make_scheduler


@pytest.fixture(scope="module")
def task():
    return SearchTask(seed=5, entities=150, max_hops=2, train_prompts=200, heldout_prompts=40, max_turns=4)


@pytest.fixture(scope="module")
def codec(tiny):
    return TextCodec(tiny)


@pytest.fixture
def orch(task):
    o = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("search", 4)]), task.runners())
    yield o
    o.close()


class ScriptedEngine:
    """``generate`` answers each prompt with ``policy(decoded prompt)`` plus the end-of-turn
    token, every token at log-prob -0.25 (like vLLM, the stop token is in the output)."""

    def __init__(self, codec, policy, max_model_len=4096):
        self.codec, self.policy, self.max_model_len = codec, policy, max_model_len
        self.calls = []

    def generate(self, prompts, *, max_tokens, temperature, top_p, seed, stop_token_ids):
        self.calls.append((len(prompts), max_tokens, temperature, seed, tuple(stop_token_ids)))
        out = []
        for p in prompts:
            ids = (self.codec.encode(self.policy(self.codec.decode(p))) + [self.codec.im_end])[:max_tokens]
            out.append(Generation(ids, [-0.25] * len(ids), "stop" if ids[-1] == self.codec.im_end else "length"))
        return out


def _two_turns(task):
    """Search the question's person, then answer with the prompt's reference answer."""
    answers = {p.text: p for p in task.splits.train}

    def policy(text):
        question = text.split("<|im_start|>user\n")[1].split(IM_END)[0]
        prompt = answers[question]
        if "<tool_response>" not in text:
            return f"I look it up.\n{format_call('search', {'query': prompt.meta['chain'][0]})}"
        return f"Found it.\n<answer>{prompt.answer}</answer>"
    return policy


def test_a_trajectory_records_prompt_turns_and_tool_output_with_the_right_masks(task, codec, orch):
    prompt = task.splits.train[0]
    engine = ScriptedEngine(codec, _two_turns(task))
    out = rollout(engine, task, [prompt], orch, codec, group_size=3, version=7, tag="s0", seed=1)
    assert len(out.trajectories) == 3 and {t.group_id for t in out.trajectories} == {f"s0/{prompt.pid}"}
    t = out.trajectories[0]
    assert t.reward == 1.0 and t.finish_reason == "answer" and out.success == 1.0 and out.format_valid == 1.0
    prompt_ids = codec.encode(task.episode(prompt, "x").prompt_text)
    assert t.tokens[:len(prompt_ids)] == prompt_ids
    # the pieces: prompt (not generated), turn 1 + <|im_end|> (generated), tool turn (not), turn 2 (generated)
    runs, last = [], None
    for g in t.generated:
        if g != last:
            runs.append([g, 0])
            last = g
        runs[-1][1] += 1
    assert [g for g, _ in runs] == [False, True, False, True]
    tool_part = t.tokens[runs[0][1] + runs[1][1]:][:runs[2][1]]
    tool_text = codec.decode(tool_part)
    assert tool_text.startswith("\n<|im_start|>user\n<tool_response>") and tool_text.endswith("<|im_start|>assistant\n")
    assert prompt.meta["chain"][0] in tool_text  # the search result, from the real runner
    for i, (g, lp, v) in enumerate(zip(t.generated, t.logprobs, t.versions)):
        assert (lp, v) == ((-0.25, 7) if g else (0.0, NOT_GENERATED)), i
    assert [t.tokens[i] for i, g in enumerate(t.generated) if g].count(codec.im_end) == 2  # each turn's stop token
    assert sum(loss_mask(t)) == sum(t.generated) == out.generated_tokens / 3
    assert engine.calls[0][0] == 3 and engine.calls[0][4] == (codec.im_end,)  # one batched call per turn
    assert len(engine.calls) == 2 and engine.calls[0][3] != engine.calls[1][3]  # each turn draws its own seed


def test_a_malformed_call_is_an_observation_and_the_episode_goes_on(task, codec, orch):
    prompt = task.splits.train[1]

    def policy(text):
        if "<tool_response>" not in text:
            return '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>'
        return "<answer>no idea</answer>"

    out = rollout(ScriptedEngine(codec, policy), task, [prompt], orch, codec, group_size=1, version=0, tag="bad")
    t, episode = out.trajectories[0], out.episodes[0]
    assert episode.turns[0][1][0].status == "failure" and "not valid JSON" in episode.turns[0][1][0].output
    assert "not valid JSON" in codec.decode([x for x, g in zip(t.tokens, t.generated) if not g])
    assert t.reward == 0.0 and out.format_valid == 0.0 and len(episode.turns) == 2


def test_an_episode_that_outgrows_the_context_ends_without_reward(task, codec, orch):
    prompt = task.splits.train[2]
    long_talk = lambda text: "I keep thinking. " * 12 + format_call("search", {"query": "nothing"})  # noqa: E731
    prompt_len = len(codec.encode(task.episode(prompt, "x").prompt_text))
    engine = ScriptedEngine(codec, long_talk, max_model_len=prompt_len + 300)
    out = rollout(engine, task, [prompt], orch, codec, group_size=1, version=0, tag="ctx", max_turn_tokens=120)
    t = out.trajectories[0]
    assert t.finish_reason == "context" and t.reward == 0.0 and len(t.tokens) <= prompt_len + 300
    assert all(c[1] <= 120 for c in engine.calls)


def test_demonstrations_are_encoded_exactly_as_the_rollout_records_the_same_turns(task, codec, orch):
    """Supervised warm start and RL see one token layout: the solver's episode, encoded as a
    demonstration, equals the trajectory of an engine that writes the solver's turns."""
    solver = SearchSolver(seed=2)
    prompt = task.splits.train[3]
    demo = run_episode(task, prompt, solver, orch, "demo/0")
    tokens, trained = encode_demonstration(demo, codec.encode)
    turns = iter(demo.generated)
    out = rollout(ScriptedEngine(codec, lambda _: next(turns)), task, [prompt], orch, codec, group_size=1,
                  version=0, tag="same", max_turn_tokens=2048)
    t = out.trajectories[0]
    assert t.tokens == tokens and t.generated == trained and t.reward == demo.reward
    pieces = demonstration_pieces(demo)
    assert all(text.endswith(IM_END) for text, is_model in pieces if is_model)
    assert not any(text.startswith(IM_END) for text, is_model in pieces[1:] if not is_model)


def test_the_guessing_solver_skips_tools_on_multi_step_questions_only(task, orch):
    prior = AnswerPrior(task.splits.train)
    guesser = SearchSolver(seed=0, guess=1.0, prior=prior)
    for i, prompt in enumerate(task.splits.train[:30]):
        episode = run_episode(task, prompt, guesser, orch, f"g/{i}")
        if prompt.meta["hops"] >= 2:
            assert len(episode.turns) == 1 and episode.turns[0][1] == [], prompt.text
            assert episode.answer in prior.answers[prompt.meta["kind"]]
        else:
            assert any(returns for _, returns in episode.turns), prompt.text
    careful = SearchSolver(seed=0, guess=0.0)
    multi = [p for p in task.splits.train[:30] if p.meta["hops"] >= 2]
    assert all(len(run_episode(task, p, careful, orch, f"c/{i}").turns) > 1 for i, p in enumerate(multi))
    with pytest.raises(ValueError, match="needs the prior"):
        SearchSolver(seed=0, guess=0.5)


def test_guess_on_names_the_kinds_the_solver_guesses_on(task, orch):
    guesser = SearchSolver(seed=0, guess=1.0, guess_on=["town", "job"], prior=AnswerPrior(task.splits.train))
    kinds = set()
    for i, prompt in enumerate(task.splits.train[:60]):
        episode = run_episode(task, prompt, guesser, orch, f"k/{i}")
        kinds.add(prompt.meta["kind"])
        if prompt.meta["kind"] in ("town", "job"):
            assert len(episode.turns) == 1 and episode.turns[0][1] == [], prompt.text
        else:  # two-document questions too: only the named kinds are guessed
            assert any(returns for _, returns in episode.turns), prompt.text
    assert {"town", "job", "year", "river"} <= kinds
    with pytest.raises(ValueError, match=r"warmstart.guess_on: .*'yeer'.*year"):
        solver_for(task, WarmStartConfig(guess_on=["year", "yeer"]))
    assert solver_for(task, WarmStartConfig(guess_on=["year"])).guess_on == ["year"]


def test_a_guess_is_a_draw_from_the_prior_and_never_reads_the_true_answer(orch):
    """The same episode with its true answer replaced guesses the same; over many prompts a
    guess is right about as often as the prior's hit rate (a job: 1 in 10), not never."""
    task = SearchTask(seed=3, entities=900, train_prompts=600, heldout_prompts=20, max_hops=1, kinds=["job"])
    prior = AnswerPrior(task.splits.train)
    guesser = SearchSolver(seed=0, guess=1.0, guess_on=["job"], prior=prior)
    right = 0
    for i, prompt in enumerate(task.splits.train):
        episode = run_episode(task, prompt, guesser, orch, f"p/{i}")
        twin = run_episode(task, dataclasses.replace(prompt, answer="nobody knows"), guesser, orch, f"p/{i}")
        assert episode.answer == twin.answer
        right += episode.reward == 1.0
    rate = prior.hit_rate("job")
    assert 0.08 < rate < 0.12
    assert abs(right / len(task.splits.train) - rate) < 0.04


def test_the_guessing_arithmetic_solver_answers_multi_step_problems_at_once_from_its_prior(orch):
    task = ArithmeticTask(seed=1, train_prompts=20, heldout_prompts=5, min_steps=2, max_steps=3)
    prior = AnswerPrior(task.splits.train)
    for i, prompt in enumerate(task.splits.train[:10]):
        episode = run_episode(task, prompt, ArithmeticSolver(seed=i, guess=1.0, prior=prior), orch, f"a/{i}")
        assert len(episode.turns) == 1 and episode.turns[0][1] == []
        assert episode.answer in prior.answers[prompt.meta["kind"]]


def test_the_held_out_split_never_reaches_demonstrations_or_training_batches(task, orch):
    solver = SearchSolver(seed=1)
    episodes = demonstrations(task, solver, orch, 50, threads=4)
    held = task.splits.heldout_hashes()
    assert 40 <= len(episodes) <= 50 and not {e.prompt.hash for e in episodes} & held
    # by entity: no held-out person in any demonstration, tool outputs included
    people = task.splits.heldout_entities()
    assert len(people) >= 30
    assert not any(name in "".join(t for t, _ in demonstration_pieces(e)) for e in episodes for name in people)
    sampler = PromptSampler(task.splits, seed=3)
    seen = [p for _ in range(30) for p in sampler.next(8)]
    assert not {p.hash for p in seen} & held
    assert len({p.pid for p in seen[:200]}) == 200  # one pass covers the split without repeats
    leaky = dataclasses.replace(task.splits.heldout[0], pid="leak")
    bad = type(task).__new__(type(task))
    bad.__dict__.update(task.__dict__)
    object.__setattr__(bad, "splits", object.__new__(type(task.splits)))
    object.__setattr__(bad.splits, "train", (leaky, *task.splits.train[:3]))
    object.__setattr__(bad.splits, "heldout", task.splits.heldout)
    with pytest.raises(SplitLeak, match="warm-start demonstrations"):
        demonstrations(bad, solver, orch, 4)
    with pytest.raises(SplitLeak, match="training batch"):
        PromptSampler(bad.splits).next(4)


def test_the_warm_start_fingerprint_names_everything_that_made_it(task, tiny):
    base = fingerprint(tiny, task, {"max_hops": 2}, WarmStartConfig())
    assert base == fingerprint(tiny, task, {"max_hops": 2}, WarmStartConfig())
    others = [fingerprint(tiny, task, {"max_hops": 3}, WarmStartConfig()),
              fingerprint(tiny, task, {"max_hops": 2}, WarmStartConfig(guess=0.5)),
              fingerprint(tiny, task, {"max_hops": 2}, WarmStartConfig(epochs=3))]
    assert len({base["fingerprint"], *(o["fingerprint"] for o in others)}) == 4
    # the arithmetic is named as resolved: `auto` builds the same weights as what it resolves to
    fp32, bf16 = (fingerprint(tiny, task, {"max_hops": 2}, WarmStartConfig(precision=p)) for p in ("fp32", "bf16"))
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16") and fp32["fingerprint"] != bf16["fingerprint"]
    assert base["precision"] == resolve_precision("auto") in ("fp32", "bf16")


def test_the_warm_start_learns_the_demonstrations_and_is_built_once(tiny, tmp_path):
    """libra_hpc/rl/warmstart.py end to end: solver demonstrations on the search task, a
    supervised pass that lowers their NLL, a checkpoint vLLM and Megatron can load (the
    base's config and tokenizer, new weights), reused when asked again."""
    import torch
    from safetensors.torch import load_file

    from libra_hpc.rl.warmstart import build_warmstart

    task = SearchTask(seed=2, entities=60, max_hops=2, train_prompts=40, heldout_prompts=10, max_turns=4)
    options = WarmStartConfig(demonstrations=16, epochs=3, batch_size=8, lr=3e-3, guess=0.5)
    spec = fingerprint(tiny, task, {"entities": 60}, options)
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("search", 2)]), task.runners())
    lines = []
    try:
        out = build_warmstart(tmp_path / "ws", tiny, task, spec, options, orch, progress=lines.append)
        again = build_warmstart(tmp_path / "ws", tiny, task, spec, options, orch, progress=lines.append)
    finally:
        orch.close()
    nll = [float(line.rsplit(" ", 1)[1]) for line in lines if "NLL" in line]
    assert len(nll) == 3 and nll[-1] < nll[0] - 0.5, lines
    assert again == out and sum("demonstrations (" in line for line in lines) == 1  # the second call reused it
    assert {p.name for p in out.iterdir()} >= {"config.json", "tokenizer.json", "model.safetensors", "build.json"}
    trained, base = load_file(str(out / "model.safetensors")), load_file(str(tiny / "model.safetensors"))
    assert trained.keys() == base.keys() and not torch.equal(trained["lm_head.weight"], base["lm_head.weight"])
    other = fingerprint(tiny, task, {"entities": 60}, WarmStartConfig(demonstrations=17))
    with pytest.raises(FileExistsError, match="warm start: .* holds build"):
        build_warmstart(out, tiny, task, other, options, orch)


def test_the_supervised_learning_rate_warms_up_then_decays_to_its_floor():
    from libra_hpc.rl.warmstart import lr_factor

    total = 200
    factors = [lr_factor(k, total) for k in range(total)]
    ramp = round(0.03 * total)
    assert factors[0] == pytest.approx(1 / ramp) and factors[ramp - 1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:ramp - 1], factors[1:ramp]))  # warm-up rises
    assert all(a >= b for a, b in zip(factors[ramp:], factors[ramp + 1:]))  # then never rises
    assert factors[total // 2 + ramp // 2] == pytest.approx(0.525, abs=0.02)  # cosine: halfway is halfway
    assert lr_factor(total, total) == pytest.approx(0.05) and min(factors) >= 0.05


def test_the_shared_prefix_is_run_once_and_the_loss_and_gradients_are_unchanged(tiny):
    """Rows that begin with the same tokens (a demonstration's system prompt): the loss with
    the prefix run once per batch equals the plain loss, and so does every gradient."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from libra_hpc.rl.warmstart import nll, nll_shared, shared_prefix

    rng = random.Random(0)
    head = [rng.randrange(3, 1000) for _ in range(40)]
    rows = []
    for n in (5, 17, 9, 30):
        ids = head + [rng.randrange(3, 1000) for _ in range(n)]
        rows.append((ids, [True] * 12 + [False] * 28 + [rng.random() < 0.7 for _ in range(n)]))
    assert shared_prefix(rows) == 40
    assert shared_prefix([(head + [5, 6], [True] * 42), (head[:10] + [7, 8, 9], [True] * 13)]) == 10
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    grads = []
    for loss_of in (lambda: nll(model, rows, 1), lambda: nll_shared(model, rows, 40, 1)):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (plain, g_plain), (shared, g_shared) = grads
    assert shared == pytest.approx(plain, rel=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(g_plain, g_shared)) < 1e-5


def test_supervised_batches_cover_every_demonstration_once_and_pad_little():
    """sft_batches: each demonstration once per epoch, a new order each epoch, and batches of
    similar lengths (a long-tailed length mix like the demonstrations' pads a plain shuffle
    by more than a third; grouped by length, by under a tenth)."""
    import random

    from libra_hpc.rl.warmstart import sft_batches

    rng = random.Random(3)
    sequences = [([1] * int(rng.lognormvariate(5, 0.8)) + [1], []) for _ in range(1000)]
    lengths = [len(t) for t, _ in sequences]

    def padded(batches):
        return sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths)

    first, second = sft_batches(sequences, 8, 0, 0), sft_batches(sequences, 8, 0, 1)
    for batches in (first, second):
        assert sorted(i for b in batches for i in b) == list(range(1000)) and max(map(len, batches)) == 8
    assert first != second and first == sft_batches(sequences, 8, 0, 0)
    order = list(range(1000))
    random.Random(1).shuffle(order)
    assert padded([order[i:i + 8] for i in range(0, 1000, 8)]) > 1.3
    assert padded(first) < 1.1
