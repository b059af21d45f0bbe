"""A one-node SLURM cluster for the test run: munged, slurmctld and slurmd as root, with
their key, sockets, state, spool and logs in one directory and their ports chosen free;
stopped by their process ids. Jobs run on this machine as they would on a cluster node
(and a drained second node, DRAINED_NODE, takes the jobs that exclude it, to wait).

Needs Debian's slurm-wlm and munge (as root: apt-get install slurm-wlm munge);
``missing()`` says what is absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue")
PACKAGES = "slurm-wlm and munge (as root: apt-get install slurm-wlm munge)"
DRAINED_NODE = "ghost"
"""A second node of the partition, drained: a job that excludes this machine's node is
accepted and waits, as it would for the other nodes of a real cluster, instead of being
refused."""
DRAINED_ADDR = "127.0.0.2"
"""Where slurmctld looks for DRAINED_NODE: a loopback address (all of 127.0.0.0/8 is this
machine's on Linux) and a port of its own where nothing listens, so its pings are refused
at once and no packet leaves the machine."""
LOOPBACK = "127.0.0.1"
"""The address of this machine's node and of its slurmctld: the daemons talk over loopback
whatever the host name resolves to."""


def missing() -> str | None:
    """Why no cluster can start here, or None when it can."""
    absent = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if absent:
        return f"no {', '.join(absent)} on PATH: install {PACKAGES}"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` is what a client command needs (SLURM_CONF)."""

    root: Path
    node: str
    env: dict[str, str]
    pids: list[int] = field(default_factory=list)

    def run(
        self, *argv: str, cwd: str | Path | None = None, env_extra: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **(env_extra or {})}
        return subprocess.run(
            list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=60
        )

    def sbatch(self, *argv: str, cwd: str | Path, env_extra: dict[str, str] | None = None) -> int:
        """Submit from ``cwd`` (the job starts there, with this environment); the job id."""
        done = self.run("sbatch", "--parsable", *argv, cwd=cwd, env_extra=env_extra)
        if done.returncode:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job as `scontrol show job` reports it (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def wait_for(self, job_id: int, states: set[str], timeout_s: float) -> dict[str, str]:
        """Poll until the job's state is one of ``states``; its record."""
        return self.wait_until(job_id, lambda record: record.get("JobState") in states, timeout_s)

    def wait_until(
        self, job_id: int, done: Callable[[dict[str, str]], bool], timeout_s: float
    ) -> dict[str, str]:
        """Poll the job's record until ``done(record)``; that record."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.job(job_id)
            if done(record):
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not there after {timeout_s} s: {record}")
            time.sleep(0.5)

    def steps(self, job_id: int) -> dict[str, str]:
        """The job's running steps by name (``srun --job-name``), as `squeue -s` lists
        them: {"group1": "12.3", ...}; of two steps with one name, the newer."""
        out = self.run("squeue", "-s", "-h", "-j", str(job_id), "-o", "%i %j").stdout
        steps: dict[str, str] = {}
        for line in out.splitlines():
            step_id, _, name = line.strip().partition(" ")
            number = step_id.partition(".")[2]
            if not number.isdigit():
                continue  # the batch step (JOBID.batch)
            if name not in steps or int(number) > int(steps[name].partition(".")[2]):
                steps[name] = step_id
        return steps

    def stop(self) -> None:
        """End the daemons by their process ids, slurmd first."""
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for pid in self.pids:
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)


def _free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind((host, 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _cluster_ports() -> list[int]:
    """slurmctld's and slurmd's ports, free on loopback, and DRAINED_NODE's, free on its
    address and unlike both (slurmd listens on every address)."""
    daemons = _free_ports(2)
    while True:
        [drained] = _free_ports(1, DRAINED_ADDR)
        if drained not in daemons:
            return [*daemons, drained]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 512
    return 1024


def slurm_conf(root: Path, node: str, ports: list[int]) -> str:
    """slurm.conf of the cluster: ``ports`` are slurmctld's, slurmd's and the one
    DRAINED_NODE is looked for at (nothing listens there)."""
    return "\n".join(
        [
            "ClusterName=kftest",
            f"SlurmctldHost={node}({LOOPBACK})",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={os.path.realpath(root / 'munge')}/socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={node} NodeAddr={LOOPBACK} CPUs={os.cpu_count()} "
            f"RealMemory={_memory_mb()} State=UNKNOWN",
            f"NodeName={DRAINED_NODE} NodeHostname={DRAINED_NODE} NodeAddr={DRAINED_ADDR} "
            f"Port={ports[2]} CPUs=1 RealMemory=100 State=DRAIN",
            f"PartitionName=debug Nodes={node},{DRAINED_NODE} Default=YES MaxTime=INFINITE "
            "State=UP",
            "",
        ]
    )


def start_cluster(root: Path, timeout_s: float = 30.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root``; returns once the node is idle."""
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munged wants every directory above its socket open to all: a directory of its own
    # under /tmp, not under the test's private temporary directory.
    munge = Path(tempfile.mkdtemp(prefix="kf-munge-"))
    munge.chmod(0o755)
    (root / "munge").symlink_to(munge)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node, _cluster_ports()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root, node, env)
    subprocess.run(
        [
            "munged",
            f"--key-file={key}",
            f"--socket={munge}/socket",
            f"--pid-file={munge}/pid",
            f"--log-file={munge}/log",
            f"--seed-file={munge}/seed",
        ],
        check=True,
        timeout=30,
    )
    cluster.pids.append(int((munge / "pid").read_text()))
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], check=True, env=env, timeout=30)
        pid_file = root / f"{daemon}.pid"
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.1)
        cluster.pids.append(int(pid_file.read_text()))
    deadline = time.monotonic() + timeout_s
    while cluster.run("sinfo", "-h", "-n", node, "-o", "%t").stdout.strip() != "idle":
        if time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"the test cluster's node is not idle after {timeout_s} s")
        time.sleep(0.3)
    return cluster
