"""Run GRPO: ``python examples/run_grpo.py --config configs/<recipe>.yaml [key=value ...] [+new.key=value ...]``.

The recipe is validated before Ray or any worker starts; a bad value exits with status 2 and one message naming
the key or file. ``--dry-run`` stops there: it validates the recipe, checks what this build runs and prints the
placement plan (which worker on which node, with which GPU / CPU share; DP/TP/PP; engines), starting no Ray worker;
a recipe that does not fit its cluster exits with status 2 naming the key. Ctrl-C or a worker failure tears down
every Ray actor and vLLM engine; complete checkpoints (``step_N``) are never touched by a failure.

The console is quiet unless ``logger.verbose=true``: the precision line, one "starting N Ray workers" line, the
progress bar and one line per step, plus errors; everything else the driver and its Ray workers print (third-party
warnings, loading bars, where each actor runs) is kept in ``<logger.log_dir>/console.log`` with the console itself
(nemo_rl_spec/utils/console_log.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from nemo_rl_spec.distributed.placement import plan_placement
from nemo_rl_spec.utils.config import ConfigError, check_runtime_support, load_config
from nemo_rl_spec.utils.console import configure_console
from nemo_rl_spec.utils.console_log import close_console_log, open_console_log
from nemo_rl_spec.utils.logger import plot_training_curves
from nemo_rl_spec.utils.precision import precision_line


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_math_smollm2_135m.yaml", help="recipe YAML")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate the recipe and print its placement plan; start no Ray worker"
    )
    return parser.parse_known_args(argv)


def dry_run(cfg, config: str) -> int:
    """Print the placement plan of a validated recipe (``--dry-run``); 0. Raises ConfigError when it does not fit."""
    plan = plan_placement(cfg)
    mode = "async" if cfg.grpo.async_grpo is not None and cfg.grpo.async_grpo.enabled else "sync"
    print(f"recipe {config}: valid, runs on this build ({mode} GRPO, model {cfg.policy.model_name})")
    print(plan.table())
    print(precision_line(cfg.policy))
    print("not checked by --dry-run: model, draft and data files; the Ray cluster's nodes and resources")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        check_runtime_support(cfg)
        if args.dry_run:
            return dry_run(cfg, args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_console(cfg.logger.verbose, cpu=cfg.cluster.gpus_per_node == 0)  # before megatron-core is imported
    console_log = open_console_log(cfg.logger.log_dir, cfg.logger.verbose)  # <log_dir>/console.log keeps it all
    try:
        return train(cfg)
    except BaseException:
        console_log.write_file(traceback.format_exc())  # the traceback the interpreter prints next, kept too
        raise
    finally:
        close_console_log()


def train(cfg) -> int:
    """Set up, train (sync or async GRPO), plot the curves and print the run's summary line; 0, or 2 when setup finds
    a bad file or key. Workers and Ray are torn down on any exit."""
    # lazy: torch, Ray and megatron-core load here, after configure_console (and never for --dry-run)
    from nemo_rl_spec.algorithms.grpo import grpo_train  # lazy: see the line above
    from nemo_rl_spec.algorithms.grpo_setup import setup, teardown  # lazy: see the line above

    s = None
    try:
        try:
            s = setup(cfg)  # also checks files the config names (draft directories, MTP-drafter model) first
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if cfg.grpo.async_grpo is not None and cfg.grpo.async_grpo.enabled:
            from nemo_rl_spec.algorithms.async_grpo import async_grpo_train  # lazy: as grpo_train above

            history = async_grpo_train(s)
        else:
            history = grpo_train(s)
        png = plot_training_curves(s.logger.jsonl_path, Path(cfg.logger.log_dir) / "training_curves.png")
        s.logger.log_image(png)  # to W&B / MLflow when enabled
        print(
            json.dumps(
                {
                    "steps_run": len(history),
                    "metrics": str(s.logger.jsonl_path),
                    "plot": str(png),
                    "latest_checkpoint": str(s.checkpoints.latest()) if s.checkpoints else None,
                }
            )
        )
    finally:
        teardown(s)
    return 0
