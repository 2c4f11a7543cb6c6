"""Tool sandboxes on other nodes, started through Slurm (``tools.placement: slurm``).

On a cluster the controller's node has few cores to spare for thousands of tool calls a
minute. With this runner each unit of the ``cpu`` pool is a worker process
(libra_hpc/tools/worker.py) that ``srun`` starts on some node and that runs the calls it is
sent in its own sandbox there:

- ``tools.slurm_partition`` set: ``srun --partition=P`` asks for an allocation of its own
  per unit on that (CPU) partition, so sandboxes never take cores from the GPU job;
- unset: the worker runs as a step of the current job (``--overlap``), on a core of the
  job's own nodes.

A unit's worker is started when the pool first dispatches to it and stopped when the pool
retires the unit (idle for ``tools.idle_timeout_s``) or the orchestrator closes: an idle
pool gives its Slurm allocations back. A worker that dies, or does not answer within the
call's wall time plus ``reply_margin_s``, fails that call with an error naming the unit,
its node and the tail of the worker's stderr; the next call on the unit starts a new worker.
A call whose processes survived SIGKILL on the worker's node raises
:class:`~libra_hpc.tools.procs.SlotLeak`, so the orchestrator quarantines the unit as it does
a local one.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from libra_hpc.tools.procs import SlotLeak
from libra_hpc.tools.sandbox import ToolResult
from libra_hpc.tools.worker import result_from_json

log = logging.getLogger(__name__)


class RemoteToolError(RuntimeError):
    """A remote tool worker failed to start, died, or broke the protocol."""


def srun_argv(worker: Sequence[str], *, partition: str = "", cpus: int = 1, time_limit: str = "",
              extra: Sequence[str] = (), job_name: str = "libra-tools") -> list[str]:
    """The ``srun`` command line that starts one worker (pure). ``partition`` empty: a step
    of the current allocation, sharing its CPUs with the running MPI step (``--overlap``)."""
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", f"--job-name={job_name}",
            "--kill-on-bad-exit=1", "--unbuffered"]
    argv += [f"--partition={partition}"] if partition else ["--overlap"]
    if time_limit:
        argv.append(f"--time={time_limit}")
    return argv + list(extra) + list(worker)


class _Worker:
    """One started worker: its process, a reader thread per output stream."""

    def __init__(self, unit: int, argv: Sequence[str], start_timeout_s: float):
        self.unit = unit
        self.node = "?"
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: deque[str] = deque(maxlen=20)
        self._pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put, True), daemon=True),
                       threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append, False),
                                        daemon=True)]
        for pump in self._pumps:
            pump.start()
        hello = self.receive(start_timeout_s, "start")
        self.node = hello.get("node", "?")
        if not hello.get("ready"):
            self.stop()
            raise RemoteToolError(f"tool worker for unit {unit}: {hello.get('error', hello)}")
        log.info("tool worker for unit %d ready on %s (%s)", unit, self.node, hello.get("isolation"))

    @staticmethod
    def _pump(stream, put: Callable[[Any], None], mark_end: bool) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        if mark_end:
            put(None)  # end of stdout: the worker is gone

    def receive(self, timeout_s: float, what: str) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise RemoteToolError(self.why(f"no {what} reply within {timeout_s:g} s")) from None
        if line is None:
            self.stop()
            raise RemoteToolError(self.why(f"worker exited (status {self.proc.poll()}) before its {what} reply"))
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            self.stop()
            raise RemoteToolError(self.why(f"sent a line that is not JSON: {line[:200]!r}")) from None
        if not isinstance(message, dict):
            self.stop()
            raise RemoteToolError(self.why(f"sent {type(message).__name__}, not a JSON object"))
        return message

    def why(self, what: str) -> str:
        tail = " | ".join(self.stderr) or "(empty)"
        return f"tool worker for unit {self.unit} on node {self.node}: {what}; its stderr: {tail}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """End of input (the worker releases its slot and exits); then SIGTERM, then SIGKILL
        to what is left (srun, or the worker when started directly)."""
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            if sig is not None:  # SIGTERM first: srun forwards it and ends the step on the node
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        for pump in self._pumps:  # what it wrote last, its stderr included, is read by now
            pump.join(timeout=1.0)


class SlurmSandboxRunner:
    """Runner of the ``cpu`` resource whose units are remote workers. ``argv``: the command
    that starts one unit's worker, the same for every unit (:func:`srun_argv` around
    ``python -m libra_hpc.tools.worker SPEC``; tests may start the worker directly).
    ``wall_time_s``: the calls' wall-time limit; a reply is awaited ``reply_margin_s``
    longer. Payloads as :class:`~libra_hpc.tools.orchestrator.SandboxRunner`'s."""

    def __init__(self, argv: Sequence[str], *, wall_time_s: float, reply_margin_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        self._argv = list(argv)
        self._reply_timeout_s = wall_time_s + reply_margin_s
        self._start_timeout_s = start_timeout_s
        self._workers: dict[int, _Worker] = {}
        self._stopping: list[threading.Thread] = []  # workers of retired units, on their way out
        self._lock = threading.Lock()

    def nodes(self) -> dict[int, str]:
        """Unit → node of its live worker."""
        with self._lock:
            return {unit: w.node for unit, w in self._workers.items() if w.alive()}

    def run(self, unit: int, payload: Any) -> ToolResult:
        request = _request(payload)
        worker = self._worker(unit)
        try:
            worker.proc.stdin.write(json.dumps(request) + "\n")
            worker.proc.stdin.flush()
        except OSError as exc:
            self._forget(unit, worker)
            raise RemoteToolError(worker.why(f"could not send the call: {exc}")) from None
        try:
            reply = worker.receive(self._reply_timeout_s, "call")
        except RemoteToolError:
            self._forget(unit, worker)
            raise
        if not reply.get("ok"):
            if reply.get("leak"):  # the orchestrator quarantines the unit, as for a local slot
                self._forget(unit, worker)
                worker.stop()
                raise SlotLeak(worker.why(str(reply.get("error"))))
            if not worker.alive():
                self._forget(unit, worker)
            raise RemoteToolError(worker.why(f"call refused: {reply.get('error', reply)}"))
        try:
            return result_from_json(reply["result"])
        except (KeyError, TypeError) as exc:
            self._forget(unit, worker)
            worker.stop()
            raise RemoteToolError(worker.why(f"malformed result {exc!r}")) from None

    def release(self, unit: int) -> None:
        """The pool retired ``unit``: stop its worker (its Slurm allocation or step ends).
        Returns at once (the orchestrator calls it under its lock); the worker is
        forgotten now, so a call that reuses the unit number starts a new one."""
        with self._lock:
            worker = self._workers.pop(unit, None)
        if worker is not None:
            log.info("tool worker for unit %d on %s stopping (unit retired)", unit, worker.node)
            stopping = threading.Thread(target=worker.stop, daemon=True, name=f"stop-tool-worker-{unit}")
            stopping.start()
            with self._lock:
                self._stopping = [t for t in self._stopping if t.is_alive()] + [stopping]

    def close(self) -> None:
        """Stop every worker; returns once all are gone."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
            stopping, self._stopping = self._stopping, []
        for worker in workers:
            worker.stop()
        for thread in stopping:
            thread.join()

    def _worker(self, unit: int) -> _Worker:
        with self._lock:
            worker = self._workers.get(unit)
            if worker is not None and worker.alive():
                return worker
            self._workers.pop(unit, None)
        worker = _Worker(unit, self._argv, self._start_timeout_s)  # may take long (queueing): unlocked
        with self._lock:
            self._workers[unit] = worker
        return worker

    def _forget(self, unit: int, worker: _Worker) -> None:
        with self._lock:
            if self._workers.get(unit) is worker:
                del self._workers[unit]


def _request(payload: Any) -> dict:
    """The worker request of a runner payload (a Python source string, ``{"code": ...}`` or
    ``{"argv": [...]}``, each with an optional ``"tool"``)."""
    if isinstance(payload, str):
        return {"code": payload, "tool": "python"}
    if isinstance(payload, dict) and "argv" in payload:
        return {"argv": list(payload["argv"]), "tool": payload.get("tool", "shell")}
    if isinstance(payload, dict) and "code" in payload:
        return {"code": payload["code"], "tool": payload.get("tool", "python")}
    raise ValueError(f"tool payload must be code (str) or a dict with 'code' or 'argv', got {payload!r:.200}")
