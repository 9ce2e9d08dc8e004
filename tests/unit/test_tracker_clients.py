"""The W&B / MLflow trackers without Ray (nemo_rl_spec/utils/trackers.py): the missing-client error naming the extra,
W&B's automatic offline decision, MLflow's param flattening / truncation and key cleaning, the Logger's fan-out, and
the default local MLflow store under the log dir. The real run: tests/functional/test_grpo_loop.py (top-k test)."""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path

import pytest

from nemo_rl_spec.utils import trackers as tr
from nemo_rl_spec.utils.config import ConfigError, check_runtime_support, load_config
from nemo_rl_spec.utils.logger import Logger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import schema_sections as ss  # noqa: E402


@pytest.mark.parametrize("key, extra", [("wandb_enabled", "wandb"), ("mlflow_enabled", "mlflow")])
def test_a_missing_client_is_refused_before_ray_naming_the_extra(monkeypatch, key, extra):
    """With the client's import failing (None in sys.modules), the check examples/run_grpo.py runs right after
    loading the recipe (before Ray) refuses the key, naming the extra and both install commands; with the client
    there, it passes (tests/unit/test_schema_sections.py runs all pre-Ray checks on the key)."""
    cfg = load_config(ss.TINY, [f"logger.{key}=true"])
    check_runtime_support(cfg)
    monkeypatch.setitem(sys.modules, extra, None)
    with pytest.raises(ConfigError) as err:
        check_runtime_support(cfg)
    message = str(err.value)
    assert f"logger.{key}=true" in message, message
    assert f"pip install -e '.[{extra}]'" in message and f"make install EXTRAS={extra}" in message, message


def test_missing_clients_lists_only_enabled_keys():
    class Cfg:
        wandb_enabled, mlflow_enabled = True, False

    def importer(name):
        raise ImportError(f"No module named '{name}'")

    got = tr.missing_clients(Cfg(), importer)
    assert len(got) == 1 and got[0].startswith("logger.wandb_enabled=true needs the W&B client")
    assert tr.missing_clients(Cfg(), lambda name: None) == []


def test_wandb_mode_is_offline_when_the_server_does_not_answer():
    seen = []

    def reachable(url):
        seen.append(url)
        return False

    assert tr.wandb_mode({}, reachable) == ("offline", "api.wandb.ai is unreachable")
    assert tr.wandb_mode({}, lambda url: True)[0] == "online"
    assert tr.wandb_mode({"WANDB_MODE": "disabled"}, reachable) == ("disabled", "WANDB_MODE is set")
    tr.wandb_mode({"WANDB_BASE_URL": "http://wandb.local:8080"}, reachable)
    assert seen == ["https://api.wandb.ai", "http://wandb.local:8080"]  # WANDB_MODE set: no probe


def test_host_reachable_probes_a_tcp_connection():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert tr.host_reachable(f"http://127.0.0.1:{port}")
    assert not tr.host_reachable(f"http://127.0.0.1:{port}", timeout_s=0.5)  # closed now


def test_an_online_wandb_start_that_fails_falls_back_to_offline(monkeypatch, tmp_path, capsys):
    import wandb

    modes = []

    class Run:
        dir = str(tmp_path / "wandb" / "offline-run-x" / "files")
        name = "n"

    def init(mode, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.UsageError("api_key not configured (no-tty)")
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    tr.WandbTracker("p", "n", tmp_path, mode="online")
    out = capsys.readouterr().out
    assert modes == ["online", "offline"] and "W&B: offline (online start failed: api_key not configured" in out
    assert f"wandb sync {tmp_path / 'wandb' / 'offline-run-x'}" in out


def test_flatten_params_dots_jsons_and_truncates():
    long = "x" * (tr.MLFLOW_MAX_PARAM_VALUE + 10)
    got = tr.flatten_params(
        {"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "s": "text", "f": 0.5, "t": True, "long": long, "k[0]=v": 1}
    )
    assert got == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "a.d": "null",
        "a.e": "{}",
        "s": "text",
        "f": "0.5",
        "t": "true",
        "long": "x" * (tr.MLFLOW_MAX_PARAM_VALUE - 3) + "...",
        "k_0__v": "1",
    }
    assert len(got["long"]) == tr.MLFLOW_MAX_PARAM_VALUE


def test_mlflow_key_keeps_valid_names_and_cleans_the_rest():
    from mlflow.utils.validation import _validate_metric_name

    assert tr.mlflow_key("timing/train/generation") == "timing/train/generation"
    assert tr.mlflow_key("train/reward mean: all-1.0") == "train/reward mean: all-1.0"
    for name, want in (("a[b]=c", "a_b__c"), ("a//b", "a__b"), ("/a", "_a"), ("../a", "_a"), ("x" * 300, "x" * 250)):
        got = tr.mlflow_key(name)
        assert got == want
        _validate_metric_name(got)  # MLflow's own check accepts it


class FakeTracker:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", dict(metrics), step))

    def log_config(self, config):
        self.calls.append(("config", config))

    def log_image(self, path, step):
        self.calls.append(("image", str(path), step))

    def close(self):
        self.calls.append(("close",))


def test_logger_fans_out_the_jsonl_records(tmp_path):
    fake = FakeTracker()
    log = Logger(tmp_path, tensorboard_enabled=False, trackers=[fake])
    log.log_metrics({"train/reward": 0.25, "validation/accuracy": float("nan")}, step=0)
    log.log_metrics({"train/reward": 1}, step=2)
    log.log_image(tmp_path / "c.png")
    log.close()
    first = fake.calls[0]
    assert first[0] == "metrics" and first[2] == 0 and first[1]["train/reward"] == 0.25
    assert math.isnan(first[1]["validation/accuracy"])
    assert fake.calls[1:] == [("metrics", {"train/reward": 1.0}, 2), ("image", str(tmp_path / "c.png"), 2), ("close",)]


def test_mlflow_default_store_is_under_the_log_dir(tmp_path):
    """tracking_uri unset: sqlite:///<log_dir>/mlflow.db, the image in <log_dir>/mlartifacts (about 5 s: MLflow
    creates its tables)."""
    from mlflow.tracking import MlflowClient

    t = tr.MlflowTracker("e", "r", None, tmp_path / "logs")
    t.log_config({"grpo": {"max_num_steps": 2}})
    t.log_metrics({"train/reward": 0.5}, step=1)
    (tmp_path / "c.png").write_bytes(b"png")
    t.log_image(tmp_path / "c.png", 1)
    t.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"grpo.max_num_steps": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "train/reward")] == [(1, 0.5)]
    assert list((tmp_path / "logs" / "mlartifacts").rglob("c.png"))
