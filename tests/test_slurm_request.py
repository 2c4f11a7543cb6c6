"""What a config asks Slurm for: sbatch directives, submitit parameters, the MPI job step,
and the plain sbatch entry (sbatch/libra.sh) agreeing with them."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from libra_hpc.cluster.slurm import WORLD_STEP_DEFAULTS, SlurmRequest, world_step_env
from libra_hpc.config import load_config

ROOT = Path(__file__).resolve().parent.parent
A800 = ROOT / "configs" / "a800-6node.yaml"
DEFAULT = ROOT / "configs" / "default.yaml"
SBATCH_SCRIPT = ROOT / "sbatch" / "libra.sh"
WORLD_FLAGS = ("--mpi=pmi2", "--overcommit", "--kill-on-bad-exit=1")


def request(*overrides: str) -> SlurmRequest:
    return SlurmRequest.from_config(load_config(A800, list(overrides)))


# ------------------------------------------------------------------- the request


def test_a800_request():
    req = request()
    assert (req.nodes, req.gpus_per_node, req.cpus_per_task) == (6, 8, 8)
    assert req.world_size == 6 * 8 + 1 == 49
    assert req.time_minutes == 24 * 60  # "1-00:00:00"
    assert req.job_name == "libra-a800"


def test_sbatch_directives():
    lines = request().sbatch_directives()
    assert all(line.startswith("#SBATCH --") for line in lines)
    for expected in ("--job-name=libra-a800", "--nodes=6", "--ntasks-per-node=8", "--gpus-per-node=8",
                     "--cpus-per-task=8", "--time=1440", "--signal=B:USR2@300", "--requeue"):
        assert f"#SBATCH {expected}" in lines
    assert not any(key in line for line in lines for key in ("--partition", "--account", "--qos", "--constraint"))


def test_optional_directives_only_when_set():
    req = request("cluster.partition=gpu", "cluster.account=proj1", "cluster.qos=high",
                  "cluster.constraint=a800", "cluster.requeue=false")
    lines = req.sbatch_directives()
    for expected in ("--partition=gpu", "--account=proj1", "--qos=high", "--constraint=a800"):
        assert f"#SBATCH {expected}" in lines
    assert "#SBATCH --requeue" not in lines


def test_submitit_parameters():
    params = request().submitit_parameters()
    assert params["use_srun"] is False  # the batch step itself starts the MPI world with srun
    assert params["ntasks_per_node"] == params["gpus_per_node"] == 8
    assert params["nodes"] == 6
    assert params["time"] == 1440
    # the time-limit warning to the batch step only, whose shell ignores it (the Python
    # process relays it to rank 0): no rank of the MPI world is signalled
    assert params["additional_parameters"] == {"requeue": True, "signal": "B:USR2@300"}
    assert params["setup"] == ["trap '' USR2"]
    assert not {"partition", "account", "qos", "constraint"} & params.keys()

    params = request("cluster.requeue=false", "cluster.partition=gpu", "cluster.qos=high").submitit_parameters()
    assert params["additional_parameters"] == {"signal": "B:USR2@300"}
    assert (params["partition"], params["qos"]) == ("gpu", "high")


@pytest.mark.parametrize("overrides", [(), ("cluster.partition=gpu", "cluster.account=proj1", "cluster.requeue=false")])
def test_submitit_writes_the_same_sbatch_header(tmp_path, overrides):
    req = request(*overrides)
    text = _make_sbatch_string(command="python x", folder=tmp_path, **req.submitit_parameters())
    lines = text.splitlines()
    assert "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --ntasks-per-node=8" in lines
    assert ("#SBATCH --requeue" in lines) == req.requeue
    assert [line for line in lines if "--signal" in line] == ["#SBATCH --signal=B:USR2@300"]  # submitit's own replaced
    assert lines.index("trap '' USR2") < lines.index("python x")
    # what submitit writes covers our own --dry-run description
    assert set(req.sbatch_directives()) <= set(lines)
    # use_srun=False: the command runs directly in the batch step
    assert "python x" in lines
    assert not any(line.lstrip().startswith("srun") for line in lines)


def test_srun_command():
    cmd = request().srun_command(Path("/tmp/exp.yaml"), python="/venv/bin/python")
    assert cmd[0] == "srun"
    for flag in WORLD_FLAGS + ("--nodes=6", "--ntasks=49"):
        assert flag in cmd
    assert cmd[cmd.index("-m") - 1] == "/venv/bin/python"
    assert cmd[cmd.index("-m") + 1] == "libra_hpc.run"
    assert cmd[-2:] == ["--config", "/tmp/exp.yaml"]


# --------------------------------------------------------------- sbatch/libra.sh


def _script_lines() -> list[str]:
    """The script with backslash continuations joined."""
    return SBATCH_SCRIPT.read_text().replace("\\\n", " ").splitlines()


def _sbatch_header() -> dict[str, str]:
    header = {}
    for line in _script_lines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            header[match.group(1)] = match.group(2)
    return header


def test_script_srun_line_matches_srun_command():
    sruns = [line for line in _script_lines() if line.lstrip().startswith("srun ")]
    assert len(sruns) == 1
    # world_size: N·G workers + the controller
    assert re.search(r"--ntasks=\$\(\(\s*NODES \* GPUS \+ 1\s*\)\)", sruns[0])
    srun = shlex.split(sruns[0])
    ours = request().srun_command(Path("c.yaml"))
    assert [a for a in srun if a in WORLD_FLAGS] == [a for a in ours if a in WORLD_FLAGS] == list(WORLD_FLAGS)
    assert '--nodes=$NODES' in srun
    assert srun[srun.index("-m") + 1] == "libra_hpc.run"


def test_the_world_step_uses_mpichs_ofi_over_tcp_unless_the_user_names_a_transport():
    # over UCX, MPICH's address lines can outgrow what Slurm's pmi2 plugin reads at once
    assert world_step_env({"PATH": "/bin"}) == {"PATH": "/bin", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    assert world_step_env({"MPIR_CVAR_CH4_NETMOD": "ucx", "FI_PROVIDER": "verbs"}) == {
        "MPIR_CVAR_CH4_NETMOD": "ucx", "FI_PROVIDER": "verbs"}
    lines = _script_lines()
    srun = next(i for i, line in enumerate(lines) if line.lstrip().startswith("srun "))
    for name, value in WORLD_STEP_DEFAULTS.items():  # the script's world has the same defaults
        assert f'export {name}="${{{name}:-{value}}}"' in lines[:srun]


def test_script_header_one_task_per_gpu():
    header = _sbatch_header()
    assert header["ntasks-per-node"] == header["gpus-per-node"]
    assert header["signal"].startswith("B:USR2@")  # to the batch shell only (it tells rank 0)
    assert "requeue" in header


def test_script_header_shape_validates_with_default_config():
    # the script passes the allocation's shape as overrides to the config it runs
    header = _sbatch_header()
    cfg = load_config(DEFAULT, [f"cluster.nodes={header['nodes']}", f"cluster.gpus_per_node={header['gpus-per-node']}"])
    assert cfg.cluster.total_gpus == int(header["nodes"]) * int(header["gpus-per-node"])


def test_script_flags_are_accepted_by_the_rank_entry(tmp_path, capsys):
    # The script runs `python -m libra_hpc.run --config C --log-dir D --set K=V ...`; argparse
    # must accept these flags. A missing config then fails cleanly (2) before MPI starts.
    from libra_hpc.run import main

    text = SBATCH_SCRIPT.read_text()
    for flag in ("--config", "--log-dir", "--set"):
        assert flag in text
    code = main(["--config", str(tmp_path / "missing.yaml"), "--log-dir", str(tmp_path), "--set", "cluster.nodes=2"])
    assert code == 2
    assert "cannot read the file" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_time_left_as_squeue_says_it():
    from libra_hpc.config_checks import slurm_time_s

    assert [slurm_time_s(t) for t in ("2:05", "1:00:00", "3-04:05:06", " 0:30\n")] == [125, 3600, 273906, 30]
    assert [slurm_time_s(t) for t in ("UNLIMITED", "NOT_SET", "INVALID", "")] == [None] * 4


def test_the_batch_step_tells_rank_0_once_when_the_limit_is_near(tmp_path):
    """submitit's batch step: ``STOP`` in the log folder when squeue's time left falls to
    the warning's lead, or when SIGUSR2 reaches it, whichever first; once."""
    import os
    import signal

    from libra_hpc.cluster.slurm import TimeLimitRelay

    (tmp_path / "STOP").write_text("an earlier run's\n")
    left = iter([600.0, None, 121.0, 120.0, 30.0])
    relay = TimeLimitRelay(tmp_path, "42", before_s=120, every_s=3600, time_left=lambda job: next(left))
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        relay.start()
        assert not (tmp_path / "STOP").exists()  # the earlier run's note is not this run's
        for _ in range(3):
            relay.look()  # 600 s, unknown, 121 s left: nothing yet
        assert relay.said is None and not (tmp_path / "STOP").exists()
        relay.look()
        assert (tmp_path / "STOP").read_text() == "time limit in 120 s (squeue; cluster.signal_before_limit_s=120)\n"
        os.kill(os.getpid(), signal.SIGUSR2)  # the warning after the note: the first word stands
        assert (tmp_path / "STOP").read_text().startswith("time limit in 120 s")
    finally:
        relay.close()
        signal.signal(signal.SIGUSR2, previous)

    relay = TimeLimitRelay(tmp_path / "b", "43", before_s=120, every_s=3600, time_left=lambda job: None)
    (tmp_path / "b").mkdir()
    try:
        relay.start()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert (tmp_path / "b" / "STOP").read_text() == "SIGUSR2 (the time-limit warning, to the batch step)\n"
    finally:
        relay.close()
        signal.signal(signal.SIGUSR2, previous)
