"""Hostile snippets against the real sandbox: each is contained, reported as a failure or
timeout, leaves no process behind, and the next snippet runs normally.

The bwrap tests need bubblewrap (scripts/install.sh --test installs it); without it they
are skipped with the reason, except in CI (CI set, as tests/conftest.py reads it), where they fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from libra_hpc.tools.cgroups import CallCgroup
from libra_hpc.tools import isolation
from libra_hpc.tools.isolation import SANDBOX_WORKDIR, SandboxLimits, bwrap_argv, bwrap_problem, interpreter_trees
from libra_hpc.tools.procs import owned_pids
from libra_hpc.tools.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILE = ROOT / "README.md"
LIMITS = SandboxLimits(wall_time_s=60.0, cpu_time_s=10, memory_mb=256, max_processes=16, output_limit_bytes=8192,
                       workdir_mb=32, max_file_mb=8)
"""A wall limit that only guards against a hang: a snippet that should end on its own never
depends on how fast it starts on busy cores. The tests of the wall limit itself run under
SHORT_WALL_S (see :func:`wall_limit`)."""
SHORT_WALL_S = 3.0
UID = 210000  # tests' own slot uids, away from the default tools.uid_base


def _live_children() -> set[int]:
    """Our live (non-zombie) child processes. Some outlive a test by design (the session's
    Slurm daemons, multiprocessing's resource tracker): compare with ``_CHILDREN_BEFORE``."""
    me, found = str(os.getpid()), []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in Path(status).read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == me and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(status.split("/")[2]))
    return set(found)


_CHILDREN_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before_the_test():
    """What the process had started before this test: a sandbox must add nothing to it."""
    _CHILDREN_BEFORE.clear()
    _CHILDREN_BEFORE.update(_live_children())


@pytest.fixture(scope="module")
def bwrap_sandbox():
    problem = bwrap_problem(os.sys.executable, UID if os.geteuid() == 0 else None)
    if problem is not None:
        if os.environ.get("CI"):  # the rule of tests/conftest.py: any non-empty CI
            pytest.fail(f"bwrap sandbox unavailable in CI: {problem}")
        pytest.skip(f"bwrap sandbox unavailable: {problem}")
    return Sandbox(LIMITS, uid=UID, isolation="bwrap")


@pytest.fixture(scope="module")
def rlimit_sandbox():
    return Sandbox(LIMITS, uid=UID + 1, isolation="rlimit")


@contextlib.contextmanager
def wall_limit(sandbox: Sandbox, seconds: float = SHORT_WALL_S):
    """Calls in the block run under a wall limit of ``seconds`` (the sandbox reads its
    limits at each call); the follow-up checks of :func:`assert_contained` do not."""
    kept = sandbox.limits
    sandbox.limits = dataclasses.replace(kept, wall_time_s=seconds)
    try:
        yield sandbox
    finally:
        sandbox.limits = kept


def assert_contained(sandbox: Sandbox, result, statuses=("failure", "timeout")):
    assert result.state.status in statuses, (result.exit_code, result.stdout[-300:], result.stderr[-500:])
    if sandbox.uid is not None:
        assert owned_pids(uid=sandbox.uid) == []
    assert _live_children() - _CHILDREN_BEFORE == set()
    after = sandbox.run_python("print(sum(range(10)))")
    assert (after.stdout, after.exit_code, after.state.status) == ("45\n", 0, "success"), after.stderr


def test_plain_snippet_returns_output_and_state(bwrap_sandbox):
    result = bwrap_sandbox.run_python("import sys; print('out'); print('err', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("out\n", "err\n", 0, False)
    assert result.state.key() == "python|S|success" and result.isolation == "bwrap"
    assert result.wall_s > 0  # it ended before the wall limit: timed_out is False above


def test_cpu_time_of_the_snippet_is_measured_inside_the_namespace(bwrap_sandbox):
    result = bwrap_sandbox.run_python("import time\nt = time.process_time()\n"
                                      "while time.process_time() - t < 0.3: pass\nprint(time.process_time())")
    assert result.state.status == "success" and not result.timed_out
    own = float(result.stdout)  # the snippet's own CPU seconds at its end (>= 0.3 by its loop)
    assert own >= 0.3 and result.cpu_s >= own - 0.02  # the tree's CPU time covers the snippet's (to the clock tick)
    assert result.stderr == ""  # the wrapper reports on its own channel, not in the snippet's output


def test_command_line_probe_and_run():
    import json
    probe = subprocess.run([sys.executable, "-m", "libra_hpc.tools", "--probe"], capture_output=True, text=True,
                           check=True, cwd=ROOT)
    assert json.loads(probe.stdout)["configured"] == "auto"
    run = subprocess.run([sys.executable, "-m", "libra_hpc.tools", "-c", "print(6 * 7)"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert run.returncode == 0 and json.loads(run.stdout)["stdout"] == "42\n"
    bad = subprocess.run([sys.executable, "-m", "libra_hpc.tools", "-c", "raise SystemExit(3)"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert bad.returncode == 1 and json.loads(bad.stdout)["state"].endswith("|failure")


def test_traceback_with_exit_zero_is_a_failure_state(bwrap_sandbox):
    result = bwrap_sandbox.run_python("import traceback\ntry:\n    1/0\nexcept Exception:\n    traceback.print_exc()")
    assert result.exit_code == 0 and result.state.status == "failure"


def test_fork_bomb_is_bounded_by_max_processes(bwrap_sandbox):
    counter = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               "            time.sleep(3600)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
               "    print(n, flush=True)\n")  # the children live until the sandbox kills them
    result = bwrap_sandbox.run_python(counter)
    assert int(result.stdout) < LIMITS.max_processes  # the limit bites even though we run as root
    assert result.leftovers_killed > 0
    assert_contained(bwrap_sandbox, result)


def test_shell_fork_bomb(bwrap_sandbox):
    result = bwrap_sandbox.run_argv(["bash", "-c", "b() { b | b & }; b; wait"])
    assert_contained(bwrap_sandbox, result)


def test_memory_bomb(bwrap_sandbox):
    result = bwrap_sandbox.run_python("x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
    assert "MemoryError" in result.stderr
    assert_contained(bwrap_sandbox, result)


def test_many_processes_together_are_held_to_the_call_memory_limit(bwrap_sandbox):
    """Each child stays under RLIMIT_AS; together they exceed the call's cgroup limit."""
    probe = CallCgroup.create(64 << 20, 8)
    if probe is None:
        pytest.skip("no cgroup can be created on this host (needs root and writable memory/pids controllers)")
    probe.remove()
    limits = dataclasses.replace(LIMITS, call_memory_mb=256)
    sandbox = Sandbox(limits, uid=UID + 3, isolation="bwrap")
    # Each child holds its 200 MiB until the parent closes the pipe, which it does once the
    # first child has ended: one the limit killed (no sleep that must outlast the others' start).
    code = ("import os\nr, w = os.pipe()\nfor _ in range(6):\n    if os.fork() == 0:\n        os.close(w)\n"
            "        b = bytearray(200 << 20)\n        os.read(r, 1)\n        os._exit(0)\n"
            "statuses = [os.wait()[1]]\nos.close(w)\nstatuses += [os.wait()[1] for _ in range(5)]\n"
            "print('killed', sum(s != 0 for s in statuses))")
    result = sandbox.run_python(code)
    assert int(result.stdout.split()[1]) >= 1 and "memory limit of 256 MiB" in result.stderr
    assert result.state.status == "failure" and not result.timed_out
    assert_contained(sandbox, result)


def test_infinite_loop_times_out_at_wall_limit(bwrap_sandbox):
    with wall_limit(bwrap_sandbox):
        result = bwrap_sandbox.run_python("while True: pass")
    assert result.timed_out and result.state.status == "timeout"
    assert result.wall_s >= SHORT_WALL_S  # not killed before its limit
    assert_contained(bwrap_sandbox, result, statuses=("timeout",))


def test_cpu_limit_kills_a_busy_snippet_before_the_wall_limit():
    sandbox = Sandbox(SandboxLimits(wall_time_s=30.0, cpu_time_s=1), uid=UID + 2, isolation="auto")
    result = sandbox.run_python("while True: pass")
    assert not result.timed_out and result.state.status == "failure"
    assert result.exit_code in (-24, 128 + 24, -9, 128 + 9)  # SIGXCPU at the soft limit (SIGKILL at the hard)
    assert_contained(sandbox, result, statuses=("failure",))


def test_snippet_that_closes_its_pipes_still_times_out(bwrap_sandbox):
    with wall_limit(bwrap_sandbox):
        result = bwrap_sandbox.run_python("import os\nos.close(1)\nos.close(2)\nwhile True: pass")
    assert result.timed_out and result.wall_s >= SHORT_WALL_S  # ended by the wall limit, not by its pipes
    assert_contained(bwrap_sandbox, result, statuses=("timeout",))


def test_busy_double_forked_daemon_is_killed(bwrap_sandbox):
    daemon = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: pass\n"
              "    os._exit(0)\nprint('main done')")
    result = bwrap_sandbox.run_python(daemon)
    assert result.stdout == "main done\n" and result.leftovers_killed >= 1
    assert_contained(bwrap_sandbox, result)


def test_disk_filling_hits_file_size_and_workdir_caps(bwrap_sandbox):
    before = set(glob.glob("/tmp/libra-sbx-*"))
    one_file = bwrap_sandbox.run_python("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))")
    assert "File too large" in one_file.stderr
    assert_contained(bwrap_sandbox, one_file)
    many = bwrap_sandbox.run_python("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\n    i += 1")
    assert "No space left on device" in many.stderr
    assert_contained(bwrap_sandbox, many)
    assert set(glob.glob("/tmp/libra-sbx-*")) == before  # nothing written on the host's disk stays


def test_huge_output_is_truncated_and_killed(bwrap_sandbox):
    result = bwrap_sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 100000)")
    assert result.output_truncated and len(result.stdout) + len(result.stderr) < LIMITS.output_limit_bytes + 200
    assert result.state.size == "L" and not result.timed_out  # killed for its output, before the wall limit
    assert_contained(bwrap_sandbox, result, statuses=("failure",))


@pytest.mark.parametrize("path", [str(PROJECT_FILE), "/etc/passwd", "/etc/shadow", "/root/.bashrc",
                                  f"/proc/1/root{PROJECT_FILE}", "../../../../etc/passwd"])
def test_files_outside_the_sandbox_are_invisible(bwrap_sandbox, path):
    result = bwrap_sandbox.run_python(f"print(open({path!r}).read())")
    assert "FileNotFoundError" in result.stderr or "PermissionError" in result.stderr
    assert "root:" not in result.stdout and "libra_hpc" not in result.stdout
    assert_contained(bwrap_sandbox, result)


def test_symlinks_and_parent_dirs_do_not_escape(bwrap_sandbox):
    code = (f"import os\nos.symlink({str(PROJECT_FILE)!r}, 'link')\nos.symlink('/', 'root')\n"
            "print(sorted(os.listdir('root')))\nfor _ in range(10): os.chdir('..')\nprint(os.getcwd(), sorted(os.listdir('.')))\n"
            "print(open('/tmp/link').read())")
    result = bwrap_sandbox.run_python(code)
    assert "work" not in result.stdout and "etc" not in result.stdout and "FileNotFoundError" in result.stderr
    assert_contained(bwrap_sandbox, result)


def test_no_network_even_to_loopback(bwrap_sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = bwrap_sandbox.run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')")
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "ConnectionRefusedError" in result.stderr or "OSError" in result.stderr
    assert_contained(bwrap_sandbox, result)


@pytest.mark.parametrize("code", ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                                  "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill({me}, signal.SIGKILL)",
                                  "import os, signal\nos.kill(-1, signal.SIGKILL)\nimport time; time.sleep(0.2)"])
def test_signals_cannot_reach_the_host(bwrap_sandbox, code):
    result = bwrap_sandbox.run_python(code.format(me=os.getpid()))
    assert_contained(bwrap_sandbox, result)  # and we are still alive to check


def test_shell_kill_everything(bwrap_sandbox):
    result = bwrap_sandbox.run_argv(["bash", "-c", "kill -9 -1; sleep 1000; echo survived"])
    assert "survived" not in result.stdout and not result.timed_out  # the call's namespace went down with it
    assert_contained(bwrap_sandbox, result, statuses=("failure",))


# ---------------------------------------------------------------- an interpreter under /tmp

@pytest.fixture(scope="module")
def tmp_venv():
    """A virtual environment under the host's /tmp (as CI tools and HPC jobs staging on a
    node-local $TMPDIR make them), with a file beside it that sandboxes must not see."""
    root = Path(tempfile.mkdtemp(prefix="libra-test-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "v")], check=True,
                       capture_output=True)
        (root / "host-secret.txt").write_text("secret")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_interpreter_trees_follow_the_venv_its_links_and_its_base(tmp_venv):
    python = str(tmp_venv / "v" / "bin" / "python")
    trees = interpreter_trees(python)
    assert str(tmp_venv / "v") in trees  # pyvenv.cfg and site-packages
    base = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    assert base.startswith("/usr") or base in trees
    argv = bwrap_argv(LIMITS, "/usr", python, UID if os.geteuid() == 0 else None, "m", 99)
    tmpfs, bind = argv.index(SANDBOX_WORKDIR), argv.index(str(tmp_venv / "v"))
    assert argv[tmpfs - 1] == "--tmpfs" and argv[bind - 1:bind + 2] == ["--ro-bind", argv[bind], argv[bind]]
    assert bind > tmpfs  # bound on top of the private tmpfs, not hidden under it


def test_an_interpreter_tree_may_not_cover_the_private_tmp(monkeypatch):
    monkeypatch.setattr(isolation, "interpreter_trees", lambda python: ["/tmp"])
    with pytest.raises(ValueError, match="contains the sandbox's own /tmp.*directory of its own"):
        bwrap_argv(LIMITS, "/usr", "/tmp/bin/python", None, "m", 99)


def test_an_interpreter_under_tmp_runs_read_only_beside_a_private_tmp(bwrap_sandbox, tmp_venv):
    python = str(tmp_venv / "v" / "bin" / "python")
    sandbox = Sandbox(LIMITS, uid=UID + 10, isolation="bwrap", python=python)
    try:
        first = sandbox.run_python(
            "import os, sys\nprint(sys.prefix)\nprint(sorted(os.listdir('/tmp')))\n"
            f"print(sorted(os.listdir({str(tmp_venv)!r})))\nopen('/tmp/mine', 'w').write('x')\n"
            f"open({str(tmp_venv / 'host-secret.txt')!r})")
        lines = first.stdout.splitlines()
        assert lines == [str(tmp_venv / "v"), repr([tmp_venv.parts[2]]), "['v']"], (first.stdout, first.stderr)
        assert "FileNotFoundError" in first.stderr  # the rest of the host's /tmp stays hidden
        write = sandbox.run_python(f"open({python + '-evil'!r}, 'w')")
        assert "Read-only file system" in write.stderr or "PermissionError" in write.stderr, write.stderr
        assert not os.path.exists(python + "-evil")
        again = sandbox.run_python("import os\nprint(sorted(os.listdir('/tmp')))")
        assert again.stdout == repr([tmp_venv.parts[2]]) + "\n"  # each call gets a fresh /tmp
        assert_contained(sandbox, write)
    finally:
        sandbox.close()


# ---------------------------------------------------------------- the weaker fallback

def test_rlimit_fallback_reaps_loops_daemons_and_bombs(rlimit_sandbox):
    assert rlimit_sandbox.isolation == "rlimit"
    with wall_limit(rlimit_sandbox):
        loop = rlimit_sandbox.run_python("while True: pass")
    assert loop.timed_out and loop.wall_s >= SHORT_WALL_S
    assert_contained(rlimit_sandbox, loop, statuses=("timeout",))
    daemon = rlimit_sandbox.run_python("import os\nif os.fork() == 0:\n    os.setsid()\n    while True: pass\nprint('x')")
    assert daemon.leftovers_killed == 1
    assert_contained(rlimit_sandbox, daemon)
    bomb = rlimit_sandbox.run_python("import os\nwhile True: os.fork()")
    assert_contained(rlimit_sandbox, bomb)
    litter = rlimit_sandbox.run_python("open('/dev/shm/libra-test-litter', 'w').write('x')")
    assert litter.state.status == "success" and not os.path.exists("/dev/shm/libra-test-litter")


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback's dedicated uid needs root")
def test_rlimit_fallback_as_root_drops_to_the_slot_uid(rlimit_sandbox):
    result = rlimit_sandbox.run_python(
        "import os\nprint(os.getuid())\nos.kill(1, 9)")
    assert result.stdout == f"{rlimit_sandbox.uid}\n" and "PermissionError" in result.stderr
    secret = rlimit_sandbox.run_python("print(open('/etc/shadow').read())")
    assert "PermissionError" in secret.stderr
    assert_contained(rlimit_sandbox, secret)


# ---------------------------------------------------------------- unprivileged bwrap

NON_ROOT_HARNESS = """
import json, os, sys, types
# The project's interpreter may live under a 0700 /root and the system python may lack
# pydantic: load the sandbox without the packages' __init__ (config, and the workload that
# libra_hpc.tools re-exports through replay.py, need pydantic).
pkg = types.ModuleType("libra_hpc"); pkg.__path__ = [sys.argv[1]]; sys.modules["libra_hpc"] = pkg
tools = types.ModuleType("libra_hpc.tools"); tools.__path__ = [sys.argv[1] + "/tools"]; sys.modules["libra_hpc.tools"] = tools
from libra_hpc.tools.isolation import SandboxLimits
from libra_hpc.tools.procs import owned_pids
from libra_hpc.tools.sandbox import Sandbox
def lingers(pid):  # an exiting process (its memory, so its command line, already gone) is not left behind
    try:
        return bool(open(f"/proc/{pid}/cmdline", "rb").read())
    except OSError:
        return False
sandbox = Sandbox(SandboxLimits(max_processes=16), isolation="bwrap", python=sys.executable)
out = {"uid": sandbox.uid}
for name, (code, wall_s) in json.loads(sys.argv[2]).items():
    sandbox.limits = SandboxLimits(wall_time_s=wall_s, max_processes=16)  # read at each call
    r = sandbox.run_python(code)
    left = [p for p in owned_pids(uid=os.getuid()) if p != os.getpid() and lingers(p)]
    out[name] = [r.stdout, r.state.status, r.leftovers_killed, left]
print(json.dumps(out))
"""


def _world_searchable(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3")
                    or not _world_searchable(ROOT / "libra_hpc" / "tools"),
                    reason="needs root (to start a harness as an unprivileged user), the system python and a "
                           "world-readable checkout")
def test_unprivileged_bwrap_as_a_normal_user(bwrap_sandbox):
    """The non-root mode: bwrap makes a user namespace; RLIMIT_NPROC counts that namespace."""
    import json
    codes = {"who": ["import os; print(os.getuid(), sorted(os.listdir('/')))", 60.0],
             "passwd": ["print(open('/etc/passwd').read())", 60.0],
             "bomb": ["import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                      "            time.sleep(3600)\n            os._exit(0)\n        n += 1\n"
                      "except OSError:\n    print(n)",
                      60.0],
             "loop": ["while True: pass", SHORT_WALL_S]}  # [code, wall limit]: only the loop should reach its limit
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                           "-c", NON_ROOT_HARNESS, str(ROOT / "libra_hpc"), json.dumps(codes)],
                          capture_output=True, text=True, timeout=120, check=False, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["uid"] is None
    assert out["who"][0].startswith("65534 ") and "work" not in out["who"][0] and "etc" not in out["who"][0]
    assert out["passwd"][1] == "failure" and "root:" not in out["passwd"][0]
    assert int(out["bomb"][0]) < 16 and out["bomb"][1] == "failure" and out["bomb"][2] > 0
    assert out["loop"][1] == "timeout"
    assert all(result[3] == [] for name, result in out.items() if name != "uid"), out  # nothing left behind
