"""scripts/site_check.py: its decisions on canned outputs of sinfo, srun, mpi4py, torch, vLLM,
bwrap and /dev/shm; the smoke job's overrides against the schema; then the script itself,
once, on this machine (whatever it has: the structure of the report, not its verdicts)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("site_check", ROOT / "scripts" / "site_check.py")
sc = sys.modules["site_check"] = importlib.util.module_from_spec(_spec)  # dataclasses look the module up
_spec.loader.exec_module(sc)

GIB = 1 << 30
NO_CONFIG = ("sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
             "sinfo: fatal: Could not establish a configuration source\n")


def test_slurm_version_passes_from_19_05_and_names_the_missing_configuration():
    assert sc.parse_slurm_version("slurm 22.05.8\n") == (22, 5, 8)
    assert sc.parse_slurm_version("slurm-wlm 23.11.4") == (23, 11, 4)
    assert sc.slurm_version_result(0, "slurm 22.05.8\n") == sc.Result("slurm.version", "PASS", "slurm 22.05.8")
    old = sc.slurm_version_result(0, "slurm 18.08.9")
    assert old.status == "FAIL" and "19.05" in old.fix
    bare = sc.slurm_version_result(1, NO_CONFIG)
    assert bare.status == "FAIL" and "SLURM_CONF" in bare.fix and "configuration source" in bare.found
    assert "apt-get install slurm-client" in sc.slurm_version_result(127, "sinfo: not found on PATH").fix


def test_controller_is_up_only_when_scontrol_ping_says_so():
    assert sc.slurm_ping_result(0, "Slurmctld(primary) at node0 is UP\n").status == "PASS"
    down = sc.slurm_ping_result(1, "Slurmctld(primary) at node0 is DOWN\n")
    assert down.status == "FAIL" and "slurmctld" in down.fix and "DOWN" in down.found


def test_gres_needs_a_gpu_on_some_node():
    ok = sc.gres_result(0, "node[1-4] gpu:a100:8(S:0-1)\nlogin (null)\n")
    assert ok.status == "PASS" and ok.found == "node[1-4]: gpu:a100:8(S:0-1)"
    none = sc.gres_result(0, "node[1-4] (null)\n")
    assert none.status == "FAIL" and "GresTypes=gpu" in none.fix and "node[1-4]: (null)" in none.found


def test_mpi_list_needs_pmi2():
    new = ("MPI plugin types are...\n\tnone\n\tcray_shasta\n\tpmi2\n\tpmix\n"
           "specific pmix plugin versions available: pmix_v4\n")
    old = "srun: MPI types are...\nsrun: none\nsrun: openmpi\nsrun: pmi2\n"
    assert sc.parse_mpi_list(new) == {"none", "cray_shasta", "pmi2", "pmix"}
    assert sc.parse_mpi_list(old) == {"none", "openmpi", "pmi2"}
    assert sc.mpi_list_result(0, new).status == "PASS"
    only_pmix = sc.mpi_list_result(0, "MPI plugin types are...\n\tnone\n\tpmix\n")
    assert only_pmix.status == "FAIL" and "pmi2" in only_pmix.fix and "none, pmix" in only_pmix.found


def test_mpi4py_names_its_mpi_and_refuses_open_mpi_5():
    mpich = sc.mpi4py_result({"mpi4py": "4.1.2", "library": "MPICH Version:      5.0.2\nMPICH Release date: x\n"}, "")
    assert mpich == sc.Result("mpi.mpi4py", "PASS", "mpi4py 4.1.2 on MPICH Version: 5.0.2")
    ompi4 = sc.mpi4py_result({"mpi4py": "4.0.1", "library": "Open MPI v4.1.5, package: Open MPI"}, "")
    assert ompi4.status == "PASS"
    ompi5 = sc.mpi4py_result({"mpi4py": "4.0.1", "library": "Open MPI v5.0.3, package: Open MPI"}, "")
    assert ompi5.status == "FAIL" and "singleton" in ompi5.found and "MPICH" in ompi5.fix
    missing = sc.mpi4py_result(None, "ModuleNotFoundError: No module named 'mpi4py'")
    assert missing.status == "FAIL" and "No module named" in missing.found and "pip install" in missing.fix


def test_cuda_skips_without_a_gpu_and_fails_when_torch_cannot_see_one():
    cpu = {"torch": "2.13.0+cpu", "cuda": False, "built_cuda": None, "devices": 0, "nccl": None}
    assert sc.cuda_result(cpu, "", nvidia_devices=0) == sc.Result("gpu.cuda", "SKIP", sc.NO_GPU)
    blind = sc.cuda_result(cpu, "", nvidia_devices=8)
    assert blind.status == "FAIL" and "8 /dev/nvidia*" in blind.found and "CUDA build" in blind.fix
    gpu = {"torch": "2.9.0+cu128", "cuda": True, "built_cuda": "12.8", "devices": 8, "nccl": "2.27.3"}
    ok = sc.cuda_result(gpu, "", nvidia_devices=8)
    assert ok.status == "PASS" and "8 GPUs" in ok.found and "NCCL 2.27.3" in ok.found
    assert sc.cuda_result({**gpu, "nccl": None}, "", 8).status == "FAIL"
    assert sc.cuda_result(None, "ImportError: libcudart.so.12", 8).status == "FAIL"


def test_vllm_cpu_build_fails_only_where_cuda_is():
    cpu = {"version": "0.32.0", "platform": "CpuPlatform", "device": "cpu", "cuda": False}
    assert sc.vllm_result(cpu, "").status == "PASS"
    wrong = sc.vllm_result({**cpu, "cuda": True}, "")
    assert wrong.status == "FAIL" and "pip install vllm" in wrong.fix
    login = sc.vllm_result({"version": "0.11.0", "platform": "UnspecifiedPlatform", "device": "", "cuda": False}, "")
    assert login.status == "PASS" and "no GPU here" in login.found
    assert sc.vllm_result(None, "ModuleNotFoundError: No module named 'vllm'").status == "FAIL"


def test_megatron_must_match_the_pin():
    assert sc.megatron_result({"version": "0.16.1"}, "", "0.16.1").status == "PASS"
    other = sc.megatron_result({"version": "0.14.0"}, "", "0.16.1")
    assert other.status == "FAIL" and other.fix == "pip install megatron-core==0.16.1"
    assert sc.megatron_result({"version": "0.14.0"}, "", None).status == "PASS"


def test_bwrap_and_user_namespaces_name_the_setting_to_change():
    assert sc.bwrap_result("bubblewrap 0.8.0\n", None).status == "PASS"
    old = sc.bwrap_result("bubblewrap 0.6.1\n", "probe exited 1: bwrap: Unknown option --disable-userns")
    assert old.status == "FAIL" and "--disable-userns" in old.found and ">= 0.8" in old.fix
    assert "user.max_user_namespaces=15000" in sc.userns_fix({"user.max_user_namespaces": "0"})
    assert "unprivileged_userns_clone=1" in sc.userns_fix(
        {"user.max_user_namespaces": "63000", "kernel.unprivileged_userns_clone": "0"})
    assert "AppArmor" in sc.userns_fix({"kernel.apparmor_restrict_unprivileged_userns": "1"})
    assert "setuid" in sc.userns_fix({})


def test_shm_fails_under_a_gib_and_counts_the_leftovers():
    counts = {"psm_*": 1, "sem.mp-*": 0, "mpich_shm_*": 2, "torch_*": 0, "vllm*": 1}
    ok = sc.shm_result(16 * GIB, 15 * GIB, counts, ["mpich_shm_9_0", "vllm_x"], GIB // 2)
    assert ok.status == "PASS" and "segments: psm_* 1, mpich_shm_* 2, vllm* 1;" in ok.found
    assert "2 left by killed runs (512 MiB)" in ok.found
    small = sc.shm_result(GIB // 2, GIB // 2, {}, [], 0)
    assert small.status == "FAIL" and "vLLM" in small.found and "size=" in small.fix and "segments: none" in small.found
    full = sc.shm_result(8 * GIB, GIB // 4, counts, ["vllm_x"], 1 << 20)
    assert full.status == "FAIL" and "free" in full.found and "remove_stale()" in full.fix


def test_smoke_reports_the_wall_time_or_the_tail():
    ok = sc.smoke_result(0, "log folder: /l/libra-local-1\ndone: exit status 0\n", 143.2, "local")
    assert ok.status == "PASS" and "143 s" in ok.found and "/l/libra-local-1" in ok.found
    books = {"steps": 2, "trajectories_trained": 8, "trajectories_lost": 0, "tool_calls": 0}
    said = "log folder: /l/libra-7 (batch output: /l/.submitit/7_0_log.out)\n"
    on_slurm = sc.smoke_result(0, said, 90, "auto", books)
    assert on_slurm.found == ("2-step job on 1 node (executor auto) done in 90 s: 2 steps, 8 trajectories trained, "
                              "0 lost, 0 tool calls; log folder /l/libra-7")
    out = "log folder: /l/x\n" + "".join(f"line {i}\n" for i in range(20)) + "FAILED: rank 2 died\n"
    bad = sc.smoke_result(1, out, 30.0, "auto")
    assert bad.status == "FAIL" and "FAILED: rank 2 died" in bad.found and "line 19" in bad.found
    assert "line 5" not in bad.found and bad.fix


def test_smoke_overrides_make_a_one_node_job_the_schema_accepts():
    from libra_hpc.cluster.layout import layout_from_config
    from libra_hpc.config import load_config

    cfg = load_config(sc.DEFAULT_CONFIG, list(sc.SMOKE_SETS), **{"cluster.nodes": 1, "cluster.gpus_per_node": 2})
    assert cfg.rl.steps == 2 and cfg.job.warmstart is False
    layout = layout_from_config(cfg)
    assert {g.role for g in layout.groups} == {"training", "rollout"}


def test_report_lines_summary_and_exit_status():
    results = [sc.Result("a", "PASS", "fine"), sc.Result("b", "FAIL", "broken", "do this"),
               sc.Result("c", "SKIP", "no GPU"), sc.Result("d", "SKIP", "no GPU"), sc.Result("e", "SKIP", "not asked")]
    assert sc.format_line(results[1]) == "FAIL  b                broken\n      fix: do this"
    assert sc.summary_line(results) == "1 PASS, 1 FAIL, 3 SKIP; not checked: c, d (no GPU); e (not asked)"
    assert sc.exit_status(results) == 1 and sc.exit_status(results[:1] + results[2:]) == 0


def test_a_crashing_check_becomes_its_fail_line():
    def broken():
        raise KeyError("library")

    (line,) = sc._guarded("mpi.mpi4py", broken)
    assert line.check == "mpi.mpi4py" and line.status == "FAIL" and "KeyError" in line.found and line.fix


def test_the_script_on_this_machine_reports_every_check():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "site_check.py"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    *results, summary = lines
    names = [r["check"] for r in results]
    assert names == ["slurm.version", "slurm.controller", "slurm.gres", "mpi.pmi", "mpi.mpi4py", "gpu.cuda", "vllm",
                     "megatron", "sandbox.bwrap", "sandbox.userns", "shm", "folder.logs", "folder.cache", "smoke"]
    for r in results:
        assert set(r) == {"check", "status", "found", "fix"} and r["status"] in sc.STATUSES, r
        assert r["found"], r  # a SKIP names its reason, a PASS what it found
        assert bool(r["fix"]) == (r["status"] == "FAIL"), r
    assert next(r for r in results if r["check"] == "smoke") == {
        "check": "smoke", "status": "SKIP", "found": "not asked for: --smoke runs a 2-step job on one node", "fix": ""}
    assert summary["summary"] == {s: sum(r["status"] == s for r in results) for s in sc.STATUSES}
    assert summary["not_checked"] == [r["check"] for r in results if r["status"] == "SKIP"]
    assert done.returncode == summary["exit"] == (1 if summary["summary"]["FAIL"] else 0), done.stderr
