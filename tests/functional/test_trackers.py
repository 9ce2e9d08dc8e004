"""W&B and MLflow against the real clients: the tiny recipe runs 2 GRPO steps through the CLI
(``examples/run_grpo.py``: Ray + vLLM + Megatron) with both trackers on, in ONE run:

- W&B offline (``WANDB_MODE=offline``; the automatic offline decision is unit-tested in
  tests/unit/test_tracker_clients.py): the run file ``<log_dir>/wandb/offline-run-*/run-*.wandb`` that ``wandb sync``
  uploads is read back record by record (its framing: a LevelDB-style log; its records: W&B's own protobuf
  ``Record``), and every step of ``metrics.jsonl`` is there with equal values, with the config and the curve image;
- MLflow against a real ``mlflow server`` the test starts on 127.0.0.1 (a free port, a sqlite store in tmp) and
  stops: every metric of every step through ``MlflowClient.get_metric_history``, the params, the curve artifact.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "grpo_math_tiny.yaml"

pytestmark = pytest.mark.timeout(900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real ``mlflow server`` on 127.0.0.1 (its own process group, stopped at teardown); yields (url, log path).
    Not waited for here: the test waits (:func:`wait_until_answers`) while the GRPO run starts."""
    store = tmp_path / "mlflow_server"
    store.mkdir()
    url = f"http://127.0.0.1:{free_port()}"
    log = store / "server.log"
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        url.rsplit(":")[-1],
        "--backend-store-uri",
        f"sqlite:///{store / 'mlflow.db'}",
        "--artifacts-destination",
        str(store / "artifacts"),
        "--workers",
        "1",
    ]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=store, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=2)  # a tmp store: no need to wait out its graceful shutdown
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until_answers(url: str, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"mlflow server at {url} did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")


def read_wandb_records(path: Path) -> list:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last), each record a serialized ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records) -> tuple[dict[int, dict], dict]:
    """({step: {name: value}} of the history records, the run's config as {key: value}). A logged image is the
    flattened dict ``<name>/_type``, ``<name>/path`` ... (its file under the run's ``files/``)."""
    history, config = {}, {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = history.setdefault(r.history.step.num, {})
            row.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return history, config


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_wandb_offline_and_mlflow_server_hold_every_step(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    from nemo_rl_spec.utils.trackers import mlflow_key

    url, server_log = mlflow_server
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(TINY),
        "grpo.max_num_steps=2",
        "data.validation.max_samples=2",
        f"logger.log_dir={logs}",
        "checkpointing.enabled=false",
        "logger.progress_bar=false",
        "logger.wandb_enabled=true",
        "logger.wandb.project=trk",
        "logger.wandb.name=tiny-2",
        "logger.mlflow_enabled=true",
        "logger.mlflow.experiment_name=trk",
        "logger.mlflow.run_name=tiny-2",
        f"logger.mlflow.tracking_uri={url}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "NEMO_RL_SPEC_VERBOSE")}
    env.update(
        WANDB_MODE="offline",
        **{k: str(tmp_path / "wandb_home" / k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")},
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until_answers(url, server_log)  # the server starts while Ray and the workers do
        out, err = proc.communicate(timeout=800)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    records = {r["step"]: r for r in map(json.loads, (logs / "metrics.jsonl").read_text().splitlines())}
    assert set(records) >= {1, 2}
    assert out.count("W&B: offline (WANDB_MODE is set)") == 1 and out.count("MLflow: run tiny-2 (") == 1, out

    (run_file,) = (logs / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = wandb_history(read_wandb_records(run_file))
    for step, record in records.items():
        got = history[step]
        for name, value in record.items():
            if name != "step":
                assert same(got[name], value), (step, name, got.get(name), value)
    assert config["grpo"]["max_num_steps"] == 2 and config["logger"]["wandb"]["name"] == "tiny-2"
    image = {k.partition("/")[2]: v for k, v in history[max(records)].items() if k.startswith("training_curves/")}
    assert image["_type"] == "image-file" and (run_file.parent / "files" / image["path"]).is_file(), image

    client = MlflowClient(tracking_uri=url)
    (run,) = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert run.info.run_name == "tiny-2" and run.info.status == "FINISHED"
    names = {name for record in records.values() for name in record if name != "step"}
    for name in names:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_key(name))}
        want = {step: r[name] for step, r in records.items() if name in r}
        assert got.keys() == want.keys() and all(same(got[s], want[s]) for s in want), (name, got, want)
    params = run.data.params
    assert params["grpo.max_num_steps"] == "2" and params["logger.mlflow.tracking_uri"] == url
    assert "training_curves.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
