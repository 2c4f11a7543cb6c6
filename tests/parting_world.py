"""An MPI world for tests/test_parting.py: ``mpiexec -n 3 python tests/parting_world.py
SCENARIO OUT``.

``stranded`` (3 ranks): what a stop leaves behind. Rank 1 (a rollout leader) has posted a
4 MB trajectory to rank 2 (a trainer that stopped) and a small report to rank 0; rank 2 (an
export holder) has posted a 4 MB policy to rank 1 as raw bytes. No rank receives
anything. Before parting, each rank records whether its sends completed on their own (a
4 MB message goes by rendezvous: it cannot, and ``MPI_Finalize`` would wait for it); then
every rank parts. The world must then exit.

``late`` (3 ranks): rank 2 reaches the parting ``LATE_S`` after the others, who part with
a timeout shorter than that: they report an incomplete parting (a rank that never
arrives is named by the timeout, not waited on forever). Rank 2 then parts too, so the
barrier the others posted completes and the world exits.

Rank 0 writes every rank's result as JSON to OUT/result.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from libra_hpc.cluster.parting import part

BIG = 4 << 20
LATE_S = 3.0
SHORT_TIMEOUT_S = 0.5


def stranded(comm, data) -> dict:
    rank = comm.Get_rank()
    pending, keep = [], []
    if rank == 1:
        pending.append(data.isend({"tokens": list(range(BIG // 8))}, dest=2, tag=11))
        pending.append(comm.isend({"op": "finish"}, dest=0, tag=12))
    if rank == 2:
        array = np.full(BIG, 7, dtype=np.uint8)
        keep.append(array)
        pending.append(data.Isend(array, dest=1, tag=13))
    time.sleep(0.5)  # nobody receives: a rendezvous send cannot complete
    before = bool(MPI.Request.Testall(pending)) if pending else True
    parting = part(comm, [comm, data], pending, timeout_s=60)
    return {"rank": rank, "sent_before": before, "complete": parting.complete,
            "dropped": {str(k): v for k, v in parting.dropped.items()}, "after": MPI.Request.Testall(pending)}


def late(comm, data) -> dict:
    rank = comm.Get_rank()
    if rank == 2:
        time.sleep(LATE_S)
        parting = part(comm, [comm, data], [], timeout_s=60)
    else:
        parting = part(comm, [comm, data], [], timeout_s=SHORT_TIMEOUT_S)
    return {"rank": rank, "complete": parting.complete, "line": parting.line()}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    comm = MPI.COMM_WORLD
    data = comm.Dup()
    mine = {"stranded": stranded, "late": late}[scenario](comm, data)
    if scenario == "late" and comm.Get_rank() != 2:
        time.sleep(LATE_S + 1)  # the late rank enters the barrier the others posted before it ends
    results = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))
    data.Free()


if __name__ == "__main__":
    main()
