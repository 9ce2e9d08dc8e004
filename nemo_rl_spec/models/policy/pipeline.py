"""Pipeline parallelism for the Megatron policy worker: megatron-core's own schedules and the stage-local names.

With ``policy.megatron_cfg.pipeline_model_parallel_size`` = P > 1 each rank holds one stage of the GPTModel: the
embedding on the first stage, ``num_layers / P`` consecutive decoder layers (numbered from 0 on every stage, megatron's
local numbering; the stage's first global layer is :func:`stage_layer_offset`), the final norm and the output layer on
the last. With tied embeddings the last stage keeps its own copy of the embedding matrix as ``output_layer.weight``,
which megatron-core keeps equal to the first stage's (the embedding group's all-reduce at build and on every gradient).

Training and log-probs run through ``get_forward_backward_func()`` (non-interleaved 1F1B; forward-only for
log-probs) with ``variable_seq_lengths`` on, so the micro-batches keep the worker's own plan (fixed chunks or dynamic
batching, each trimmed to its longest row): the stages exchange each activation's shape before it. Activations travel
by p2p send / recv over the pipeline group (gloo on CPU, NCCL on GPU). The loss and the log-probs exist on the last
stage only; :func:`broadcast_from_last_stage` hands them to the stage-0 rank the controller reads.

Weights are exchanged under GLOBAL names (``decoder.layers.<global index>.*``; ``output_layer.weight`` dropped when tied):
:func:`to_global_names` / :func:`stage_state` convert, :func:`gather_stages` puts a full model together on every stage,
so HF exports and checkpoints are independent of P.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat

apply_cpu_compat()  # before any megatron import (triton stub, torch proxies)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def pp_size() -> int:
    """The pipeline-parallel world size (1 without PP)."""
    return parallel_state.get_pipeline_model_parallel_world_size()


def stage_layer_offset(module: torch.nn.Module) -> int:
    """Global index of this stage's first decoder layer (megatron-core's ``get_transformer_layer_offset``)."""
    return int(get_transformer_layer_offset(module.config))


def _shift_layer(name: str, shift: int) -> str:
    match = _LAYER.match(name)
    return name if match is None else f"{match[1]}{int(match[2]) + shift}{match[3]}"


def to_global_names(state: dict, offset: int, tied: bool) -> dict:
    """Stage-local names -> global names: ``decoder.layers.<l>.*`` -> ``decoder.layers.<l + offset>.*``; the last
    stage's copy of a tied embedding (``output_layer.weight``) is left out (the first stage holds the matrix). Values
    (tensors, optimizer-state dicts) pass unchanged."""
    return {_shift_layer(k, offset): v for k, v in state.items() if not (tied and k == TIED_OUTPUT)}


def stage_state(global_state: dict, local_names: Iterable[str], offset: int, tied: bool) -> dict:
    """The entries of ``global_state`` this stage holds, under its local names: ``decoder.layers.<g>.*`` for this
    stage's layers renamed ``<g - offset>``; a tied ``output_layer.weight`` taken from the embedding's entry.
    Names in ``local_names`` without a global entry are left out (the caller decides whether that is an error:
    :func:`~.megatron_model.load_megatron_state` raises a KeyError naming them).
    """
    out = {}
    for name in local_names:
        source = EMBEDDING if tied and name == TIED_OUTPUT else _shift_layer(name, offset)
        if source in global_state:
            out[name] = global_state[source]
    return out


def gather_stages(state: dict) -> dict:
    """Every stage's ``state`` (global names, CPU tensors) merged, on every rank of the pipeline group (a
    collective, ``all_gather_object``). Without PP, ``state`` itself."""
    if pp_size() == 1:
        return state
    parts: list = [None] * pp_size()
    dist.all_gather_object(parts, state, group=parallel_state.get_pipeline_model_parallel_group())
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def broadcast_from_last_stage(obj):
    """``obj`` of the last pipeline stage on every stage of this rank's pipeline group (a collective; a
    ``torch.Tensor`` of the same shape and dtype on every stage is broadcast in place, anything else pickled)."""
    if pp_size() == 1:
        return obj
    group, src = (
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_last_rank(),
    )
    if isinstance(obj, torch.Tensor):
        dist.broadcast(obj, src=src, group=group)
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


StageLoss = Callable[[torch.Tensor, object, dict], tuple[torch.Tensor, dict]]


def run_schedule(
    model: torch.nn.Module, micro_batches: Sequence[tuple], stage_loss: StageLoss, forward_only: bool
) -> list[dict]:
    """Run megatron-core's pipeline schedule over ``micro_batches`` (``(plan entry, rows)`` pairs, the same on every
    stage of a pipeline group).

    Every stage runs its part of ``model`` (``model(input_ids, position_ids)``; the first stage embeds, later ones
    take the previous stage's activations, [s, b, H]); on the last stage ``stage_loss(logits [b, s, V/TP], plan
    entry, rows)`` returns (scalar loss to backpropagate, dict of per-micro-batch outputs). The schedule then runs the
    backward through the stages (not with ``forward_only``). Gradients are left unreduced: the caller runs
    ``finalize_model_grads`` (DP all-reduce, the tied embedding's all-reduce between first and last stage).

    Returns:
        The last stage: one dict per micro-batch, in order; other stages: [].
    """
    batches = iter(micro_batches)

    def forward_step(data_iterator, stage_model):
        plan_mb, mb = next(data_iterator)
        ids = mb["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        output = stage_model(ids, positions, attention_mask=None)

        def loss_func(logits):
            loss, outputs = stage_loss(logits, plan_mb, mb)
            # megatron's per-token contract: (loss, token count, reduced) with no division by the micro-batch count;
            # the worker's losses are already normalised by global counts
            return loss, torch.tensor(1, dtype=torch.int), outputs

        return output, loss_func

    width = max((int(mb["input_ids"].shape[1]) for _, mb in micro_batches), default=1)
    rows = max((int(mb["input_ids"].shape[0]) for _, mb in micro_batches), default=1)
    return list(
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=width,  # unused: variable_seq_lengths exchanges every activation's shape
            micro_batch_size=rows,
            forward_only=forward_only,
        )
    )
