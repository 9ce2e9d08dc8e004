"""W&B and MLflow checks against the real clients, for the GRPO run that carries them (owned with test_grpo_loop.py:
``test_top_k_sampling_weights_only_checkpoint_and_trackers``).

- W&B offline (``WANDB_MODE=offline``; the automatic offline decision is unit-tested in
  tests/unit/test_tracker_clients.py): the run file ``<log_dir>/wandb/offline-run-*/run-*.wandb`` that ``wandb sync``
  uploads is read back record by record (its framing: a LevelDB-style log; its records: W&B's own protobuf
  ``Record``);
- MLflow against a real ``mlflow server`` started on 127.0.0.1 (a free port, a sqlite store in tmp) and stopped at
  teardown (:func:`mlflow_server`).
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
