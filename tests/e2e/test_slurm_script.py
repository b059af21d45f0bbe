"""scripts/slurm/train.sbatch without SLURM: its body run by bash, with stand-ins for srun
and scontrol on PATH, a real torchrun starting two ranks on this machine, and either a
stand-in trainer (exit codes, environment) or the real one (a stop signal, save, requeue).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.metrics_rows import read_rows

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
VENV_BIN = pathlib.Path(sys.executable).parent
WAIT_S = 180.0

# srun on one node: runs the command as the node's one task and, as slurmstepd does, gives
# a stop signal it receives to every process of the task, torchrun's ranks included.
FAKE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
export SLURM_PROCID=0 SLURM_NODEID=0 SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES
"$@" &
task=$!
tree() { local p; for p in $(pgrep -P "$1"); do echo "$p"; tree "$p"; done; }
forward() { kill -s "$1" "$task" $(tree "$task") 2>/dev/null; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while kill -0 "$task" 2>/dev/null; do wait "$task"; done
wait "$task"
"""
# scontrol: this machine is the allocation's one node; a requeue is only recorded. (A
# hardware fault's exclusion of hosts is tested under a real SLURM, tests/slurm/: a
# stand-in had accepted the update of a running job's ExcNodeList that SLURM refuses.)
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") echo localhost ;;
    requeue*) echo "requeue $2" >> "$SLURM_FAKE_LOG" ;;
    *) exit 1 ;;
esac
"""
# The trainer: records what a rank sees and exits with FAKE_RC_<rank> (default 0).
FAKE_TRAINER = """#!/bin/bash
echo "rank $RANK local $LOCAL_RANK world $WORLD_SIZE master $MASTER_ADDR args $*" \
    >> "$SLURM_FAKE_LOG"
rc_var=FAKE_RC_$RANK
[[ -n ${FAKE_FAULT_HOST:-} ]] && echo "$FAKE_FAULT_HOST" >> "$KEMPNERFORGE_FAULT_HOSTS_FILE"
exit "${!rc_var:-0}"
"""


def _free_port_for_job_id() -> int:
    """A job id whose MASTER_PORT (15000 + id % 15000) is free on this machine. The port is
    drawn at random: the kernel's ephemeral ports lie above this range, and a fixed order
    would give tests running side by side (pytest-xdist workers) the same port."""
    ports = list(range(15000, 30000))
    random.SystemRandom().shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port - 15000
    raise RuntimeError("no free port in 15000..29999")


def _write_tool(directory: pathlib.Path, name: str, text: str) -> None:
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)


def start(tmp_path, *args: str, fake_trainer: bool, env_extra=None) -> subprocess.Popen:
    """Run the script's body as sbatch would on one node with two ranks."""
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    _write_tool(tools, "srun", FAKE_SRUN)
    _write_tool(tools, "scontrol", FAKE_SCONTROL)
    if fake_trainer:
        _write_tool(tools, "kempnerforge", FAKE_TRAINER)
    env = {
        **os.environ,
        # The stand-ins first, then this venv's torchrun (and its kempnerforge, unless faked).
        "PATH": f"{tools}:{VENV_BIN}:{os.environ['PATH']}",
        "VENV": str(tmp_path / "no-venv"),  # nothing to activate: PATH is set above
        "SLURM_JOB_ID": str(_free_port_for_job_id()),
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_NNODES": "1",
        "SLURM_RESTART_COUNT": "0",
        "GPUS_PER_NODE": "2",
        "SLURM_FAKE_LOG": str(tmp_path / "slurm.log"),
        **(env_extra or {}),
    }
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def fake_log(tmp_path) -> list[str]:
    path = tmp_path / "slurm.log"
    return sorted(path.read_text().splitlines()) if path.exists() else []


def test_each_rank_gets_its_torchrun_environment_and_a_finished_run_exits_0(tmp_path):
    proc = start(tmp_path, "cfg.toml", "--train.max_steps=9", fake_trainer=True)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, out
    assert "(1 nodes x 2 ranks): cfg.toml --train.max_steps=9" in out
    assert out.rstrip().endswith("training finished")
    assert fake_log(tmp_path) == [
        f"rank {r} local {r} world 2 master localhost args train cfg.toml --train.max_steps=9"
        for r in (0, 1)
    ]


def test_a_port_held_on_the_node_moves_the_rendezvous_to_the_next_free_one(tmp_path):
    """The job id's port is in use on the first node (a job whose id is equal modulo
    15000, a launcher still leaving): the script says so and takes a free one."""
    job_id = _free_port_for_job_id()
    with socket.socket() as holder:
        holder.bind(("", 15000 + job_id))
        holder.listen()
        env = {"SLURM_JOB_ID": str(job_id)}
        proc = start(tmp_path, "cfg.toml", fake_trainer=True, env_extra=env)
        out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, out
    moved = [line for line in out.splitlines() if line.startswith(f"port {15000 + job_id} ")]
    assert len(moved) == 1 and "is in use on" in moved[0], out
    taken = int(moved[0].rsplit(" ", 1)[1])
    assert taken != 15000 + job_id and 15000 <= taken < 30000


@pytest.mark.parametrize(
    ("codes", "restarts", "expected_rc", "requeued", "message"),
    [
        ((75, 75), 0, 0, True, "saved after a stop signal: requeueing job"),
        ((75, 75), 50, 75, False, "already restarted 50 times: not requeueing"),
        ((77, 1), 0, 0, True, "hung: requeueing job"),
        ((1, 77), 50, 77, False, "hung, but already restarted 50 times: not requeueing"),
        ((0, 3), 0, 3, False, "stopped on non-finite losses"),
        ((2, 0), 0, 2, False, "training failed with exit code 2"),
        ((76, 76), 50, 76, False, "already restarted 50 times: not requeueing"),
    ],
)
def test_the_highest_rank_exit_code_decides_requeue(
    tmp_path, codes, restarts, expected_rc, requeued, message
):
    env = {f"FAKE_RC_{rank}": str(code) for rank, code in enumerate(codes)}
    env["SLURM_RESTART_COUNT"] = str(restarts)
    hosts = tmp_path / "fault-hosts"
    env["KEMPNERFORGE_FAULT_HOSTS_FILE"] = str(hosts)
    if 76 in codes:
        env["FAKE_FAULT_HOST"] = "gpu-7.cluster.example"
    proc = start(tmp_path, "cfg.toml", fake_trainer=True, env_extra=env)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == expected_rc, out
    assert message in out
    job_id = out.split()[1]  # "job <id> restart 0 on ..."
    requeues = [line for line in fake_log(tmp_path) if line.startswith("requeue")]
    assert requeues == ([f"requeue {job_id}"] if requeued else [])


def _descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), as slurmd's signal to a job step reaches."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_stop_signal_saves_on_every_rank_and_requeues(tmp_path, builtin_cache, sig):
    run_dir = tmp_path / "run"
    proc = start(
        tmp_path,
        DEBUG,
        "--model.dim=64",
        "--model.n_layers=2",
        "--train.seq_len=32",
        "--train.batch_size=2",
        "--train.max_steps=100000",
        "--metrics.log_interval=1",
        "--metrics.progress=off",
        "--checkpoint.interval=0",
        "--eval.interval=0",
        f"--train.run_dir={run_dir}",
        fake_trainer=False,
        env_extra={"KEMPNERFORGE_CACHE": str(builtin_cache)},
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not any("loss" in r for r in read_rows(run_dir, live=True)):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no training step within the time limit"
            time.sleep(0.5)
        if sig == signal.SIGTERM:
            # scancel: slurmd signals every process of the step, and the batch shell, which
            # forwards it once more through srun: each process sees it twice.
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        proc.send_signal(sig)  # the batch shell; for USR1 the only one SLURM signals
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"received SIG{sig.name[3:]}" in out
    assert "requeueing job" in out
    assert fake_log(tmp_path) == [f"requeue {out.split()[1]}"]
    rows = read_rows(run_dir, live=True)
    shutdown = [r for r in rows if r.get("event") == "shutdown"]
    assert len(shutdown) == 1, rows[-5:]
    step = shutdown[0]["step"]
    assert (run_dir / "checkpoints" / f"step_{step}").is_dir()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
