"""A rollout instance leader: one vLLM engine serving the C-MLFQ queue's turns.

The loop (:meth:`RolloutLeader.run`), one pass at a time, never waiting on one peer:

1. commands from the controller: ``route`` (send a finished trajectory to the training
   ranks named, or to none: it was regenerated), ``abort`` (partial rollout: these
   trajectories are regenerated; each one ends at its next turn boundary, wherever that
   runs), ``eval`` (greedy held-out episodes), ``stop``;
2. trajectory states other leaders ask for (a turn moved to their bucket) and those that
   arrive here;
3. tool results from the controller's shared pool (:mod:`.tools`);
4. new weights (:mod:`.weights`): no new turn starts until the running ones end, then the
   engine loads them and reports the version and the time it stood idle;
5. turns whose tool calls are done: the observation is appended and the tool return is
   reported (the C-MLFQ signal; the queue places the next turn, maybe elsewhere), or the
   trajectory is finished and reported;
6. one queue exchange: the reports, and an ``ask`` for more turns while there is room;
7. one engine step (continuous batching: turns join and leave the running batch).

A turn of batch ``b`` starts only on weights of version ≥ ``b - rl.max_staleness``
(the controller submits batch ``b`` only once that version exists), so no trajectory is
staler than the bound and none is dropped for it. An aborted trajectory ends where its
next turn would start or where its tool calls return: the lease is closed with the queue
(``finish``) and the controller hears ``aborted`` with the tokens it had generated, which
are wasted; it is never routed to training. A turn whose previous turn ran on
another instance pulls the trajectory's state from there and recomputes its KV cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from libra_hpc.cluster.messages import COMMAND, EPISODE, EPISODE_ASK, REPORT, TRAJECTORY, Backoff
from libra_hpc.runtime.episodes import MIN_TURN, LiveEpisode, batch_of
from libra_hpc.runtime.heartbeat import note
from libra_hpc.runtime.tools import ToolProxy
from libra_hpc.runtime.weights import WeightReceiver

log = logging.getLogger(__name__)
CONTROLLER = 0
HEARTBEAT_S = 2.0
LOAD_REPORT_S = 1.0


class RolloutLeader:
    """The leader of rollout instance ``instance``; ``engine`` is its vLLM engine."""

    def __init__(self, job: Any, engine: Any, instance: int):
        self.job, self.engine, self.instance = job, engine, instance
        self.comm, self.data, self.rank = job.comm, job.data, job.rank
        self.cfg, self.task, self.codec = job.cfg, job.task, job.codec
        self.tools = ToolProxy(self.comm, self.rank)
        self.weights = WeightReceiver(self.data)
        self.version = 0
        self.limit = int(engine.max_model_len)
        self.live: dict[str, LiveEpisode] = {}  # trajectories whose state is here
        self.leases: dict[str, int] = {}  # tid → lease of its current turn
        self.running: dict[str, LiveEpisode] = {}  # request id → episode generating
        self.in_tools: dict[str, LiveEpisode] = {}  # tid → episode whose calls run
        self.parked: list[dict] = []  # leased turns waiting (state on its way, weights too old, update pending)
        self.asked: set[str] = set()  # tids whose state was asked for
        self.outbox: dict[str, Any] = {}  # finished trajectories waiting for their route
        self.reports: list[dict] = []
        self.sends: list[Any] = []
        self.update: tuple[int, list] | None = None
        self.update_seen = 0.0
        self.tokens = 0
        self.busy_s = self.idle_update_s = 0.0
        self.last_contact = self.last_load = 0.0
        self.stopped = False
        self.deferred: list[dict] = []  # commands that arrived while a queue request was out
        self.leaving = False
        self.until_version = 0
        self.leave_asked = 0.0
        self.aborted: set[str] = set()  # tids regenerated elsewhere: end them at their next turn boundary

    # ------------------------------------------------------------------ the loop

    def run(self) -> str:
        """Serve until ``stop`` (returns ``stop``) or, after ``leave``, until drained
        (returns ``left``: the engine is shut down, every trajectory held here is gone)."""
        backoff = Backoff(1e-4, 0.01)
        while not self.stopped:
            worked = self._commands()
            if self.stopped:
                break
            worked |= self._episodes()
            worked |= self.tools.pump()
            worked |= self._weights()
            worked |= self._tool_turns()
            worked |= self._exchange()
            if self.stopped:
                break
            note(f"rollout leader of instance {self.instance}: policy v{self.version}, "
                 f"{len(self.running)} turns decoding, {len(self.in_tools)} in tools")
            worked |= self._engine_step()
            self.sends = [r for r in self.sends if not r.Test()]
            self._load_report()
            if self.leaving and self._drained():
                return self._leave()
            if worked:
                backoff.reset()
            else:
                backoff.sleep()
        self.job.hand_over(self.sends)  # to ranks that may have stopped: the world's parting completes them
        return "stop"

    def _drained(self) -> bool:
        """Nothing of the rollout side is left here: no turn running, in tools or leased,
        no trajectory held (the instances that took their next turns pulled them), nothing
        to report or send, and the last policy posted to this leader taken."""
        return not (self.running or self.in_tools or self.parked or self.live or self.outbox or self.reports
                    or self.sends or self.update is not None or self.version < self.until_version)

    def _leave(self) -> str:
        self.engine.shutdown()
        self.job.report({"op": "left", "instance": self.instance, "version": self.version,
                         "drain_s": round(time.perf_counter() - self.leave_asked, 3)})
        return "left"

    def _commands(self) -> bool:
        worked = False
        while self.deferred or (message := self.comm.improbe(source=CONTROLLER, tag=COMMAND)) is not None:
            command = self.deferred.pop(0) if self.deferred else message.recv()
            worked = True
            op = command["op"]
            if op == "route":
                trajectory = self.outbox.pop(command["tid"])
                payload = {"tid": command["tid"], "trajectory": trajectory.to_dict(), "replica": command["replica"],
                           "forward": command.get("forward", [])}
                self.sends += [self.data.isend(payload, dest=r, tag=TRAJECTORY) for r in command["dest"]]
            elif op == "abort":
                self.aborted.update(command["tids"])
            elif op == "eval":
                self.job.report(self._evaluate(command))
            elif op == "roles":  # a relayout elsewhere: where each instance's leader is now
                self.job.roles = command["roles"]
            elif op == "leave":  # the hybrid pool is lent to training: drain, then hand over the GPUs
                self.leaving, self.until_version = True, command["until_version"]
                self.leave_asked = time.perf_counter()
            elif op == "stop":
                self._drain_weights(command.get("version", 0))
                self.stopped = True
                return True
            else:
                raise ValueError(f"rank {self.rank} (rollout leader of instance {self.instance}): unknown command "
                                 f"{op!r}")
        return worked

    # ------------------------------------------------------------------ trajectories between leaders

    def _episodes(self) -> bool:
        from mpi4py import MPI

        worked = False
        status = MPI.Status()
        while (message := self.data.improbe(source=MPI.ANY_SOURCE, tag=EPISODE_ASK, status=status)) is not None:
            tid = message.recv()
            worked = True
            episode = self.live.pop(tid, None)
            if episode is None:
                raise RuntimeError(f"rank {self.rank}: rank {status.Get_source()} asked for trajectory {tid}, "
                                   "which is not held here")
            self.sends.append(self.data.isend(episode.state(), dest=status.Get_source(), tag=EPISODE))
        while (message := self.data.improbe(source=MPI.ANY_SOURCE, tag=EPISODE)) is not None:
            state = message.recv()
            worked = True
            episode = LiveEpisode.from_state(self.task, state)
            episode.migrations += 1
            self.live[episode.tid] = episode
            self.asked.discard(episode.tid)
        return worked

    # ------------------------------------------------------------------ weights

    def _drain_weights(self, version: int, timeout_s: float = 30.0) -> None:
        """Before this rank exits: receive the policies posted to it up to ``version`` (not
        loaded), so that no trainer's send to it is left unmatched; a run stopped mid-way
        (Slurm's time-limit warning) may still have one on the way."""
        have = max(self.version, self.update[0] if self.update is not None else 0)
        deadline = time.monotonic() + timeout_s
        while have < version and time.monotonic() < deadline:
            arrived = self.weights.poll()
            if arrived is not None:
                have = max(have, arrived[0])
            else:
                time.sleep(0.005)
        if have < version:
            log.warning("rank %d: stopping without policy v%d (have v%d after %.0f s)", self.rank, version, have,
                        timeout_s)

    def _weights(self) -> bool:
        arrived = self.weights.poll()
        if arrived is not None:
            if self.update is None:
                self.update_seen = time.perf_counter()
            self.update = arrived
        if self.update is None or self.running:
            return arrived is not None
        version, tensors = self.update
        started = time.perf_counter()
        self.engine.update_weights(tensors)
        load_s = time.perf_counter() - started
        idle_s = time.perf_counter() - self.update_seen
        self.idle_update_s += idle_s
        self.version, self.update = version, None
        self.job.report({"op": "weights_taken", "instance": self.instance, "version": version,
                         "load_s": round(load_s, 4), "idle_s": round(idle_s, 4)})
        return True

    # ------------------------------------------------------------------ turns

    def _start(self, turn: dict) -> bool:
        """Start a leased turn now if it can start; False to keep it parked."""
        tid = turn["tid"]
        if tid in self.aborted and (tid in self.live or turn["prev_instance"] is None):
            self._abort(turn["lease"], tid, self.live.get(tid))
            return True
        if self.update is not None or batch_of(tid) - self.cfg.rl.max_staleness > self.version:
            return False
        episode = self.live.get(tid)
        if episode is None:
            if turn["prev_instance"] is None:
                prompt = self.job.prompts[turn["prompt_id"]]
                episode = self.live[tid] = LiveEpisode.start(self.task, prompt, tid, self.codec)
            else:
                if tid not in self.asked:
                    source = self.job.roles.leaders[turn["prev_instance"]]
                    self.sends.append(self.data.isend(tid, dest=source, tag=EPISODE_ASK))
                    self.asked.add(tid)
                return False
        self.leases[tid] = turn["lease"]
        room = self.limit - len(episode.tokens)
        if room < MIN_TURN:
            episode.episode.abandon("context")
            self._finished(episode)
            return True
        request = f"{tid}#{episode.turns}"
        self.engine.submit(request, episode.tokens, max_tokens=min(self.cfg.rollout.max_new_tokens, room),
                           temperature=self.cfg.rollout.temperature, stop_token_ids=[self.codec.im_end])
        episode.extra["version"] = self.version
        self.running[request] = episode
        return True

    def _engine_step(self) -> bool:
        if not self.running:
            return False
        started = time.perf_counter()
        finished = self.engine.step()
        self.busy_s += time.perf_counter() - started
        for request, generation in finished:
            episode = self.running.pop(request)
            episode.add_turn(list(generation.tokens), list(generation.logprobs), episode.extra["version"])
            self.tokens += len(generation.tokens)
            ids = generation.tokens
            text = self.codec.decode(ids[:-1] if ids and ids[-1] == self.codec.im_end else ids)
            calls_before = self.tools.calls
            episode.pending = episode.episode.begin(text, self.tools)
            episode.tool_calls += self.tools.calls - calls_before
            episode.tool_started = time.perf_counter()
            self.in_tools[episode.tid] = episode
        return True

    def _tool_turns(self) -> bool:
        done = [e for e in self.in_tools.values() if e.pending.ready() or time.monotonic() >= e.pending.deadline]
        for episode in done:
            del self.in_tools[episode.tid]
            result = episode.episode.finish(episode.pending)
            episode.pending = None
            episode.tool_s += time.perf_counter() - episode.tool_started
            episode.tool_failures += sum(r.status == "failure" for r in result.returns)
            episode.tool_timeouts += sum(r.status == "timeout" for r in result.returns)
            if episode.tid in self.aborted:
                self._abort(self.leases.pop(episode.tid), episode.tid, episode)
                continue
            if result.done or not episode.add_observation(result.observation, self.codec, self.limit):
                self._finished(episode)
                continue
            first = result.returns[0]
            self.reports.append({"op": "tool_return", "lease": self.leases.pop(episode.tid), "tool": first.tool,
                                 "output": first.output, "exit_code": None,
                                 "timed_out": any(r.status == "timeout" for r in result.returns),
                                 "tokens": episode.turn_tokens})
        return bool(done)

    def _abort(self, lease: int, tid: str, episode: LiveEpisode | None) -> None:
        """End regenerated trajectory ``tid`` here: its lease closed with the queue, its
        state and sandbox gone, and the controller told how many tokens it had generated
        (none when it never started)."""
        self.aborted.discard(tid)
        self.reports.append({"op": "finish", "lease": lease, "tokens": 0})
        self.live.pop(tid, None)
        generated = 0
        if episode is not None:
            self.tools.end_trajectory(episode.episode.trajectory)
            generated = sum(episode.generated)
        self.job.report({"op": "aborted", "tid": tid, "instance": self.instance, "gen_tokens": generated,
                         "turns": 0 if episode is None else episode.turns})

    def _finished(self, episode: LiveEpisode) -> None:
        tid = episode.tid
        self.reports.append({"op": "finish", "lease": self.leases.pop(tid), "tokens": episode.turn_tokens})
        self.live.pop(tid, None)
        self.tools.end_trajectory(episode.episode.trajectory)
        trajectory = episode.trajectory()
        self.outbox[tid] = trajectory
        generated = [v for v, g in zip(trajectory.versions, trajectory.generated) if g]
        self.job.report({"op": "traj", "tid": tid, "instance": self.instance, "reward": trajectory.reward,
                         "tokens": len(trajectory.tokens), "gen_tokens": len(generated), "turns": episode.turns,
                         "prompt_tokens": next((i for i, g in enumerate(trajectory.generated) if g),
                                               len(trajectory.tokens)),
                         "tool_calls": episode.tool_calls, "tool_s": round(episode.tool_s, 4),
                         "active_s": round(time.time() - episode.started, 4),
                         "tool_failures": episode.tool_failures, "tool_timeouts": episode.tool_timeouts,
                         "migrations": episode.migrations, "finish_reason": trajectory.finish_reason,
                         "min_version": min(generated, default=self.version),
                         "max_version": max(generated, default=self.version)})

    def _exchange(self) -> bool:
        """Reports out and more turns in, in one queue request."""
        now = time.perf_counter()
        self.parked = [t for t in self.parked if not self._start(t)]
        room = 0 if self.update is not None or self.leaving else max(
            0, self.cfg.scheduler.max_batch * 2 - len(self.running) - len(self.parked))
        if not self.reports and (self.leaving or (not room and now - self.last_contact < HEARTBEAT_S)):
            return False
        requests = list(self.reports)
        if not self.leaving:  # a leaving instance only reports (an ask or a heartbeat would be refused work)
            requests.append({"op": "ask", "instance": self.instance, "max": min(room, self.cfg.scheduler.max_batch)}
                            if room else {"op": "heartbeat", "instance": self.instance})
        self.reports = []
        self.last_contact = now
        replies = self._request({"op": "batch", "requests": requests})
        if replies is None:
            return True  # the controller said stop while the request was out
        for request, reply in zip(requests, replies):
            if not reply.get("ok"):
                log.warning("rank %d: queue refused %s: %s", self.rank, request["op"], reply.get("error"))
        turns = replies[-1].get("turns", []) if requests[-1]["op"] == "ask" else []
        for turn in turns:
            if not self._start(turn):
                self.parked.append(turn)
        return bool(turns) or len(requests) > 1

    def _request(self, message: dict) -> list[dict] | None:
        """One queue round trip that still hears the controller: a ``stop`` sent while
        the request is out (the controller's loop ended) stops this leader instead of
        leaving it waiting for a reply that will not come. Other commands wait their turn."""
        from libra_hpc.cluster.messages import QUEUE_REPLY, QUEUE_REQUEST

        self.comm.send(message, dest=CONTROLLER, tag=QUEUE_REQUEST)
        backoff = Backoff(2e-5, 0.005)
        while True:
            reply = self.comm.improbe(source=CONTROLLER, tag=QUEUE_REPLY)
            if reply is not None:
                answer = reply.recv()
                if not answer.get("ok"):
                    raise RuntimeError(f"rank {self.rank}: the queue refused a batch: {answer.get('error')}")
                return answer["replies"]
            command = self.comm.improbe(source=CONTROLLER, tag=COMMAND)
            if command is not None:
                payload = command.recv()
                if payload["op"] == "stop":
                    self._drain_weights(payload.get("version", 0))
                    self.stopped = True
                    return None
                self.deferred.append(payload)
            backoff.sleep()

    def _load_report(self) -> None:
        now = time.perf_counter()
        if now - self.last_load < LOAD_REPORT_S:
            return
        self.last_load = now
        kv = self.engine.stats().kv_usage if hasattr(self.engine, "stats") else None
        self.job.report({"op": "load", "instance": self.instance, "tokens": self.tokens, "busy_s": round(self.busy_s, 4),
                         "running": len(self.running), "in_tools": len(self.in_tools), "kv_usage": kv,
                         "idle_update_s": round(self.idle_update_s, 4), "version": self.version})

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, command: dict) -> dict:
        from libra_hpc.rl.rollout import evaluate

        prompts = [self.job.heldout[i] for i in command["indices"]]
        started = time.perf_counter()
        result = evaluate(self.engine, self.task, prompts, self.tools, self.codec, tag=f"eval-{command['phase']}",
                          max_turn_tokens=self.cfg.rollout.max_new_tokens)
        return {"op": "eval", "phase": command["phase"], "instance": self.instance, "version": self.version,
                "rewards": [t.reward for t in result.trajectories], "pids": [p.pid for p in prompts],
                "tool_calls": [sum(len(returns) for _, returns in e.turns) for e in result.episodes],
                "format_valid": result.format_valid, "wall_s": round(time.perf_counter() - started, 3)}
