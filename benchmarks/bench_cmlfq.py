"""C-MLFQ queue service and routing: throughput, latency, cost and quality.

    python benchmarks/bench_cmlfq.py [--clients 4] [--repeats 3] [--client-poll-s 0]

In-process (no MPI, best of 3): the routing cost of ``CmlfqRouter.place`` after tool
returns, the learning cost of ``observe`` per finished trajectory, the QueueService loop
with asks, tool returns and finishes (tree updates included), the rebuild of a causal
index from 10,000 trajectories, and routing quality (bucket accuracy of cmlfq against always
keeping the top level). The workload is the shared synthetic one (libra_hpc/envs/synthetic.py)
of the scenario configs/sim/cmlfq-premise.yaml, on which C-MLFQ's premise holds (tool returns
say how much work is left), seen as the router sees it (libra_hpc/scheduler/synthetic.py);
routing quality is also measured on the paper's SWE scenario (configs/sim/a800-swe.yaml),
on which it does not.

Under MPI (the script re-launches itself with ``mpiexec -n clients+1``): rank 0 serves
in its event loop (``libra_hpc/runtime/loop.py``) as the job runs it: the queue's
handler with the control (REPORT) and tool-completion (TOOL_DONE) handlers registered
beside it (no traffic on those here, but the loop probes for every tag); the raw phase
runs :func:`~libra_hpc.runtime.loop.serve_queue` (the loop with one handler) over an
empty service. The clients act as rollout instance leaders. Each client stands for the
leaders of one instance per bucket (a node's engines): every round it reports the turns
of its last engine step and asks for every instance, its own first, so that no bucket's
share of the work idles a client.
Phases, interleaved and repeated (best of each, so that a neighbour's load burst cannot
favour one side of the ratio):

- raw: an empty server (same transport, a constant reply) answering one small request
  at a time, with the same clients, and again with clients spinning in MPI's receive;
  the better of the two is the transport's limit (``raw_msgs_per_s``);
- batched (the headline): a round is one message with the batch op, as the client
  library is meant to be used by an engine that finishes many turns per step;
- single (once): one request per report and per ask.

A decision is a tool_return answered with a placement; its latency is the client's
round trip. Tool returns are classified by the clients (the worker-classified report),
before the clocks start: each client only copies its report and adds the lease.
Clients wait for replies as ``--client-poll-s``/``--client-spin-s`` say. The default
probes and yields the core between probes: with ``--pin`` (default) the server rank has a
core to itself and the clients share the others, as a controller rank would on a node,
and clients that share a core must yield it to each other (4 clients spinning in MPI's
receive on one core starve the ones with a batch to build: the server then idles 60% of
the service phase; clients that sleep between probes add the sleep to every round trip).
The raw phases run the same way. Whether the scheduler ran compiled (``pip install -e .``
builds it, libra_hpc/_compiled.py) is printed. The server's time answering per decision
and its CPU share are reported too. Prints a table; the last line is one JSON object with
the headline figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from libra_hpc import _compiled
from libra_hpc.scheduler.routers import make_router
from libra_hpc.scheduler.service import QueueService
from libra_hpc.scheduler.synthetic import (
    default_buckets,
    evaluate_routing,
    generate,
    split_by_sample,
)
from libra_hpc.scheduler.types import TrajectoryView
from libra_hpc.sim.config import load_sim_config

THRESHOLDS, MARKERS = [256, 4096], ["Traceback (most recent call last)", "Error:"]
SEED = 0
ROOT = Path(__file__).resolve().parents[1]
SCENARIO, PAPER_SCENARIO = ROOT / "configs/sim/cmlfq-premise.yaml", ROOT / "configs/sim/a800-swe.yaml"


def workload(n_prompts: int, scenario: Path = SCENARIO):
    """``n_prompts × 16`` trajectories of the scenario's synthetic workload, their tool
    returns classified with the service's thresholds and markers (by the worker where the
    tool ran: the worker-classified report)."""
    cfg = load_sim_config(scenario)
    return generate(cfg.workload, n_prompts, 16, SEED, seq_len=cfg.training.seq_len, size_thresholds=THRESHOLDS,
                    error_markers=MARKERS)


def cmlfq(buckets, rebuild_every=1000):
    return make_router("cmlfq", buckets, window=256, min_samples=8, rebuild_every=rebuild_every)


def trained_router(buckets, train):
    router = cmlfq(buckets)
    for trajectory in train:
        router.observe(trajectory.finished())
    return router


def report_of(trajectory, turn: int) -> dict:
    """The protocol report of ``turn`` of a synthetic trajectory (lease left out). A tool
    return is reported classified (the worker-classified form: the output stays on the
    worker, :func:`workload` classified it)."""
    if turn == len(trajectory.states):
        return {"op": "finish", "tokens": trajectory.turns[turn]}
    state = trajectory.states[turn]
    return {"op": "tool_return", "tool": state.tool, "size": state.size, "status": state.status,
            "tokens": trajectory.turns[turn]}


def new_service(router):
    return QueueService(router, lease_s=60.0, max_batch=16, size_thresholds=THRESHOLDS, error_markers=MARKERS)


# -------------------------------------------------------------------- in-process

def bench_route_us(train, test, buckets) -> float:
    router = trained_router(buckets, train)
    # Per-turn tokens as the service passes them, so the timing includes conditioning a
    # shallower node on the tokens generated since it.
    views = [TrajectoryView(t.tid, t.prompt_id, t.states[:d], sum(t.turns[:d]), "tp1", None, tuple(t.turns[:d]))
             for t in test for d in range(1, len(t.turns))]
    start = time.perf_counter()
    for view in views:
        router.place(view)
    return (time.perf_counter() - start) / len(views) * 1e6


def bench_observe_us(train, test, buckets, rebuild_every: int) -> float:
    router = cmlfq(buckets, rebuild_every)
    for trajectory in train:
        router.observe(trajectory.finished())
    finished = [t.finished() for t in test]
    start = time.perf_counter()
    for f in finished:
        router.observe(f)
    return (time.perf_counter() - start) / len(finished) * 1e6


def bench_loop(train, work, buckets) -> dict:
    """Submit in waves, then asks, tool returns and finishes until every trajectory is done."""
    service = new_service(trained_router(buckets, train))
    by_tid = {t.tid: t for t in work}
    instances = [i for b in buckets for i in b.instances]
    now, wave = 0.0, 2000
    start = time.perf_counter()
    for first in range(0, len(work), wave):
        for t in work[first:first + wave]:
            service.submit(t.tid, t.prompt_id)
        while service.stats()["active"]:
            for instance in instances:
                reply = service.handle({"op": "ask", "instance": instance, "max": 16}, now)
                for turn in reply["turns"]:
                    message = report_of(by_tid[turn["tid"]], turn["turn"])
                    message["lease"] = turn["lease"]
                    assert service.handle(message, now)["ok"]
            now += 0.001
    elapsed = time.perf_counter() - start
    stats = service.stats()
    assert stats["completed"] == len(work)
    return {"loop_decisions_per_s": stats["decisions"] / elapsed, "loop_s": elapsed, "loop_decisions": stats["decisions"],
            "loop_migrations": stats["migrations"]}


def bench_rebuild(trajectories, buckets) -> float:
    router = cmlfq(buckets, rebuild_every=10_000)
    for t in trajectories[:10_000]:
        router.observe(t.finished())
    start = time.perf_counter()
    router.index.rebuild()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- MPI

class _Echo:
    """An empty server: the transport alone."""

    def handle(self, message, now):
        return {"ok": True}

    def maintain(self, now, *, busy=False):
        return False


def mpi_main(args) -> None:
    from mpi4py import MPI

    from libra_hpc.runtime.loop import serve_queue
    from libra_hpc.scheduler.mpi_service import QueueClient

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if rank and args.client_nice:
        os.nice(args.client_nice)
    if args.pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        cores = sorted(os.sched_getaffinity(0))  # the server a core of its own, the clients the rest
        os.sched_setaffinity(0, {cores[0]} if rank == 0 else set(cores[1:]))
    clients = comm.Split(MPI.UNDEFINED if rank == 0 else 1, rank)
    buckets = default_buckets()
    instances = [i for b in buckets for i in b.instances]
    train, work = split_by_sample(workload(args.mpi_prompts), 8)
    # Each client's reports, classified before the clocks start: classifying is a worker's
    # work on its own node, and here four clients share one core with each other.
    reports = {(t.tid, turn): report_of(t, turn) for t in work for turn in range(len(t.turns))} if rank else {}
    out = {}

    def phase(server, client, poll_s=None):
        """Rank 0 runs ``server()`` (a serve loop), the clients ``client(queue)``, then
        the clients stop it; returns the server's result and the clients' (rank 0 only)."""
        comm.Barrier()
        if rank == 0:
            mine = server()
        else:
            queue = QueueClient(comm, poll_s=None if poll_s < 0 else poll_s, spin_s=max(0.0, args.client_spin_s))
            mine = client(queue)
            clients.Barrier()
            if rank == 1:
                queue.shutdown()
        gathered = comm.gather(mine)
        return gathered and (gathered[0], gathered[1:])

    def full_service():
        service = new_service(trained_router(buckets, train))
        for t in work:
            service.submit(t.tid, t.prompt_id)
        return service

    probe = report_of(work[0], 0) | {"lease": 1}
    rotation = instances[rank - 1:] + instances[:rank - 1] if rank else []
    raw_rates: dict[str, list[float]] = {"raw": [], "raw_spin": []}
    # Raw and batched service phases interleaved, best of each: the ratio is taken between
    # phases a few seconds apart, so a neighbour's load burst cannot favour one side.
    for mode in ["raw", "raw_spin", "batched"] * args.repeats + ["single"]:
        if mode.startswith("raw"):  # raw_spin: the same, clients in MPI's spinning receive
            result = phase(lambda: serve_queue(comm, _Echo(), idle_sleep_s=args.server_idle_sleep_s),
                           lambda queue: _raw_client(queue, probe, args.mpi_seconds),
                           -1.0 if mode == "raw_spin" else args.client_poll_s)
            if rank == 0:
                counts = result[1]
                raw_rates[mode].append(sum(c for c, _ in counts) / max(s for _, s in counts))
            continue
        service = full_service() if rank == 0 else None
        if rank == 0:  # what the loop would do at its start, before the clients' clocks run
            gc.collect()
            gc.freeze()
        batched = mode == "batched"
        result = phase(lambda service=service: _timed_serve(comm, service, args.server_idle_sleep_s),
                       lambda queue, batched=batched: _client(queue, rotation, reports, batched=batched),
                       args.client_poll_s)
        if rank == 0:
            gc.unfreeze()
            (transport, stats, cpu_s, busy_s), runs = result
            assert stats["completed"] == len(work), stats
            latencies = sorted(x for r in runs for x in r["latencies"])
            elapsed = max(r["elapsed"] for r in runs)
            prefix = "batched_" if batched else "single_"
            if stats["decisions"] / elapsed < out.get(f"{prefix}decisions_per_s", 0):
                continue  # an earlier repeat was faster
            out.update({f"{prefix}decisions_per_s": stats["decisions"] / elapsed,
                        f"{prefix}requests_per_s": transport["requests"] / elapsed,
                        f"{prefix}p50_ms": latencies[len(latencies) // 2] * 1e3,
                        f"{prefix}p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
                        f"{prefix}elapsed_s": elapsed,
                        f"{prefix}decisions_per_request": stats["decisions"] / transport["requests"],
                        f"{prefix}server_cpu_us_per_decision": cpu_s / stats["decisions"] * 1e6,
                        f"{prefix}server_cpu_share": cpu_s / elapsed,
                        f"{prefix}server_busy_share": busy_s / elapsed,
                        f"{prefix}server_busy_us_per_decision": busy_s / stats["decisions"] * 1e6})
            out.update(decisions=stats["decisions"], trajectories=len(work), migrations=stats["migrations"],
                       empty_asks=sum(r["empty_asks"] for r in runs))
    if rank == 0:
        out["raw_same_clients_msgs_per_s"] = max(raw_rates["raw"])
        out["raw_spin_msgs_per_s"] = max(raw_rates["raw_spin"])
        out["raw_msgs_per_s"] = max(out["raw_same_clients_msgs_per_s"], out["raw_spin_msgs_per_s"])  # the limit
        print("MPI_RESULT " + json.dumps(out), flush=True)
    else:
        clients.Free()


class _Timed:
    """A service whose handle() adds up the seconds it takes (the server's busy time)."""

    def __init__(self, service):
        self.service, self.busy_s = service, 0.0

    def handle(self, message, now):
        started = time.perf_counter()
        try:
            return self.service.handle(message, now)
        finally:
            self.busy_s += time.perf_counter() - started

    def maintain(self, now, *, busy=False):
        started = time.perf_counter()
        try:
            return self.service.maintain(now, busy=busy)
        finally:
            self.busy_s += time.perf_counter() - started


def _timed_serve(comm, service, idle_sleep_s: float) -> tuple[dict, dict, float, float]:
    """Rank 0's event loop with the queue's handler and the job's other handlers (control
    reports, tool completions: none arrive here) until a client's shutdown; returns the
    transport counters, the service's stats, the server's CPU seconds (process time: the
    share of a core it got, idle probing included) and the seconds spent answering
    requests and maintaining."""
    from libra_hpc.cluster.messages import REPORT, TOOL_DONE
    from libra_hpc.runtime.loop import EventLoop
    from libra_hpc.scheduler.mpi_service import QueueHandler

    def unexpected(payload, source):
        raise RuntimeError(f"bench: no control or tool message expected, rank {source} sent {payload!r}")

    timed = _Timed(service)
    loop = EventLoop(comm, idle_sleep_s=idle_sleep_s)
    queue = QueueHandler(comm, timed, on_shutdown=lambda source: loop.stop(f"rank {source}: shutdown"))
    queue.attach(loop)
    loop.on(REPORT, unexpected, fatal=True)
    loop.on(TOOL_DONE, unexpected, fatal=True)
    cpu = time.process_time()
    loop.run()
    return ({"requests": queue.requests, "bad_payloads": queue.bad_payloads}, service.stats(),
            time.process_time() - cpu, timed.busy_s)


def _raw_client(queue, probe: dict, seconds: float) -> tuple[int, float]:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            queue.request(probe)
        count += 100
    return count, time.perf_counter() - start


def _client(queue, instances: list[int], reports_of: dict, batched: bool) -> dict:
    """A client stands for the leaders of one instance per bucket (a node's engines): each
    round it reports the turns it was handed (all generated in one engine step) and asks
    for every instance, its own first, so that every client stays busy whatever each
    bucket's share of the work: the server, not one bucket, is the limit. ``batched``: the
    round is one message (batch op); otherwise one request per report and per ask.
    Latencies: round trips that carried a tool return."""
    latencies, empty, backoff, turns = [], 0, 0.0, []
    asks = [{"op": "ask", "instance": instance, "max": 16} for instance in instances]
    start = time.perf_counter()
    while True:
        reports = []
        for turn in turns:
            message = reports_of[turn["tid"], turn["turn"]].copy()  # its report (tid, turn) with the lease
            message["lease"] = turn["lease"]
            reports.append(message)
        if batched:
            sent = time.perf_counter()
            replies = queue.batch(reports + asks)
            if any(r["op"] == "tool_return" for r in reports):
                latencies.append(time.perf_counter() - sent)
            assert all(reply["ok"] for reply in replies), [reply for reply in replies if not reply["ok"]]
            replies = replies[len(reports):]
        else:
            for message in reports:
                sent = time.perf_counter()
                queue.request(message)
                if message["op"] == "tool_return":
                    latencies.append(time.perf_counter() - sent)
            replies = [queue.request(ask) for ask in asks]
        turns = [turn for reply in replies for turn in reply["turns"]]
        if turns:
            backoff = 0.0
            continue
        if replies[-1]["active"] == 0:
            break
        empty += 1  # nothing anywhere: poll again after a growing backoff
        backoff = min(max(backoff * 2, 1e-4), 2e-3)
        time.sleep(backoff)
    return {"latencies": latencies, "elapsed": time.perf_counter() - start, "empty_asks": empty}


def run_mpi(args) -> dict:
    # `-m mpi4py`: an exception on any rank aborts the world instead of hanging it.
    command = ["mpiexec", "-n", str(args.clients + 1), sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "--mpi-part",
               "--mpi-seconds", str(args.mpi_seconds), "--prompts", str(args.mpi_prompts), "--repeats", str(args.repeats),
               "--client-poll-s", str(args.client_poll_s), "--client-spin-s", str(args.client_spin_s),
               "--client-nice", str(args.client_nice),
               "--server-idle-sleep-s", str(args.server_idle_sleep_s), "--pin" if args.pin else "--no-pin"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MPI_RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the MPI part failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1].removeprefix("MPI_RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="rollout instance leaders (MPI ranks besides the server)")
    parser.add_argument("--mpi-seconds", type=float, default=2.0, help="duration of each raw request/reply phase")
    parser.add_argument("--mpi-prompts", "--prompts", dest="mpi_prompts", type=int, default=1200,
                        help="synthetic prompts of the MPI part (16 samples each, half for training)")
    parser.add_argument("--repeats", type=int, default=3, help="raw and batched service phases, interleaved; best of each")
    parser.add_argument("--client-poll-s", type=float, default=0.0,
                        help="QueueClient poll_s of every client, raw phase included: 0 probes and yields the core, "
                             "> 0 sleeps between probes, < 0 waits in MPI's (spinning) blocking receive")
    parser.add_argument("--client-spin-s", type=float, default=5e-5,
                        help="QueueClient spin_s: probe this long before sleeping --client-poll-s between probes")
    parser.add_argument("--client-nice", type=int, default=0, help="niceness the client ranks give themselves")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="give the server rank a core of its own and the clients the others (as a controller "
                             "rank on its own core; the raw phase runs pinned the same way)")
    parser.add_argument("--server-idle-sleep-s", type=float, default=2e-4,
                        help="the server loop's idle_sleep_s: its first sleep when idle (0: it spins while idle)")
    parser.add_argument("--mpi-only", action="store_true", help="only the MPI part; print its raw results")
    parser.add_argument("--mpi-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_part:
        return mpi_main(args)
    if args.mpi_only:
        print(json.dumps(run_mpi(args)))
        return
    buckets = default_buckets()
    train, test = split_by_sample(workload(1000), 4)
    results = {"route_us": min(bench_route_us(train, test, buckets) for _ in range(3)),
               "observe_us": min(bench_observe_us(train, test, buckets, 1000) for _ in range(3)),
               "observe_no_rebuild_us": min(bench_observe_us(train, test, buckets, 10**9) for _ in range(3))}
    results.update(max((bench_loop(train, test, buckets) for _ in range(3)), key=lambda r: r["loop_decisions_per_s"]))
    results["rebuild_10k_s"] = min(bench_rebuild(train, buckets) for _ in range(3))
    quality = evaluate_routing(cmlfq, train, test, buckets)
    results.update(bucket_accuracy=quality["bucket_accuracy"], top_level_accuracy=quality["top_level_accuracy"],
                   mean_level_error=quality["mean_level_error"])
    paper = evaluate_routing(cmlfq, *split_by_sample(workload(1000, PAPER_SCENARIO), 4), buckets)
    results.update(paper_bucket_accuracy=paper["bucket_accuracy"], paper_top_level_accuracy=paper["top_level_accuracy"])
    results.update(run_mpi(args))
    results["scheduler"] = _compiled.status()  # the MPI ranks import the same build
    results["decisions_per_s"], results["p99_ms"] = results["batched_decisions_per_s"], results["batched_p99_ms"]
    poll = ("clients spin" if args.client_poll_s < 0 else "clients yield between probes" if args.client_poll_s == 0
            else f"clients probe {args.client_spin_s * 1e6:g} µs, then sleep {args.client_poll_s * 1e6:g} µs "
                 "between probes")
    rows = [("routing cost, CmlfqRouter.place after a tool return", f"{results['route_us']:.2f} µs", "≤ 20 µs"),
            ("CmlfqRouter.observe per finish, rebuild every 1000 / never",
             f"{results['observe_us']:.1f} / {results['observe_no_rebuild_us']:.1f} µs", ""),
            ("in-process loop (ask, tool_return, finish)", f"{results['loop_decisions_per_s']:,.0f} decisions/s", "≥ 50,000"),
            ("rebuild of the causal index, 10k trajectories", f"{results['rebuild_10k_s']:.3f} s", "≤ 1 s"),
            ("bucket accuracy: cmlfq / always top level",
             f"{results['bucket_accuracy']:.3f} / {results['top_level_accuracy']:.3f}", "cmlfq higher"),
            ("  the same on the paper's SWE scenario (a800-swe)",
             f"{results['paper_bucket_accuracy']:.3f} / {results['paper_top_level_accuracy']:.3f}", ""),
            (f"MPI raw request/reply, {args.clients} clients ({poll})",
             f"{results['raw_same_clients_msgs_per_s']:,.0f} msgs/s", ""),
            ("  the same, clients spinning in MPI's receive", f"{results['raw_spin_msgs_per_s']:,.0f} msgs/s", ""),
            ("  the transport's limit: the better of the two", f"{results['raw_msgs_per_s']:,.0f} msgs/s", ""),
            ("MPI service, batch op (an engine step's reports + ask)",
             f"{results['batched_decisions_per_s']:,.0f} decisions/s", f"≥ {results['raw_msgs_per_s'] / 2:,.0f} (50% raw)"),
            ("  against the raw rate of the same clients / of the limit",
             (f"{results['batched_decisions_per_s'] / results['raw_same_clients_msgs_per_s']:.0%} / "
              f"{results['batched_decisions_per_s'] / results['raw_msgs_per_s']:.0%}"), ""),
            ("  server time answering, per decision / share of the run",
             (f"{results['batched_server_busy_us_per_decision']:.1f} µs / "
              f"{results['batched_server_busy_share']:.0%}"), ""),
            ("  server CPU per decision (idle probing included) / share of a core",
             (f"{results['batched_server_cpu_us_per_decision']:.1f} µs / "
              f"{results['batched_server_cpu_share']:.0%}"), ""),
            ("  requests / decisions per request", (f"{results['batched_requests_per_s']:,.0f} req/s / "
                                                    f"{results['batched_decisions_per_request']:.1f}"), ""),
            ("  batch round trip p50 / p99", f"{results['batched_p50_ms']:.3f} / {results['batched_p99_ms']:.3f} ms", ""),
            ("MPI service, one request per report", f"{results['single_decisions_per_s']:,.0f} decisions/s", ""),
            ("  decision latency p50 / p99", f"{results['single_p50_ms']:.3f} / {results['single_p99_ms']:.3f} ms", "")]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'measured':>28}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>28}  {target}")
    print(f"(scheduler {results['scheduler']}; MPI: {results['trajectories']} trajectories, {results['decisions']} decisions, "
          f"{results['migrations']} migrations, {results['empty_asks']} empty asks, best of {args.repeats}; "
          f"clients at nice {args.client_nice}; {os.cpu_count()} cores)")
    keys = ("decisions_per_s", "raw_msgs_per_s", "p99_ms", "route_us", "loop_decisions_per_s", "rebuild_10k_s",
            "bucket_accuracy", "top_level_accuracy", "paper_bucket_accuracy", "paper_top_level_accuracy",
            "single_decisions_per_s", "raw_spin_msgs_per_s",
            "raw_same_clients_msgs_per_s")
    print(json.dumps({**{k: round(results[k], 4) for k in keys}, "scheduler": results["scheduler"]}))


if __name__ == "__main__":
    main()
