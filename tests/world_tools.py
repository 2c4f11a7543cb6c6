"""MPI world for tests/test_runtime_tools.py: rank 0 serves tool actions on the
controller's event loop (ToolService over a Tangram orchestrator with real sandboxes),
rank 1 is a rollout leader's ToolProxy. Rank 1 sends a tool that hangs, a good one, a
request with fields missing and one that does not unpickle; it prints one JSON line
of what came back and how long each took."""

from __future__ import annotations

import json
import pickle
import sys
import time

from mpi4py import MPI

from libra_hpc.cluster.messages import TOOL_REQUEST, Outbox
from libra_hpc.config import ToolsConfig
from libra_hpc.runtime.loop import EventLoop
from libra_hpc.runtime.tools import RemoteFuture, ToolProxy, ToolService
from libra_hpc.tools.orchestrator import orchestrator_from_config

comm = MPI.COMM_WORLD
wall = float(sys.argv[1])
if comm.rank == 0:
    orchestrator = orchestrator_from_config(ToolsConfig(wall_time_s=wall, max_workers=2))
    service = ToolService(Outbox(comm), orchestrator)
    loop = EventLoop(comm)
    service.attach(loop)
    done = []
    loop.on(7001, lambda message, source: done.append(message), name="done")
    loop.run(stop_when=lambda: bool(done))
    orchestrator.close()
    print("SERVICE " + json.dumps({"calls": service.calls, "failures": service.failures, "by_tool": service.by_tool,
                                   "bad_payloads": loop.counters["bad_payloads"]}), flush=True)
else:
    proxy = ToolProxy(comm, 1)
    out = {}

    def outcome(future, timeout):
        started = time.monotonic()
        try:
            value = future.result(timeout=timeout)
            return {"ok": True, "value": str(value)[:300], "s": round(time.monotonic() - started, 2)}
        except Exception as exc:  # noqa: BLE001 - what the episode would read
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "s": round(time.monotonic() - started, 2)}

    hang = proxy.submit("t0", "python", "cpu", {"code": "import time\nwhile True: time.sleep(1)", "tool": "python"})
    good = proxy.submit("t1", "python", "cpu", {"code": "print(6 * 7)", "tool": "python"})
    out["hang"] = outcome(hang, wall * 10)
    out["good"] = outcome(good, wall * 10)
    comm.send({"op": "run", "id": 999}, dest=0, tag=TOOL_REQUEST)  # no tool, no payload
    missing = RemoteFuture(proxy)
    proxy._waiting[999] = (missing, time.monotonic(), "?")  # as if submit() had sent it
    out["missing"] = outcome(missing, wall * 5)
    comm.Send([pickle.dumps({"op": "run"})[:-3], MPI.BYTE], dest=0, tag=TOOL_REQUEST)  # does not unpickle
    after = proxy.submit("t2", "python", "cpu", {"code": "print('still served')", "tool": "python"})
    out["after_garbage"] = outcome(after, wall * 10)
    comm.send({}, dest=0, tag=7001)
    print("CLIENT " + json.dumps(out), flush=True)
