"""Tool calls of every rollout leader run on one shared pool: the controller's Tangram
orchestrator (:mod:`libra_hpc.tools.orchestrator`), action by action.

Leader side, :class:`ToolProxy`: the executor an :class:`~libra_hpc.envs.task.Episode`
submits to. ``submit`` sends the action to the controller (tag ``TOOL_REQUEST``) and
returns a :class:`RemoteFuture`; results come back with tag ``TOOL_RESULT`` and are
matched by action id whenever the leader :meth:`ToolProxy.pump`\\ s, which its loop does
between engine steps and which a waiting ``RemoteFuture.result`` does itself (so the
synchronous held-out evaluation, :func:`libra_hpc.rl.rollout.evaluate`, runs through
the same pool).

Controller side, :class:`ToolService`: a handler of rank 0's event loop. It submits each
action to the orchestrator; the orchestrator's threads finish it and queue the result,
and the loop sends the queued results out (a timer, so that the loop thread alone talks
MPI). A tool that hangs is cut by its sandbox's wall time, and the episode stops waiting
at ``Task.call_timeout_s`` (the model reads a timeout); a runner's error is the action's
result, never the controller's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from libra_hpc.cluster.messages import TOOL_REQUEST, TOOL_RESULT

log = logging.getLogger(__name__)
CONTROLLER = 0
RUN_FIELDS = ("id", "trajectory", "tool", "resource", "payload")


class RemoteFuture(Future):
    """A tool action running at the controller; waiting on it pumps the proxy."""

    def __init__(self, proxy: ToolProxy):
        super().__init__()
        self._proxy = proxy

    def done(self) -> bool:
        if not super().done():
            self._proxy.pump()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not super().done():
            if deadline is not None and time.monotonic() >= deadline:
                raise FutureTimeout()
            if not self._proxy.pump():
                time.sleep(0.002)
        return super().result(0)


class ToolProxy:
    """The executor of one rollout leader: actions go to the controller's pool."""

    def __init__(self, comm: Any, rank: int):
        self.comm, self.rank = comm, rank
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[RemoteFuture, float, str]] = {}
        self.calls = 0
        self.seconds = 0.0

    def submit(self, trajectory: str, tool: str, resource: str, payload: Any) -> Future:
        aid = next(self._ids)
        future = RemoteFuture(self)
        self._waiting[aid] = (future, time.monotonic(), tool)
        self.comm.send({"op": "run", "id": aid, "trajectory": trajectory, "tool": tool, "resource": resource,
                        "payload": payload}, dest=CONTROLLER, tag=TOOL_REQUEST)
        self.calls += 1
        return future

    def end_trajectory(self, trajectory: str) -> None:
        self.comm.send({"op": "end", "trajectory": trajectory}, dest=CONTROLLER, tag=TOOL_REQUEST)

    def pump(self) -> bool:
        """Take every result that arrived; whether there was any."""
        got = False
        while (message := self.comm.improbe(source=CONTROLLER, tag=TOOL_RESULT)) is not None:
            reply = message.recv()
            got = True
            entry = self._waiting.pop(reply["id"], None)
            if entry is None:
                log.warning("rank %d: tool result for unknown action %s dropped", self.rank, reply["id"])
                continue
            future, started, _ = entry
            self.seconds += time.monotonic() - started
            if future.cancelled():
                continue
            if reply["ok"]:
                future.set_result(reply["result"])
            else:
                future.set_exception(RuntimeError(reply["error"]))
        return got


class ToolService:
    """Rank 0's side: actions from the leaders on the orchestrator, results back through
    ``outbox`` (rank 0's :class:`~libra_hpc.cluster.messages.Outbox`: a leader inside an
    engine step takes a large result only after it)."""

    def __init__(self, outbox: Any, orchestrator: Any):
        self.outbox, self.orchestrator = outbox, orchestrator
        self._done: deque[tuple[int, dict]] = deque()
        self.calls = 0
        self.failures = 0
        self.by_tool: dict[str, int] = {}

    def attach(self, loop: Any) -> None:
        loop.on(TOOL_REQUEST, self.handle, malformed=self._malformed, name="tool_request")
        loop.every(0.005, self.flush, name="tool results", busy_after_s=0.005)

    def handle(self, request: Any, source: int) -> None:
        op = request.get("op") if isinstance(request, dict) else None
        missing = [k for k in RUN_FIELDS if k not in request] if op == "run" else [] if op == "end" else ["op"]
        if missing:  # answered when it names its action (the episode reads the error), else logged
            log.error("rank %d sent a malformed tool request (missing %s): %.200r", source, missing, request)
            if isinstance(request, dict) and "id" in request:
                self._send(source, {"id": request["id"], "ok": False,
                                    "error": f"malformed tool request from rank {source}: missing {', '.join(missing)}"})
            return
        if request["op"] == "end":
            self.orchestrator.end_trajectory(request["trajectory"])
            return
        aid, tool = request["id"], request["tool"]
        self.calls += 1
        self.by_tool[tool] = self.by_tool.get(tool, 0) + 1
        try:
            future = self.orchestrator.submit(request["trajectory"], tool, request["resource"], request["payload"])
        except Exception as exc:  # noqa: BLE001 - the action fails, the job goes on
            self._finish(source, aid, tool, None, exc)
            return
        future.add_done_callback(lambda f: self._finish(source, aid, tool, f, None))

    def _finish(self, source: int, aid: int, tool: str, future: Future | None, error: Exception | None) -> None:
        """Runs on the orchestrator's thread: only queue the reply."""
        if error is None and future is not None:
            error = future.exception()
        if error is not None:
            self.failures += 1
            log.warning("tool %s (action %d of rank %d) failed: %r", tool, aid, source, error)
            self._done.append((source, {"id": aid, "ok": False, "error": f"{tool}: {error}"}))
        else:
            self._done.append((source, {"id": aid, "ok": True, "result": future.result()}))

    def flush(self) -> bool:
        sent = False
        while self._done:
            source, reply = self._done.popleft()
            self._send(source, reply)
            sent = True
        return sent

    def _send(self, dest: int, reply: dict) -> None:
        self.outbox.send(reply, dest, TOOL_RESULT)

    def _malformed(self, source: int, exc: Exception) -> None:
        log.error("rank %d sent a tool request that does not unpickle: %r", source, exc)
