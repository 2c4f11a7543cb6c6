"""Weight sync training → rollout: the bucket plan alone, then for real in a 3-rank MPI
world (tests/train_world.py sync): ranks 0-1 train the tiny model at PP=2, each stage's
holder pushes its HF weights over MPI to rank 2, a vLLM rollout leader that chains both
streams into one update_weights; its score() must then match the trained Megatron
log-probs. (TP export gathering is checked against transformers in test_engines_train.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from libra_hpc.engines.sync import buckets

HERE = Path(__file__).resolve().parent


def test_buckets_keep_order_align_tensors_and_respect_the_size():
    weights = {"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16), "c": torch.zeros(100),
               "d": torch.zeros(7, dtype=torch.int64), "e": torch.zeros(0)}
    plan = [[entry for entry, _ in bucket] for bucket in buckets(weights.items(), bucket_bytes=256)]
    assert [[e.name for e in b] for b in plan] == [["a", "b"], ["c"], ["d", "e"]]  # c (400 B) alone
    assert all(e.offset % 64 == 0 for b in plan for e in b)
    assert [e.nbytes for b in plan for e in b] == [40, 6, 400, 56, 0]
    assert [b[-1].offset + b[-1].nbytes for b in plan] == [64 + 6, 400, 64]
    for bucket in plan:  # no two tensors of a bucket overlap
        assert all(e.offset + e.nbytes <= f.offset for e, f in itertools.pairwise(bucket))
    assert plan[0][1].dtype == "bfloat16" and plan[2][0].shape == (7,)
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        next(buckets(weights.items(), bucket_bytes=0))


def test_buckets_ask_the_producer_for_no_more_than_the_next_tensor():
    produced = []

    def producer():
        for i in range(6):
            produced.append(i)
            yield f"t{i}", torch.zeros(16)  # 64 B each: two per 128 B bucket

    stream = buckets(producer(), bucket_bytes=128)
    first = next(stream)
    assert [e.name for e, _ in first] == ["t0", "t1"] and produced == [0, 1, 2]


def test_push_refuses_a_rank_that_is_not_the_root():
    from mpi4py import MPI

    from libra_hpc.engines.sync import push_weights

    with pytest.raises(ValueError, match="root=1"):
        push_weights(MPI.COMM_SELF, {"a": torch.zeros(1)}, root=1)


@pytest.mark.mpi
def test_trained_weights_reach_the_vllm_leader_and_its_logprobs_match(tiny, tmp_path):
    from mpi_worlds import run_world

    run_world("train_world.py", 3, "sync", tiny, tmp_path, timeout=300, what="the sync world")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["rollout"] == "VllmRolloutEngine"
    assert result["rollout_vs_trained"] < 1e-4  # after the sync: the trained policy, to fp32 precision
    assert result["rollout_before_vs_trained"] > 1e-2  # before it: visibly the old policy
    losses = result["losses"]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert result["placement"]["pp"] == 2  # two stage holders, each pushing its own layers
    config = json.loads((tiny / "config.json").read_text())
    pulls, pushes = result["pulls"], result["pushes"]
    assert [p["tensors"] for p in pulls] == [p["tensors"] for p in pushes] == [1 + 12, 12 + 2]
    assert sum(p["tensors"] for p in pulls) == 3 + 12 * config["num_hidden_layers"]
    assert [p["bytes"] for p in pulls] == [p["bytes"] for p in pushes]
    assert result["mixed_exact"] == result["mixed_names"] and len(result["mixed_names"]) == 7
    assert result["push_mixed_buckets"] > 1
