"""Tool sandboxes on other nodes (tools.placement: slurm): the srun command line, the worker
protocol with real sandboxes (workers started directly), failures named with the unit, idle
units giving their workers back, and workers started by srun on the private Slurm cluster."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from test_slurm_cluster import SLURM_WAIT_S, wait_for_slurm

from libra_hpc.config import ConfigError, validate_config
from libra_hpc.tools.isolation import SandboxLimits, bwrap_problem
from libra_hpc.tools.orchestrator import ToolOrchestrator, cpu_runner_from_config, orchestrator_from_config
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.procs import owned_pids
from libra_hpc.tools.remote import RemoteToolError, SlurmSandboxRunner, srun_argv
from libra_hpc.tools.sandbox import DEFAULT_RULES
from libra_hpc.tools.scheduling import make_scheduler
from libra_hpc.tools.worker import worker_spec

UID_BASE = 240000  # this module's slot uids, away from the other tool tests'
LIMITS = SandboxLimits(wall_time_s=60.0)  # a hang guard: no call here is meant to reach it
WAIT_S = 120.0  # how long a test waits for a result: a hang guard too


class FakeClock:
    """Monotonic seconds that move only when the test says so (the orchestrator's idle
    timeouts then fire on the test's word, not on how fast the calls ran)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(what: str, probe, timeout_s: float = WAIT_S) -> None:
    """Poll ``probe`` until true: a hang guard, never a measure of speed."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:g} s"
        time.sleep(0.05)


def _worker(uid_base: int = UID_BASE, slots: int = 4) -> list[str]:
    spec = worker_spec(LIMITS, uid_base=uid_base, slots=slots, isolation="auto", python="", rules=DEFAULT_RULES,
                       lock_dir="/run/libra_sandbox")
    return [sys.executable, "-m", "libra_hpc.tools.worker", spec]


@pytest.fixture(scope="module", autouse=True)
def _needs_a_sandbox():
    problem = bwrap_problem(sys.executable, UID_BASE if os.geteuid() == 0 else None)
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"bwrap sandbox unavailable in CI: {problem}")
        pytest.skip(f"bwrap sandbox unavailable: {problem}")


def test_srun_line_asks_for_a_partition_or_overlaps_the_job():
    worker = ["python", "-m", "libra_hpc.tools.worker", "{}"]
    own = srun_argv(worker, partition="cpu", cpus=2, time_limit="1:00:00", extra=["--account=rl"])
    assert own[0] == "srun" and "--partition=cpu" in own and "--overlap" not in own
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=2", "--time=1:00:00"} <= set(own)
    assert own.index("--account=rl") < own.index("python") and own[-4:] == worker
    step = srun_argv(worker)
    assert "--overlap" in step and not any(a.startswith("--partition") for a in step)


@pytest.mark.parametrize("tools, field", [
    ({"slurm_partition": "cpu"}, "tools.slurm_partition is set but tools.placement is 'local'"),
    ({"placement": "slurm", "slurm_time_limit": "1:00:00"}, "tools.slurm_time_limit needs tools.slurm_partition"),
    ({"placement": "slurm", "slurm_args": ["account=rl"]}, "tools.slurm_args: 'account=rl'"),
    ({"placement": "ssh"}, "tools.placement"),
])
def test_slurm_placement_options_are_checked(tools, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("(", r"\(")):
        validate_config({"tools": tools})


def test_worker_runs_snippets_in_its_sandbox_and_names_itself():
    runner = SlurmSandboxRunner(_worker(), wall_time_s=LIMITS.wall_time_s)
    try:
        result = runner.run(0, "print(6 * 7)")
        assert (result.stdout, result.exit_code, result.state.key()) == ("42\n", 0, "python|S|success")
        assert result.isolation == "bwrap"
        shell = runner.run(0, {"argv": ["sh", "-c", "echo out; exit 3"], "tool": "bash"})
        assert (shell.stdout, shell.exit_code, shell.state.key()) == ("out\n", 3, "bash|S|failure")
        failing = runner.run(1, {"code": "raise SystemExit('boom')", "tool": "python"})
        assert failing.state.status == "failure" and "boom" in failing.stderr
        assert set(runner.nodes()) == {0, 1}  # one worker per unit
        with pytest.raises(ValueError, match="tool payload must be code"):
            runner.run(0, 42)
    finally:
        runner.close()
    assert runner.nodes() == {}
    if os.geteuid() == 0:
        assert owned_pids(uid=UID_BASE) == [] and owned_pids(uid=UID_BASE + 1) == []


def test_a_dead_worker_fails_its_call_with_the_unit_and_the_next_call_starts_a_new_one():
    runner = SlurmSandboxRunner(_worker(), wall_time_s=LIMITS.wall_time_s)
    try:
        assert runner.run(3, "print(1)").stdout == "1\n"
        first = runner._workers[3].proc.pid
        os.kill(first, signal.SIGKILL)
        runner._workers[3].proc.wait()
        assert runner.run(3, "print(2)").stdout == "2\n"  # found dead before sending: restarted
        assert runner._workers[3].proc.pid != first
        hang = runner._workers[3]
        os.kill(hang.proc.pid, signal.SIGSTOP)  # alive but silent: the call times out
        short = SlurmSandboxRunner(_worker(), wall_time_s=0.5, reply_margin_s=0.5)
        short._workers[3] = hang
        with pytest.raises(RemoteToolError, match=r"unit 3 on node .*no call reply within 1 s"):
            short.run(3, "print(3)")
        assert 3 not in short._workers and hang.proc.poll() is not None  # killed, forgotten
        runner._workers.pop(3)
        assert runner.run(3, "print(4)").stdout == "4\n"
    finally:
        runner.close()


@pytest.mark.parametrize("argv, start_timeout_s, why", [  # a start timeout only the silent worker reaches
    ([sys.executable, "-c", "print('hello'); import sys; sys.exit(3)"], 120.0, "sent a line that is not JSON"),
    ([sys.executable, "-c", "import sys; sys.exit(4)"], 120.0, r"worker exited \(status 4\) before its start reply"),
    ([sys.executable, "-c", "import sys; print('oops', file=sys.stderr, flush=True); print(7)"], 120.0,
     "not a JSON object"),
    ([sys.executable, "-c", "import time; time.sleep(600)"], 0.5, "no start reply within 0.5 s"),
])
def test_a_worker_that_cannot_start_is_named_with_its_stderr(argv, start_timeout_s, why):
    runner = SlurmSandboxRunner(argv, wall_time_s=1.0, start_timeout_s=start_timeout_s)
    with pytest.raises(RemoteToolError, match=f"tool worker for unit 5.*{why}") as error:
        runner.run(5, "print(1)")
    if "oops" in argv[-1]:
        assert "its stderr: oops" in str(error.value)
    runner.close()


def test_a_worker_that_finds_no_sandbox_slot_says_so():
    busy = [SlurmSandboxRunner(_worker(slots=1), wall_time_s=LIMITS.wall_time_s) for _ in range(2)]
    try:
        assert busy[0].run(0, "print(1)").stdout == "1\n"  # holds the only slot uid of this spec
        if os.geteuid() != 0:
            pytest.skip("slot uids are taken only when running as root")
        with pytest.raises(RemoteToolError, match="no tool sandbox on .*all 1 sandbox slots"):
            busy[1].run(0, "print(2)")
    finally:
        for runner in busy:
            runner.close()


def test_retired_units_give_their_workers_back_without_another_call():
    runner, clock = SlurmSandboxRunner(_worker(), wall_time_s=LIMITS.wall_time_s), FakeClock()
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("cpu", 2, idle_timeout_s=0.5)]), {"cpu": runner},
                            clock=clock)
    try:
        futures = [orch.submit(f"t{i}", "python", "cpu", f"import time; time.sleep(0.3); print({i})") for i in range(4)]
        assert sorted(f.result(timeout=WAIT_S).stdout for f in futures) == ["0\n", "1\n", "2\n", "3\n"]
        units = {record["unit"] for record in orch.records}
        assert units <= {0, 1} and set(runner.nodes()) == units  # a worker per unit used, none retired: idle 0 s
        clock.now += 0.5  # every unit has been idle for the timeout: the pool's own timer retires them
        wait_until("the idle units' workers stopped", lambda: runner.nodes() == {})
        assert orch.submit("t9", "python", "cpu", "print(9)").result(timeout=WAIT_S).stdout == "9\n"  # a new worker
    finally:
        orch.close()
    assert runner.nodes() == {}


@pytest.mark.slurm
def test_workers_started_by_srun_run_calls_on_the_clusters_nodes(slurm_cluster, monkeypatch, tmp_path):
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # srun's working directory on the nodes
    cfg = validate_config({"tools": {"placement": "slurm", "slurm_partition": "debug", "max_workers": 2,
                                     "wall_time_s": LIMITS.wall_time_s, "idle_timeout_s": 60.0,
                                     "uid_base": UID_BASE + 20}})
    orch = orchestrator_from_config(cfg.tools, cfg.scheduler, clock=FakeClock())  # no unit retires before close()
    runner = orch.runners["cpu"]
    assert isinstance(runner, SlurmSandboxRunner)
    try:
        secret = tmp_path / "secret.txt"
        secret.write_text("host file")
        code = f"import os, time; time.sleep(0.5); print(os.path.exists({str(secret)!r}))"
        results = [f.result(timeout=SLURM_WAIT_S) for f in [orch.submit(f"t{i}", "python", "cpu", code)
                                                              for i in range(4)]]
        assert all(r.state.status == "success" and r.isolation == "bwrap" for r in results), [r.stderr for r in results]
        assert [r.stdout for r in results] == ["False\n"] * 4  # run in the node's sandbox, not on the host's files
        units, nodes = {record["unit"] for record in orch.records}, runner.nodes()
        assert units <= {0, 1} and set(nodes) == units  # at most max_workers, a worker per unit used
        assert set(nodes.values()) <= {f"node{i}" for i in range(1, slurm_cluster.nodes + 1)}
        jobs = slurm_cluster.run("squeue", "-h", "-o", "%j %T").split("\n")
        assert sum(line.startswith("libra-tools RUNNING") for line in jobs) == len(units)  # one allocation per unit
    finally:
        orch.close()
    # the workers ended: their jobs leave (COMPLETING is the node's cleanup)
    wait_for_slurm(slurm_cluster, "the tool workers' jobs leaving", lambda: _tool_jobs_holding(slurm_cluster),
                   until=lambda held: not held)


def _tool_jobs_holding(cluster) -> list[str]:
    """libra-tools jobs still pending or running (not those Slurm is cleaning up after)."""
    jobs = [line.split() for line in cluster.run("squeue", "-h", "-o", "%j %T").splitlines() if line.strip()]
    return [state for name, state in jobs if name == "libra-tools" and state != "COMPLETING"]


def test_local_placement_keeps_the_sandboxes_on_this_host():
    cfg = validate_config({"tools": {"uid_base": UID_BASE + 40}})
    runner = cpu_runner_from_config(cfg.tools)
    assert type(runner).__name__ == "SandboxRunner"


def test_a_leaked_slot_on_the_worker_quarantines_the_unit():
    from libra_hpc.tools.procs import SlotLeak

    leaky = ("import json, sys\nprint(json.dumps({'ready': True, 'node': 'n9', 'host': 'h', 'isolation': 'bwrap'}), "
             "flush=True)\nsys.stdin.readline()\nprint(json.dumps({'ok': False, 'leak': True, 'error': 'pid 7 survives'}), "
             "flush=True)\n")
    runner = SlurmSandboxRunner([sys.executable, "-c", leaky], wall_time_s=1.0)
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("cpu", 2)]), {"cpu": runner})
    with pytest.raises(SlotLeak, match="unit 0 on node n9: .*pid 7 survives"):
        orch.submit("t", "python", "cpu", "print(1)").result(timeout=WAIT_S)
    assert orch.scheduler.pools["cpu"].quarantined() == [0] and runner.nodes() == {}
    orch.close()


def test_the_worker_reports_a_leak_and_stops(monkeypatch):
    import io

    from libra_hpc.tools import worker as worker_module
    from libra_hpc.tools.procs import SlotLeak

    class Leaky:
        isolation = "bwrap"
        closed = False

        def run_python(self, code, tool="python"):
            raise SlotLeak("uid 240099: pid 7 survives SIGKILL")

        def close(self):
            Leaky.closed = True

    monkeypatch.setattr(worker_module, "first_free_sandbox", lambda *args, **kwargs: Leaky())
    out = io.StringIO()
    spec = json.loads(_worker()[-1])
    status = worker_module.serve(spec, io.StringIO('{"code": "print(1)"}\n{"code": "print(2)"}\n'), out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert status == 1 and lines[0]["ready"] and len(lines) == 2  # the second call never ran
    assert lines[1]["ok"] is False and lines[1]["leak"] is True and "pid 7 survives" in lines[1]["error"]
    assert Leaky.closed


@pytest.mark.slurm
def test_inside_a_job_the_workers_are_steps_beside_the_running_mpi_step(slurm_cluster, tmp_path):
    """No partition: the worker is a step of the current allocation (srun --overlap), even
    while another step (the MPI world) holds every task of the job."""
    script = tmp_path / "tools_in_job.py"
    script.write_text(
        "from libra_hpc.config import validate_config\n"
        "from libra_hpc.tools.orchestrator import orchestrator_from_config\n"
        f"cfg = validate_config({{'tools': {{'placement': 'slurm', 'max_workers': 1, 'wall_time_s': 60.0, "
        f"'uid_base': {UID_BASE + 30}}}}})\n"
        "orch = orchestrator_from_config(cfg.tools, cfg.scheduler)\n"
        "result = orch.submit('t', 'python', 'cpu', 'print(6 * 7)').result(timeout=120)\n"
        "print('RESULT', result.stdout.strip(), result.state.key(), sorted(orch.runners['cpu'].nodes().values()), "
        "flush=True)\n"
        "orch.close()\n")
    # The step holds every task until the tool call has finished (it never ends by itself), and
    # the call starts only once both of the step's tasks run: had the worker waited for the
    # step's tasks, the call would have hung until its timeout and the job failed.
    job = ("srun --nodes=2 --ntasks=2 sh -c 'touch step.$SLURM_PROCID; exec sleep 3600' & step=$!; "
           "until [ -e step.0 ] && [ -e step.1 ]; do sleep 0.1; done; "
           f"{sys.executable} {script}; status=$?; kill $step; wait; exit $status")
    job_id = slurm_cluster.run("sbatch", "--parsable", "--nodes=2", "--ntasks=2", f"--chdir={tmp_path}",
                               f"--output={tmp_path}/job.out", "--wrap", job).strip()
    state = slurm_cluster.wait_job(job_id, timeout_s=180)
    out = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", out
    line = next(line for line in out.splitlines() if line.startswith("RESULT"))
    assert line.startswith("RESULT 42 python|S|success ['node"), out
