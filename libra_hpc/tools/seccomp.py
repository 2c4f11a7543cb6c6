"""The seccomp filter every bwrap sandbox runs under, built as classic BPF in pure Python.

Why: run as root, bwrap drops to the slot uid with ``setpriv``, which cannot forbid new
namespaces. Without a filter a snippet can ``unshare -Ur`` into a user namespace where it
is root, mount its own tmpfs (past ``tools.workdir_mb``) and reach kernel surface meant for
administrators; and the kernel keyring of the slot uid outlives the call (a snippet could
leave data for the next call of the same slot). The filter denies, with ``EPERM``:

- ``clone`` and ``unshare`` with any ``CLONE_NEW*`` flag (the flags are in the first
  argument register, which classic BPF can read); plain threads and forks pass;
- ``clone3`` with ``ENOSYS`` (its flags are in memory BPF cannot read; glibc then falls
  back to ``clone``, checked above);
- the keyring (``add_key``, ``request_key``, ``keyctl``), ``setns``, mounting (``mount``,
  ``umount2``, ``pivot_root`` and the new mount API), ``ptrace`` and
  ``process_vm_readv/writev``, ``bpf``, ``perf_event_open``, ``userfaultfd``, kernel
  modules and ``kexec``, ``name_to_handle_at``/``open_by_handle_at``, ``acct``, swap and
  ``reboot``.

A system call of another ABI than the one the filter was built for (32-bit ``int 0x80`` on
x86_64) kills the process; x32 system calls (bit 30 set in the number) get ``ENOSYS``.
Everything else is allowed: the filter is a deny list on top of the namespaces, the
dropped uid and the resource limits, not a whitelist of what Python needs.

Layout of one instruction (``struct sock_filter``, native byte order): ``u16 code; u8 jt;
u8 jf; u32 k``; jumps are forward offsets relative to the next instruction. The data the
filter reads is ``struct seccomp_data``: ``int nr`` at offset 0, ``u32 arch`` at 4, the
six ``u64`` arguments from 16 (the low 32 bits of argument ``i`` at ``16 + 8 i`` on a
little-endian machine).
"""

from __future__ import annotations

import errno
import os
import platform
import struct
import sys
from dataclasses import dataclass

# BPF opcodes (linux/filter.h, linux/bpf_common.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

# seccomp return actions (linux/seccomp.h)
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000

OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16

CLONE_NAMESPACE_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
                         | 0x40000000)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET."""
X32_SYSCALL_BIT = 0x40000000

INSTRUCTION = struct.Struct("=HBBI")


@dataclass(frozen=True)
class Abi:
    """The system call numbers of one architecture (``audit``: its AUDIT_ARCH_* value)."""

    name: str
    audit: int
    calls: dict[str, int]
    x32_bit: bool = False


_COMMON_GENERIC = {  # asm-generic numbering (aarch64)
    "unshare": 97, "clone": 220, "clone3": 435, "keyctl": 219, "add_key": 217, "request_key": 218,
    "mount": 40, "umount2": 39, "pivot_root": 41, "ptrace": 117, "bpf": 280, "perf_event_open": 241,
    "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
    "delete_module": 106, "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271,
    "name_to_handle_at": 264, "open_by_handle_at": 265, "acct": 89, "swapon": 224, "swapoff": 225,
    "reboot": 142,
}
_NEW_MOUNT_API = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
                  "fspick": 433, "mount_setattr": 442}  # same numbers on every architecture

ABIS = {
    "x86_64": Abi("x86_64", 0xC000003E, {
        "unshare": 272, "clone": 56, "clone3": 435, "keyctl": 250, "add_key": 248, "request_key": 249,
        "mount": 165, "umount2": 166, "pivot_root": 155, "ptrace": 101, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "acct": 163, "swapon": 167, "swapoff": 168,
        "reboot": 169, **_NEW_MOUNT_API}, x32_bit=True),
    "aarch64": Abi("aarch64", 0xC00000B7, {**_COMMON_GENERIC, **_NEW_MOUNT_API}),
}

DENIED = tuple(sorted(set(ABIS["x86_64"].calls) - {"clone", "unshare", "clone3"}))
"""System calls denied outright with EPERM (clone/unshare: only with namespace flags)."""


def host_abi() -> Abi:
    """The ABI of this machine; RuntimeError on an architecture the filter does not know."""
    machine = platform.machine()
    if machine == "arm64":
        machine = "aarch64"
    if machine not in ABIS or sys.byteorder != "little":
        raise RuntimeError(f"the tool sandbox's seccomp filter knows x86_64 and aarch64 only, this host is "
                           f"{machine!r} ({sys.byteorder}-endian): add its system call numbers to "
                           "libra_hpc/tools/seccomp.py ABIS")
    return ABIS[machine]


def _assemble(program: list[tuple]) -> bytes:
    """``program``: ``("label", name)`` markers and ``(code, jt, jf, k)`` instructions whose
    jt/jf are 0 or a label name (forward only)."""
    labels, index = {}, 0
    for item in program:
        if item[0] == "label":
            labels[item[1]] = index
        else:
            index += 1
    out, index = bytearray(), 0
    for item in program:
        if item[0] == "label":
            continue
        code, jt, jf, k = item
        offsets = [labels[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= o <= 255 for o in offsets):
            raise AssertionError(f"seccomp program: jump out of range at instruction {index}: {offsets}")
        out += INSTRUCTION.pack(code, offsets[0], offsets[1], k)
        index += 1
    return bytes(out)


def build_filter(abi: Abi | None = None) -> bytes:
    """The filter program for ``abi`` (default: this host's), as bwrap's ``--seccomp`` reads it."""
    abi = abi or host_abi()
    program: list[tuple] = [
        (LD_W_ABS, 0, 0, OFFSET_ARCH),
        (JEQ_K, 1, 0, abi.audit),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, OFFSET_NR),
    ]
    if abi.x32_bit:
        program.append((JGE_K, "enosys", 0, X32_SYSCALL_BIT))
    program.append((JEQ_K, "enosys", 0, abi.calls["clone3"]))
    program += [(JEQ_K, "flags", 0, abi.calls[name]) for name in ("clone", "unshare")]
    program += [(JEQ_K, "eperm", 0, abi.calls[name]) for name in DENIED]
    program += [
        (RET_K, 0, 0, RET_ALLOW),
        ("label", "flags"),
        (LD_W_ABS, 0, 0, OFFSET_ARG0),
        (JSET_K, "eperm", 0, CLONE_NAMESPACE_FLAGS),
        (RET_K, 0, 0, RET_ALLOW),
        ("label", "eperm"),
        (RET_K, 0, 0, RET_ERRNO | errno.EPERM),
        ("label", "enosys"),
        (RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
    ]
    return _assemble(program)


def decode(program: bytes) -> list[tuple[int, int, int, int]]:
    """The ``(code, jt, jf, k)`` instructions of a filter (for tests and debugging)."""
    if len(program) % INSTRUCTION.size:
        raise ValueError(f"a seccomp program is a multiple of {INSTRUCTION.size} bytes, got {len(program)}")
    return [INSTRUCTION.unpack_from(program, i) for i in range(0, len(program), INSTRUCTION.size)]


def filter_fd() -> int:
    """A fresh, inheritable file descriptor positioned at the start of this host's filter
    (bwrap reads ``--seccomp FD`` to its end). The caller closes it after starting bwrap."""
    fd = os.memfd_create("libra-sandbox-seccomp", 0)  # no MFD_CLOEXEC: bwrap must inherit it
    os.write(fd, build_filter())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
