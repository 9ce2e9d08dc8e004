"""``grpo.max_num_epochs`` (NeMo-RL): the run stops at whichever of max_num_steps / max_num_epochs comes first; each
epoch is a fresh permutation seeded by (seed, epoch); a resumed allocator keeps its epoch position.

Pool of 10 prompts, 4 per step: an epoch is 3 steps (4 + 4 + 2 prompts; a batch never crosses an epoch), so
max_num_epochs=2 stops after step 6 and max_num_steps=4 (with 2 epochs) after step 4 -- worked out by hand.
"""

from __future__ import annotations

import torch

from nemo_rl_spec.algorithms.grpo import end_step, epochs_finished
from nemo_rl_spec.algorithms.rollout_allocation import UniformAllocator, mix_seed
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.logger import Logger


class _Run:
    """What end_step reads of a GRPOSetup: the config and a real logger."""

    def __init__(self, cfg, log_dir):
        self.cfg, self.logger = cfg, Logger(log_dir, tensorboard_enabled=False)


def _generate(requests):
    return [r.result([float(i % 2) for i in range(r.n)], 0) for r in requests]


def _run(allocator, run, start_step=0):
    """The driver's loop (grpo.grpo_train) without workers: returns (prompts of each step, checkpointed steps)."""
    steps, saved = [], []
    for step in range(start_step, run.cfg.grpo.max_num_steps):
        if epochs_finished(run.cfg.grpo.max_num_epochs, allocator.epochs_completed()):
            break
        sel = allocator.step(_generate)
        steps.append([g.prompt_id for g in sel.groups])
        if end_step(run, step, dict(sel.metrics), sel.exhausted, dict, lambda m, d=step + 1: saved.append(d)):
            break
    return steps, saved


def _cfg(*overrides):
    return load_config(
        "configs/grpo_math_tiny.yaml", ["grpo.val_period=0", "checkpointing.save_period=100", *overrides]
    )


def _perm(seed, epoch, n=10):
    return torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, epoch))).tolist()


def test_epochs_stop_the_run_and_reshuffle_from_the_seed(tmp_path):
    cfg = _cfg("grpo.max_num_steps=100", "grpo.max_num_epochs=2")
    steps, saved = _run(UniformAllocator(range(10), 4, 2, seed=cfg.grpo.seed), _Run(cfg, tmp_path))
    assert [len(s) for s in steps] == [4, 4, 2, 4, 4, 2] and saved == [6]  # last step checkpointed
    e0, e1 = _perm(cfg.grpo.seed, 0), _perm(cfg.grpo.seed, 1)
    assert sum(steps[:3], []) == e0 and sum(steps[3:], []) == e1 and e0 != e1  # one fresh permutation per epoch


def test_max_num_steps_first(tmp_path):
    cfg = _cfg("grpo.max_num_steps=4", "grpo.max_num_epochs=2")
    steps, saved = _run(UniformAllocator(range(10), 4, 2, seed=0), _Run(cfg, tmp_path))
    assert len(steps) == 4 and saved == [4]


def test_no_epoch_limit_by_default(tmp_path):
    cfg = _cfg("grpo.max_num_steps=8")
    assert cfg.grpo.max_num_epochs is None
    steps, _ = _run(UniformAllocator(range(10), 4, 2, seed=0), _Run(cfg, tmp_path))
    assert len(steps) == 8


def test_resume_keeps_the_epoch_position(tmp_path):
    cfg = _cfg("grpo.max_num_steps=100", "grpo.max_num_epochs=2")
    full, _ = _run(UniformAllocator(range(10), 4, 2, seed=3), _Run(cfg, tmp_path / "a"))
    first = UniformAllocator(range(10), 4, 2, seed=3)
    for _ in range(4):  # stopped after step 4 (epoch 1, one batch in)
        first.step(_generate)
    resumed = UniformAllocator(range(10), 4, 2, seed=3)
    resumed.load_state_dict(first.state_dict())
    rest, saved = _run(resumed, _Run(cfg, tmp_path / "b"), start_step=4)
    assert rest == full[4:] and saved == [6]
    done, _ = _run(resumed, _Run(cfg, tmp_path / "c"), start_step=6)  # resumed after the last epoch: no step
    assert done == []
