"""``launch.py --plan`` prints the decision the simulator's first planning round makes on
the same config: both come from Libra's control loop (libra_hpc/planner/control.py) with
options built by ``ControlOptions.from_config``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from libra_hpc.config import load_config, parse_yaml
from libra_hpc.launcher import first_decision
from libra_hpc.planner.control import journal_form

REPO = Path(__file__).resolve().parent.parent


def _scenario_of(experiment: Path, **extra):
    """The experiment file as a simulator scenario: its own sections plus the workload of
    the paper scenario (the initial plan does not look at the workload)."""
    from libra_hpc.sim.config import validate_sim_config

    raw = parse_yaml(experiment.read_text())
    swe = parse_yaml((REPO / "configs/sim/a800-swe.yaml").read_text())
    raw.update(name="plan-check", workload=swe["workload"], **extra)
    raw.get("planner", {}).pop("borrow_at_step", None)
    raw.get("planner", {}).pop("return_at_step", None)
    return validate_sim_config(raw, str(experiment))


@pytest.mark.parametrize("experiment", ["configs/a800-6node.yaml"])
def test_plan_equals_the_simulators_first_planning_round(experiment):
    from libra_hpc.sim.context import Context
    from libra_hpc.sim.policies import SETUPS, control_loop

    _, _, live = first_decision(load_config(REPO / experiment))
    sim = control_loop(Context(_scenario_of(REPO / experiment)), SETUPS["libra"]).initial()
    assert journal_form(live) == journal_form(sim)
    assert live.layout == sim.layout


def test_plan_command_prints_that_decision():
    _, _, first = first_decision(load_config(REPO / "configs/a800-6node.yaml"))
    out = subprocess.run([sys.executable, "launch.py", "--config", "configs/a800-6node.yaml", "--plan"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert first.plan.describe() in out
    assert first.layout.table() in out
