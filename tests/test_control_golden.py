"""Golden test of Libra's control loop (libra_hpc/planner/control.py): one recorded stream
of observations (tests/data/control_golden.json) fed to the control loop alone, and the
simulator driving it on the same scenario, give the recorded decisions, call for call.

Two streams:
- recorded: the context-growth scenario (configs/sim/context-growth.yaml), 20 steps,
  staleness 3 and a prior far shorter than the workload, so that the stream holds plan
  changes applied and refused, a change that waits for its moment (``while_waiting`` asked
  after the batch done meanwhile; tests/test_sim_memory.py drives its memory branch), and
  a hybrid pool that no move is predicted to pay for (none is considered where none could
  move: its refusals were recorded until the pool priced its moves by the cost models'
  pipelined step). (With a prior of 200 generated tokens the
  memory check, holding the last batch's mean since, moves training at step 4 by a
  re-shard, and no change waits);
- live: a pinned layout whose training binds (tests/sim_cases.py), so that the hybrid
  pool lends a replica through every phase; the simulator's stream replayed into a fresh
  loop gives the same decisions.

Re-record after an intended change of the decisions (and say why in the commit):
    python tests/test_control_golden.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from libra_hpc.planner.control import ControlLoop
from libra_hpc.planner.costs import LengthSample

GOLDEN = Path(__file__).parent / "data" / "control_golden.json"
REPO = Path(__file__).resolve().parent.parent


def _scenario(golden: dict):
    """The recorded stream's scenario."""
    from libra_hpc.sim.config import load_sim_config
    from libra_hpc.sim.context import Context

    return Context(load_sim_config(REPO / golden["scenario"], golden["overrides"]))


def simulate(scenario: str, overrides: dict, policy: str) -> list[dict]:
    """The control loop's journal when the simulator drives it (as sim/run.py run_policy)."""
    from libra_hpc.sim.controller import PolicyRun
    from libra_hpc.sim.policies import SETUPS, control_loop

    ctx = _scenario({"scenario": scenario, "overrides": overrides})
    setup = SETUPS[policy]
    control = control_loop(ctx, setup)
    control.journal = []
    first = control.initial()
    PolicyRun(ctx, setup, first.layout, first.plan.train, ctx.cfg.rl.steps, control).run()
    return _plain(control.journal)


def replay(control: ControlLoop, journal: list[dict], pinned=None) -> list[dict]:
    """Feed the recorded inputs to ``control`` alone; returns its journal. ``pinned``: the
    plan a ``start`` call was given."""
    control.journal = []
    changes = {}
    for entry in journal:
        given = entry["in"]
        call = entry["call"]
        if call == "initial":
            control.initial()
        elif call == "start":
            assert pinned is not None and pinned.describe() == given["plan"]
            control.start(pinned, given["reason"])
        elif call == "observe":
            control.observe([LengthSample(*s) for s in given["samples"]])
        elif call == "after_rollout":
            out = control.after_rollout(given["step"], given["now"], given["makespan_s"], given["t_train"])
            if out.change is not None:
                changes[out.change.step] = out.change
        elif call == "while_waiting":
            if given["waiting"] in changes:  # as for apply
                out = control.while_waiting(given["step"], changes[given["waiting"]])
                if out is not None:
                    changes[out.step] = out
        elif call == "apply":
            if given["step"] in changes:  # a perturbed stream may not have decided that change
                control.apply(changes[given["step"]])
        elif call == "progress":
            control.progress(given["rid"], given["now"])
        elif call == "after_training_step":
            control.after_training_step(given["now"])
        elif call == "reshard":
            pass  # the loop's own record, inside the after_rollout call recorded next
        else:
            raise AssertionError(f"unknown call {call!r} in the golden stream")
    return _plain(control.journal)


def _plain(journal: list[dict]) -> list[dict]:
    """JSON round trip (tuples become lists; floats are exact)."""
    return json.loads(json.dumps(journal))


def _load() -> dict:
    return json.loads(GOLDEN.read_text())


def _hybrid_stream(tmp_path):
    """The live stream: the simulator drives a loop pinned to a training-bound layout."""
    from libra_hpc.sim.controller import PolicyRun
    from libra_hpc.sim.policies import SETUPS, control_loop
    from sim_cases import hybrid_case

    ctx, plan = hybrid_case(tmp_path)
    setup = SETUPS["libra_no_replan"]
    control = control_loop(ctx, setup)
    control.journal = []
    first = control.start(plan, "pinned")
    PolicyRun(ctx, setup, first.layout, plan.train, ctx.cfg.rl.steps, control,
              train_time=lambda shape, tokens: 3.0 / shape.dp).run()
    return ctx, plan, _plain(control.journal)


def test_the_streams_exercise_every_kind_of_decision(tmp_path):
    recorded = _load()["journal"]
    live = _hybrid_stream(tmp_path)[2]
    calls = {e["call"] for e in recorded + live}
    assert {"initial", "start", "observe", "after_rollout", "while_waiting", "apply", "progress",
            "after_training_step"} <= calls
    outs = [e["out"] for e in recorded if e["call"] == "after_rollout"]
    assert any(o["change"] for o in outs), "no layout change in the recorded stream"
    pool = [e["out"] for e in live if e["call"] == "after_rollout"]
    assert any(o["pool_decided"] and not o["pool_events"] for o in pool), "the pool never held"
    moves = {ev["to_state"] for o in pool for ev in o["pool_events"]}
    phases = {ev["to_state"] for e in live if e["call"] in ("progress", "after_training_step") for ev in e["out"]}
    assert "requested" in moves and {"fetching_state", "zero_grad_sync", "active"} <= phases


def test_control_loop_alone_makes_the_simulators_hybrid_decisions(tmp_path):
    from libra_hpc.sim.policies import SETUPS, control_options

    ctx, plan, live = _hybrid_stream(tmp_path)
    alone = ControlLoop(ctx.model, ctx.hw, control_options(ctx, SETUPS["libra_no_replan"]), ctx.cal)
    assert replay(alone, live, pinned=plan) == live


def test_control_loop_alone_reproduces_the_recorded_decisions():
    golden = _load()
    from libra_hpc.sim.policies import SETUPS, control_options

    ctx = _scenario(golden)
    control = ControlLoop(ctx.model, ctx.hw, control_options(ctx, SETUPS[golden["policy"]]), ctx.cal)
    assert replay(control, golden["journal"]) == golden["journal"]


def test_simulator_makes_the_recorded_decisions():
    golden = _load()
    assert simulate(golden["scenario"], golden["overrides"], golden["policy"]) == golden["journal"]


def test_a_different_observation_changes_the_decisions():
    """The comparison can fail: a perturbed stream gives other decisions."""
    golden = _load()
    from libra_hpc.sim.policies import SETUPS, control_options

    ctx = _scenario(golden)
    control = ControlLoop(ctx.model, ctx.hw, control_options(ctx, SETUPS[golden["policy"]]), ctx.cal)
    journal = json.loads(json.dumps(golden["journal"]))
    for entry in journal:
        if entry["call"] == "after_rollout":
            entry["in"]["makespan_s"] *= 3
    assert [e["out"] for e in replay(control, journal)] != [e["out"] for e in golden["journal"]]


SCENARIO = "configs/sim/context-growth.yaml"
OVERRIDES: dict = {"rl.steps": 20, "rl.max_staleness": 3, "planner.prior": {"gen_tokens_median": 400, "turns": 2}}
POLICY = "libra"

if __name__ == "__main__" and "--record" in sys.argv:
    GOLDEN.parent.mkdir(exist_ok=True)
    journal = simulate(SCENARIO, OVERRIDES, POLICY)
    GOLDEN.write_text(json.dumps({"scenario": SCENARIO, "overrides": OVERRIDES, "policy": POLICY,
                                  "journal": journal}, indent=None, separators=(",", ":")) + "\n")
    print(f"recorded {len(journal)} calls to {GOLDEN}")
