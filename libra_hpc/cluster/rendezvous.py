"""Where a torch world meets: one rendezvous helper for every role that starts one.

A torch process group is started with ``init_method="tcp://ADDR:PORT"``: rank 0 of the new
world listens there (torch's TCPStore) and every member connects. :func:`rendezvous`
agrees on that address over the MPI communicator of exactly the future members, so a role
can start its world without any environment variable (MASTER_ADDR, MASTER_PORT) and
without the rest of the job taking part.

No torch and no mpi4py here: ``comm`` is any mpi4py-like communicator (``allgather``,
``bcast``, ``Get_rank``); the choice of address is the pure :func:`store_host`.
"""

from __future__ import annotations

import socket
from typing import Any

LOOPBACK = "127.0.0.1"


def store_host(hostnames: list[str], root: int = 0) -> str:
    """The address the store of a world listens on: ``hostnames[root]``'s, or loopback
    when every member runs on one host (emulated nodes: their Slurm names, node1…, do not
    resolve, and a single-host world needs no network anyway). ``hostnames[i]`` is member
    i's ``socket.gethostname()``."""
    if not hostnames:
        raise ValueError("store_host: a world needs at least one member")
    if not 0 <= root < len(hostnames):
        raise ValueError(f"store_host: root {root} is not a member of a world of {len(hostnames)}")
    if len(set(hostnames)) == 1:
        return LOOPBACK
    try:
        return socket.gethostbyname(hostnames[root])
    except OSError as exc:
        raise OSError(f"rendezvous: the store's host {hostnames[root]!r} (member {root}) does not resolve "
                      f"({exc}); the members run on hosts {sorted(set(hostnames))}") from exc


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (the OS picks it). Another
    process could take it before the store binds it; in practice the window is
    microseconds and the OS does not hand the same ephemeral port out again at once."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def rendezvous(comm: Any, root: int = 0) -> tuple[str, int]:
    """Collective over ``comm``: (address, port) of a fresh store on ``root``'s host, the
    same on every member. Each call picks a new port, so a world destroyed and started
    again never meets the old store's keys."""
    hostnames = comm.allgather(socket.gethostname())
    address = (store_host(hostnames, root), free_port()) if comm.Get_rank() == root else None
    return comm.bcast(address, root=root)


def init_method(address: tuple[str, int]) -> str:
    """``tcp://ADDR:PORT`` for ``torch.distributed.init_process_group``."""
    host, port = address
    return f"tcp://{host}:{port}"
