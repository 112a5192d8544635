"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd on loopback.

Everything lives in one temporary directory: the munge key and socket, slurm.conf (loopback
addresses, ports free right now, `proctrack/linuxproc` and `task/none` so no cgroups are
needed), state, spool and logs. The daemons run in the foreground as children of the test and
are stopped by their own pids. Clients (`sbatch`, `srun`, `squeue`, `scancel`) find the cluster
through `SLURM_CONF`, which `env()` sets. Needs Debian's `slurm-wlm` and `munge` and root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from services.common import process
from services.common.ports import free_ports

#: The programs the cluster needs, each with the Debian package that has it.
PROGRAMS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm",
            "srun": "slurm-wlm", "sbatch": "slurm-wlm"}
SRUN_PORTS = 200  # the width of SrunPortRange


def missing_programs() -> list[str]:
    """Why this machine cannot run the cluster: missing programs or not root (empty: it can)."""
    missing = [f"{p} (package {pkg})" for p, pkg in PROGRAMS.items() if shutil.which(p) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd runs job steps as their users)")
    return missing


class SlurmCluster:
    """munged + slurmctld + slurmd for one node, the machine itself, at 127.0.0.1."""

    def __init__(self, root: Path, cpus: int | None = None) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = root / "slurm.conf"
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        #: The ports the daemons and every srun take (srun's from SrunPortRange while a step
        #: runs): a test choosing ports for its own services must stay out of them.
        self.ports: list[int] = []

    def env(self) -> dict[str, str]:
        """The environment of a Slurm client of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start(self) -> None:
        for sub in ("state", "spool", "logs", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = self.root / "munge" / "munge.socket"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={self.root / 'munge/pid'}",
                               f"--log-file={self.root / 'logs/munged.log'}",
                               f"--seed-file={self.root / 'munge/seed'}"])
        self._wait(lambda: socket_path.exists(), "munged", 20.0)
        self.conf.write_text(self._slurm_conf(socket_path))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ping(), "slurmctld", 30.0)
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self._node_idle(), "slurmd", 60.0)

    def _slurm_conf(self, munge_socket: Path) -> str:
        ctld, slurmd, srun_low = free_ports(3)
        self.ports = [ctld, slurmd, *range(srun_low, srun_low + SRUN_PORTS + 1)]
        r = self.root
        return "\n".join([
            "ClusterName=riptidetest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
            f"SrunPortRange={srun_low}-{srun_low + SRUN_PORTS}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'logs/slurmctld.log'}",
            f"SlurmdLogFile={r / 'logs/slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "MpiDefault=none", "ReturnToService=2", "KillWait=5",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        self.children[name] = process.spawn(cmd, log_path=self.root / "logs" / f"{name}.out")

    def _wait(self, probe: Callable[[], bool], name: str, timeout_s: float) -> None:
        process.wait_until_ready(probe, self.children[name], name, timeout_s,
                                 lambda: self.log_tail(name), 0.3)

    def _ping(self) -> bool:
        out = self.run(["scontrol", "ping"], check=False)
        return "is UP" in out.stdout

    def _node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False)
        return out.stdout.strip() in ("idle", "mix", "alloc")

    def run(self, cmd: list[str], check: bool = True,
            timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        result = subprocess.run(cmd, env=self.env(), capture_output=True, text=True,
                                timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
        return result

    def log_tail(self, name: str, lines: int = 30) -> str:
        texts = []
        for path in (self.root / "logs" / f"{name}.log", self.root / "logs" / f"{name}.out"):
            if path.exists():
                texts.append("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts) or "(no log)"

    def cancel_all_jobs(self, timeout_s: float = 60.0) -> None:
        """scancel every job and wait until none is left: a step's slurmstepd is no child of
        slurmd and would outlive it, with the step's processes."""
        if "slurmctld" not in self.children or self.children["slurmctld"].poll() is not None:
            return
        jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons, newest first, each by its own
        process group."""
        self.cancel_all_jobs()
        for name in reversed(list(self.children)):
            process.stop(self.children[name], grace_s=10.0)
        self.children.clear()
