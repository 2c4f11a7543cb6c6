"""Exercise the training half of the GPU path: the Megatron engine on CUDA with NCCL.

    python scripts/gpu_check.py [--out DIR] [--quick]

Run from the repository root with ``PYTHONPATH=.`` on a machine with one GPU and
megatron-core 0.16.1 + pydantic importable (no vLLM needed). The driver builds the tiny
model (and a wider one for timings), then runs each case in a subprocess of its own
(the CPU cases with ``CUDA_VISIBLE_DEVICES=`` so that the engine takes its CPU/gloo path
with the shims, exactly as on a machine without a GPU):

* the torch world over one rank (``TrainingWorld`` over MPI COMM_WORLD when mpi4py
  works, else over a one-rank stand-in communicator), megatron's groups, the engine;
* checks that the CPU shims are skipped on CUDA (megatron's own RNG tracker, the real
  ``torch.cuda`` calls, parameters and gradients on the GPU);
* a synthetic agentic batch (prompt, generated, tool output, generated) →
  ``prepare_batch`` → ``grpo_step`` for a few steps: finite losses, losses falling,
  weights moving, the log-probs of positively advantaged tokens rising;
* the export the weight sync uses (``iter_hf``/``export_hf``, packed by
  ``runtime.weights.WeightSender.post`` and unpacked like ``WeightReceiver.poll``, and
  ``engines.sync.push_weights`` over COMM_SELF when MPI works), checked against plain
  transformers log-probs; a dist checkpoint save/load round trip.

Each case prints ``RESULT {json}``; the driver prints a table and one final line
``GPU_CHECK {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": {},
    "wide": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}


# ---------------------------------------------------------------------------------- worker

class _OneRank:
    """An MPI communicator stand-in for a world of one rank (what rendezvous needs)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, x):
        return [x]

    def bcast(self, x, root=0):
        return x


class _CaptureComm:
    """A communicator for ``WeightSender.post``: records what would be sent."""

    def __init__(self):
        self.sent = []

    def isend(self, obj, dest, tag):
        self.sent.append(("obj", obj))
        return None

    def Isend(self, buf, dest, tag):
        self.sent.append(("buf", buf))
        return None


def _trajectories(engine, groups: int, per_group: int, length: int, seed: int):
    """Synthetic rollout output at policy version 0: (prompt, generated, tool, generated)
    segments, random tokens, rollout log-probs from the engine, rewards varying in each group."""
    import torch

    from libra_hpc.rl import NOT_GENERATED, Trajectory

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.shape.vocab_size
    raw = []
    for g in range(groups):
        for k in range(per_group):
            n = int(torch.randint(length // 2, length + 1, (1,), generator=gen))
            p, tool = n // 5, n // 6
            first = (n - p - tool) // 2
            second = n - p - tool - first
            generated = [False] * p + [True] * first + [False] * tool + [True] * second
            tokens = torch.randint(1, vocab, (n,), generator=gen).tolist()
            raw.append((f"g{g}", tokens, generated, float((g + k) % 2)))
    width = max(len(t) for _, t, _, _ in raw)
    padded = torch.tensor([t + [0] * (width - len(t)) for _, t, _, _ in raw])
    lp = engine.logprobs(padded).cpu()
    out = []
    for i, (group, tokens, generated, reward) in enumerate(raw):
        row = lp[i].tolist()
        logprobs = [0.0] + [x if g else 0.0 for x, g in zip(row, generated[1:])]
        out.append(Trajectory(prompt_id=f"p{group}", group_id=group, tokens=tokens, generated=generated,
                              logprobs=logprobs, versions=[0 if g else NOT_GENERATED for g in generated],
                              reward=reward, finish_reason="stop"))
    return out


def _sync(cuda: bool):
    if cuda:
        import torch

        torch.cuda.synchronize()


def worker(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    res: dict = {"case": args.case, "cuda": cuda, "dtype": args.dtype, "shape": args.shape,
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "errors": []}
    t0 = time.perf_counter()
    from libra_hpc.config import RLConfig
    from libra_hpc.engines.train import cpu_shims
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import TrainingWorld
    from libra_hpc.rl import grpo_step, prepare_batch

    import megatron.core
    from megatron.core.tensor_parallel import random as mrandom

    res["megatron"] = megatron.core.__version__
    res["import_s"] = time.perf_counter() - t0
    res["shims_needed"] = cpu_shims.needed()

    # ---- torch world
    t = time.perf_counter()
    comm, mpi = _OneRank(), False
    if args.world == "mpi":
        from mpi4py import MPI

        comm, mpi = MPI.COMM_WORLD, True
    world = TrainingWorld(comm, device_index=0 if cuda else None)
    res["world"] = {"via": "mpi4py COMM_WORLD" if mpi else "one-rank stand-in", "backend": world.backend,
                    "device": str(world.device), "check": world.check()[0], "start_s": time.perf_counter() - t}

    # ---- engine
    real_current_device = torch.cuda.current_device
    with cpu_shims.megatron_on_cpu():
        shims_active_in_scope = torch.cuda.current_device is not real_current_device
    t = time.perf_counter()
    engine = MegatronTrainEngine(args.model, tp=1, lr=args.lr, micro_batch_size=args.mbs, seed=0,
                                 dtype=getattr(torch, args.dtype),
                                 distributed_optimizer=args.distributed_optimizer)
    world.own(engine)
    _sync(cuda)
    res["engine_start_s"] = time.perf_counter() - t
    params = list(engine.model.parameters())
    res["engine"] = {
        "device": str(engine.device), "param_devices": sorted({str(p.device) for p in params}),
        "param_dtypes": sorted({str(p.dtype) for p in params}), "params": sum(p.numel() for p in params),
        "rng_tracker": type(mrandom.get_cuda_rng_tracker()).__name__,
        "shims_active_in_scope": shims_active_in_scope,
        "optimizer": type(engine.optimizer).__name__,
        "inner_optimizer": type(getattr(engine.optimizer, "optimizer", None)).__name__,
    }
    if cuda:
        assert not res["shims_needed"], "shims claim to be needed with CUDA present"
        assert res["engine"]["param_devices"] == ["cuda:0"], res["engine"]["param_devices"]
        assert res["engine"]["rng_tracker"] != "CpuRNGStatesTracker", "CPU RNG tracker installed on CUDA"
        assert not shims_active_in_scope, "megatron_on_cpu patched torch.cuda with CUDA present"

    # ---- batch
    t = time.perf_counter()
    trajectories = _trajectories(engine, args.groups, 2, args.length, seed=1)
    rl = RLConfig(loss_aggregation="seq_mean_token_sum", max_staleness=1)
    batch, report = prepare_batch(trajectories, rl, train_version=engine.steps, pad_id=0, rows_multiple=args.mbs)
    pb = batch.to_policy_batch()
    res["batch"] = {"sequences": report.sequences, "width": len(batch.tokens[0]),
                    "trained_tokens": report.trained_tokens, "tokens": sum(len(t.tokens) for t in trajectories),
                    "build_s": time.perf_counter() - t}
    before_w = {k: v.detach().float().cpu().clone() for k, v in engine.export_hf().items()}
    before_lp = engine.logprobs(pb.tokens).cpu()

    # ---- steps (the first one is warm-up: kernels, allocator, optimizer state)
    stats, times = [], []
    for i in range(args.steps + 1):
        _sync(cuda)
        t = time.perf_counter()
        stats.append(grpo_step(engine, batch))
        _sync(cuda)
        times.append(time.perf_counter() - t)
    losses = [s.loss for s in stats]
    timed = times[1:]
    mean = sum(timed) / len(timed)
    res["steps"] = {"losses": losses, "grad_norms": [s.grad_norm for s in stats],
                    "clipped": [s.clipped_fraction for s in stats], "tokens": stats[0].tokens,
                    "first_step_s": times[0], "step_s": timed, "mean_step_s": mean, "steps_per_s": 1 / mean,
                    "trained_tokens_per_s": stats[0].tokens / mean,
                    "all_tokens_per_s": res["batch"]["tokens"] / mean}
    res["finite"] = all(math.isfinite(x) for x in losses + res["steps"]["grad_norms"])
    res["loss_falls"] = losses[-1] < losses[0]
    if cuda:
        res["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30

    # ---- did it learn what the advantages say?
    after_lp = engine.logprobs(pb.tokens).cpu()
    moved = ((after_lp - before_lp) * pb.loss_mask).sum(1)
    adv = (pb.advantages.max(1).values + pb.advantages.min(1).values)
    rows = pb.loss_mask.sum(1) > 0
    res["direction_ok"] = bool(torch.all(moved[rows & (adv > 0)] > 0) and torch.all(moved[rows & (adv < 0)] < 0))

    # ---- export (the weight sync's source), and the packing the sync does
    _sync(cuda)
    t = time.perf_counter()
    exported = engine.export_hf()
    _sync(cuda)
    res["export_s"] = time.perf_counter() - t
    res["export"] = {"tensors": len(exported), "devices": sorted({str(v.device) for v in exported.values()}),
                     "dtypes": sorted({str(v.dtype) for v in exported.values()}),
                     "bytes": sum(v.numel() * v.element_size() for v in exported.values())}
    res["weights_changed"] = max((exported[k].detach().float().cpu() - before_w[k]).abs().max().item()
                                 for k in exported)
    res["weights_unchanged_tensors"] = [k for k in exported
                                        if torch.equal(exported[k].detach().float().cpu(), before_w[k])]
    try:
        from libra_hpc.runtime.weights import WeightSender

        capture = _CaptureComm()
        sender = WeightSender(capture, leaders=[1], stage=0, stages=1)
        t = time.perf_counter()
        pack_s = sender.post(1, engine.iter_hf())
        res["sender_post_s"] = time.perf_counter() - t
        res["sender_pack_s"] = pack_s
        manifest = next(o for kind, o in capture.sent if kind == "obj")
        array = next(o for kind, o in capture.sent if kind == "buf")
        buffer = torch.from_numpy(array)
        bad = []
        for name, dtype, shape, start, nbytes in manifest["entries"]:
            got = buffer[start:start + nbytes].view(getattr(torch, dtype)).reshape(shape)
            if not torch.equal(got, exported[name].detach().cpu()):
                bad.append(name)
        res["sender_roundtrip_ok"] = not bad and len(manifest["entries"]) == len(exported)
    except Exception as exc:  # noqa: BLE001 - report, keep going
        res["errors"].append(f"WeightSender: {exc!r}\n{traceback.format_exc()}")
    if mpi:
        try:
            from mpi4py import MPI

            from libra_hpc.engines.sync import push_weights

            st = push_weights(MPI.COMM_SELF, engine.iter_hf(), root=0)
            res["push_weights"] = {"tensors": st.tensors, "bytes": st.bytes, "seconds": st.seconds}
        except Exception as exc:  # noqa: BLE001
            res["errors"].append(f"push_weights: {exc!r}\n{traceback.format_exc()}")

    # ---- exported weights under plain transformers (CPU, float32) vs the engine
    if args.hf_check:
        try:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            state = {k: v.detach().float().cpu() for k, v in exported.items()}
            if hf.config.tie_word_embeddings:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            hf.load_state_dict(state, strict=True)
            rows_n = min(4, pb.tokens.shape[0])
            tok = pb.tokens[:rows_n]
            with torch.no_grad():
                logits = hf(tok).logits.float()
            ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tok[:, 1:, None])[..., 0]
            mask = pb.loss_mask[:rows_n] > 0
            res["export_vs_hf_max_abs"] = (after_lp[:rows_n] - ref)[mask].abs().max().item()
        except Exception as exc:  # noqa: BLE001
            res["errors"].append(f"hf check: {exc!r}\n{traceback.format_exc()}")

    # ---- checkpoint round trip
    if args.checkpoint:
        try:
            from libra_hpc.engines.train.checkpoint import load_checkpoint, save_checkpoint

            ckpt = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_")) / "c"
            t = time.perf_counter()
            save_checkpoint(engine, ckpt)
            res["ckpt_save_s"] = time.perf_counter() - t
            saved_lp = engine.logprobs(pb.tokens).cpu()
            grpo_step(engine, batch)
            t = time.perf_counter()
            try:
                load_checkpoint(engine, ckpt, with_optimizer=True)
                res["ckpt_with_optimizer"] = "loaded"
            except NotImplementedError as exc:
                res["ckpt_with_optimizer"] = f"refused: {str(exc)[:120]}"
                load_checkpoint(engine, ckpt, with_optimizer=False)
            res["ckpt_load_s"] = time.perf_counter() - t
            res["ckpt_restored_max_abs"] = (engine.logprobs(pb.tokens).cpu() - saved_lp).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            res["errors"].append(f"checkpoint: {exc!r}\n{traceback.format_exc()}")

    t = time.perf_counter()
    world.close()
    res["close_s"] = time.perf_counter() - t
    res["total_s"] = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------- driver

def _mpi_works(timeout: float = 60.0) -> tuple[bool, str]:
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0], MPI.COMM_WORLD.Get_size())"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timeout"
    return p.returncode == 0, (p.stdout.strip() or p.stderr.strip()[-300:])


def _run_case(case: dict, model: Path, out: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if case.get("cpu"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case["name"], "--model", str(model),
           "--dtype", case.get("dtype", "float32"), "--shape", case["shape"], "--steps", str(case.get("steps", 5)),
           "--groups", str(case.get("groups", 8)), "--length", str(case.get("length", 256)),
           "--mbs", str(case.get("mbs", 4)), "--world", case.get("world", "local")]
    for flag in ("hf_check", "checkpoint", "distributed_optimizer"):
        if case.get(flag):
            cmd.append("--" + flag.replace("_", "-"))
    if case.get("mpiexec"):
        cmd = [case["mpiexec"], "-n", "1"] + cmd
    start = time.perf_counter()
    log = out / f"{case['name']}.log"
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout}s", 124
        text = text if isinstance(text, str) else str(text)
    log.write_text(text)
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            break
    else:
        tail = "\n".join(text.splitlines()[-40:])
        result = {"case": case["name"], "failed": True, "rc": rc, "tail": tail}
        print(f"--- {case['name']} FAILED (rc {rc}); last lines:\n{tail}\n---", flush=True)
    result["wall_s"] = time.perf_counter() - start
    return result


def driver(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    ok, info = _mpi_works()
    env_info["mpi4py"] = info if ok else f"unusable: {info}"
    print("ENV", json.dumps(env_info), flush=True)

    from libra_hpc.engines.tiny import build_tiny_model

    models = {}
    model_root = Path(args.models or tempfile.mkdtemp(prefix="gpu_check_models_"))
    for shape in ("tiny",) if args.quick else ("tiny", "wide"):
        t = time.perf_counter()
        models[shape] = build_tiny_model(model_root / f"model-{shape}", seed=0, **SHAPES[shape])
        print(f"built {shape} model in {time.perf_counter() - t:.1f}s", flush=True)

    world = "mpi" if ok else "local"
    cases = [
        {"name": "cuda-fp32-tiny", "shape": "tiny", "world": world, "hf_check": True, "checkpoint": True},
        {"name": "cuda-bf16-tiny", "shape": "tiny", "dtype": "bfloat16", "hf_check": True},
        {"name": "cuda-fp32-tiny-distopt", "shape": "tiny", "distributed_optimizer": True, "checkpoint": True},
        {"name": "cpu-fp32-tiny", "shape": "tiny", "cpu": True, "steps": 3, "world": world},
    ]
    if not args.quick:
        cases += [
            {"name": "cuda-fp32-wide", "shape": "wide", "steps": 5, "groups": 16, "length": 512},
            {"name": "cuda-bf16-wide", "shape": "wide", "dtype": "bfloat16", "steps": 5, "groups": 16,
             "length": 512, "hf_check": True},
            {"name": "cpu-fp32-wide", "shape": "wide", "cpu": True, "steps": 2, "groups": 16, "length": 512},
        ]
    if args.only:
        cases = [c for c in cases if c["name"] in args.only.split(",")]
    results = []
    for case in cases:
        r = _run_case(case, models[case["shape"]], out, args.case_timeout)
        results.append(r)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        s = r.get("steps", {})
        print(f"{case['name']:24s} ok={not r.get('failed') and not r.get('errors')} "
              f"finite={r.get('finite')} falls={r.get('loss_falls')} dir={r.get('direction_ok')} "
              f"moved={r.get('weights_changed')} step={s.get('mean_step_s')} steps/s={s.get('steps_per_s')} "
              f"losses={[round(x, 5) for x in s.get('losses', [])]} wall={r['wall_s']:.1f}s", flush=True)
        if r.get("traceback"):
            print(f"   traceback:\n{r['traceback']}", flush=True)
        for e in r.get("errors", []):
            print(f"   error: {e[:2000]}", flush=True)

    by = {r["case"]: r for r in results}

    def ratio(a, b):
        try:
            return by[b]["steps"]["mean_step_s"] / by[a]["steps"]["mean_step_s"]
        except (KeyError, ZeroDivisionError):
            return None

    summary = {"env": env_info, "ratios_cpu_over_gpu": {"tiny": ratio("cuda-fp32-tiny", "cpu-fp32-tiny"),
                                                         "wide": ratio("cuda-fp32-wide", "cpu-fp32-wide")},
               "cases": {r["case"]: {k: r.get(k) for k in (
                   "failed", "rc", "exception", "finite", "loss_falls", "direction_ok", "weights_changed",
                   "export_vs_hf_max_abs", "sender_roundtrip_ok", "ckpt_with_optimizer", "ckpt_restored_max_abs",
                   "engine_start_s", "export_s", "max_mem_gib", "world", "engine", "batch")} |
                   {"steps": {k: r.get("steps", {}).get(k) for k in (
                       "losses", "grad_norms", "mean_step_s", "steps_per_s", "trained_tokens_per_s",
                       "first_step_s")},
                    "errors": [e.splitlines()[0][:300] for e in r.get("errors", [])]}
                         for r in results}}
    print("GPU_CHECK " + json.dumps(summary), flush=True)
    failed = [r["case"] for r in results if r.get("failed") or r.get("errors") or not r.get("finite")]
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--quick", action="store_true", help="tiny model cases only")
    ap.add_argument("--models", default="", help="where to build the models (default: a temporary folder)")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--case-timeout", type=float, default=240.0)
    # worker options
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--case", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--world", choices=("mpi", "local"), default="local")
    ap.add_argument("--hf-check", action="store_true")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    args = ap.parse_args()
    if not args.worker:
        return driver(args)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        res = worker(args)
    except BaseException as exc:  # noqa: BLE001 - the driver wants the reason
        traceback.print_exc()
        print("RESULT " + json.dumps({"case": args.case, "failed": True, "exception": repr(exc)[:500],
                                      "traceback": traceback.format_exc()[-3000:]}), flush=True)
        return 1
    print("RESULT " + json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
