"""CE warm start of the MTP layers before RL (``policy.megatron_cfg.mtp_warm_start``; docs/guides/occ.md).

The OCC paper co-trains MiMo's *pretrained* MTP layer; ours starts from a seeded random initialisation. The warm
start trains the MTP block alone on the policy's own samples, trunk frozen, with the heads' cross-entropy

    L = (1 / K) sum_k CE_k,   CE_k = -sum(valid_k * log p_k(target)) / sum(valid_k)

(head k at position p reads the trunk output at p and the embeddings of tokens p+1..p+k+1 and predicts token
p+k+2: :mod:`~.mtp_loss`), with a temporary AdamW. The block reads detached trunk outputs, embeddings and output
weight, so no trunk parameter or gradient is touched. Afterwards the MTP optimizer is replaced by a fresh one, so RL
starts from zero Adam moments and fp32 masters equal to the new weights. Every rank gets the whole (replicated) data
and the same seeded row order, so DP ranks take identical steps without a reduction; TP peers compute the same rows
together (vocab-parallel log-probs, q/k-norm gradients summed over TP, TP-aware grad norm).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy import mtp_loss as ml
from nemo_rl_spec.models.policy.dynamic_batching import MicroBatch, select_rows
from nemo_rl_spec.models.policy.mixed_precision import MasterWeightAdamW
from nemo_rl_spec.models.policy.mtp_cotraining import MTPCoTraining
from nemo_rl_spec.models.policy.parallel import all_reduce_grads, all_reduce_sum, clip_grads_
from nemo_rl_spec.models.policy.vocab_parallel import target_logprobs, vocab_argmax

PREFIX = "mtp_warm_start/"
_DATA_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def adamw_hyperparameters(optimizer: MasterWeightAdamW) -> dict:
    """``lr``, ``betas``, ``eps``, ``weight_decay`` of ``optimizer``'s first param group."""
    group = optimizer.param_groups[0]
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}


def reset_mtp_optimizer(mtp: MTPCoTraining) -> None:
    """Replace ``mtp.optimizer`` by a fresh :class:`MasterWeightAdamW` with the same hyper-parameters and lr: zero
    Adam moments, fp32 masters copied from the current MTP weights."""
    mtp.optimizer = MasterWeightAdamW(mtp.params, **adamw_hyperparameters(mtp.optimizer))


def _rows(data: TrainDatumSpec, rows: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of ``data`` (the warm start's four keys), trimmed to their longest row, on ``device``."""
    width = max(int(data["input_lengths"][rows].max()), 1)
    picked = select_rows({k: data[k] for k in _DATA_KEYS}, MicroBatch(rows, width))
    return {k: v.to(device) for k, v in picked.items()}


def _forward(mtp: MTPCoTraining, ids: torch.Tensor):
    """(trunk output, per-head MTP hidden states [S, B, H]) of ``ids`` [B, S]: the trunk without a graph, the MTP
    block on its detached output (a graph into the MTP parameters when grad is enabled)."""
    mod = mtp.module
    with torch.no_grad():
        trunk = mm.gpt_trunk_forward(mod, ids)
    return trunk, mm.mtp_hidden_states(mod, ids, trunk, trunk.hidden.detach(), mm.detached_embedding(mod))


def _head_targets(batch: dict[str, torch.Tensor], head: int):
    """Head ``head``'s valid targets (:func:`~.mtp_loss.mtp_valid_mask`): rows, positions, token ids; each [N]."""
    rows, pos = (ml.mtp_valid_mask(batch, head) > 0).nonzero(as_tuple=True)
    return rows, pos, batch["input_ids"][rows, pos]


def _logits_at(mod, hidden: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The output layer at positions (``pos``, ``rows``) of ``hidden`` [S, B, H] only: [1, N, V(/T)]. Responses are a
    fraction of each sequence and the vocabulary projection is the cost, so only predicting positions are projected
    (per position the same values as :func:`~.megatron_model.output_logits` of the whole sequence)."""
    return mm.output_logits(mod, hidden[pos, rows].unsqueeze(1), weight=mm.output_weight(mod).detach())


def _head_logprobs(mtp: MTPCoTraining, batch, hidden: torch.Tensor, head: int):
    """(MTP logits [1, N, V(/T)], log-probs [1, N] at ``mtp.train_temperature``, (rows, positions) [N] each) of head
    ``head``'s valid targets: target s is predicted from position s - head - 2 (:func:`~.mtp_loss.mtp_offset`)."""
    rows, pos, targets = _head_targets(batch, head)
    logits = _logits_at(mtp.module, hidden, rows, pos - ml.mtp_offset(head))
    return logits, target_logprobs(logits, targets.unsqueeze(0), mtp.train_temperature, mtp.tp_group), (rows, pos)


def mtp_ce(mtp: MTPCoTraining, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The warm-start loss of one batch: the mean over heads of each head's CE per valid target (module docstring),
    ``ml.mtp_ce_loss(ml.mtp_token_logprobs(...), valid, valid.sum())`` computed on the valid targets only (a head
    without valid targets counts 0). Log-probs at ``mtp.train_temperature``. Shape: batch [B, S] -> scalar."""
    _, hidden = _forward(mtp, batch["input_ids"])
    losses = []
    for k, hk in enumerate(hidden):
        _, lp, _ = _head_logprobs(mtp, batch, hk, k)
        losses.append(-lp.sum() / max(lp.numel(), 1))
    return sum(losses) / len(losses)


def average_over_dp(mtp: MTPCoTraining) -> None:
    """Average the MTP parameters over the DP group. The replicas took the same steps on the same rows, so this is
    exact where they agree and removes any drift a non-deterministic kernel (GPU attention backward) introduced."""
    size = dist.get_world_size(mtp.dp_group)
    if size == 1:
        return
    with torch.no_grad():
        for p in mtp.params:
            p.copy_(all_reduce_sum(p.detach(), mtp.dp_group).to(p.device) / size)


def tp_partial_indices(mtp: MTPCoTraining) -> list[int]:
    """Positions in ``mtp.params`` of the replicated parameters whose gradient each TP rank holds in part (the MTP
    layers' q/k RMSNorm weights, :func:`~.megatron_model.tp_partial_grad`); the training step's
    ``finalize_model_grads`` sums them over TP, the warm start does it itself."""
    index = {id(p): i for i, p in enumerate(mtp.params)}
    config = mtp.module.config
    return [index[id(p)] for n, p in mtp.module.named_parameters() if id(p) in index and mm.tp_partial_grad(n, config)]


def train_step(mtp: MTPCoTraining, optimizer: MasterWeightAdamW, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step of ``optimizer`` (over ``mtp.params``) on :func:`mtp_ce` of ``batch``, gradients into the
    MTP parameters only (the per-head q/k-norm ones summed over TP), clipped to ``mtp.clip_grad`` (TP-aware norm).
    Returns the loss before the step."""
    optimizer.zero_grad(set_to_none=True)
    loss = mtp_ce(mtp, batch)
    loss.backward()  # the trunk output, the embeddings and the output weight are detached: MTP parameters only
    masters = optimizer.stage_grads()
    all_reduce_grads([masters[i] for i in tp_partial_indices(mtp)], mtp.tp_group)
    clip_grads_(masters, mtp.clip_grad, mtp.tp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def evaluate_mtp(mtp: MTPCoTraining, data: TrainDatumSpec, batch_size: int) -> dict[str, float]:
    """CE and greedy acceptance of every MTP head on ``data`` (chunks of ``batch_size`` rows).

    Returns ``ce_<k>`` (nats per valid target of head k, over the whole set), ``ce`` (the mean over heads),
    ``acceptance_<k>`` (the fraction of valid targets where head k's argmax equals the main head's at position s - 1,
    as :func:`~.mtp_loss.mtp_acceptance_counts`) and ``acceptance`` (over all heads' targets); NaN without targets.
    """
    n, device = int(data["input_ids"].shape[0]), mtp.params[0].device
    sums = torch.zeros(mtp.num_layers, 3, dtype=torch.float64)  # per head: -sum lp, targets, agreeing targets
    for start in range(0, n, batch_size):
        batch = _rows(data, torch.arange(start, min(start + batch_size, n)), device)
        trunk, hidden = _forward(mtp, batch["input_ids"])
        for k, hk in enumerate(hidden):
            logits, lp, (rows, pos) = _head_logprobs(mtp, batch, hk, k)
            main_top = vocab_argmax(_logits_at(mtp.module, trunk.hidden, rows, pos - 1), mtp.tp_group)
            agree = float((vocab_argmax(logits, mtp.tp_group) == main_top).sum())
            sums[k] += torch.tensor([float(-lp.sum()), lp.numel(), agree], dtype=torch.float64)
    return _eval_metrics(sums)


def _eval_metrics(sums: torch.Tensor) -> dict[str, float]:
    def ratio(num: float, den: float) -> float:
        return num / den if den else math.nan

    out = {}
    for k, (nll, targets, agree) in enumerate(sums.tolist()):
        out[f"ce_{k}"], out[f"acceptance_{k}"] = ratio(nll, targets), ratio(agree, targets)
    heads = range(sums.shape[0])
    out["ce"] = sum(out[f"ce_{k}"] for k in heads) / len(heads)
    out["acceptance"] = ratio(float(sums[:, 2].sum()), float(sums[:, 1].sum()))
    return out


def _tagged(metrics: dict[str, float], tag: str) -> dict[str, float]:
    """``ce`` -> ``ce_<tag>``, ``ce_0`` -> ``ce_<tag>_0`` (the same for ``acceptance``)."""
    out = {}
    for key, value in metrics.items():
        name, _, head = key.partition("_")
        out[f"{name}_{tag}" + (f"_{head}" if head else "")] = value
    return out


def row_order(num_rows: int, count: int, seed: int) -> torch.Tensor:
    """``count`` row indices: consecutive seeded permutations of ``range(num_rows)`` (one per epoch), from a
    ``torch.Generator`` seeded with ``seed``. Shape: [count] int64.

    Raises:
        ValueError: ``num_rows < 1``.
    """
    if num_rows < 1:
        raise ValueError("the MTP warm start needs at least one training sequence")
    gen = torch.Generator().manual_seed(seed)
    epochs = -(-count // num_rows)
    return torch.cat([torch.randperm(num_rows, generator=gen) for _ in range(epochs)])[:count]


def ce_warm_start(
    mtp: MTPCoTraining,
    train_data: TrainDatumSpec,
    eval_data: TrainDatumSpec,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> dict[str, float]:
    """Train the MTP block alone (trunk frozen) on ``train_data`` with the heads' CE (module docstring): ``steps``
    AdamW steps of ``batch_size`` sequences each, in the seeded epoch order of :func:`row_order`, then a fresh MTP
    optimizer (:func:`reset_mtp_optimizer`).

    Args:
        mtp: the worker's MTP plug-in (its ``params`` are trained in place).
        train_data, eval_data: ``input_ids`` [B, S] int64, ``input_lengths`` [B], ``token_mask`` [B, S] (1 on response
            tokens), ``sample_mask`` [B]; CPU tensors (moved to the MTP block's device per batch). ``eval_data`` may
            have no rows (its metrics are then NaN).
        steps, batch_size, lr, seed: the optimizer steps, sequences per step, the temporary AdamW's lr, the row
            order's seed.

    Returns:
        ``mtp_warm_start/``: ``ce_before`` / ``ce_after`` (held-out CE, mean over heads; ``ce_before_<k>`` ... per head),
        ``acceptance_before`` / ``acceptance_after`` (held-out greedy acceptance; per head too), ``train_ce_first`` /
        ``train_ce_last`` (the loss of the first / last step's batch), ``steps``, ``train_sequences``,
        ``eval_sequences``, ``train_seconds``.
    Raises:
        ValueError: ``train_data`` has no rows.
    """
    start, was_training = time.perf_counter(), mtp.module.training
    order = row_order(int(train_data["input_ids"].shape[0]), steps * batch_size, seed)
    device = mtp.params[0].device
    mtp.module.eval()
    before = evaluate_mtp(mtp, eval_data, batch_size)
    mtp.module.train()
    optimizer = MasterWeightAdamW(mtp.params, **{**adamw_hyperparameters(mtp.optimizer), "lr": lr})
    losses = [train_step(mtp, optimizer, _rows(train_data, rows, device)) for rows in order.split(batch_size)]
    average_over_dp(mtp)
    reset_mtp_optimizer(mtp)
    mtp.module.eval()
    after = evaluate_mtp(mtp, eval_data, batch_size)
    mtp.module.train(was_training)
    out = {**_tagged(before, "before"), **_tagged(after, "after")}
    out.update(
        train_ce_first=losses[0],
        train_ce_last=losses[-1],
        steps=float(steps),
        train_sequences=float(train_data["input_ids"].shape[0]),
        eval_sequences=float(eval_data["input_ids"].shape[0]),
        train_seconds=time.perf_counter() - start,
    )
    return {PREFIX + k: float(v) for k, v in out.items()}
