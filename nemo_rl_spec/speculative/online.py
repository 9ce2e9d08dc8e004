"""Online EAGLE-3 draft training inside the Megatron policy worker, across a ``.detach()`` boundary.

During the policy's own training forward (one per micro-batch), forward hooks capture the aux layers' outputs
(:func:`~nemo_rl_spec.speculative.capture.capture_hidden_states`, detached) and the policy's logits are detached
into soft targets ``log_softmax(logits)`` at temperature 1, whatever the rollout temperature T: vLLM draws the draft
token from ``softmax(z / T)`` of the draft's logits z (and ``make draft`` trains on temperature-1 targets too), so a
head whose z fits ``log p_1`` drafts from ``p_T``; a head fitted to ``log p_T`` would draft from a sharper
``softmax(log p_T / T)``. After the policy's backward of that micro-batch, the draft head runs its own
forward/backward on those tensors (:meth:`OnlineDraft.accumulate`); after the policy's optimizer step the draft
takes its own optimizer step (:meth:`OnlineDraft.finish`). Nothing the draft computes is connected to the policy's
graph, so the policy's gradients are bitwise those of a run without the draft (tests/functional/test_online_draft.py).
Config: ``policy.draft`` (:class:`~nemo_rl_spec.utils.config_schema.DraftConfig`). Data parallel: every rank trains
the same head on its own row shard, the loss normalised by the global count of scored tokens and the gradients
summed over the ranks (:class:`~nemo_rl_spec.speculative.draft_trainer.DataParallelSync`), so all replicas stay
identical; every TP rank trains an identical replica on identical inputs.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl_spec.speculative.acceptance import DRAFT_SAMPLE_METHODS, expected_acceptance
from nemo_rl_spec.speculative.capture import HiddenStateCapture, capture_hidden_states
from nemo_rl_spec.speculative.draft_trainer import DataParallelSync, DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3Config, Eagle3DraftHead
from nemo_rl_spec.speculative.ttt_scored import scored_index, scored_soft_targets
from nemo_rl_spec.utils.checkpoint import read_safetensors
from nemo_rl_spec.utils.config_schema import DraftConfig
from nemo_rl_spec.utils.dtypes import cast_state

DRAFT_STATE_DIR = "draft"


def draft_trains_at(step: int, train_period: int) -> bool:
    """True when the online draft trains in GRPO step ``step`` (0-based, the driver's step, whatever number of
    optimizer steps its mini-batches take): every ``policy.draft.train_period``-th step, starting with the first
    (``step % train_period == 0``). The driver passes it to ``Policy.train(train_draft=)``; the refit pushes the draft
    only when it changed (``WeightRefitter.pushes_draft``).

    Raises:
        ValueError: ``train_period < 1`` or ``step < 0``.
    """
    if train_period < 1 or step < 0:
        raise ValueError(f"policy.draft.train_period={train_period} (>= 1 expected) at step {step} (>= 0 expected)")
    return step % train_period == 0


def build_draft_head(
    draft_cfg: DraftConfig, hf_config, embedding: torch.Tensor, output_weight: torch.Tensor, seed: int = 0
) -> Eagle3DraftHead:
    """The head to train: loaded from ``draft_cfg.model_name`` or new (``lm_head`` = the policy's output layer;
    ``policy.draft.num_layers`` decoder layers, 1 when None).

    Args:
        hf_config: the policy's HF config; embedding, output_weight: the policy's full [V, H] input embedding and
            output weight.
    Raises:
        FileNotFoundError: ``policy.draft.model_name`` is not a draft directory.
        ValueError: the checkpoint's aux layer ids differ from ``policy.draft.aux_layer_ids``, or its decoder layer
            count from ``policy.draft.num_layers``.
    """
    name, aux = draft_cfg.model_name, draft_cfg.aux_layer_ids
    if name:
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"policy.draft.model_name={name!r}: no EAGLE-3 head there (config.json missing)")
        head = Eagle3DraftHead.from_pretrained(name, target_embeddings=embedding)
        if aux is not None and tuple(sorted(aux)) != tuple(head.cfg.aux_layer_ids):
            raise ValueError(
                f"policy.draft.aux_layer_ids={aux} but {name} was trained with {list(head.cfg.aux_layer_ids)}"
            )
        check_draft_num_layers(draft_cfg.num_layers, head.cfg.num_layers, name)
        return head
    head = Eagle3DraftHead(Eagle3Config.from_target(hf_config, aux, num_layers=draft_cfg.num_layers or 1))
    head.reset_parameters(seed=seed)
    head.set_target_embeddings(embedding)
    with torch.no_grad():
        head.lm_head.weight.copy_(output_weight.detach())
    return head


def check_draft_num_layers(num_layers: int | None, found: int, name: str) -> None:
    """Raise ValueError when ``policy.draft.num_layers`` is set and differs from the ``found`` decoder layers of the
    EAGLE-3 head at ``name`` (a draft's depth is fixed by its checkpoint; None accepts any)."""
    if num_layers is not None and int(num_layers) != int(found):
        raise ValueError(
            f"policy.draft.num_layers={num_layers} but the EAGLE-3 head {name} has {found} decoder layer(s) "
            f"(num_hidden_layers={found} in its config.json); set policy.draft.num_layers={found} or null, or point "
            "policy.draft.model_name at a head of that depth"
        )


def target_embedding_and_output(model_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's input embedding and output weight, each [V, H] as stored, read from the safetensors files of the
    HF checkpoint directory ``model_path`` (``model.embed_tokens.weight``; ``lm_head.weight``, or the embedding when
    the checkpoint ties them and stores no ``lm_head``).

    Raises:
        FileNotFoundError: no ``model.embed_tokens.weight`` in any ``*.safetensors`` file of ``model_path``.
    """
    found = read_safetensors(model_path, {"model.embed_tokens.weight", "lm_head.weight"})
    if "model.embed_tokens.weight" not in found:
        raise FileNotFoundError(f"{model_path}: no model.embed_tokens.weight in its *.safetensors files")
    embedding = found["model.embed_tokens.weight"]
    return embedding, found.get("lm_head.weight", embedding)


def write_fresh_draft_head(draft_cfg: DraftConfig, model_path: str, out_dir: str | Path, seed: int = 0) -> str:
    """Write the head :func:`build_draft_head` makes without ``policy.draft.model_name`` (fresh layers from
    ``seed``, ``lm_head`` = the policy's output layer) in vLLM's eagle3 format to ``out_dir``, from the HF
    checkpoint at ``model_path`` and without a policy worker: the initial draft of an engine whose draft is frozen
    (``policy.draft.online: false``) and names no directory. Returns ``out_dir`` as a string.

    Raises:
        FileNotFoundError: ``model_path`` holds no ``model.embed_tokens.weight``.
    """
    from transformers import AutoConfig  # lazy: transformers is slow to import

    embedding, output = target_embedding_and_output(model_path)
    hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    head = build_draft_head(draft_cfg.model_copy(update={"model_name": None}), hf_config, embedding, output, seed)
    head.save_pretrained(out_dir)
    return str(out_dir)


class AcceptanceEstimate:
    """Estimated acceptance of the online head, and of the head the run started from (frozen), on the rollouts each
    step trains on: ``policy.draft.estimate_acceptance``. A paired, policy-side measure of what training the draft
    buys, on every chain of the step's rollouts (about 1,000 in the default recipe), where the engines' counters see only the steps that drafted.

    Per micro-batch, :func:`~nemo_rl_spec.speculative.acceptance.expected_acceptance` (a teacher-forced unroll of
    ``num_steps`` draft steps; step acceptance ``sum_v min(p_T, q_T)`` for probabilistic drafting and ``p_T(argmax
    q)`` for greedy, with ``q_T = softmax(z / T)`` as vLLM draws it; chain length ``1 + sum_i prod_{j<i} a_j``;
    Leviathan et al. 2023) of

    - the online head before this step's update: the step's rollouts are new to it, so a held-out estimate;
    - ``reference``: a frozen copy of the head the trainer started from (``policy.draft.model_name`` or the fresh
      head), sharing the online head's ``embed_tokens``, i.e. the policy's current embedding, as an engine's frozen
      draft does (vLLM's EAGLE-3 drafter reads the target's embedding).

    Chain-weighted over micro-batches and data-parallel ranks. Metrics (the driver adds ``train/``):
    ``draft_est_acceptance_{greedy,probabilistic}``, ``draft_ref_est_acceptance_{greedy,probabilistic}``,
    ``draft_est_chains`` (chains over all ranks), ``draft_est_seconds`` (this rank's time, apart from
    ``draft_seconds``).

    Args:
        head: the online head at the start of training (copied).
        temperature: the rollout temperature T (<= 0: greedy, step acceptance ``argmax q == argmax p``).
        num_steps: draft steps per chain (``ttt_steps``).
    """

    def __init__(self, head: Eagle3DraftHead, temperature: float, num_steps: int) -> None:
        shared = {id(head.embed_tokens): head.embed_tokens}
        self.reference = copy.deepcopy(head, memo=shared).eval().requires_grad_(False)
        self.temperature, self.num_steps = float(temperature), int(num_steps)
        self._sums: dict[str, float] = {}
        self._seconds = 0.0

    @torch.no_grad()
    def add(
        self,
        head: Eagle3DraftHead,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        """Add one micro-batch. Shape: aux_hidden [b, s, n_aux * H], input_ids [b, s], loss_mask [b, s] (response
        tokens), logits [b, s, V] (the policy's, full vocabulary)."""
        t0 = time.perf_counter()
        # the policy's log p_T, in the draft vocabulary, only where a chain step reads it: the position before each
        # scored token (expected_acceptance masks every other position)
        rows, cols = scored_index(loss_mask)
        draft_ids = head.draft_ids if head.cfg.draft_vocab_size != head.cfg.vocab_size else None
        temperature = self.temperature if self.temperature > 0 else 1.0
        lp = logits.new_zeros((*input_ids.shape, head.cfg.draft_vocab_size), dtype=torch.float32)
        lp[rows, cols - 1] = scored_soft_targets(logits, loss_mask, temperature, draft_ids)
        for prefix, h in (("draft_est", head), ("draft_ref_est", self.reference)):
            res = expected_acceptance(h, aux_hidden, input_ids, loss_mask, lp, self.temperature, self.num_steps)
            for m in DRAFT_SAMPLE_METHODS:
                key = f"{prefix}_acceptance_{m}"
                self._sums[key] = self._sums.get(key, 0.0) + res.get(f"{m}/acceptance_length", 0.0) * res["chains"]
        self._sums["draft_est_chains"] = self._sums.get("draft_est_chains", 0.0) + res["chains"]
        self._seconds += time.perf_counter() - t0

    def metrics(self, sync: DataParallelSync | None = None) -> dict[str, float]:
        """The step's chain-weighted means (summed over ranks with ``sync``); starts the next step."""
        sums = sync.sum_metrics(self._sums) if sync is not None else dict(self._sums)
        chains = sums.pop("draft_est_chains", 0.0)
        out = {k: v / chains for k, v in sums.items()} if chains else {}
        out.update(draft_est_chains=chains, draft_est_seconds=self._seconds)
        self._sums, self._seconds = {}, 0.0
        return out


class OnlineDraft:
    """An EAGLE-3 head and its :class:`DraftTrainer`, fed by the policy worker's training forward.

    Args:
        head: the draft head.
        draft_cfg: the ``policy.draft`` section.
        ttt_steps: unrolled draft steps of the training-time-test loss.
        temperature: the rollout temperature, used only by ``estimate``; the soft targets are
            ``log_softmax(logits)`` at temperature 1 whatever it is (module docstring).
        sync: sums over data-parallel ranks (None: a single worker).

    Attributes:
        policy_version: weight version of the policy the draft was last trained with (set by the worker).
    """

    def __init__(
        self,
        head: Eagle3DraftHead,
        draft_cfg: DraftConfig,
        ttt_steps: int,
        temperature: float,
        sync: DataParallelSync | None = None,
    ) -> None:
        opt = draft_cfg.optimizer
        self.trainer = DraftTrainer(
            head,
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            max_grad_norm=opt.max_grad_norm,
            ttt_steps=int(ttt_steps),
            loss_weight=draft_cfg.loss_weight,
            autocast_dtype=torch.bfloat16 if draft_cfg.precision == "bfloat16" else None,
        )
        self.estimate = AcceptanceEstimate(head, temperature, ttt_steps) if draft_cfg.estimate_acceptance else None
        self.sync = sync
        self.policy_version = 0
        self._total = 1
        self._seconds = 0.0

    @property
    def head(self) -> Eagle3DraftHead:
        return self.trainer.head

    def capture(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[HiddenStateCapture]:
        """Hooks on ``model``'s aux layers for one forward (see :func:`capture_hidden_states`)."""
        return capture_hidden_states(model, self.head.cfg.aux_layer_ids)

    def begin(self, policy_embedding: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Start a draft step: copy the policy's current full [V, H] embedding into the head (vLLM's drafter shares
        the target's) and set the normaliser from this rank's [B, S] ``loss_mask`` (summed over DP ranks)."""
        t0 = time.perf_counter()
        self.trainer.sync_embeddings(policy_embedding)
        self.trainer.zero_grad()
        scored = torch.tensor([float(DraftTrainer.scored_tokens(loss_mask))], dtype=torch.float64)
        if self.sync is not None:
            scored = self.sync.sum(scored)
        self._total = max(int(scored[0]), 1)
        self._seconds = time.perf_counter() - t0

    def accumulate(
        self, cap: HiddenStateCapture, input_ids: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """Draft forward/backward on one captured micro-batch, at the scored (response) tokens only: the soft targets
        ``log_softmax(logits)`` (temperature 1) at those tokens in the draft vocabulary's columns
        (:func:`~nemo_rl_spec.speculative.ttt_scored.scored_soft_targets`) and the TTT loss there
        (:func:`~nemo_rl_spec.speculative.ttt_scored.scored_ttt_loss`; the same loss and gradients as at every position).

        Shape: input_ids [b, s], loss_mask [b, s], logits [b, s, V] (the policy's, detached here).
        """
        if self.estimate is not None:
            self.estimate.add(self.head, cap.aux_hidden(), input_ids, loss_mask, logits)
        t0 = time.perf_counter()
        cfg = self.head.cfg
        draft_ids = self.head.draft_ids if cfg.draft_vocab_size != cfg.vocab_size else None
        target = scored_soft_targets(logits, loss_mask, 1.0, draft_ids)
        self.trainer.accumulate(cap.aux_hidden(), input_ids, loss_mask, target, self._total)
        self._seconds += time.perf_counter() - t0

    def finish(self) -> dict[str, float]:
        """Draft optimizer step; metrics without the ``train/`` prefix (``draft_loss``, ``draft_grad_norm``,
        ``draft_acc_step{j}``, ``draft_version``, ...), which the driver logs as ``train/draft_*``.
        ``draft_seconds``: this rank's wall time of the draft's own work in the step (embedding copy, the draft
        forward/backward of every micro-batch, its optimizer step), next to the policy's training time. With
        ``policy.draft.estimate_acceptance`` also :class:`AcceptanceEstimate`'s metrics (not in ``draft_seconds``)."""
        t0 = time.perf_counter()
        metrics = {k.removeprefix("train/"): v for k, v in self.trainer.apply(self.sync).items()}
        metrics["draft_seconds"] = self._seconds + time.perf_counter() - t0
        return {**metrics, **(self.estimate.metrics(self.sync) if self.estimate is not None else {})}

    def export(self, dtype: str | None = None) -> dict[str, Any]:
        """``{"weights": checkpoint-named tensors, "draft_version": int, "policy_version": int}`` for
        :meth:`VllmGenerationWorker.update_draft_weights`; floating-point weights cast to ``dtype`` (the engine's,
        ``float32`` | ``bfloat16``; None: as trained, fp32). The head's weights are fp32 whatever the policy's dtype
        (``policy.draft.precision: bfloat16`` autocasts the forward only)."""
        weights = cast_state(self.trainer.export_weights(), dtype)
        return {"weights": weights, "draft_version": self.trainer.draft_version, "policy_version": self.policy_version}

    def state_dict(self) -> dict[str, Any]:
        return {**self.trainer.state_dict(), "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
        self.policy_version = int(state.get("policy_version", 0))
