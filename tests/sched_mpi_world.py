"""An MPI world for tests/test_sched_mpi.py: ``mpiexec -n 3 python tests/sched_mpi_world.py``.

Rank 0 serves the queue; rank 1 is rollout instance 0 (bucket tp1: first turns), rank 2
instance 1 (bucket tp4: every later turn, so each multi-turn trajectory migrates across
ranks). Rank 1 sends a non-dict request and reports each batch of turns in one batch
request; rank 2 sends raw bytes that do not unpickle, sits on its first batch of turns
until their leases expire (then reports them late: they were re-queued and are done
again) and repeats its first finish. Rank 0 writes a JSON summary (what it saw, and each
client's refusals, gathered over MPI) to the file named by the first argument: the
ranks' interleaved stdout is not a channel to parse.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent))
from test_sched_service import StubRouter

from libra_hpc.cluster.messages import QUEUE_REQUEST
from libra_hpc.runtime.loop import serve_queue
from libra_hpc.scheduler.mpi_service import QueueClient, QueueError
from libra_hpc.scheduler.service import QueueService
from libra_hpc.scheduler.types import BucketSpec

BUCKETS = (BucketSpec("tp1", 1, 1024, (0,)), BucketSpec("tp4", 4, 1 << 30, (1,)))
TRAJECTORIES = 12
LEASE_S = 1.0


def tool_returns(tid: str) -> int:
    return int(tid[1:]) % 3 + 1


def tokens(tid: str, turn: int) -> int:
    return 10 * (turn + 1) + int(tid[1:])


def first_turn_report(turn: dict) -> dict:
    assert turn["turn"] == 0 and tool_returns(turn["tid"]) > 0
    return {"op": "tool_return", "lease": turn["lease"], "tool": "python", "output": "Error: x", "exit_code": 0,
            "timed_out": False, "tokens": tokens(turn["tid"], 0)}


def server(comm, out: Path) -> None:
    service = QueueService(StubRouter(BUCKETS), lease_s=LEASE_S, max_batch=4, size_thresholds=[256, 4096],
                           error_markers=["Error:"])
    for i in range(TRAJECTORIES):
        service.submit(f"t{i}", f"p{i % 2}")
    saves = []
    transport = serve_queue(comm, service, save=lambda: saves.append(service.stats()["completed"]), save_every_s=0.2)
    records = service.drain_finished()
    completed = sorted(r.tid for r in records)
    wrong = [r.tid for r in records
             if r.turn_tokens != tuple(tokens(r.tid, d) for d in range(tool_returns(r.tid) + 1))]
    stats = service.stats()
    clients = comm.gather(None)[1:]
    out.write_text(json.dumps({
        "completed": completed, "unique": len(set(completed)), "wrong_tokens": wrong, "stats": stats,
        "transport": transport, "saves": len(saves), "audit": service.audit(),
        "requeues": sum(r.requeues for r in records), "clients": clients}))


def client(comm, clients) -> None:
    rank = comm.Get_rank()
    instance = rank - 1
    queue = QueueClient(comm)
    refused: dict[str, int] = {}

    def report(call, *args, **kw):
        try:
            return call(*args, **kw)
        except QueueError as exc:
            refused[exc.reason] = refused.get(exc.reason, 0) + 1
            return None

    if rank == 1:
        report(queue.request, ["not", "a", "dict"])
    else:
        comm.Send(bytearray(b"\x80\x05garbage"), dest=0, tag=QUEUE_REQUEST)
        reply = comm.recv(source=0)
        refused[reply["reason"]] = refused.get(reply["reason"], 0) + 1
    repeated = abandoned = False
    while True:
        reply = queue.request({"op": "ask", "instance": instance, "max": 3})
        if not reply["turns"]:
            if reply["active"] == 0:
                break
            time.sleep(0.002)
            continue
        if rank == 1:  # first turns only (all end in a tool call): one message for the whole batch
            for answer in queue.batch([first_turn_report(turn) for turn in reply["turns"]]):
                if not answer["ok"]:
                    refused[answer["reason"]] = refused.get(answer["reason"], 0) + 1
            continue
        for turn in reply["turns"]:
            tid, lease = turn["tid"], turn["lease"]
            if rank == 2 and not abandoned:  # pretend this instance hung on this turn
                abandoned = True
                time.sleep(LEASE_S * 1.5)
                report(queue.finish, lease, tokens=1)
                continue
            if turn["turn"] < tool_returns(tid):
                report(queue.tool_return, lease, tool="python", output="ok" if turn["turn"] else "Error: x",
                       tokens=tokens(tid, turn["turn"]))
            else:
                report(queue.finish, lease, tokens(tid, turn["turn"]))
                if not repeated and rank == 2:
                    repeated = True
                    report(queue.finish, lease, tokens(tid, turn["turn"]))
    assert queue.heartbeat(instance) == 0
    clients.Barrier()
    if rank == 1:
        queue.shutdown()
    comm.gather(refused)


def main() -> None:
    comm = MPI.COMM_WORLD
    clients = comm.Split(MPI.UNDEFINED if comm.Get_rank() == 0 else 1, comm.Get_rank())
    if comm.Get_rank() == 0:
        server(comm, Path(sys.argv[1]))
    else:
        client(comm, clients)
        clients.Free()


if __name__ == "__main__":
    main()
