"""slurm/ray.sub on a real Slurm: Debian's slurm-wlm + munge on this machine (scripts/start_local_slurm.sh).

The local cluster has two slurmd daemons on localhost (nodes <host>n1, <host>n2), so a 2-node job really starts
the Ray head on one node and a worker on the other through srun. The jobs run with this venv on PATH (no
container: there is no container runtime here). The install step starts that cluster (`make slurm`, which .ci/run
runs as root before `make test`); the tests that need it (the ``slurm`` tier: those taking ``slurm_nodes``) skip
with the reason when no Slurm node is idle, and fail instead under REQUIRE_SLURM=1 (.ci/run sets it).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY_SUB = ROOT / "slurm" / "ray.sub"
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _unavailable(reason: str) -> None:
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm required (REQUIRE_SLURM=1) but unavailable: {reason}")
    pytest.skip(reason)


def _idle_nodes() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [
        line.split()[0]
        for line in out.stdout.splitlines()
        if len(line.split()) == 2 and line.split()[1] in ("idle", "mixed")
    ]


@pytest.fixture(scope="module")
def slurm_nodes() -> list[str]:
    """The idle nodes of the running local Slurm. Installing and starting it is the install step's job
    (`make slurm`, run by .ci/run before the tests), not a test's: with none running this skips with the reason,
    or fails under REQUIRE_SLURM=1 (as .ci/run sets)."""
    if shutil.which("sinfo") is None:
        _unavailable(
            "Slurm is not installed: run `sudo make slurm` (scripts/start_local_slurm.sh: apt-get install "
            "slurm-wlm munge, starts the daemons), then rerun"
        )
    nodes = _idle_nodes()
    if not nodes:
        _unavailable(
            "no idle Slurm node (sinfo): start the local cluster with `sudo make slurm` "
            "(scripts/start_local_slurm.sh), then rerun"
        )
    return nodes


def _free_port() -> int:
    """A free port in [20000, 32000): below Linux's ephemeral range (32768+), from which Ray's own randomly
    assigned gRPC ports come (an ephemeral port chosen here was once taken by one of them before the job bound it:
    'Address already in use' for the Ray client server), and above Ray's default worker ports (10002-19999)."""
    import random

    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [20000, 32000)")


def _job_env(tmp: Path, command: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHON=sys.executable,
        BASE_LOG_DIR=str(tmp / "slurm"),
        RAY_PORT=str(_free_port()),
        RAY_CLIENT_PORT=str(_free_port()),
        RAY_DASHBOARD="false",
        RAY_START_TIMEOUT_S="300",
    )
    if command is not None:
        env["COMMAND"] = command
    return env


def _submit(tmp: Path, command: str | None, nodes: int = 1, *extra: str) -> str:
    """sbatch slurm/ray.sub with COMMAND (None: interactive mode); the job id."""
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            f"--chdir={ROOT}",
            f"--output={tmp}/slurm-%j.out",
            "--time=00:30:00",
            *extra,
            str(RAY_SUB),
        ],
        env=_job_env(tmp, command),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(job: str, tmp: Path, timeout_s: float) -> dict[str, str]:
    """Poll until the job is in a terminal state; on timeout cancel it and fail with its output."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        fields = _job_fields(job)
        if fields.get("JobState") in TERMINAL:
            return fields
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} still running after {timeout_s}s:\n{_output(job, tmp)}")


def _output(job: str, tmp: Path) -> str:
    path = tmp / f"slurm-{job}.out"
    return path.read_text()[-6000:] if path.exists() else "<no output file>"


def _log_dir(job: str, tmp: Path) -> Path:
    return tmp / "slurm" / f"{job}-logs"


def _ray_processes(job: str) -> list[str]:
    """Processes still using this job's Ray temp dir (/tmp/ray_<jobid>)."""
    out = subprocess.run(["pgrep", "-af", f"/tmp/ray_{job}[/ ]|/tmp/ray_{job}$"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_two_node_ray_cluster_runs_command_and_tears_down(slurm_nodes, tmp_path):
    nodes = min(2, len(slurm_nodes))
    result = tmp_path / "result.json"
    command = (
        f'{sys.executable} -c "import json, os, ray; ray.init(); '
        f"alive = [n['NodeManagerHostname'] for n in ray.nodes() if n['Alive']]; "
        f"json.dump({{'alive': len(alive), 'address': os.environ['RAY_ADDRESS']}}, open('{result}', 'w'))\""
    )
    t0 = time.monotonic()
    job = _submit(tmp_path, command, nodes)
    fields = _wait(job, tmp_path, 600)
    elapsed = time.monotonic() - t0
    out = _output(job, tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out
    got = json.loads(result.read_text())
    assert got["alive"] == nodes, out
    logs = _log_dir(job, tmp_path)
    assert (logs / "command.exitcode").read_text().strip() == "0"
    assert (logs / "ray-head.log").is_file() and (logs / "driver.log").is_file()
    if nodes == 2:
        assert "Ray runtime started" in (logs / "ray-worker-1.log").read_text()
        assert f"{nodes} node(s)" in out
    assert "teardown done" in out
    assert _ray_processes(job) == []
    print(f"{nodes}-node job {job}: {elapsed:.1f}s from sbatch to COMPLETED")


def test_command_exit_code_is_the_job_exit_code(slurm_nodes, tmp_path):
    job = _submit(tmp_path, "echo failing on purpose; exit 3")
    fields = _wait(job, tmp_path, 600)
    out = _output(job, tmp_path)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0", (fields, out)
    assert "failing on purpose" in (_log_dir(job, tmp_path) / "driver.log").read_text()
    assert _ray_processes(job) == []


def test_interactive_mode_attach_and_scancel_teardown(slurm_nodes, tmp_path):
    job = _submit(tmp_path, None)
    logs = _log_dir(job, tmp_path)
    end = time.monotonic() + 300
    while not (logs / "ray-cluster-ready").exists():
        state = _job_fields(job).get("JobState")
        assert state not in TERMINAL, (state, _output(job, tmp_path))
        assert time.monotonic() < end, _output(job, tmp_path)
        time.sleep(1)
    # the cluster stays up without COMMAND: attach runs a command on the head node against it
    time.sleep(3)
    assert _job_fields(job)["JobState"] == "RUNNING"
    attach = subprocess.run(
        [
            "bash",
            str(logs / "attach.sh"),
            sys.executable,
            "-c",
            "import ray; ray.init(); print('ATTACHED', int(ray.cluster_resources()['CPU']))",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert attach.returncode == 0 and "ATTACHED" in attach.stdout, attach.stdout + attach.stderr
    assert _ray_processes(job), "Ray should be running before scancel"
    t0 = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=30)
    fields = _wait(job, tmp_path, 120)
    out = _output(job, tmp_path)
    assert fields["JobState"] == "CANCELLED", out
    assert time.monotonic() - t0 < 60, out
    assert "received SIGTERM" in out and "teardown done" in out, out
    deadline = time.monotonic() + 30  # Slurm reaps the steps' processes asynchronously
    while _ray_processes(job) and time.monotonic() < deadline:
        time.sleep(1)
    assert _ray_processes(job) == []


PLACEMENT_LINE = re.compile(r"\[placement\] (policy rank|generation engine) (\d+) \(node (\d+)\) on ray node (\w+)")


@pytest.mark.timeout(2400)
def test_two_node_grpo_places_a_policy_worker_and_an_engine_on_each_node(slurm_nodes, tmp_path):
    """cluster.num_nodes=2 under a 2-node job: the placement plan puts policy rank n and engine n on node n
    (colocated, one slot per node); the Ray node id each actor reports (printed by the driver as ``[placement]``
    lines) differs between the two nodes and agrees between the rank and the engine of one node; 2 GRPO steps run
    and train (the scripted env.reward=char_fraction gives every group a reward spread, so the loss has a gradient);
    the driver joined the job's Ray cluster (RAY_ADDRESS exported by ray.sub) rather than starting its own.
    (Also the single-node case's checks: one job, one driver, the steps' metrics; a separate 1-node run was dropped.)"""
    if len(slurm_nodes) < 2:
        _unavailable(f"needs 2 Slurm nodes, sinfo shows {slurm_nodes}")
    log_dir = tmp_path / "logs"
    command = (
        f"{sys.executable} examples/run_grpo.py --config configs/grpo_math_tiny.yaml cluster.num_nodes=2 "
        f"grpo.max_num_steps=2 grpo.val_at_start=false data.validation.max_samples=2 "
        f"logger.log_dir={log_dir} checkpointing.enabled=false logger.progress_bar=false "
        # verbose: Ray's "Connecting to existing Ray cluster" line (asserted below) is INFO
        "env.reward=char_fraction logger.verbose=true cluster.ray_address=$RAY_ADDRESS"
    )
    t0 = time.monotonic()
    job = _submit(tmp_path, command, 2, "--time=00:40:00")
    fields = _wait(job, tmp_path, 2100)
    elapsed = time.monotonic() - t0
    out = _output(job, tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out
    driver = (_log_dir(job, tmp_path) / "driver.log").read_text()
    assert "Connecting to existing Ray cluster" in driver, driver[-4000:]
    placed = {
        (role.split()[0], int(i)): (int(node), ray_node) for role, i, node, ray_node in PLACEMENT_LINE.findall(driver)
    }
    assert set(placed) == {("policy", 0), ("policy", 1), ("generation", 0), ("generation", 1)}, driver[-4000:]
    for i in (0, 1):
        assert placed["policy", i][0] == placed["generation", i][0] == i  # the plan: rank i, engine i on node i
        assert placed["policy", i][1] == placed["generation", i][1]  # the actors agree on their Ray node
    assert placed["policy", 0][1] != placed["policy", 1][1]  # two different Ray nodes
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records}
    assert {1, 2} <= set(steps), records
    for step in (1, 2):  # sync GRPO trains on-policy: the token-mean ratio is 1 when DP normalises globally
        assert all(math.isfinite(v) for v in steps[step].values() if isinstance(v, (int, float))), steps[step]
        assert "train/loss" in steps[step] and abs(steps[step]["train/probs_ratio"] - 1.0) < 1e-3, steps[step]
        assert steps[step]["train/grad_norm"] > 1e-6 and "timing/train/total_step_time" in steps[step], steps[step]
    assert _ray_processes(job) == []
    print(f"2-node GRPO under Slurm, job {job}: {elapsed:.1f}s from sbatch to COMPLETED; placement {placed}")


# ---- container plumbing, without Slurm: stub srun/scontrol/squeue/scancel on PATH --------------------------------
STUB_SRUN = r"""#!/bin/bash
# records its arguments (one JSON list per call, in one O_APPEND write: steps start concurrently, and print() under
# PYTHONUNBUFFERED writes the line and its newline separately, so another step's line could land between them),
# then emulates the step by its --job-name
python3 -c 'import json, os, sys
fd = os.open(os.environ["STUB_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, (json.dumps(sys.argv[1:]) + "\n").encode())' "$@"
name=""; args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in --job-name=*) name=${args[$i]#--job-name=} ;; bash) cmd=("${args[@]:$i}"); break ;; esac
done
case "$name" in
  ray-head|ray-worker-*) exec sleep 300 ;;
  ray-wait) echo "ray nodes: 2, resources: {'CPU': 4.0}"; exit 0 ;;
  driver) exec "${cmd[@]}" ;;
  *) exit 0 ;;
esac
"""
STUB_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo "$3" | tr ',' '\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3" ;;
esac
"""


def test_container_flags_reach_every_step_without_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "srun": STUB_SRUN,
        "scontrol": STUB_SCONTROL,
        "squeue": "#!/bin/bash\n",
        "scancel": "#!/bin/bash\n",
    }.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log, seen_env = tmp_path / "srun.jsonl", tmp_path / "driver_env.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        STUB_LOG=str(log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="nodeA,nodeB",
        SLURM_SUBMIT_DIR=str(tmp_path),
        BASE_LOG_DIR=str(tmp_path / "logs"),
        CONTAINER="/images/nemo_rl_spec.sqsh",
        GPUS_PER_NODE="4",
        MOUNTS="/lustre:/lustre,/home/u:/home/u",
        RAY_PORT="16379",
        COMMAND=f"env | grep -E '^RAY_(ADDRESS|AUTH_MODE)=' | sort > {seen_env}; exit 7",
    )
    proc = subprocess.run(["bash", str(RAY_SUB)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    names = [next(a.split("=", 1)[1] for a in c if a.startswith("--job-name=")) for c in calls]
    assert sorted(names) == ["driver", "ray-head", "ray-wait", "ray-worker-1"], names  # 3 start concurrently
    assert names[-1] == "driver"
    for call in calls:
        assert "--overlap" in call
        assert "--container-image=/images/nemo_rl_spec.sqsh" in call
        assert "--container-mounts=/lustre:/lustre,/home/u:/home/u" in call
        assert f"--container-workdir={tmp_path}" in call
        assert "--gres=gpu:4" in call
    by_name = dict(zip(names, calls))
    assert by_name["ray-head"][by_name["ray-head"].index("-w") + 1] == "nodeA"
    assert by_name["ray-worker-1"][by_name["ray-worker-1"].index("-w") + 1] == "nodeB"
    assert by_name["driver"][by_name["driver"].index("-w") + 1] == "nodeA"
    head_cmd, worker_cmd = by_name["ray-head"][-1], by_name["ray-worker-1"][-1]
    assert "ray start --head --block --node-ip-address=127.0.0.1 --port=16379" in head_cmd
    assert "--temp-dir=/tmp/ray_4242" in head_cmd and "--num-gpus=4" in head_cmd and "--num-gpus=4" in worker_cmd
    assert "ray start --block --address=127.0.0.1:16379" in worker_cmd
    assert seen_env.read_text().splitlines() == ["RAY_ADDRESS=127.0.0.1:16379", "RAY_AUTH_MODE=token"]
    logs = tmp_path / "logs" / "4242-logs"
    assert (logs / "command.exitcode").read_text().strip() == "7"
    attach = (logs / "attach.sh").read_text()
    assert "--container-image=/images/nemo_rl_spec.sqsh" in attach and "RAY_AUTH_TOKEN=" in attach
    assert oct((logs / "attach.sh").stat().st_mode & 0o777) == "0o700"
    assert "COMMAND exited with 7" in proc.stdout and "teardown done" in proc.stdout
