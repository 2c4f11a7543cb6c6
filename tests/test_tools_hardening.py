"""The security review's findings on the tool sandbox, each as a hostile snippet or misuse
that succeeded before the fix: user namespaces and the kernel keyring under bwrap (the
seccomp filter), leftovers of the rlimit fallback, slot uids shared or taken from real
accounts. The filter's bytes are also decoded and run by a small BPF interpreter here."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from libra_hpc.tools import isolation, seccomp
from libra_hpc.tools.cleanup import sysv_ipc_of
from libra_hpc.tools.isolation import SandboxLimits, bwrap_problem, choose_isolation
from libra_hpc.tools.procs import owned_pids
from libra_hpc.tools.sandbox import Sandbox, first_free_sandbox
from libra_hpc.tools import sandbox as sandbox_module
from libra_hpc.tools.slots import SlotBusy

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 60.0
"""The calls' wall limit, and how long a test waits for another thread's call to start: only
against a hang, never a measure of speed (no test here is about the wall limit)."""
LIMITS = SandboxLimits(wall_time_s=HANG_GUARD_S, memory_mb=512, max_processes=16)
UID = 230000  # this file's slot uids
AS_ROOT = os.geteuid() == 0
GATED = ("import os, time\nhere = os.path.dirname(os.path.abspath(__file__))\n"
         "while not os.path.exists(os.path.join(here, 'release')):\n    time.sleep(0.01)\n")
"""Prefix of a snippet that runs until :func:`release` drops a file beside its code (in the
call's host directory, which bwrap binds read-only and the rlimit mode runs from)."""


def _call_dir(uid: int) -> str | None:
    """The host directory of the call running as slot ``uid`` (it holds the call's code)."""
    found = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "libra-sbx-*")) if os.stat(d).st_uid == uid]
    return found[0] if len(found) == 1 else None


def wait_for_call(uid: int) -> str:
    """Wait until a call runs as ``uid``; returns its host directory."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not (owned_pids(uid=uid) and (found := _call_dir(uid))):
        assert time.monotonic() < deadline, f"no call of slot uid {uid} running after {HANG_GUARD_S} s (hang guard)"
        time.sleep(0.01)
    return found


def release(call_dir: str) -> None:
    """Let a :data:`GATED` snippet go on."""
    Path(call_dir, "release").touch()


# ---------------------------------------------------------------- the filter, decoded

def run_bpf(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """Interpret a seccomp classic-BPF program on one system call (the opcodes it uses)."""
    data = struct.pack("=IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns, pc, acc = seccomp.decode(program), 0, 0
    for _ in range(len(insns)):
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x} at {pc}")
    raise AssertionError("program fell off its end")


EPERM, ENOSYS, ALLOW, KILL = 0x50001, 0x50026, 0x7FFF0000, 0x80000000
THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes to clone
FORK_FLAGS = 0x01200011  # SIGCHLD | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_filter_denies_namespaces_keyring_and_mounts_and_allows_the_rest(arch):
    abi = seccomp.ABIS[arch]
    program = seccomp.build_filter(abi)
    assert len(program) % 8 == 0 and seccomp.decode(program)[-1] == (0x06, 0, 0, ENOSYS)
    call = abi.calls
    verdict = lambda name, arg0=0: run_bpf(program, abi.audit, call[name], arg0)  # noqa: E731
    assert verdict("unshare", CLONE_NEWUSER) == EPERM and verdict("unshare", CLONE_NEWNET) == EPERM
    assert verdict("clone", FORK_FLAGS | CLONE_NEWUSER) == EPERM
    assert verdict("clone", THREAD_FLAGS) == ALLOW and verdict("clone", FORK_FLAGS) == ALLOW
    assert verdict("unshare", 0x400) == ALLOW  # CLONE_FILES: no namespace
    assert verdict("clone3") == ENOSYS  # flags in memory: glibc falls back to clone
    for name in ("add_key", "request_key", "keyctl", "mount", "umount2", "pivot_root", "setns", "ptrace", "bpf",
                 "perf_event_open", "userfaultfd", "init_module", "kexec_load", "fsopen", "open_tree"):
        assert verdict(name) == EPERM, name
    for harmless in (0, 1, 3, 9, 60, 231):  # read/write/close/mmap (x86_64) or io_setup.. (aarch64): numbers not denied
        if harmless not in call.values():
            assert run_bpf(program, abi.audit, harmless) == ALLOW
    assert run_bpf(program, 0x40000003, 1) == KILL  # i386 ABI (int 0x80) on the same kernel
    if abi.x32_bit:
        assert run_bpf(program, abi.audit, 0x40000000 | 1) == ENOSYS


def test_filter_refuses_an_unknown_architecture(monkeypatch):
    monkeypatch.setattr(seccomp.platform, "machine", lambda: "riscv64")
    with pytest.raises(RuntimeError, match="riscv64.*seccomp.py ABIS"):
        seccomp.build_filter()


# ---------------------------------------------------------------- bwrap + filter, live

@pytest.fixture(scope="module")
def bwrap_sandbox():
    problem = bwrap_problem(sys.executable, UID if AS_ROOT else None)
    if problem is not None:
        if os.environ.get("CI"):  # same rule as tests/conftest.py: never skip in CI
            pytest.fail(f"bwrap sandbox unavailable in CI: {problem}")
        pytest.skip(f"bwrap sandbox unavailable: {problem}")
    sandbox = Sandbox(LIMITS, uid=UID, isolation="bwrap")
    yield sandbox
    sandbox.close()


def test_user_namespaces_cannot_be_created(bwrap_sandbox):
    shell = bwrap_sandbox.run_argv(["sh", "-c", "unshare -Urm sh -c 'id -u; mount -t tmpfs none /tmp && echo mounted'"])
    assert "mounted" not in shell.stdout and "Operation not permitted" in shell.stderr, (shell.stdout, shell.stderr)
    assert shell.state.status == "failure"
    calls = seccomp.host_abi().calls
    direct = bwrap_sandbox.run_python(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"r = libc.unshare({CLONE_NEWUSER}); print('unshare', r, ctypes.get_errno())\n"
        f"r = libc.syscall({calls['clone']}, {CLONE_NEWUSER | 17}, 0, 0, 0, 0)\n"
        "if r == 0:\n    os._exit(0)\nprint('clone', r, ctypes.get_errno())")
    assert direct.stdout == "unshare -1 1\nclone -1 1\n", direct.stderr


def test_kernel_keyring_is_closed_so_nothing_persists_between_calls(bwrap_sandbox):
    calls = seccomp.host_abi().calls
    prelude = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
               "I = ctypes.c_int\n")
    write = bwrap_sandbox.run_python(prelude + (
        f"r = libc.syscall({calls['add_key']}, b'user', b'libra-secret', b'left-by-call-1', ctypes.c_size_t(14), I(-4))\n"
        "print('add_key', r, ctypes.get_errno())"))
    assert write.stdout == "add_key -1 1\n", write.stderr
    read = bwrap_sandbox.run_python(prelude + (
        f"serial = libc.syscall({calls['keyctl']}, I(10), I(-4), b'user', b'libra-secret', I(0))\n"
        "buf = ctypes.create_string_buffer(64)\n"
        f"n = libc.syscall({calls['keyctl']}, I(11), I(serial), buf, I(64)) if serial > 0 else -1\n"
        "print(serial, buf.raw[:max(n, 0)], ctypes.get_errno())"))
    assert "left-by-call-1" not in read.stdout and read.stdout.startswith("-1 b'' 1"), (read.stdout, read.stderr)


def test_ordinary_python_still_runs_under_the_filter(bwrap_sandbox):
    code = ("import asyncio, multiprocessing, subprocess, threading\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
            "print(asyncio.run(asyncio.sleep(0, 'async')))\n"
            "if __name__ == '__main__':\n    with multiprocessing.Pool(2) as pool:\n"
            "        print(sum(pool.map(abs, range(-3, 0))))")
    result = bwrap_sandbox.run_python(code)
    assert (result.stdout, result.state.status) == ("thread\nchild\nasync\n6\n", "success"), result.stderr


# ---------------------------------------------------------------- the rlimit fallback

def test_auto_never_falls_back_and_rlimit_needs_root(monkeypatch):
    monkeypatch.setattr(isolation, "bwrap_problem", lambda python, uid: "bwrap not found on PATH")
    with pytest.raises(RuntimeError, match=r"tools.isolation=auto needs bwrap.*bwrap not found.*`tools.isolation: rlimit`"):
        choose_isolation("auto", sys.executable, UID)
    with pytest.raises(RuntimeError, match="tools.isolation=rlimit needs root"):
        choose_isolation("rlimit", sys.executable, None)
    assert choose_isolation("rlimit", sys.executable, UID) == "rlimit"


needs_root = pytest.mark.skipif(not AS_ROOT, reason="the rlimit fallback runs only as root (it is refused otherwise)")


@pytest.fixture(scope="module")
def rlimit_sandbox():
    if not AS_ROOT:
        pytest.skip("the rlimit fallback runs only as root (it is refused otherwise)")
    sandbox = Sandbox(LIMITS, uid=UID + 1, isolation="rlimit")
    yield sandbox
    sandbox.close()


@needs_root
def test_rlimit_call_leaves_no_files_nor_ipc_objects(rlimit_sandbox):
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for path in ('/run/lock/libra-litter', '/var/tmp/libra-litter', '/dev/shm/libra-litter'):\n"
            "    open(path, 'w').write('x')\n"
            "os.makedirs('/tmp/libra-litter-dir/sub'); open('/tmp/libra-litter-dir/sub/f', 'w').write('x')\n"
            "print(libc.shmget(0, 4096, 0o1666), libc.msgget(0, 0o1666), libc.semget(0, 1, 0o1666))")
    result = rlimit_sandbox.run_python(code)
    assert result.state.status == "success", result.stderr
    assert all(int(ident) >= 0 for ident in result.stdout.split()), result.stdout  # all three were created
    assert sysv_ipc_of(rlimit_sandbox.uid) == []
    for path in ("/run/lock/libra-litter", "/var/tmp/libra-litter", "/dev/shm/libra-litter", "/tmp/libra-litter-dir"):
        assert not os.path.lexists(path), path


@needs_root
def test_rlimit_code_of_a_concurrent_slot_is_unreadable(rlimit_sandbox):
    other = Sandbox(LIMITS, uid=UID + 2, isolation="rlimit")
    try:
        slow = {}
        thread = threading.Thread(target=lambda: slow.update(r=other.run_python(
            GATED + "# the-other-slot's-secret\n")))
        thread.start()
        call_dir = wait_for_call(other.uid)  # its code is on the host's disk until it ends
        try:
            spy = rlimit_sandbox.run_python(
                "import glob\nfound = glob.glob('/tmp/libra-sbx-*')\nprint(len(found))\nfor d in found:\n"
                "    try:\n        print(open(d + '/main.py').read())\n    except OSError as err:\n"
                "        print(type(err).__name__)")
        finally:
            release(call_dir)
            thread.join()
    finally:
        other.close()
    assert "secret" not in spy.stdout and "PermissionError" in spy.stdout, spy.stdout  # it saw the dir, not the code
    assert slow["r"].state.status == "success"


@needs_root
def test_rlimit_daemon_that_clears_its_environment_is_reaped(rlimit_sandbox):
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execve('/bin/sleep', ['sleep', '3600'], {})\n    os._exit(0)\nprint('parent done')")
    result = rlimit_sandbox.run_python(code)
    assert result.stdout == "parent done\n" and result.leftovers_killed >= 1 and result.state.status == "failure"
    assert owned_pids(uid=rlimit_sandbox.uid) == []


# ---------------------------------------------------------------- slot uids

@needs_root
def test_a_slot_uid_is_held_by_one_sandbox_and_the_other_does_not_kill_its_call():
    first = Sandbox(LIMITS, uid=UID + 3, isolation="bwrap")
    try:
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=first.run_python(GATED + "print('alive')")))
        thread.start()
        call_dir = wait_for_call(first.uid)
        try:
            with pytest.raises(SlotBusy, match=f"uid {UID + 3} is in use"):  # while the call runs
                Sandbox(LIMITS, uid=UID + 3, isolation="bwrap")
        finally:
            release(call_dir)
            thread.join()
        assert (out["r"].stdout, out["r"].state.status) == ("alive\n", "success"), out["r"].stderr
        second = first_free_sandbox(LIMITS, UID + 3, 2, isolation="bwrap")
        assert second.uid == UID + 4
        second.close()
    finally:
        first.close()
    Sandbox(LIMITS, uid=UID + 3, isolation="bwrap").close()  # released: usable again


def test_a_busy_slot_is_refused_before_anything_runs_as_its_uid(monkeypatch):
    """The isolation probe runs a process as the slot uid: it must not start while another
    sandbox (another worker process) holds the uid and may reap it at any moment."""
    first = Sandbox(LIMITS, uid=UID + 5, isolation="bwrap")
    probes = []
    monkeypatch.setattr(sandbox_module, "choose_isolation", lambda *args: probes.append(args) or "bwrap")
    try:
        if AS_ROOT:
            with pytest.raises(SlotBusy):
                Sandbox(LIMITS, uid=UID + 5, isolation="bwrap")
            assert probes == []
        Sandbox(LIMITS, uid=UID + 6, isolation="bwrap").close()
        assert len(probes) == 1
    finally:
        first.close()


@needs_root
def test_uids_of_real_accounts_are_refused():
    with pytest.raises(ValueError, match="uid 0 belongs to the account 'root'.*tools.uid_base"):
        Sandbox(LIMITS, uid=0, isolation="bwrap")


@needs_root
def test_command_line_takes_the_next_free_slot(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(f"tools:\n  uid_base: {UID + 5}\n  max_workers: 2\n")
    held = Sandbox(LIMITS, uid=UID + 5, isolation="bwrap")
    try:
        run = subprocess.run([sys.executable, "-m", "libra_hpc.tools", "--config", str(config), "-c",
                              "import os; print(os.getuid())"], capture_output=True, text=True, check=False, cwd=ROOT)
    finally:
        held.close()
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["stdout"] == f"{UID + 6}\n"
