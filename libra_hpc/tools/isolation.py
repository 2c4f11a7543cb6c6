"""How a sandboxed command is started: the command line for each isolation mode.

Two modes (``tools.isolation``):

``bwrap`` (bubblewrap). Fresh mount, pid, network, IPC and UTS namespaces. The snippet sees
a root made of: ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links into it) read-only,
the Python interpreter's own install tree read-only, a new ``/proc`` of its pid namespace,
a minimal ``/dev``, its code at ``/sandbox`` read-only and a private, size-capped tmpfs at
``/tmp`` as working directory. Nothing else: no ``/etc``, no home directories, no project
files, no host network (only a loopback of its own). The interpreter's trees are bound
after the tmpfs, at their own paths: a virtual environment in ``/tmp/v`` or one staged on
a node-local ``$TMPDIR`` under ``/tmp`` shows through the private ``/tmp`` (read-only; the
rest of the host's ``/tmp`` stays hidden). The pid namespace's init is bwrap's;
when the command or bwrap dies, the kernel kills every process left in the namespace.

- Run as root (CI, most containers): bwrap sets the namespaces up as root (it must, to bind
  an interpreter that lives under a 0700 ``/root``), then ``setpriv`` drops to the slot's
  dedicated uid with no capabilities and no-new-privs. A dedicated, unmapped uid makes
  ``RLIMIT_NPROC`` bite (the kernel ignores it for uid 0) and lets :mod:`procs` find every
  leftover by uid.
- Run as another user: unprivileged bwrap with a user namespace as well (and no nested
  ones); ``RLIMIT_NPROC`` then counts the processes of that user namespace only.

In both cases bwrap installs the seccomp filter of :mod:`seccomp` before the command
starts: ``setpriv`` cannot forbid new user namespaces (in which the slot uid would be root
and could mount past the tmpfs cap) nor the slot uid's kernel keyring (which outlives a
call); the filter denies both and more. The two tmpfs (``/tmp``, ``/dev/shm``) are each
``workdir_mb`` large; bwrap 0.8 has no option to cap their inode count.

``rlimit`` (the weaker fallback; only when asked for by name, ``auto`` never falls back to
it; root only): no namespaces and no seccomp filter. Limits, a new session, the slot's
dedicated uid and a private host directory (0700, owned by the slot uid) as working
directory, so the snippet cannot read root-only files (0700 home directories,
``/etc/shadow``), another slot's code, nor signal our processes. It *can* read
world-readable files (``/etc/passwd``, a world-readable checkout), reach the network
(127.0.0.1 included), fill the host disk file by file (``RLIMIT_FSIZE`` bounds one file)
and use the kernel keyring; after each call :mod:`cleanup` deletes the uid's files in
world-writable directories and its System V IPC objects. Without root it is refused: the
snippet would run as our own user (``kill -9 -1`` would kill all of our processes, and a
daemon that clears its environment drops the marker the reaping looks for).

In both modes ``prlimit`` (util-linux) applies the resource limits right before the
interpreter starts; it needs no ``preexec_fn`` (unsafe in a threaded orchestrator). When
run as root on a host with writable cgroup controllers, each call also gets its own cgroup
(cgroups.py) that bounds the memory and process count of all its processes together.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

from libra_hpc.tools.seccomp import filter_fd

log = logging.getLogger(__name__)

SANDBOX_CODE_DIR = "/sandbox"
"""Where the snippet's code is mounted read-only inside a bwrap sandbox."""
SANDBOX_WORKDIR = "/tmp"
"""The private, size-capped working directory inside a bwrap sandbox."""
MARKER_VAR = "LIBRA_SANDBOX"
"""Environment variable every sandboxed process inherits; its value names the run."""

_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(RuntimeError):
    """No sandbox of the configured mode can start on this host (bwrap missing or failing
    its probe, the interpreter not runnable inside, rlimit without root). Every call would
    fail the same way: the orchestrator fails the resource's actions at once with it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one tool call (``tools.*`` in the YAML; units in the names)."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    workdir_mb: int = 64
    output_limit_bytes: int = 65536
    call_memory_mb: int = 1024
    """All processes of one call together (cgroup, when available; 0: no cgroup)."""

    def __post_init__(self):
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_mb",
                     "max_open_files", "workdir_mb", "output_limit_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"tools.{name} must be > 0, got {getattr(self, name)!r}")
        if self.call_memory_mb < 0:
            raise ValueError(f"tools.call_memory_mb must be >= 0, got {self.call_memory_mb!r}")


def prlimit_argv(limits: SandboxLimits) -> list[str]:
    """``prlimit`` prefix setting soft:hard limits. CPU: SIGXCPU at the soft limit, SIGKILL
    one second later. No core dumps (a memory bomb would write hundreds of MB)."""
    mib = 1 << 20
    return ["prlimit", f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
            f"--as={limits.memory_mb * mib}:{limits.memory_mb * mib}",
            f"--nproc={limits.max_processes}:{limits.max_processes}",
            f"--fsize={limits.max_file_mb * mib}:{limits.max_file_mb * mib}",
            f"--nofile={limits.max_open_files}:{limits.max_open_files}", "--core=0:0", "--"]


def sandbox_env(marker: str, workdir: str) -> dict[str, str]:
    """The whole environment a snippet starts with (nothing of ours leaks in)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", MARKER_VAR: marker}


def interpreter_trees(python: str) -> list[str]:
    """Directories a bwrap sandbox must bind read-only, at these same paths, so that
    ``python`` runs there: the install prefix of every hop of its symlink chain (a virtual
    environment's own prefix holds ``pyvenv.cfg`` and its site-packages; the last hop is the
    real install), the base interpreter a ``pyvenv.cfg`` names (``home``: a ``--copies``
    venv has no link to it), and ``sys.prefix`` / ``sys.base_prefix`` when ``python`` is
    our own interpreter. Each path is kept as written and also resolved (an interpreter
    finds its prefix from its resolved location). Paths under ``/usr`` (bound anyway) and
    paths inside another kept tree are left out."""
    trees: set[str] = set()
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not realpath: venvs share the binary
        trees.update((sys.prefix, sys.base_prefix))
    for hop in _link_chain(python):
        prefix = os.path.dirname(os.path.dirname(hop))
        trees.add(prefix)
        home = _venv_home(prefix)
        if home:
            trees.add(os.path.dirname(home))
    trees |= {os.path.realpath(t) for t in trees}
    keep = sorted(os.path.normpath(t) for t in trees if not _system_path(t))
    return [t for t in keep if not any(t != other and _under(t, other) for other in keep)]


def _link_chain(path: str, hops: int = 40) -> list[str]:
    """``path`` (absolute) and every path its symlinks lead to, the resolved one last."""
    chain = [os.path.abspath(path)]
    while os.path.islink(chain[-1]) and len(chain) < hops:
        target = os.readlink(chain[-1])
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), target)))
    resolved = os.path.realpath(path)
    return chain if chain[-1] == resolved else [*chain, resolved]


def _venv_home(prefix: str) -> str:
    """The ``home`` (base interpreter's bin directory) of a ``pyvenv.cfg`` in ``prefix``, or ''."""
    try:
        with open(os.path.join(prefix, "pyvenv.cfg"), encoding="utf-8") as cfg:
            for line in cfg:
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    return os.path.normpath(value.strip())
    except OSError:
        pass
    return ""


def _system_path(path: str) -> bool:
    """Already in every sandbox: ``/``, ``/usr`` and what the ``/bin``-style links lead into it."""
    if path in ("", "/") or _under(path, "/usr"):
        return True
    return any(_under(path, link) and os.path.islink(link) and _under(os.path.realpath(link), "/usr")
               for link in _SYSTEM_LINKS)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _ancestors(path: str) -> list[str]:
    parts = PurePosixPath(path).parents
    return [str(p) for p in reversed(parts) if str(p) != "/"]


_OWN_MOUNTS = ("/proc", "/dev", SANDBOX_WORKDIR, "/dev/shm", SANDBOX_CODE_DIR)
"""Mount points a bwrap sandbox makes itself; an interpreter tree may lie under them (bound
on top) but must not cover them."""


def _check_tree(tree: str) -> None:
    for mount in _OWN_MOUNTS:
        if _under(mount, tree):
            raise ValueError(f"the interpreter's tree {tree} contains the sandbox's own {mount}: binding it would "
                             "show the host's files there; use an interpreter or virtual environment installed in a "
                             f"directory of its own (e.g. python3 -m venv {SANDBOX_WORKDIR}/venv), set as tools.python")


def bwrap_argv(limits: SandboxLimits, code_dir: str, python: str, uid: int | None, marker: str,
               seccomp_fd: int) -> list[str]:
    """The bwrap command line up to (and including) the limits prefix; append the command.

    ``uid``: the slot's dedicated uid when run as root (privileged bwrap + setpriv), None
    when run unprivileged (bwrap makes a user namespace). ``seccomp_fd``: an inheritable
    descriptor holding the filter of seccomp.py (``seccomp.filter_fd()``); the caller passes
    it to the child (``pass_fds``) and closes it after the start."""
    argv = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    if uid is None:
        argv[1:1] = ["--unshare-user", "--disable-userns"]
    for link in _SYSTEM_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.workdir_mb << 20),
             "--tmpfs", SANDBOX_WORKDIR, "--perms", "1777", "--size", str(limits.workdir_mb << 20), "--tmpfs", "/dev/shm",
             "--ro-bind", code_dir, SANDBOX_CODE_DIR]
    made = set(_OWN_MOUNTS)
    for tree in interpreter_trees(python):  # after the tmpfs: a tree under /tmp shows through it
        _check_tree(tree)
        for parent in _ancestors(tree):
            if parent not in made:  # bwrap would make missing parents 0700: unreadable after setpriv
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", os.path.realpath(tree), tree]
    argv += ["--chdir", SANDBOX_WORKDIR, "--seccomp", str(seccomp_fd), "--clearenv"]
    for key, value in sandbox_env(marker, SANDBOX_WORKDIR).items():
        argv += ["--setenv", key, value]
    if uid is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--",
                 *setpriv_argv(uid)]
    return argv + ["--"] + prlimit_argv(limits)


def setpriv_argv(uid: int) -> list[str]:
    """Drop from root to ``uid`` (as its own group), with no capabilities left anywhere and
    no-new-privs (a setuid binary cannot give them back)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]


LEFTOVER_EXIT = 125
"""Exit status of a bwrap sandbox whose command exited but left processes running (they
die with the pid namespace; the status makes the call a failure for C-MLFQ)."""

# Runs inside a bwrap sandbox as the parent of the command, with the *status channel* (the
# write end of a pipe from the supervisor) as its fd 0; the command gets /dev/null as stdin.
# After the command exits it reports the command's CPU time (``times``: the second line is
# the children's user and system time) and the number of live processes of the pid
# namespace other than bwrap's init (1) and itself. Shell builtins only: a forked helper
# would count itself. A snippet could write to the channel too; it would only misreport
# its own CPU time and leftovers.
_WRAPPER = (
    '"$@" </dev/null; rc=$?; times >&0; n=0; '
    'for d in /proc/[0-9]*; do p=${d#/proc/}; [ "$p" = 1 ] || [ "$p" = $$ ] && continue; '
    'while read -r k v _; do [ "$k" = State: ] && { [ "$v" = Z ] || n=$((n+1)); break; }; done < "$d/status" 2>/dev/null; '
    'done; echo "leftovers $n" >&0; '
    f'if [ $n -gt 0 ]; then exit {LEFTOVER_EXIT}; fi; exit $rc')


def wrapper_argv() -> list[str]:
    """Prefix for the command inside a bwrap sandbox (see _WRAPPER)."""
    return ["/bin/sh", "-c", _WRAPPER, "sh"]


def parse_wrapper_report(text: str) -> tuple[float | None, int]:
    """(CPU seconds of the command, leftover processes) from the wrapper's status channel;
    (None, 0) for what a killed wrapper did not write."""
    cpu = None
    times = re.findall(r"^(\d+)m([\d.]+)s (\d+)m([\d.]+)s$", text, flags=re.MULTILINE)
    if len(times) >= 2:
        um, us, sm, ss = times[1]
        cpu = 60 * (int(um) + int(sm)) + float(us) + float(ss)
    left = re.search(r"^leftovers (\d+)$", text, flags=re.MULTILINE)
    return cpu, int(left.group(1)) if left else 0


def missing_tools(mode: str) -> list[str]:
    """Executables ``mode`` needs that are not on PATH."""
    need = ["prlimit"] + (["setpriv"] if os.geteuid() == 0 else []) + (["bwrap"] if mode == "bwrap" else [])
    return [tool for tool in need if shutil.which(tool) is None]


@functools.lru_cache(maxsize=4)
def bwrap_problem(python: str, probe_uid: int | None) -> str | None:
    """Why bwrap cannot run sandboxes here (None: it can). Probed once per interpreter and
    uid by starting a real, trivial sandbox."""
    missing = missing_tools("bwrap")
    if missing:
        return f"{', '.join(missing)} not found on PATH (Debian: apt-get install bubblewrap util-linux)"
    code_dir = "/usr"  # any readable directory: the probe runs no code from it
    try:
        fd = filter_fd()
    except RuntimeError as err:  # an architecture the filter does not know
        return str(err)
    try:
        argv = bwrap_argv(SandboxLimits(), code_dir, python, probe_uid, "probe", fd) + [python, "-I", "-c", "pass"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, pass_fds=(fd,),
                              env={"PATH": os.environ.get("PATH", "")})
    except ValueError as err:  # an interpreter tree that would cover the sandbox's own mounts
        return str(err)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"probe failed: {err}"
    finally:
        os.close(fd)
    if done.returncode != 0:
        hint = ""
        if f"failed to execute {python}" in done.stderr:
            hint = (f" (the interpreter {python} cannot run inside the sandbox; bound read-only there: "
                    f"{', '.join(interpreter_trees(python)) or 'nothing outside /usr'})")
        return f"probe exited {done.returncode}: {done.stderr.strip()[-500:]}{hint}"
    return None


def choose_isolation(requested: str, python: str, probe_uid: int | None) -> str:
    """The mode to use for ``tools.isolation = requested`` (``auto``, ``bwrap``, ``rlimit``).

    ``auto`` means bwrap: it never falls back silently to the weaker mode. Raises
    :class:`SandboxUnavailable` when bwrap is wanted but cannot run (naming ``tools.isolation: rlimit`` as
    the explicit opt-in), when ``rlimit`` is asked for without root (``probe_uid`` None: no
    dedicated uid, so neither RLIMIT_NPROC nor the reaping by uid would hold), or when a
    mode's tools are missing."""
    if requested not in ("auto", "bwrap", "rlimit"):
        raise ValueError(f"tools.isolation must be auto, bwrap or rlimit, got {requested!r}")
    if requested in ("auto", "bwrap"):
        problem = bwrap_problem(python, probe_uid)
        if problem is None:
            return "bwrap"
        raise SandboxUnavailable(f"tools.isolation={requested} needs bwrap, which cannot run here: {problem}. Install "
                           "bubblewrap, or opt in to the weaker fallback with `tools.isolation: rlimit` (root only; "
                           "see its documentation in configs/README.md)")
    if probe_uid is None:
        raise SandboxUnavailable("tools.isolation=rlimit needs root: without a dedicated slot uid a snippet runs as our own "
                           "user (it could signal our processes, and a daemon that drops the marker escapes the "
                           "reaping); run as root or use tools.isolation=bwrap")
    missing = missing_tools("rlimit")
    if missing:
        raise SandboxUnavailable(f"tool sandbox needs {', '.join(missing)} on PATH (util-linux)")
    return "rlimit"
