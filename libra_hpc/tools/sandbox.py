"""Run one untrusted snippet under limits and always reap everything it started.

A :class:`Sandbox` is one *slot*: a dedicated uid (when run as root) that only one run uses
at a time, so a run's processes are exactly the live processes of that uid. A slot runs
one call at a time; the orchestrator gives every worker its own slot.

What one call guarantees, whatever the snippet does (see isolation.py for the mounts):
- it ends by ``limits.wall_time_s``: on expiry the whole tree is SIGKILLed (process group,
  pid namespace, then a ``/proc`` scan by uid/marker) and the result says ``timed_out``;
- its output is read incrementally and kept up to ``limits.output_limit_bytes`` (stdout
  and stderr together); beyond that the tree is killed and the result says
  ``output_truncated`` (like ``RLIMIT_FSIZE`` for pipes: a runaway printer cannot blow our
  memory nor keep a worker busy until the wall-time limit);
- when the main process exits, anything it left behind (daemons, double forks) is killed;
  the call returns only once no process of the run is alive (RuntimeError otherwise).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from libra_hpc.scheduler.state import classify
from libra_hpc.scheduler.types import ToolState
from libra_hpc.tools.cgroups import CallCgroup
from libra_hpc.tools.cleanup import remove_files_of, remove_sysv_ipc_of
from libra_hpc.tools.isolation import (
    LEFTOVER_EXIT,
    MARKER_VAR,
    SANDBOX_CODE_DIR,
    SandboxLimits,
    SandboxUnavailable,
    bwrap_argv,
    choose_isolation,
    parse_wrapper_report,
    prlimit_argv,
    sandbox_env,
    setpriv_argv,
    wrapper_argv,
)
from libra_hpc.tools.procs import kill_owned
from libra_hpc.tools.seccomp import filter_fd
from libra_hpc.tools.slots import DEFAULT_LOCK_DIR, SlotBusy, SlotLock, check_unassigned
from libra_hpc.tools.supervise import Outcome, Supervisor

log = logging.getLogger(__name__)


def _read_available(fd: int, limit: int = 4096) -> str:
    """What is in a pipe right now (at most ``limit`` bytes), without blocking."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit).decode("ascii", "replace")
    except BlockingIOError:
        return ""


def world_reachable(path: str) -> bool:
    """Whether any uid may execute ``path``: every parent directory world-searchable and
    the file world-executable."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & 0o001:
            return False
        parent = os.path.dirname(real)
        while parent != "/":
            if not os.stat(parent).st_mode & 0o001:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call, as the model and C-MLFQ see it."""

    tool: str
    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status; negative ``-N`` (rlimit mode) or ``128 + N`` (bwrap) when killed by signal N."""
    timed_out: bool
    output_truncated: bool
    wall_s: float
    """Seconds from start to the last process reaped."""
    cpu_s: float | None
    """User + system CPU seconds of the command's reaped tree; None when it was killed
    before this could be measured (bwrap: the in-sandbox wrapper reports it)."""
    state: ToolState
    isolation: str
    leftovers_killed: int = 0
    """Processes still alive after the main one ended (daemons) that the sandbox killed."""

    @property
    def output(self) -> str:
        """What the model gets back: stdout then stderr."""
        return self.stdout + self.stderr


@dataclass(frozen=True)
class ClassifyRules:
    """How a return is turned into a C-MLFQ ToolState (``scheduler.size_thresholds`` and
    ``scheduler.error_markers``)."""

    size_thresholds: tuple[int, ...] = (256, 4096)
    error_markers: tuple[str, ...] = ("Traceback (most recent call last)", "Error:", "error:", "Exception")


DEFAULT_LIMITS = SandboxLimits()
DEFAULT_RULES = ClassifyRules()


class Sandbox:
    """One sandbox slot. ``uid``: the slot's dedicated uid, used only when we run as root: it
    must not be in the password database (ValueError) and is held exclusively through an
    flock under ``lock_dir`` for this object's life (:class:`SlotBusy` when another Sandbox
    holds it; :meth:`close` releases it). ``isolation``: ``bwrap``, ``rlimit`` (root only) or
    ``auto`` (= bwrap; never a silent fallback), see isolation.py; :class:`SandboxUnavailable`
    when that mode cannot start here."""

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, *, uid: int = 200000, isolation: str = "auto",
                 python: str = "", rules: ClassifyRules = DEFAULT_RULES, lock_dir: str = DEFAULT_LOCK_DIR):
        self.limits = limits
        self.python = python or sys.executable
        self.uid = uid if os.geteuid() == 0 else None
        self.rules = rules
        self._lock = None
        if self.uid is not None:  # the slot first: the isolation probe runs as its uid, which the
            check_unassigned(self.uid)  # holder of the slot may reap at any moment
            self._lock = SlotLock(self.uid, lock_dir)
        try:
            self.isolation = choose_isolation(isolation, self.python, self.uid)
        except Exception:
            self.close()
            raise
        if self.isolation == "rlimit":
            self.python = self._reachable_python()
            log.warning("tool sandbox slot uid=%s runs WITHOUT namespaces (rlimit fallback): snippets can read "
                        "world-readable host files and reach the network", self.uid)
        if self.uid is not None:
            kill_owned(self.uid, None)  # a slot starts empty, whatever an earlier process left

    def close(self) -> None:
        """Release the slot uid (the object must not run calls afterwards)."""
        if self._lock is not None:
            self._lock.release()

    def _reachable_python(self) -> str:
        """In rlimit mode as root the snippet runs as the slot uid on the host's files: the
        interpreter must be world-executable (a pyenv under a 0700 /root is not)."""
        if self.uid is None or world_reachable(self.python):
            return self.python
        if world_reachable("/usr/bin/python3"):
            log.warning("tool sandbox: %s is not reachable by the slot uid %d; rlimit mode uses /usr/bin/python3",
                        self.python, self.uid)
            return "/usr/bin/python3"
        raise SandboxUnavailable(f"tools.python: {self.python} cannot be executed by the sandbox uid {self.uid} "
                           "(a parent directory is not world-searchable); set tools.python to a world-executable interpreter")

    def run_python(self, code: str, tool: str = "python") -> ToolResult:
        """Run ``code`` with this sandbox's interpreter (``python -I``: no user site, no
        PYTHON* variables, the working directory not on sys.path)."""
        return self._run(code, lambda code_path: [self.python, "-I", code_path], tool)

    def run_argv(self, argv: Sequence[str], tool: str = "shell") -> ToolResult:
        """Run a command (e.g. ``["bash", "-c", "..."]``) under the same limits."""
        if not argv:
            raise ValueError("run_argv needs a non-empty command")
        return self._run(None, lambda _code_path: list(argv), tool)

    # ------------------------------------------------------------------ internals
    def _run(self, code: str | None, command, tool: str) -> ToolResult:
        if self._lock is not None and not self._lock.held:
            raise RuntimeError(f"sandbox slot uid {self.uid} was closed; make a new Sandbox")
        marker = f"{MARKER_VAR}={uuid.uuid4().hex}"
        host_dir = tempfile.mkdtemp(prefix="libra-sbx-")  # 0700: other slots cannot read the code
        cgroup = self._call_cgroup()
        seccomp = None
        try:
            code_path = os.path.join(host_dir, "main.py")
            with open(os.open(code_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
                f.write(code or "")
            if self.uid is not None:  # the slot uid alone may read its code
                os.chown(host_dir, self.uid, self.uid)
                os.chown(code_path, self.uid, self.uid)
            if self.isolation == "bwrap":
                seccomp = filter_fd()
                argv = bwrap_argv(self.limits, host_dir, self.python, self.uid, marker.split("=", 1)[1], seccomp)
                argv += wrapper_argv() + command(f"{SANDBOX_CODE_DIR}/main.py")
                env, cwd = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, None
            else:
                cwd = os.path.join(host_dir, "work")
                os.mkdir(cwd, 0o700)
                drop = []
                if self.uid is not None:
                    os.chown(cwd, self.uid, self.uid)
                    drop = [*setpriv_argv(self.uid), "--"]
                argv = drop + prlimit_argv(self.limits) + command(code_path)
                env = sandbox_env(marker.split("=", 1)[1], cwd)
            if cgroup is not None:
                argv = cgroup.join_argv() + argv
            return self._supervise(argv, env, cwd, marker, tool, cgroup, seccomp)
        finally:
            if seccomp is not None:
                os.close(seccomp)
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(host_dir, ignore_errors=True)
            if self.isolation == "rlimit" and self.uid is not None:
                remove_files_of(self.uid)
                remove_sysv_ipc_of(self.uid)

    _cgroup_warned = False

    def _call_cgroup(self) -> CallCgroup | None:
        """The call's cgroup (aggregate memory and process limits), when we can make one."""
        if self.limits.call_memory_mb == 0 or os.geteuid() != 0:
            return None
        cgroup = CallCgroup.create(self.limits.call_memory_mb << 20, self.limits.max_processes + 4)
        if cgroup is None and not Sandbox._cgroup_warned:
            Sandbox._cgroup_warned = True
            log.warning("tool sandbox: no cgroup can be created here; a call's processes together may use up to "
                        "tools.memory_mb x tools.max_processes = %d MiB", self.limits.memory_mb * self.limits.max_processes)
        return cgroup

    def _supervise(self, argv, env, cwd, marker, tool, cgroup, seccomp: int | None) -> ToolResult:
        start = time.monotonic()
        report_r, report_w = os.pipe() if self.isolation == "bwrap" else (None, None)  # the wrapper's status channel
        try:
            proc = subprocess.Popen(argv, stdin=report_w if report_w is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                                    start_new_session=True, close_fds=True, pass_fds=() if seccomp is None else (seccomp,))
        finally:
            if report_w is not None:
                os.close(report_w)
        try:
            outcome = Supervisor(proc, self.limits.wall_time_s, self.limits.output_limit_bytes,
                                 kill_tree=lambda p: self._kill_tree(p, marker, cgroup),
                                 kill_leftovers=lambda: kill_owned(self.uid, marker)).run()
            report = _read_available(report_r) if report_r is not None else ""
        finally:
            if report_r is not None:
                os.close(report_r)
        proc.returncode = os.waitstatus_to_exitcode(outcome.status)
        if outcome.leftovers:
            log.info("sandbox (%s): killed %d processes left behind", tool, outcome.leftovers)
        oom = cgroup is not None and cgroup.oom_killed()
        return self._result(tool, proc.returncode, outcome, report, oom, time.monotonic() - start)

    def _result(self, tool: str, exit_code: int, outcome: Outcome, report: str, oom: bool, wall_s: float) -> ToolResult:
        """The ToolResult and its C-MLFQ state. A run that was cut for its output or left
        processes behind is a failure even if its main process exited 0."""
        stdout, stderr = outcome.stdout.decode("utf-8", "replace"), outcome.stderr.decode("utf-8", "replace")
        if outcome.truncated:
            stderr += f"\n[libra_hpc sandbox: output exceeded {self.limits.output_limit_bytes} bytes; the tool was killed]\n"
        if outcome.timed_out:
            stderr += f"\n[libra_hpc sandbox: wall-time limit of {self.limits.wall_time_s} s reached; the tool was killed]\n"
        if oom:
            stderr += (f"\n[libra_hpc sandbox: the call's memory limit of {self.limits.call_memory_mb} MiB was reached; "
                       "the kernel killed a process]\n")
            exit_code = exit_code or -signal.SIGKILL
        cpu_s, inside = parse_wrapper_report(report)
        leftovers = max(outcome.leftovers, inside)  # our scan may have caught the same ones
        if self.isolation != "bwrap":
            cpu_s = outcome.rusage.ru_utime + outcome.rusage.ru_stime if outcome.rusage else None
        if leftovers and exit_code == 0:
            exit_code = LEFTOVER_EXIT
        state_code = -signal.SIGKILL if outcome.truncated and exit_code == 0 else exit_code
        state = classify(tool, stdout + stderr, state_code, outcome.timed_out, self.rules.size_thresholds,
                         self.rules.error_markers)
        return ToolResult(tool, stdout, stderr, exit_code, outcome.timed_out, outcome.truncated, wall_s, cpu_s,
                          state, self.isolation, leftovers)

    def _kill_tree(self, proc, marker, cgroup):
        """SIGKILL the call's cgroup, the process group (bwrap's monitor; its pid-namespace
        init follows by PDEATHSIG and takes the namespace down), then every process of the
        run by uid or marker; reap the main process. Returns its (wait status, rusage)."""
        if cgroup is not None:
            cgroup.kill_all()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_owned(self.uid, marker)
        _, wstatus, ru = os.wait4(proc.pid, 0)
        kill_owned(self.uid, marker)
        return wstatus, ru


def first_free_sandbox(limits: SandboxLimits, uid_base: int, slots: int, **kwargs) -> Sandbox:
    """A Sandbox on the first slot uid ``uid_base + i`` (``i < slots``) no other Sandbox
    holds; RuntimeError when all are busy. ``kwargs`` go to :class:`Sandbox`."""
    for uid in range(uid_base, uid_base + slots):
        try:
            return Sandbox(limits, uid=uid, **kwargs)
        except SlotBusy:
            continue
    raise RuntimeError(f"all {slots} sandbox slots uid {uid_base}..{uid_base + slots - 1} are in use "
                       "(tools.uid_base, tools.max_workers); wait for a run to end or raise tools.max_workers")
