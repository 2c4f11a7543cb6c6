"""A private, throwaway Slurm cluster on this host, for the test suite and by hand.

munged, optionally a private mariadbd + slurmdbd (accounting), slurmctld and one slurmd
per emulated node (node1..nodeN, all 127.0.0.1); every file lives under ``root``. Ports and
job ids derive from ``port_base`` so that two clusters can coexist. Daemons are started,
kept and stopped by PID, never by name: other clusters may be running.

    python tests/slurm_cluster.py up --root /tmp/slurm --nodes 4 --gpus 4
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

_CORE = ("munged", "mungekey", "slurmctld", "slurmd", "sinfo", "scontrol", "squeue",
         "scancel", "sbatch", "srun")
_ACCT = ("slurmdbd", "sacctmgr", "sacct", "mariadbd", "mariadb-install-db", "mariadb")
MIN_JOB_AGE_S = 90  # finished jobs stay visible to `scontrol show job` this long
_DB_USER, _DB_PASS, _DB_NAME = "slurm", "slurm-test-only", "slurm_acct_db"
# A small database: 26 MB on disk instead of 114 MB, quicker to create on a busy disk.
_INNODB = ("--innodb-log-file-size=8M", "--innodb-undo-tablespaces=0",
           "--innodb-buffer-pool-size=64M")


def missing_binaries(accounting: bool = True) -> str | None:
    """None if a cluster can start here, else a human reason naming what is missing."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    for name in _CORE + (_ACCT if accounting else ()):
        if shutil.which(name, path=path) is None:
            return f"{name} not on PATH; install with scripts/install.sh"
    return None


def busiest_processes(count: int = 12) -> str:
    """The processes using the most CPU now, for the message of a test that timed out (a
    world that never gets going on 2 cores is most often starved by a leftover spinner)."""
    try:
        listing = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
                                 text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(ps failed: {exc})"
    return "busiest processes:\n" + "\n".join(line[:200] for line in listing.splitlines()[:count + 1])


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ports(base: int, nodes: int) -> dict[str, int]:
    """Who listens where: slurmctld base, slurmdbd +1, mariadbd +2, slurmd of node i +10+i."""
    return {"slurmctld": base, "slurmdbd": base + 1, "mariadbd": base + 2,
            **{f"slurmd node{i}": base + 10 + i for i in range(1, nodes + 1)}}


def free_port_base(start: int = 17000, stop: int = 30000, nodes: int = 4) -> int:
    """First multiple of 100 in [start, stop) whose cluster ports are all free here."""
    for base in range(start, stop, 100):
        if not any(_port_open(p) for p in _ports(base, nodes).values()):
            return base
    raise RuntimeError(f"no free port range for a Slurm cluster in [{start}, {stop})")


class DaemonError(RuntimeError):
    """A daemon of the local cluster died or did not become ready in time; the message
    names it and carries the tail of its log files."""

    def __init__(self, daemon: str, what: str, logs: list[Path], lines: int = 25):
        parts = [f"{daemon}: {what}"]
        for p in dict.fromkeys(logs):  # in order, each once
            if p.exists() and p.stat().st_size:
                tail = p.read_text(errors="replace").splitlines()[-lines:]
                parts += [f"  --- tail of {p} ---", *("    " + t for t in tail)]
        super().__init__("\n".join(parts))


class _Daemon:
    """One background process, in its own session, and the logs that explain it."""

    def __init__(self, name: str, argv: list[str], logs: list[Path], env: dict[str, str]):
        self.name, self.logs = name, logs
        with open(logs[-1], "ab") as out:  # stdout+stderr: crashes before logging starts
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        log.debug("started %s pid %d: %s", name, self.proc.pid, " ".join(argv))

    def fail(self, what: str) -> DaemonError:
        return DaemonError(f"{self.name} (pid {self.proc.pid})", what, self.logs)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise self.fail(f"exited with status {self.proc.returncode}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group we made for this PID (helpers it forked go too),
        SIGKILL it after ``grace_s`` seconds."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s pid %d ignored SIGTERM for %.0f s; killing its group",
                        self.name, self.proc.pid, grace_s)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            self.proc.wait(5)


# Slurm clients that only ask, so running one again is harmless.
_READ_ONLY = {"squeue", "sinfo", "sacct", ("scontrol", "show")}


_TRANSIENT = ("Socket timed out on send/recv operation", "Unable to contact slurm controller")
"""What a Slurm client prints when the controller was too busy to answer: a query is asked again."""

_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
"""Job states of a job that has not ended."""


class LocalSlurmCluster:
    """``nodes`` emulated nodes, each declaring ``gpus_per_node`` GPUs (GRES backed by
    /dev/null links, so Slurm sets CUDA_VISIBLE_DEVICES) and ``cpus_per_node`` CPUs
    (more than the host has, via ``SlurmdParameters=config_overrides``). Job ids start at
    ``port_base * 1000``: MPICH names its /dev/shm segments after the job id, so two
    clusters must not hand out the same ids."""

    def __init__(self, root: Path, nodes: int = 4, gpus_per_node: int = 4,
                 cpus_per_node: int = 8, accounting: bool = True, port_base: int = 17000):
        self.root = Path(root).resolve()
        self.nodes, self.gpus, self.cpus = nodes, gpus_per_node, cpus_per_node
        self.accounting, self.port_base = accounting, port_base
        self.name = f"libra{port_base}"  # also the accounting cluster name (lowercase)
        self.host = socket.gethostname().split(".")[0]
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.db_socket = self.root / "db" / "mariadbd.sock"
        self._daemons: list[_Daemon] = []
        self._started_at = 0.0  # time.time() of the last start()

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Variables a subprocess needs to talk to this cluster (merge into os.environ)."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> None:
        """Start every daemon; return once ``sinfo`` reports all nodes idle.

        Raises DaemonError naming the daemon, with its log tail, if one dies or is not
        ready within ``timeout_s`` seconds overall; what was started is stopped again.
        """
        reason = missing_binaries(self.accounting)
        if reason:
            raise RuntimeError(reason)
        t0, self._started_at = time.monotonic(), time.time()
        deadline = t0 + timeout_s
        try:
            self._prepare()
            m = self.root / "munge"
            munged = self._spawn("munged", [
                "munged", "-F", "--force", f"--key-file={m / 'munge.key'}",
                f"--socket={self.munge_socket}", f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"],
                m / "munged.log")
            self._wait(munged, "listening", self.munge_socket.exists, deadline)
            if self.accounting:
                self._start_accounting(deadline)
            self._start_slurm(deadline)
        except BaseException:
            self.stop()
            raise
        log.info("Slurm cluster %s (%d nodes x %d GPUs) up in %.1f s; SLURM_CONF=%s",
                 self.name, self.nodes, self.gpus, time.monotonic() - t0, self.conf)

    def stop(self) -> None:
        """Cancel jobs, stop our daemons by PID (reverse start order), kill job processes
        carrying our SLURM_CONF, remove the /dev/shm/mpich_shm_* they left. Keeps root."""
        if not self._daemons:
            return
        owned = _shm_mapped(_job_processes(str(self.conf)))
        try:
            if any(d.name == "slurmctld" and d.proc.poll() is None for d in self._daemons):
                self._cancel_all_jobs(timeout_s=10)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("could not cancel the jobs of %s: %s", self.name, exc)
        finally:
            for daemon in reversed(self._daemons):
                daemon.stop()
            self._daemons.clear()
        _kill_and_reap(_job_processes(str(self.conf)))
        _remove_orphan_shm(owned, since=self._started_at)
        log.info("Slurm cluster %s stopped; its files stay under %s", self.name, self.root)

    def __enter__(self) -> LocalSlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_job(self, job_id: str, timeout_s: float = 60) -> str:
        """Poll ``scontrol show job`` (quicker than ``sbatch --wait``) until the job leaves
        the pending/running states; returns its final state. A job still running after
        ``timeout_s`` is cancelled (and waited for, up to 60 s) before the TimeoutError:
        left running it holds the nodes, and every later test's job times out behind it
        (CI: a world hung in MPI_Init took five Slurm tests down with it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self._state(job_id)
            if state not in _ACTIVE:
                return state
            time.sleep(0.2)
        shown = self.run("scontrol", "show", "job", job_id, check=False)
        self.run("scancel", job_id, check=False)
        cancel_deadline = time.monotonic() + 60
        while time.monotonic() < cancel_deadline and self._state(job_id) in _ACTIVE:
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s} s (cancelled)\n{shown}\n{busiest_processes()}")

    def _state(self, job_id: str) -> str:
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return line.split("JobState=")[1].split()[0]

    def run(self, *argv: str, timeout_s: float = 30, check: bool = True) -> str:
        """Run a Slurm client (sinfo, sbatch, ...) against this cluster; return stdout
        ("" on failure or timeout when not ``check``). A query (``_READ_ONLY``) killed by a
        signal, or refused by a controller too busy to answer in time, is asked again, up
        to three times: on a loaded machine slurmctld can drop the connection mid-answer
        and the client dies of SIGPIPE (seen in CI, rc -13), or the client gives up with
        "Socket timed out on send/recv operation" (rc 1, seen under a full test run)."""
        tries = 3 if (argv[0], *argv[1:2]) in _READ_ONLY or argv[0] in _READ_ONLY else 1
        for attempt in range(tries):
            try:
                res = subprocess.run(list(argv), env={**os.environ, **self.env}, text=True,
                                     capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                if check:
                    raise RuntimeError(f"{' '.join(argv)} timed out after {timeout_s} s") from None
                return ""
            if res.returncode >= 0 and not any(m in res.stderr for m in _TRANSIENT):
                break
            time.sleep(0.5 * (attempt + 1))
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): "
                               f"{res.stderr.strip() or res.stdout.strip()}")
        return res.stdout

    # -- start-up steps ---------------------------------------------------------------
    def _prepare(self) -> None:
        """Fresh state/log dirs, configs, a munge key and the dummy GPU devices."""
        r = self.root
        for sub in ("state", "spool", "tmp", "run", "log"):
            shutil.rmtree(r / sub, ignore_errors=True)
        for d in ["etc", "log", "run", "state", "dev", "munge", "db",
                  *(f"{s}/node{i}" for s in ("spool", "tmp") for i in range(1, self.nodes + 1))]:
            (r / d).mkdir(parents=True, exist_ok=True)
        for sock in (self.munge_socket, self.db_socket):
            if len(str(sock)) > 100:  # sun_path holds 108 bytes
                raise RuntimeError(f"socket path {sock} is too long; use a shorter root")
            sock.unlink(missing_ok=True)  # a stale one would pass the readiness checks
        for g in range(self.gpus):  # gres/gpu accepts only char devices: link /dev/null
            dev = r / "dev" / f"gpu{g}"
            if not dev.is_symlink():
                dev.unlink(missing_ok=True)
                dev.symlink_to("/dev/null")
        key = r / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        (r / "munge").chmod(0o711)  # munged wants o+x on its socket dir
        self.conf.write_text(self._slurm_conf())
        (r / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName=node[1-{self.nodes}] Name=gpu "
            f"File={r}/dev/gpu[0-{self.gpus - 1}]\n")
        if self.accounting:
            dbd = r / "etc" / "slurmdbd.conf"
            dbd.write_text(self._slurmdbd_conf())
            dbd.chmod(0o600)  # slurmdbd refuses a readable file holding a password
        for who, port in _ports(self.port_base, self.nodes).items():
            if (self.accounting or who not in ("slurmdbd", "mariadbd")) and _port_open(port):
                raise RuntimeError(f"port {port} for {who} is in use on 127.0.0.1 "
                                   f"(another cluster?); pass another port_base")

    def _spawn(self, name: str, argv: list[str], logfile: Path) -> _Daemon:
        out = self.root / "log" / f"{name.replace(' ', '_')}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        daemon = _Daemon(name, argv, [logfile, out], {**env, **self.env})
        self._daemons.append(daemon)
        return daemon

    def _wait(self, daemon: _Daemon, what: str, ready: Callable[[], bool],
              deadline: float, exit_ok: bool = False) -> None:
        """Poll ``ready()`` until true; fail if ``daemon`` dies (exits, with ``exit_ok``:
        exits non-zero) or the deadline passes."""
        delay = 0.02
        while not ready():
            if not exit_ok or daemon.proc.poll():
                daemon.check_alive()
            if time.monotonic() > deadline:
                raise daemon.fail(f"not {what} before the start timeout")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        log.debug("%s %s after %.2f s", daemon.name, what, time.time() - self._started_at)

    def _start_accounting(self, deadline: float) -> None:
        """A private mariadbd (datadir under root, own port and socket), a db user for
        slurmdbd, slurmdbd itself, and this cluster registered with it."""
        data, db_log = self.root / "db" / "data", self.root / "db" / "mariadbd.log"
        if not (data / "mysql").is_dir():  # a root used before keeps its database
            shutil.rmtree(data, ignore_errors=True)
            install = self._spawn("mariadb-install-db", [
                "mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                "--auth-root-authentication-method=socket", "--skip-test-db", *_INNODB],
                self.root / "log" / "mariadb-install-db.out")
            self._wait(install, "finished", lambda: install.proc.poll() == 0, deadline,
                       exit_ok=True)
        mariadbd = self._spawn("mariadbd", [
            "mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
            f"--socket={self.db_socket}", f"--port={self.port_base + 2}",
            "--bind-address=127.0.0.1", "--skip-name-resolve", f"--log-error={db_log}",
            f"--pid-file={self.root / 'db' / 'mariadbd.pid'}", "--skip-log-bin",
            "--innodb-lock-wait-timeout=900", *_INNODB], db_log)
        self._wait(mariadbd, "accepting SQL", lambda: self._sql("SELECT 1"), deadline)
        # Fresh accounting like slurmctld -c's fresh state: job ids restart at FirstJobId,
        # and sacct must not mix in the records of an earlier run on this root.
        who = f"'{_DB_USER}'@'127.0.0.1'"
        if not self._sql(f"DROP DATABASE IF EXISTS {_DB_NAME}; CREATE USER IF NOT EXISTS "
                         f"{who} IDENTIFIED BY '{_DB_PASS}'; GRANT ALL ON {_DB_NAME}.* TO {who};"):
            raise mariadbd.fail(f"could not reset {_DB_NAME} or create the user {who}")
        dbd = self._spawn("slurmdbd", ["slurmdbd", "-D"], self.root / "log" / "slurmdbd.log")
        self._wait(dbd, "listening", lambda: _port_open(self.port_base + 1), deadline)
        self._wait(dbd, "registering the cluster", self._register_cluster, deadline)

    def _sql(self, statement: str) -> bool:
        try:
            return subprocess.run(["mariadb", "--no-defaults", f"--socket={self.db_socket}",
                                   "-uroot", "-e", statement], capture_output=True,
                                  timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _register_cluster(self) -> bool:
        """Add this cluster to the accounting db; True once sacctmgr lists it."""
        listed = self.run("sacctmgr", "-n", "-P", "list", "cluster", "format=cluster",
                          check=False, timeout_s=10)
        if self.name in listed.split():
            return True
        self.run("sacctmgr", "-i", "add", "cluster", self.name, check=False, timeout_s=10)
        return False

    def _start_slurm(self, deadline: float) -> None:
        conf, logs = str(self.conf), self.root / "log"
        ctld = self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", conf],
                           logs / "slurmctld.log")
        self._wait(ctld, "listening", lambda: _port_open(self.port_base), deadline)
        slurmds = [self._spawn(f"slurmd node{i}", ["slurmd", "-D", "-N", f"node{i}", "-f",
                                                    conf], logs / f"slurmd.node{i}.log")
                   for i in range(1, self.nodes + 1)]

        def all_idle() -> bool:
            for d in slurmds:
                d.check_alive()
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout_s=10)
            return states.split() == ["idle"] * self.nodes

        self._wait(ctld, "reporting all nodes idle", all_idle, deadline)

    def _cancel_all_jobs(self, timeout_s: float) -> None:
        """scancel every job, then wait (bounded) until the queue is empty."""
        self.run("scancel", "--full", f"--user={os.getuid()}", check=False)
        end = time.monotonic() + timeout_s
        while self.run("squeue", "-h", "-o", "%i", check=False).strip():
            if time.monotonic() > end:
                log.warning("jobs still queued on %s after %.0f s; killing their "
                            "processes", self.name, timeout_s)
                return
            time.sleep(0.2)

    # -- configuration text -------------------------------------------------------------
    def _slurm_conf(self) -> str:
        r, n, base = self.root, self.nodes, self.port_base
        acct = {"AccountingStorageType": "accounting_storage/none"}
        if self.accounting:  # AccountingStoragePass is the munge socket for slurmdbd links
            acct = {"AccountingStorageType": "accounting_storage/slurmdbd",
                    "AccountingStorageHost": "127.0.0.1", "AccountingStoragePort": base + 1,
                    "AccountingStorageTRES": "gres/gpu",
                    "AccountingStoragePass": self.munge_socket}
        return _conf_text({
            "ClusterName": self.name, "SlurmctldHost": f"{self.host}(127.0.0.1)",
            "SlurmctldPort": base, "SlurmUser": "root", "SlurmdUser": "root",
            "AuthType": "auth/munge", "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket},cred_expire=10",
            "StateSaveLocation": f"{r}/state", "SlurmctldPidFile": f"{r}/run/slurmctld.pid",
            "SlurmctldLogFile": f"{r}/log/slurmctld.log", "SlurmdSpoolDir": f"{r}/spool/%n",
            "SlurmdPidFile": f"{r}/run/slurmd.%n.pid", "TmpFS": f"{r}/tmp/%n",
            "SlurmdLogFile": f"{r}/log/slurmd.%n.log",
            # no systemd, no cgroups; CPUs from this file, not from the 2 real cores
            "SlurmdParameters": "config_overrides", "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none", "JobAcctGatherType": "jobacct_gather/none", **acct,
            "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_Core",
            # start a job within ~1 s; a requeued one is eligible cred_expire + 1 s after its
            # requeue, and only the main loop (every sched_interval) starts it: 60 s by default
            "SchedulerParameters": "batch_sched_delay=0,sched_interval=2",
            "MpiDefault": "pmi2", "GresTypes": "gpu", "MailProg": "/bin/true",
            "ReturnToService": 2, "MinJobAge": MIN_JOB_AGE_S, "FirstJobId": base * 1000,
            "KillWait": 5, "InactiveLimit": 0,
            # the clients wait this long for slurmctld's answer (10 s by default: under a full
            # test run on 2 cores a query timed out while the controller was busy)
            "MessageTimeout": 30,
            "NodeName": f"node[1-{n}] NodeHostname={self.host} NodeAddr=127.0.0.1 "
                        f"Port={base + 11}-{base + 10 + n} CPUs={self.cpus} "
                        f"Gres=gpu:{self.gpus} RealMemory=1000 State=UNKNOWN",
            "PartitionName": f"debug Nodes=node[1-{n}] Default=YES MaxTime=INFINITE State=UP",
        })

    def _slurmdbd_conf(self) -> str:
        return _conf_text({
            "AuthType": "auth/munge", "AuthInfo": f"socket={self.munge_socket}",
            "DbdHost": self.host, "DbdAddr": "127.0.0.1", "DbdPort": self.port_base + 1,
            "SlurmUser": "root", "PidFile": f"{self.root}/run/slurmdbd.pid",
            "LogFile": f"{self.root}/log/slurmdbd.log",
            "StorageType": "accounting_storage/mysql", "StorageHost": "127.0.0.1",
            "StoragePort": self.port_base + 2, "StorageUser": _DB_USER,
            "StoragePass": _DB_PASS, "StorageLoc": _DB_NAME})


def _conf_text(settings: dict[str, object]) -> str:
    lines = [f"{k}={v}" for k, v in settings.items()]
    return "# Generated by tests/slurm_cluster.py: a private throwaway cluster.\n" + \
        "\n".join(lines) + "\n"


def _job_processes(slurm_conf: str) -> dict[int, str]:
    """PID -> name of processes whose environment holds our SLURM_CONF and that are
    slurmstepd (started by our slurmd) or job tasks (SLURM_JOB_ID set): the SLURM_CONF
    path ties them to this cluster and no other."""
    marker, found = f"SLURM_CONF={slurm_conf}".encode(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), os.getppid()):
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if marker in env and (comm == "slurmstepd"
                              or any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
            found[int(entry.name)] = comm
    return found


def _kill_and_reap(procs: dict[int, str], timeout_s: float = 5) -> None:
    """SIGKILL ``procs``; wait until each is gone or a zombie (mappings released)."""
    for pid, comm in procs.items():
        log.info("killing leftover job process %d (%s)", pid, comm)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end = time.monotonic() + timeout_s
    while any(running(p) for p in procs) and time.monotonic() < end:
        time.sleep(0.05)


def _shm_mapped(pids: Iterable[int] | None = None) -> set[Path]:
    """/dev/shm/mpich_shm_* files mapped by ``pids`` (by any process if None)."""
    maps = (Path(f"/proc/{p}/maps") for p in pids) if pids is not None \
        else Path("/proc").glob("[0-9]*/maps")
    mapped: set[Path] = set()
    for m in maps:
        try:
            mapped |= {Path(line.split()[-1]) for line in m.read_text().splitlines()
                       if "/dev/shm/mpich_shm_" in line}
        except OSError:
            continue
    return mapped


def _remove_orphan_shm(owned: set[Path], since: float, settle_s: float = 10) -> None:
    """Delete MPICH segments nobody maps any more that are ``owned`` (mapped by our jobs
    before we stopped them) or last changed between ``since`` (epoch s, our start) and
    ``settle_s`` ago: left by our jobs killed earlier. The settle time spares segments
    that another job has created but not mapped yet."""
    now = time.time()

    def stale(p: Path) -> bool:
        try:
            return since <= p.stat().st_mtime <= now - settle_s
        except OSError:
            return False

    candidates = owned | {p for p in Path("/dev/shm").glob("mpich_shm_*") if stale(p)}
    for p in candidates - (_shm_mapped() if candidates else set()):
        p.unlink(missing_ok=True)
        log.debug("removed %s", p)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    up = ap.add_subparsers(dest="cmd", required=True).add_parser(
        "up", help="start a cluster and keep it up until Ctrl-C or SIGTERM")
    up.add_argument("--root", type=Path, required=True)
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--gpus", type=int, default=4, help="GPUs (GRES) per node")
    up.add_argument("--cpus", type=int, default=8, help="CPUs declared per node")
    up.add_argument("--port-base", type=int, default=17000)
    up.add_argument("--no-accounting", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: `cmd &` ignores it
        signal.signal(sig, lambda *_: sys.exit(0))  # SystemExit runs __exit__
    with LocalSlurmCluster(args.root, args.nodes, args.gpus, args.cpus,
                           not args.no_accounting, args.port_base) as cluster:
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
