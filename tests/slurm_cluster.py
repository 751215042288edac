"""A real single-node Slurm cluster on this machine, for tests/test_slurm.py.

Debian's packages (``make slurm`` installs them as root): ``slurm-wlm`` (slurmctld, slurmd and the
client commands), ``munge`` (Slurm's authentication) and, because submitit asks ``sacct`` for the
state of every job it waits on (a cancelled job never writes a result, so only ``sacct`` can say it
ended), ``slurmdbd`` and ``mariadb-server`` for job accounting.

Everything lives in one temporary directory: a MariaDB data directory, the munge key and socket,
``slurm.conf`` / ``slurmdbd.conf``, state, spool and logs. The daemons run in the foreground as
children of the test process (and die with it), as root (``SlurmUser=root``), on free loopback
ports, so nothing of the machine's own Slurm or munge set-up (``/etc/slurm``, ``/etc/munge``,
``/run/munge``) is used or touched. The node is this machine: its cores and memory as
``slurmd -C`` reports them, ``proctrack/linuxproc``, ``task/none``, no cgroups; one partition
``debug``. Clients find the cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`), which jobs
inherit from ``sbatch``.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

#: the programs the cluster needs, with the Debian package that ships each
PROGRAMS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "slurmdbd": "slurmdbd",
            "sbatch": "slurm-client", "sacct": "slurm-client", "scancel": "slurm-client",
            "mariadbd": "mariadb-server", "mariadb-install-db": "mariadb-server"}
PACKAGES = "slurm-wlm munge slurmdbd mariadb-server"
#: states of a job that has ended (sacct)
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")


def missing() -> list[str]:
    """The programs of :data:`PROGRAMS` not found on PATH (or in /usr/sbin), with their package."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [f"{p} ({pkg})" for p, pkg in PROGRAMS.items() if shutil.which(p, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # preexec_fn: the daemon gets SIGTERM when the test process dies
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """``start()`` brings the cluster up (raises :class:`SlurmError` with the daemons' log tails when
    it cannot), ``stop()`` cancels what is still queued and stops the daemons (idempotent)."""

    def __init__(self, root: Path | None = None, log=print):
        self.root = Path(root or tempfile.mkdtemp(prefix="selfspec-slurm-"))
        self.root.chmod(0o755)  # munged wants the socket's directories searchable by all
        self.log = log
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.env["PATH"] = self.env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        self.node = ""

    # -- clients --------------------------------------------------------------------------------

    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def sacct(self, job: str) -> dict[str, dict[str, str]]:
        """``{job id: {field: value}}`` of ``job`` (an array's id: each of its tasks), job steps left out."""
        fields = "JobID,JobIDRaw,JobName,State,ExitCode,Start,End,Elapsed,NodeList"
        text = self.cmd("sacct", "-X", "-n", "--parsable2", "-o", fields, "-j", job)
        rows = [dict(zip(fields.split(","), line.split("|"))) for line in text.splitlines() if line.strip()]
        return {r["JobID"]: r for r in rows}

    def queued(self) -> list[str]:
        """Job ids squeue still lists (pending, running, completing)."""
        return self.cmd("squeue", "-h", "-o", "%i").split()

    def wait_ended(self, job: str, n: int, timeout: float = 600) -> dict[str, dict[str, str]]:
        """Wait until sacct shows ``n`` tasks of ``job``, each in an ended state; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.sacct(job)
            if len(jobs) >= n and all(j["State"].split()[0] in ENDED for j in jobs.values()):
                return jobs
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} has not ended after {timeout:.0f} s: {jobs}")
            time.sleep(1)

    # -- daemons --------------------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=self.root, preexec_fn=_die_with_parent)
        out.close()
        self.procs.append((name, proc))
        return proc

    def _wait(self, what: str, ready, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited {proc.returncode} while waiting for {what}\n{self.tails()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"{what} not ready after {timeout:.0f} s\n{self.tails()}")
            time.sleep(0.5)

    def tails(self, n: int = 15) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _node_line(self) -> str:
        """This machine as ``slurmd -C`` sees it: name, CPUs and memory (MB)."""
        text = self.cmd("slurmd", "-C")
        fields = dict(re.findall(r"(\w+)=(\S+)", text.splitlines()[0]))
        self.node = fields["NodeName"]
        return f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={fields['CPUs']} RealMemory={fields['RealMemory']} State=UNKNOWN"

    def start(self) -> SlurmCluster:
        root = self.root
        for d in ("munge", "run", "log", "state", "spool", "db"):
            (root / d).mkdir(exist_ok=True)
        (root / "munge").chmod(0o700)
        (root / "run").chmod(0o755)
        ports = {k: _free_port() for k in ("mysql", "dbd", "ctld", "slurmd")}
        sock = root / "run" / "munge.socket"
        try:
            # munge: a fresh key, its own socket
            key = root / "munge" / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
            self._spawn("munged", "munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
                        f"--log-file={root / 'log' / 'munged.log'}", f"--pid-file={root / 'run' / 'munged.pid'}",
                        f"--seed-file={root / 'munge' / 'munged.seed'}")
            self._wait("munged", sock.exists)

            # MariaDB for slurmdbd: a throw-away data directory, loopback only
            self.cmd("mariadb-install-db", "--no-defaults", f"--datadir={root / 'db'}", "--user=root",
                     "--auth-root-authentication-method=normal", "--skip-test-db", timeout=180)
            self._spawn("mariadbd", "mariadbd", "--no-defaults", f"--datadir={root / 'db'}", "--user=root",
                        f"--socket={root / 'run' / 'mysql.sock'}", f"--port={ports['mysql']}",
                        "--bind-address=127.0.0.1", "--skip-name-resolve", "--innodb-buffer-pool-size=64M",
                        f"--pid-file={root / 'run' / 'mariadbd.pid'}", f"--log-error={root / 'log' / 'mariadbd.log'}")
            self._wait("mariadbd", lambda: self._listening(ports["mysql"]))

            auth = f"AuthType=auth/munge\nAuthInfo=socket={sock}\n"
            dbd = root / "slurmdbd.conf"  # slurmdbd reads it next to SLURM_CONF
            dbd.write_text(
                auth + f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={ports['dbd']}\nSlurmUser=root\n"
                f"PidFile={root / 'run' / 'slurmdbd.pid'}\nLogFile={root / 'log' / 'slurmdbd.log'}\n"
                f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={ports['mysql']}\n"
                "StorageUser=root\nStorageLoc=slurm_acct_db\n")
            dbd.chmod(0o600)
            self.conf.write_text(
                auth + "ClusterName=selfspec\n"
                f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)\n"
                f"SlurmctldPort={ports['ctld']}\nSlurmdPort={ports['slurmd']}\n"
                "SlurmUser=root\nSlurmdUser=root\nCredType=cred/munge\nMailProg=/bin/true\n"
                f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root / 'spool'}\n"
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}\nSlurmdPidFile={root / 'run' / 'slurmd.pid'}\n"
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}\nSlurmdLogFile={root / 'log' / 'slurmd.log'}\n"
                # no cgroups: processes tracked through /proc, no task binding
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/linux\n"
                "MpiDefault=none\nSchedulerType=sched/backfill\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory\n"
                # sacct, through slurmdbd: AccountingStoragePass names the munge socket to use there
                f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={ports['dbd']}\nAccountingStoragePass={sock}\nJobCompType=jobcomp/none\n"
                # a cancelled job: SIGTERM (submitit's jobs ignore it, as they would a preemption
                # notice), SIGKILL 2 s later
                "ReturnToService=2\nKillWait=2\nSlurmctldTimeout=30\nSlurmdTimeout=60\n"
                f"{self._node_line()}\n"
                f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP\n")

            self._spawn("slurmdbd", "slurmdbd", "-D")
            self._wait("slurmdbd", lambda: self._listening(ports["dbd"]))
            self._spawn("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
            self._wait("slurmctld", lambda: self._listening(ports["ctld"]))
            self._spawn("slurmd", "slurmd", "-D", "-f", str(self.conf), "-N", self.node)
            self._wait("node idle", lambda: self.cmd("sinfo", "-h", "-o", "%T", check=False).strip() == "idle")
            self._wait("the cluster in the accounting database",
                       lambda: "selfspec" in self.cmd("sacctmgr", "-n", "-P", "list", "cluster", "format=cluster",
                                                      check=False))
        except BaseException:
            self.stop()
            raise
        self.log(f"slurm cluster up in {root}: node {self.node!r}: " + self.cmd("sinfo", "-h", "-N", "-o",
                                                                               "%N %T cpus=%c mem=%mMB").strip())
        return self

    def stop(self) -> None:
        """Cancel every job still queued, wait for them to go, then stop the daemons, newest first."""
        if any(n == "slurmctld" and p.poll() is None for n, p in self.procs):
            try:
                if self.queued():
                    self.cmd("scancel", "--full", *self.queued(), check=False)
                    deadline = time.monotonic() + 60
                    while self.queued() and time.monotonic() < deadline:
                        time.sleep(1)
            except (SlurmError, subprocess.SubprocessError, OSError):
                pass
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.procs:
            self.log("slurm cluster stopped: " + ", ".join(f"{n} (exit {p.returncode})" for n, p in self.procs))
        self.procs = []
