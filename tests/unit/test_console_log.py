"""The quiet console: ``<log_dir>/console.log`` keeps everything, the terminal gets the driver's
lines, worker errors and Ray's errors; the per-step table behind ``logger.verbose``. Expected outputs by hand."""

import logging
import sys

import pytest

from nemo_rl_spec.utils import console_log as cl
from nemo_rl_spec.utils.console import VERBOSE_ENV, step_report, step_table


def _batch(lines, pid=11, actor="MegatronPolicyWorker", is_err=True):
    return {
        "lines": lines,
        "pid": pid,
        "actor_name": actor,
        "task_name": "",
        "is_err": is_err,
        "ip": "10.0.0.1",
        "localhost": "10.0.0.1",
        "job": "",
    }


@pytest.fixture
def opened(tmp_path, monkeypatch):
    """Opens console logs in the test body (pytest re-installs its capture streams between setup and call, so a tee
    started in a fixture would be replaced); closes the active one afterwards."""
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    yield lambda verbose=False: cl.open_console_log(tmp_path / "logs", verbose=verbose)
    cl.close_console_log()


def test_driver_output_reaches_terminal_and_file(opened, capsys):
    quiet_log = opened()
    print("precision: training float32")
    sys.stderr.write("GRPO:   0%|          | 0/3\r")
    cl.log_only("[placement] policy rank 0 (node 0) on ray node abc")
    cl.close_console_log()
    out, err = capsys.readouterr()
    assert out == "precision: training float32\n" and err == "GRPO:   0%|          | 0/3\r"
    assert quiet_log.path.read_bytes().decode() == (
        "precision: training float32\nGRPO:   0%|          | 0/3\r[placement] policy rank 0 (node 0) on ray node abc\n"
    )
    assert sys.stdout is not None and not isinstance(sys.stdout, cl._Tee)  # restored on close


def test_worker_noise_goes_to_the_file_only(opened, capsys):
    quiet_log = opened()
    noise = [
        "UserWarning: CUDA_DEVICE_MAX_CONNECTIONS should be set",
        "(MainProcess pid=12) WARNING 12-04 10:12:55 [layerwise.py:1] VocabParallelEmbedding: Failed to load weights",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1",
    ]
    quiet_log.on_worker_output(_batch(noise))
    cl.close_console_log()
    assert capsys.readouterr() == ("", "")
    assert quiet_log.path.read_bytes().decode() == "".join(f"(MegatronPolicyWorker pid=11) {line}\n" for line in noise)


def test_worker_errors_reach_the_terminal_with_their_tail(opened, capsys):
    quiet_log = opened()
    quiet_log.on_worker_output(_batch(["Traceback (most recent call last):", '  File "w.py", line 3, in f']))
    quiet_log.on_worker_output(_batch(["RuntimeError: boom"]))  # the same worker, within ERROR_TAIL_S
    quiet_log.on_worker_output(_batch(["a harmless warning"], pid=12))  # another worker: file only
    quiet_log.on_worker_output(_batch(["ERROR 12-04 10:00:00 [core.py:1] engine died"], pid=13, is_err=False))
    out, err = capsys.readouterr()
    assert err == (
        "(MegatronPolicyWorker pid=11) Traceback (most recent call last):\n"
        '(MegatronPolicyWorker pid=11)   File "w.py", line 3, in f\n'
        "(MegatronPolicyWorker pid=11) RuntimeError: boom\n"
    )
    assert out == "(MegatronPolicyWorker pid=13) ERROR 12-04 10:00:00 [core.py:1] engine died\n"
    assert "(MegatronPolicyWorker pid=12) a harmless warning\n" in quiet_log.path.read_bytes().decode()


def test_worker_tail_window_closes(opened, monkeypatch):
    quiet_log = opened()
    now = [100.0]
    monkeypatch.setattr(cl.time, "monotonic", lambda: now[0])
    assert quiet_log.to_terminal(_batch(["ValueError: bad"]))
    now[0] += cl.ERROR_TAIL_S - 0.1
    assert quiet_log.to_terminal(_batch(["  more of it"]))
    now[0] += 0.2 + cl.ERROR_TAIL_S
    assert not quiet_log.to_terminal(_batch(["a later warning"]))
    assert quiet_log.to_terminal({**_batch(["worker killed: memory"]), "pid": "raylet"})


def test_autoscaler_batches_are_cut_to_their_events(opened, capsys, monkeypatch):
    quiet_log = opened()
    monkeypatch.setattr(
        cl, "_autoscaler_events", lambda lines: [x.split(":event_summary:")[1] for x in lines if ":event_summary:" in x]
    )
    quiet_log.on_worker_output(
        {
            **_batch(
                [
                    "INFO autoscaler.py:147 -- The autoscaler took 0.0 seconds",
                    "Node status",
                    ":event_summary:Adding 1 node(s)",
                ]
            ),
            "pid": "autoscaler",
        }
    )
    cl.close_console_log()
    assert capsys.readouterr().err == "(autoscaler) Adding 1 node(s)\n"
    assert quiet_log.path.read_text() == "(autoscaler) Adding 1 node(s)\n"


def test_verbose_passes_everything(opened, capsys):
    log = opened(verbose=True)
    try:
        log.on_worker_output(_batch(["a harmless warning"], is_err=False))
        cl.log_only("[placement] x")
    finally:
        cl.close_console_log()
    assert capsys.readouterr().out == "(MegatronPolicyWorker pid=11) a harmless warning\n[placement] x\n"
    assert log.path.read_bytes().decode() == "(MegatronPolicyWorker pid=11) a harmless warning\n[placement] x\n"


def test_ray_records_below_error_go_to_the_file(opened, capsys, monkeypatch):
    quiet_log = opened()
    # Ray's own handler prints to sys.stderr as it is at emit time (the tee); a plain one on the tee stands in for it
    monkeypatch.setattr(logging.getLogger("ray"), "handlers", [logging.StreamHandler(sys.stderr)])
    quiet_log.quiet_ray_records()
    logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
    logging.getLogger("ray.some.module").error("the GCS died")
    cl.close_console_log()
    err = capsys.readouterr().err
    assert "the GCS died" in err and "Token authentication" not in err
    text = quiet_log.path.read_bytes().decode()
    assert "WARNING ray: Token authentication is enabled for this Ray cluster.\n" in text and "the GCS died" in text
    assert not any(isinstance(f, cl._RayRecordsToFile) for h in logging.getLogger("ray").handlers for f in h.filters)


def test_log_only_without_a_console_log_prints(capsys):
    cl.close_console_log()
    cl.log_only("[placement] y")
    assert capsys.readouterr().out == "[placement] y\n"


METRICS = {
    "step": 3,
    "train/reward": 0.375,
    "train/loss": -0.5,
    "validation/accuracy": 0.5,
    "timing/train/total_step_time": 10.0,
    "timing/train/generation": 2.5,
    "vllm/x": 1.0,
    "misc": 2.0,
}


def test_step_table():
    assert step_table(METRICS, 3) == "\n".join(
        [
            "==================== step 3 ====================",
            "train:",
            "  train/loss    -0.5",
            "  train/reward  0.375",
            "validation:",
            "  validation/accuracy  0.5",
            "vllm:",
            "  vllm/x  1",
            "other:",
            "  misc  2",
            "timing:",
            "  timing/train/generation       2.5 (25.0%)",
            "  timing/train/total_step_time  10 (100.0%)",
        ]
    )


def test_step_report_adds_the_table_only_when_verbose(monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "0")
    assert step_report(METRICS, 3) == "step 3: reward 0.375 | val accuracy 0.500 | 10.0 s"
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert step_report(METRICS, 3) == "step 3: reward 0.375 | val accuracy 0.500 | 10.0 s\n" + step_table(METRICS, 3)
