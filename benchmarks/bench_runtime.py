"""Rank 0's event loop and the heartbeat thread on the real clock: the wall-clock figures
that tests/test_runtime_loop.py and tests/test_runtime_heartbeat.py no longer bound.

    python benchmarks/bench_runtime.py [--seconds 3] [--no-mpi]

The tests assert the logic on a virtual clock and on counts (which timer runs when, how
long each sleep is, whose turn comes when); how that turns into seconds and CPU on this
machine is measured here, each figure beside the target the tests used to assert:

1. In-process (a stand-in communicator with no traffic, or one message forever):
   - idle timers: ``every(20 ms)`` on a loop with naps of 0.1 ms and sleeps up to 1 ms;
     the median gap between two ticks (target 20-40 ms);
   - constant load: messages of 4 ms one after another, a 20 ms timer overdue after 10 ms
     more; the longest gap between two ticks (target < 0.1 s);
   - an idle loop with the job's defaults (naps of 0.2 ms, sleeps doubling up to 10 ms):
     its CPU time over wall time (target < 5% of a core), wake-ups per second;
   - heartbeats: a rank beating every 50 ms for ``--seconds``: beats written per second.
2. Under MPI (``tests/loop_world.py`` in its timed mode, ``--seconds S``):
   - ``mixed`` (6 ranks): three queue clients and a control client for S seconds against a
     queue that works 10 ms per request; the control client's round trips over the queue
     clients' mean (target 0.5-2: one turn each per round), its median and longest round
     trip (targets < 0.1 s and < 1 s), its fewest round trips in a 0.5 s window (target
     > 0), the longest gap between two timer ticks while requests flow (target < 0.5 s);
   - ``control-when-idle``: the same against the wrong rule (other messages read only when
     the queue idles): the ratio the fairness check must tell apart (expected < 0.25);
   - ``idle`` (2 ranks): rank 0 idle in its loop for S seconds: its CPU share (target
     < 5% of a core) and how late it saw the one report (target < 0.1 s).

Each row says whether the figure met its target; a miss on a shared, loaded machine is a
figure to look at, not a failed test. Prints a table; the last line is one JSON object
with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from mpi4py import MPI  # noqa: E402

from libra_hpc.cluster.messages import REPORT  # noqa: E402
from libra_hpc.runtime import heartbeat as hb  # noqa: E402
from libra_hpc.runtime.loop import EventLoop  # noqa: E402

WORLD = ROOT / "tests" / "loop_world.py"
QUEUE_CLIENTS, CONTROL_CLIENT = ("1", "2", "3"), "4"


class _Message:
    def recv(self):
        return {}


class _Comm:
    """No traffic (``busy`` False) or a REPORT from rank 1 at every probe."""

    def __init__(self, busy: bool = False):
        self.busy = busy

    def improbe(self, source, tag, status):
        if not self.busy:
            return None
        status.Set_tag(REPORT)
        status.Set_source(1)
        return _Message()


def idle_timers(seconds: float) -> dict:
    loop = EventLoop(_Comm(), idle_sleep_s=1e-4, max_sleep_s=1e-3, collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    ticks: list[float] = []
    loop.every(0.02, lambda: ticks.append(time.monotonic()), name="tick")
    started = time.monotonic()
    loop.run(stop_when=lambda: time.monotonic() - started > seconds)
    gaps = sorted(b - a for a, b in zip(ticks, ticks[1:]))
    return {"median_gap_s": gaps[len(gaps) // 2], "max_gap_s": gaps[-1], "ticks": len(ticks)}


def busy_timers(seconds: float) -> dict:
    loop = EventLoop(_Comm(busy=True), idle_sleep_s=1e-4, collect_every_s=None)
    loop.on(REPORT, lambda report, source: time.sleep(0.004))
    ticks: list[float] = []
    loop.every(0.02, lambda: ticks.append(time.monotonic()), name="tick", busy_after_s=0.01)
    started = time.monotonic()
    counters = loop.run(stop_when=lambda: time.monotonic() - started > seconds)
    gaps = sorted(b - a for a, b in zip(ticks, ticks[1:]))
    return {"median_gap_s": gaps[len(gaps) // 2], "max_gap_s": gaps[-1], "sleeps": counters["sleeps"]}


def idle_cpu(seconds: float) -> dict:
    """The job's defaults; measured after the first 0.3 s (the short-idle naps are over)."""
    loop = EventLoop(_Comm(), collect_every_s=None)
    loop.on(REPORT, lambda report, source: None)
    mark: dict[str, float] = {}
    loop.after(0.3, lambda: mark.update(wall=time.monotonic(), cpu=time.process_time(), sleeps=loop.counters["sleeps"]),
               name="mark")
    started = time.monotonic()
    counters = loop.run(stop_when=lambda: time.monotonic() - started > 0.3 + seconds)
    wall = time.monotonic() - mark["wall"]
    return {"cpu_share": (time.process_time() - mark["cpu"]) / wall,
            "wakeups_per_s": (counters["sleeps"] - mark["sleeps"]) / wall}


def heartbeats(seconds: float) -> dict:
    written = []
    with tempfile.TemporaryDirectory() as folder:
        beat = hb.Heartbeat(Path(folder), 3, interval_s=0.05, timeout_s=0, slot="n0g3")
        write = beat._write
        beat._write = lambda: (written.append(time.monotonic()), write())[1]
        started = time.monotonic()
        beat.start()
        time.sleep(seconds)
        beat.close()
        wall = time.monotonic() - started
    gaps = sorted(b - a for a, b in zip(written, written[1:]))
    return {"beats_per_s": len(written) / wall, "max_gap_s": gaps[-1]}


def world(scenario: str, ranks: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "summary.json"
        command = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py", str(WORLD), scenario, str(out),
                   "--seconds", str(seconds)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120 + 4 * seconds, cwd=ROOT,
                              check=False)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"the loop world {scenario} failed (exit {done.returncode}):\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def fairness(summary: dict, seconds: float) -> dict:
    clients = summary["clients"]
    queue = [clients[rank] for rank in QUEUE_CLIENTS]
    control = clients[CONTROL_CLIENT]
    mean_queue = sum(c["count"] for c in queue) / len(queue)
    during = [t for t in summary["ticks"] if t < seconds]
    return {"control_over_queue": control["count"] / mean_queue, "control_p50_s": control["p50_s"],
            "control_max_s": control["max_s"], "min_window": min(min(c["windows"]) for c in [*queue, control]),
            "tick_max_gap_s": max((b - a for a, b in zip(during, during[1:])), default=float("inf")),
            "ticks_after": len([t for t in summary["ticks"] if t > seconds + 0.1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each timed phase")
    parser.add_argument("--no-mpi", action="store_true", help="only the in-process phases")
    args = parser.parse_args()
    s = args.seconds
    rows: list[tuple[str, float, str, bool]] = []  # figure, value, target, met

    timers = idle_timers(s)
    rows.append(("idle: median tick gap, every 20 ms (s)", timers["median_gap_s"], "0.02-0.04",
                 0.02 <= timers["median_gap_s"] < 0.04))
    busy = busy_timers(s)
    rows.append(("busy (4 ms messages): longest tick gap (s)", busy["max_gap_s"], "< 0.1", busy["max_gap_s"] < 0.1))
    cpu = idle_cpu(s)
    rows.append(("idle, defaults: CPU share of a core", cpu["cpu_share"], "< 0.05", cpu["cpu_share"] < 0.05))
    rows.append(("idle, defaults: wake-ups per second", cpu["wakeups_per_s"], "<= 100 (10 ms sleeps)",
                 cpu["wakeups_per_s"] <= 105))
    beats = heartbeats(s)
    rows.append(("heartbeat every 50 ms: beats per second", beats["beats_per_s"], "~20",
                 15 <= beats["beats_per_s"] <= 21))
    rows.append(("heartbeat: longest gap between two beats (s)", beats["max_gap_s"], "< 0.5", beats["max_gap_s"] < 0.5))
    figures = {"idle_tick_median_gap_s": timers["median_gap_s"], "busy_tick_max_gap_s": busy["max_gap_s"],
               "idle_cpu_share_inprocess": cpu["cpu_share"], "beats_per_s": beats["beats_per_s"]}

    if not args.no_mpi:
        mixed = fairness(world("mixed", 6, s), s)
        rows += [("mpi mixed: control / mean queue round trips", mixed["control_over_queue"], "0.5-2",
                  0.5 <= mixed["control_over_queue"] <= 2),
                 ("mpi mixed: control round trip, median (s)", mixed["control_p50_s"], "< 0.1",
                  mixed["control_p50_s"] < 0.1),
                 ("mpi mixed: control round trip, longest (s)", mixed["control_max_s"], "< 1.0",
                  mixed["control_max_s"] < 1.0),
                 ("mpi mixed: fewest round trips of a client in 0.5 s", mixed["min_window"], "> 0",
                  mixed["min_window"] > 0),
                 ("mpi mixed: longest tick gap while serving (s)", mixed["tick_max_gap_s"], "< 0.5",
                  mixed["tick_max_gap_s"] < 0.5),
                 ("mpi mixed: ticks in the idle tail", mixed["ticks_after"], ">= 3", mixed["ticks_after"] >= 3)]
        wrong = fairness(world("control-when-idle", 6, s), s)
        rows.append(("mpi control-when-idle (wrong rule): control / queue", wrong["control_over_queue"],
                     "< 0.25 (starved)", wrong["control_over_queue"] < 0.25))
        idle = world("idle", 2, s)["idle"]
        share = (idle["cpu"] - idle["cpu0"]) / (idle["wall"] - idle["wall0"])
        rows += [("mpi idle: rank 0 CPU share of a core", share, "< 0.05", share < 0.05),
                 ("mpi idle: report seen late by (s)", idle["seen_late_s"], "< 0.1", idle["seen_late_s"] < 0.1)]
        figures.update(control_over_queue=mixed["control_over_queue"], control_p50_s=mixed["control_p50_s"],
                       control_max_s=mixed["control_max_s"], wrong_rule_control_over_queue=wrong["control_over_queue"],
                       idle_cpu_share_mpi=share, idle_seen_late_s=idle["seen_late_s"])

    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'value':>10}  {'target':<22} met")
    for name, value, target, met in rows:
        print(f"{name:<{width}}  {value:>10.4g}  {target:<22} {'yes' if met else 'NO'}")
    print(json.dumps({**{k: round(v, 5) for k, v in figures.items()}, "targets_met": sum(r[3] for r in rows),
                      "targets": len(rows), "seconds": s, "mpi": not args.no_mpi, "mpi_vendor": MPI.get_vendor()[0]}))


if __name__ == "__main__":
    main()
