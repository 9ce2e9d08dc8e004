"""Experiment trackers behind ``logger.wandb_enabled`` and ``logger.mlflow_enabled`` (docs/guides/logging.md).

Each tracker has the same four calls, which :class:`~nemo_rl_spec.utils.logger.Logger` fans out to: ``log_metrics``
(the metric names of ``metrics.jsonl`` / TensorBoard, one call per logged step), ``log_config`` (the resolved recipe,
once), ``log_image`` (the training-curve PNG, at the end) and ``close``. The clients are optional extras
(``pip install -e '.[wandb]'`` / ``'.[mlflow]'``); :func:`missing_clients` names the one a recipe needs and lacks,
before any Ray worker starts (:func:`~nemo_rl_spec.utils.config.check_runtime_support`).

On resume each launch starts a new tracker run that logs from the resumed step on (``Logger.truncate_after`` only
rewrites ``metrics.jsonl``), so steps a killed launch logged after its last checkpoint appear in both runs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import posixpath
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol
from urllib.parse import urlparse

#: key -> (client module, extra, what it is): the clients the logger keys need
CLIENTS: dict[str, tuple[str, str, str]] = {
    "wandb_enabled": ("wandb", "wandb", "the W&B client"),
    "mlflow_enabled": ("mlflow", "mlflow", "the MLflow client"),
}
WANDB_DEFAULT_HOST = "https://api.wandb.ai"
MLFLOW_MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value (characters); longer values are cut
MLFLOW_MAX_KEY = 250  # ... and on a param / metric key
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000


class Tracker(Protocol):
    """The interface every tracker implements (all values are plain Python; steps are GRPO steps)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_image(self, path: str | Path, step: int) -> None: ...

    def close(self) -> None: ...


def missing_clients(logger_cfg: Any, importer: Callable[[str], Any] = importlib.import_module) -> list[str]:
    """One message per enabled tracker whose client does not import, naming the key and the extra to install.

    Args:
        logger_cfg: the ``logger`` section (reads ``wandb_enabled`` / ``mlflow_enabled``).
        importer: imports a module by name (tests replace it to simulate a missing client).
    """
    out = []
    for key, (module, extra, what) in CLIENTS.items():
        if not getattr(logger_cfg, key):
            continue
        try:
            importer(module)
        except ImportError as exc:
            out.append(
                f"logger.{key}=true needs {what} ({module}), which does not import ({exc}): install the "
                f"'{extra}' extra: pip install -e '.[{extra}]' (or make install EXTRAS={extra})"
            )
    return out


def host_reachable(url: str, timeout_s: float = 1.5) -> bool:
    """True when a TCP connection to ``url``'s host and port (443 for https) opens within ``timeout_s`` seconds,
    name lookup included (run in a thread, so a hanging DNS lookup cannot stall the caller longer)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def wandb_mode(
    env: Mapping[str, str] = os.environ, reachable: Callable[[str], bool] = host_reachable
) -> tuple[str, str]:
    """(W&B mode, why): ``WANDB_MODE`` when set; else ``"offline"`` when the W&B server (``WANDB_BASE_URL``, default
    api.wandb.ai:443) does not answer, else ``"online"``."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"], "WANDB_MODE is set"
    host = env.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST
    if not reachable(host):
        return "offline", f"{urlparse(host).netloc or host} is unreachable"
    return "online", f"{urlparse(host).netloc or host} answers"


class WandbTracker:
    """A W&B run in ``<log_dir>/wandb`` (offline runs: ``<log_dir>/wandb/offline-run-*``, uploaded later with
    ``wandb sync``). Says its mode once on the console. W&B's console capture and system-metrics sampler are off
    (the console stays the project's; the sampler would compete for the CPUs).

    Args:
        project, name: ``logger.wandb.project`` / ``.name``.
        log_dir: the run's ``logger.log_dir``.
        mode: W&B's mode; None: :func:`wandb_mode`. An ``online`` start that fails (e.g. no API key) falls back to
            offline, saying so.
    """

    def __init__(self, project: str, name: str, log_dir: str | Path, mode: str | None = None) -> None:
        import wandb  # lazy: optional extra (make install EXTRAS=wandb)

        why = "given"
        if mode is None:
            mode, why = wandb_mode()
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        kwargs = dict(project=project, name=name, dir=str(log_dir), settings=settings)
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure to reach / log in to W&B: log offline instead
            if mode != "online":
                raise
            mode, why = "offline", f"online start failed: {exc}"
            self.run = wandb.init(mode=mode, **kwargs)
        run_dir = Path(self.run.dir).parent
        tail = f"; upload it later: wandb sync {run_dir}" if mode == "offline" else ""
        print(f"W&B: {mode} ({why}), run {self.run.name} in {run_dir}{tail}", flush=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log one step's metrics (NaN included) at W&B step ``step``."""
        self.run.log(dict(metrics), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Set the run's config to the resolved recipe (nested dict)."""
        self.run.config.update(dict(config), allow_val_change=True)

    def log_image(self, path: str | Path, step: int) -> None:
        """Log the PNG at ``path`` as the image ``training_curves`` at step ``step``."""
        import wandb  # lazy: optional extra (make install EXTRAS=wandb)

        self.run.log({"training_curves": wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        """Finish the run (flushes the offline run file)."""
        self.run.finish()


def mlflow_key(name: str) -> str:
    """``name`` as a valid MLflow metric / param key: characters other than letters, digits, ``_ - . : / space``
    become ``_``; a name whose path form is not unique (``a//b``, leading ``/``, ``..``) has its ``/`` replaced;
    and its leading dots dropped; cut to MLflow's 250 characters."""
    key = re.sub(r"[^/\w.\- :]", "_", name)
    norm = posixpath.normpath(key)
    if norm != key or norm.startswith(("/", "..")) or norm == ".":
        key = key.replace("/", "_").lstrip(".") or "_"
    return key[:MLFLOW_MAX_KEY]


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (:func:`mlflow_key`), values as strings (strings as they are,
    everything else as JSON), each cut to MLflow's 6000 characters (ending in ``...``)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, path + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MLFLOW_MAX_PARAM_VALUE:
            text = text[: MLFLOW_MAX_PARAM_VALUE - 3] + "..."
        out[mlflow_key(path)] = text
    return out


def _chunks(items: list, size: int):
    return (items[i : i + size] for i in range(0, len(items), size))


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global MLflow state).

    Args:
        experiment_name, run_name: ``logger.mlflow.experiment_name`` / ``.run_name`` (the experiment is created when
            missing).
        tracking_uri: a server or store URI; None: ``sqlite:///<log_dir>/mlflow.db`` with the experiment's artifacts
            in ``<log_dir>/mlartifacts`` (view with ``mlflow ui --backend-store-uri sqlite:///<log_dir>/mlflow.db``).
        log_dir: the run's ``logger.log_dir``.
    Raises:
        mlflow.exceptions.MlflowException: the store refused the experiment or run (after MLflow's own retries when
            the server does not answer).
    """

    def __init__(self, experiment_name: str, run_name: str, tracking_uri: str | None, log_dir: str | Path) -> None:
        from mlflow.tracking import MlflowClient  # lazy: optional extra (make install EXTRAS=mlflow)

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines (DB migrations) are not for users
        root = Path(log_dir).resolve()
        self.tracking_uri = tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        artifacts = None if tracking_uri else (root / "mlartifacts").as_uri()
        self.experiment_id = self._experiment(experiment_name, artifacts)
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        print(
            f"MLflow: run {run_name} ({self.run_id}) in experiment {experiment_name} at {self.tracking_uri}", flush=True
        )

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except Exception:  # noqa: BLE001 - created meanwhile by another run
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log one step's metrics (keys through :func:`mlflow_key`; NaN kept) at MLflow step ``step``."""
        from mlflow.entities import Metric  # lazy: optional extra (make install EXTRAS=mlflow)

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for chunk in _chunks(batch, MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the resolved recipe as params (:func:`flatten_params`)."""
        from mlflow.entities import Param  # lazy: optional extra (make install EXTRAS=mlflow)

        params = [Param(k, v) for k, v in flatten_params(config).items()]
        for chunk in _chunks(params, MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log_image(self, path: str | Path, step: int) -> None:
        """Upload the file at ``path`` as a run artifact (its own name, top level); ``step`` is not used."""
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


def build_trackers(logger_cfg: Any, config: Mapping[str, Any]) -> list[Tracker]:
    """The trackers ``logger_cfg`` enables, each started and given ``config`` (the resolved recipe) once."""
    trackers: list[Tracker] = []
    if logger_cfg.wandb_enabled:
        trackers.append(WandbTracker(logger_cfg.wandb.project, logger_cfg.wandb.name, logger_cfg.log_dir))
    if logger_cfg.mlflow_enabled:
        m = logger_cfg.mlflow
        trackers.append(MlflowTracker(m.experiment_name, m.run_name, m.tracking_uri, logger_cfg.log_dir))
    for tracker in trackers:
        tracker.log_config(config)
    return trackers
