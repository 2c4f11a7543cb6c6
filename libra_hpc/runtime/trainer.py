"""A training rank: Megatron-Core in the training ranks' torch world, fed by the rollout
leaders directly.

The loop (:meth:`Trainer.run`): finished trajectories arrive from the leaders (tag
``TRAJECTORY``, the DP replica the controller routed them to; every TP rank and stage of
the replica gets its copy), and the controller says when a step may start and which GRPO
groups each replica trains (``train``; with partial rollout they may come from several
submitted batches, and groups that were regenerated are named to be discarded). Then, on every training rank at once
(the step is collective over the torch world): the replica's GRPO batch
(:func:`~libra_hpc.rl.step.prepare_batch`: staleness bound, group advantages — whole
groups are routed to one replica, so advantages need nothing from the others), the
policy-gradient step (:func:`~libra_hpc.rl.step.grpo_step`), the new weights posted to
every leader by the holders (:mod:`.weights`, point to point: the trainers go on without
waiting for the leaders to take them) and one report to the controller.

A replica whose every group has zero reward variance still takes part in the step with
zero advantages (its gradient is zero), since the DP all-reduce needs every replica.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from libra_hpc.cluster.messages import COMMAND, TRAJECTORY, Backoff
from libra_hpc.runtime.episodes import group_of
from libra_hpc.runtime.heartbeat import note, progressed
from libra_hpc.runtime.weights import WeightSender

log = logging.getLogger(__name__)
CONTROLLER = 0


class Trainer:
    def __init__(self, job: Any, engine: Any):
        self.job, self.engine = job, engine
        self.comm, self.data, self.rank, self.cfg = job.comm, job.data, job.rank, job.cfg
        roles = job.roles
        self.replica = roles.replica_of(self.rank)
        self.first_of_replica = roles.replicas[self.replica][0] == self.rank
        self.sender = None
        if self.rank in roles.holders:
            self.sender = WeightSender(self.data, sorted(roles.leaders.values()), roles.holders.index(self.rank),
                                       len(roles.holders))
        self.inbox: dict[str, list] = {}  # GRPO group → its (tid, trajectory) so far
        self.discarded: set[str] = set()  # groups regenerated (partial rollout): never trained
        self.wait_s = 0.0
        self.stopped = False
        self.forwards: list[Any] = []  # sends of trajectories this rank passes on (gather_scatter)
        self.forwarded = 0
        self.relayed: dict[str, int] = {}  # group → its trajectories passed on to another replica
        self.streamed: dict[str, list] = {}  # rl.stream_training: groups of the coming step already accumulated
        self.stream_reports: list = []  # their prepare_batch reports
        self.stream_s = 0.0
        self.hub = job.cfg.parallel.dispatch == "gather_scatter" and roles.replicas[0][0] == self.rank
        """The gather rank: it must have passed on every trajectory of a step before the
        step's collectives, or the replicas waiting for them would wait forever."""

    def run(self) -> dict | None:
        """Serve until ``stop`` (returns None) or ``relayout`` (returns the command, after
        saving this training world's checkpoint for the next one to load)."""
        from mpi4py import MPI

        backoff = Backoff(1e-4, 0.01)
        status = MPI.Status()
        waiting_since = time.perf_counter()
        while not self.stopped:
            worked = False
            progressed()
            while (message := self.data.improbe(source=MPI.ANY_SOURCE, tag=TRAJECTORY, status=status)) is not None:
                self._receive(message.recv())
                worked = True
            if self.sender is not None:
                self.sender.progress()
            self.forwards = [r for r in self.forwards if not r.Test()]
            message = self.comm.improbe(source=CONTROLLER, tag=COMMAND)
            if message is not None:
                command = message.recv()
                if command["op"] == "stop":
                    self.stopped = True
                    # the other trainers and the leaders may have stopped already: the
                    # world's parting completes these sends (cluster/parting.py)
                    self.job.hand_over(self.forwards)
                    if self.sender is not None:
                        self.job.hand_over(*self.sender.outstanding())
                    break
                if command["op"] == "relayout":
                    return self._leave_world(command)
                self.wait_s += time.perf_counter() - waiting_since
                self._command(command)
                waiting_since = time.perf_counter()
                worked = True
            if worked:
                backoff.reset()
            else:
                backoff.sleep()
        return None

    def _leave_world(self, command: dict) -> dict:
        """Before the training group changes: the model and optimizer state to disk, where
        the next training world loads it (resharded to its DP size), and the sends of
        weights still going out completed."""
        from libra_hpc.engines.train.checkpoint import save_checkpoint

        from mpi4py import MPI

        started = time.perf_counter()
        self._unstream()
        save_checkpoint(self.engine, command["checkpoint"])
        MPI.Request.Waitall(self.forwards)
        if self.sender is not None:
            self.sender.finish(self.cfg.scheduler.lease_s)
        command["saved_s"] = time.perf_counter() - started
        return command

    def _checkpoint(self, command: dict) -> dict:
        """This training world's state for the job's checkpoint (collective): the Megatron
        model, optimizer and step counter, and this rank's RNG."""
        import torch

        from pathlib import Path

        from libra_hpc.engines.train.checkpoint import save_checkpoint

        started = time.perf_counter()
        note(f"trainer: saving the checkpoint of version {command['version']}")
        save_checkpoint(self.engine, command["path"])
        rng = Path(command["rng"])
        rng.mkdir(parents=True, exist_ok=True)
        torch.save({"torch": torch.get_rng_state()}, rng / f"rank-{self.rank}.pt")
        return {"op": "checkpointed", "version": command["version"], "save_s": round(time.perf_counter() - started, 3)}

    def _receive(self, payload: dict) -> None:
        from libra_hpc.rl.trajectory import Trajectory

        tid = payload["tid"]
        group = group_of(tid)
        hops = payload.get("forward", [])
        if hops and hops[0][0] == self.rank:  # the gather rank of parallel.dispatch: gather_scatter
            onward = {**payload, "forward": hops[1:]}
            self.forwards += [self.data.isend(onward, dest=d, tag=TRAJECTORY) for d in hops[0][1]]
            self.forwarded += 1
        if payload.get("replica", self.replica) != self.replica:
            self.relayed[group] = self.relayed.get(group, 0) + 1
            return
        if group not in self.discarded:
            self.inbox.setdefault(group, []).append((tid, Trajectory.from_dict(payload["trajectory"])))

    def _command(self, command: dict) -> None:
        op = command["op"]
        if op == "train":
            for group in command.get("discard", ()):
                self.discarded.add(group)
                self.inbox.pop(group, None)
                self.relayed.pop(group, None)
            relay = [g for r, gs in command["groups"].items() if r != self.replica for g in gs] if self.hub else []
            self.job.report(self._train(command["batch"], command["groups"].get(self.replica, []), command["leaders"],
                                        relay))
        elif op == "accumulate":
            self._accumulate(command["batch"], command["groups"].get(self.replica, []))
        elif op == "export":
            self.job.report(self._export(command["path"]))
        elif op == "checkpoint":
            self.job.report(self._checkpoint(command))
        else:
            raise ValueError(f"rank {self.rank} (trainer): unknown command {op!r}")

    def _wait_for(self, step: int, groups: list[str], relay: list[str] = ()) -> list:
        """Every trajectory of this replica's ``groups`` for ``step`` (the leaders may
        still be sending), in the order the groups were named; the gather rank also waits
        until it has passed on every trajectory of the other replicas' groups (``relay``)."""
        from mpi4py import MPI

        need = self.cfg.rl.group_size
        backoff = Backoff(1e-4, 0.01)
        deadline = time.monotonic() + self.cfg.scheduler.lease_s
        while missing := [g for g in groups if len(self.inbox.get(g, ())) < need] + \
                [g for g in relay if self.relayed.get(g, 0) < need]:
            progressed()
            message = self.data.improbe(source=MPI.ANY_SOURCE, tag=TRAJECTORY)
            if message is not None:
                self._receive(message.recv())
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} (trainer, DP replica {self.replica}): step {step}: groups "
                                   f"{missing[:5]} not complete ({need} trajectories each) within "
                                   f"{self.cfg.scheduler.lease_s} s")
            backoff.sleep()
        for g in relay:
            del self.relayed[g]
        got = [self.inbox.pop(g) for g in groups]
        if any(len(members) != need for members in got):
            raise RuntimeError(f"rank {self.rank}: step {step}: groups of {[len(m) for m in got]} trajectories "
                               f"arrived, {need} each expected")
        return [item for members in got for item in members]

    def _accumulate(self, batch: int, groups: list[str]) -> None:
        """``rl.stream_training``: this replica's ``groups`` of the coming step ``batch``
        (complete at the controller; their trajectories may still be on the way) through
        forward and backward now, into the gradients the step's ``train`` completes. Other
        replicas take no part (no DP collective before the step)."""
        from libra_hpc.rl.step import prepare_batch

        groups = [g for g in groups if g not in self.streamed]
        if not groups:
            return
        received = self._wait_for(batch, groups)
        started = time.perf_counter()
        train, report = prepare_batch([t for _, t in received], self.cfg.rl, train_version=batch,
                                      pad_id=self.job.codec.pad_id, rows_multiple=self.cfg.training.micro_batch_size)
        if train is not None:
            self.engine.accumulate(train.to_policy_batch())
        for g in groups:
            self.streamed[g] = [item for item in received if group_of(item[0]) == g]
        self.stream_reports.append(report)
        self.stream_s += time.perf_counter() - started

    def _unstream(self) -> None:
        """The training world ends before the step its accumulated groups belong to (a
        relayout): their gradients go with the engine, their trajectories back to the inbox,
        and the next world's step trains them whole."""
        for g, items in self.streamed.items():
            self.inbox[g] = items
        self.streamed, self.stream_reports, self.stream_s = {}, [], 0.0

    def _train(self, batch: int, groups: list[str], leaders: list[int], relay: list[str] = ()) -> dict:
        from libra_hpc.rl.grpo import build_batch
        from libra_hpc.rl.step import grpo_step, prepare_batch

        from libra_hpc.config_learning import epochs_at
        from libra_hpc.rl.step import BatchReport

        streamed, reports = self.streamed, self.stream_reports
        self.streamed, self.stream_reports = {}, []
        rest = [g for g in groups if g not in streamed]
        note(f"trainer (DP replica {self.replica}): waiting for batch {batch}'s {len(rest)} groups"
             + (f" ({len(streamed)} trained as they came)" if streamed else ""), waiting=True)
        received = self._wait_for(batch, rest, relay) if rest or relay else []
        note(f"trainer (DP replica {self.replica}): training batch {batch}")
        trajectories = [t for _, t in received]
        started = time.perf_counter()
        mbs, pad = self.cfg.training.micro_batch_size, self.job.codec.pad_id
        epochs = epochs_at(self.cfg.rl.update_epochs, batch)
        if streamed and (epochs > 1 or set(streamed) - set(groups)):
            raise RuntimeError(f"rank {self.rank}: step {batch}: groups {sorted(streamed)[:4]} were trained as they "
                               f"came, but the step has {epochs} passes or does not name them all")
        if trajectories:
            train, report = prepare_batch(trajectories, self.cfg.rl, train_version=batch, pad_id=pad, rows_multiple=mbs)
        else:  # a replica that just joined, or whose groups all came early: the step is still collective
            train, report = None, BatchReport(given=0)
        if train is None:  # nothing (more) to learn from here; the step is still collective
            train = build_batch(trajectories or [_empty(pad)], [0.0] * max(len(trajectories), 1), pad_id=pad,
                                rows_multiple=mbs)
        prox = None
        if epochs > 1 and train.is_cap > 0:  # the correction weighs against the policy before the first pass
            import torch
            prox = self.engine.logprobs(torch.tensor(train.tokens, dtype=torch.long))
        passes = [grpo_step(self.engine, train, prox_logprobs=prox) for _ in range(epochs)]
        stats, first = passes[-1], passes[0]  # the gap: the rollout against the trainer before it moved
        train_s = time.perf_counter() - started
        report = _merged([*reports, report])
        received = [item for items in streamed.values() for item in items] + received
        started = time.perf_counter()
        weights = self.engine.iter_hf()
        if self.sender is not None:
            pack_s = self.sender.post(batch + 1, weights, leaders)
        else:
            for _ in weights:  # collective gathers over the TP group
                pass
            pack_s = 0.0
        out = {"op": "trained", "batch": batch, "version": batch + 1, "replica": self.replica,
               "train_s": round(train_s, 4), "push_s": round(time.perf_counter() - started, 4),
               "pack_s": round(pack_s, 4), "wait_s": round(self.wait_s, 4), "loss": stats.loss,
               "grad_norm": stats.grad_norm, "tokens": stats.tokens, "clipped": stats.clipped_fraction,
               "gap_kl": first.gap_kl, "gap_max": first.gap_max, "is_capped": first.is_capped,
               "dropped_stale": dict(report.dropped_stale), "max_lag": report.max_lag,
               "groups": report.groups, "filtered_groups": report.filtered_groups, "forwarded": self.forwarded,
               "streamed_groups": len(streamed), "stream_s": round(self.stream_s, 4),
               "work": self.engine.take_work()}  # the streamed groups' too
        if self.first_of_replica:
            out["tids"] = [tid for tid, _ in received]
        self.wait_s, self.forwarded, self.stream_s = 0.0, 0, 0.0
        note(f"trainer (DP replica {self.replica}): waiting for a command after batch {batch}", waiting=True)
        return out

    def _export(self, path: str) -> dict:
        """The current policy as a Hugging Face checkpoint in ``path``. Each pipeline
        stage's holder writes its stage's weights: one ``model.safetensors`` without
        pipeline parallelism, else ``model-0000s-of-0000P.safetensors`` per stage, whose
        names the reply carries so that the controller writes the index. The first holder
        also copies the warm start's config and tokenizer."""
        import shutil
        from pathlib import Path

        from safetensors.torch import save_file

        weights = dict(self.engine.iter_hf())
        holders = self.job.roles.holders
        if self.rank not in holders:
            return {"op": "exported", "path": None}
        stage, stages = holders.index(self.rank), len(holders)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if stage == 0:
            for item in Path(self.job.warm).iterdir():
                if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".index.json")) \
                        and item.name != "build.json":
                    shutil.copy2(item, out / item.name)
        name = "model.safetensors" if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / name), metadata={"format": "pt"})
        return {"op": "exported", "path": str(out), "tensors": len(weights), "stage": stage, "stages": stages,
                "weight_map": dict.fromkeys(weights, name) if stages > 1 else {},
                "bytes": sum(v.numel() * v.element_size() for v in weights.values())}


def _merged(reports: list) -> Any:
    """One step's :class:`~libra_hpc.rl.step.BatchReport` from those of its parts."""
    from libra_hpc.rl.step import BatchReport

    out = BatchReport(given=sum(r.given for r in reports))
    for r in reports:
        for reason, n in r.dropped_stale.items():
            out.dropped_stale[reason] = out.dropped_stale.get(reason, 0) + n
        out.groups += r.groups
        out.filtered_groups += r.filtered_groups
        out.max_lag = max(out.max_lag, r.max_lag)
    return out


def _empty(pad: int):
    """A record with nothing generated: all its tokens are masked out of the loss."""
    from libra_hpc.rl.trajectory import NOT_GENERATED, Trajectory

    return Trajectory("none", "none", [pad, pad], [False, False], [0.0, 0.0], [NOT_GENERATED] * 2, 0.0, "none")
