"""The testbed policy: a small Llama taught one-digit chain sums by supervised fine-tuning, built offline.

Why: a random tiny model solves nothing (every GRPO advantage is 0) and accepts no draft, so the method
benchmarks and the speculative tests need a policy that is *partly* competent: per-prompt success rates spread
over (0, 1) at the sampling temperature, and an accuracy at that temperature that GRPO can raise. Built-in name
``testbed-llama`` (``policy.model_name``); :func:`build_testbed` makes it, ``resolve_model`` caches it.

Build (deterministic, CPU): reasoning-gym ``chain_sum`` problems as ChatML conversations whose answer is a
step-by-step chain; a task-sized byte-level BPE tokenizer (digits one per token); a ``LlamaForCausalLM`` of
:data:`TESTBED.model`; SFT stage 1 on the chains, then stage 2 on a corpus where a fraction of the answers is a bare
``\\boxed{answer}``. The policy then answers directly most of the time, and a direct answer is a guess: GRPO raises
accuracy by learning to write the chain. Usage: ``python -m nemo_rl_spec.models.testbed --out DIR [--steps N]`` (or
``make testbed``). Stage-2 choices fixed in code (corpus seed ``seed + 2``, size ``direct_steps * batch_size``, a
fresh AdamW, the shuffle seed ``seed + 1``) are not recipe fields: changing one must bump
``hf_assets.ASSET_FORMAT_VERSION`` so that cached builds are rebuilt.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from nemo_rl_spec.data.datasets import parse_generator
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.models.weight_init import init_deterministic

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
"""The system prompt of the math recipes (``data.system_prompt`` in configs/grpo_math_base.yaml)."""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class TestbedRecipe:
    """Everything a testbed build depends on (recorded in the cache marker; a change rebuilds).

    Attributes:
        generator: reasoning-gym generator spec of the SFT problems (the testbed recipe trains on the same family).
        slip_rate: probability that a step of a demonstration is off by one (:func:`draw_slips`; 0 in this
            recipe); the SFT policy learns to slip at about this rate when it samples at T = 1.
        direct_rate, direct_steps, direct_lr: SFT stage 2 (:func:`build_testbed`): ``direct_steps`` steps at the
            constant ``direct_lr`` on a corpus whose answers are a bare ``\\boxed{answer}`` with probability
            ``direct_rate`` (0 steps: no stage 2).
        seed: seed of the SFT problems, of the initial weights and of the batch order.
        sft_examples: corpus size (problems; repeats allowed, the family is small).
        vocab_size: BPE vocabulary of the tokenizer (specials included); the model's is rounded up to 128.
        model: LlamaConfig size keys.
        sft_steps, batch_size, lr, warmup_steps, min_lr_ratio, weight_decay: the stage-1 SFT optimisation.
        init_std: std of every initial non-norm tensor.
        threads: torch threads during the build (fixed, so the reduction order and the result do not depend on
            the machine's core count).
        families: the multi-family build (empty: the single-family build from ``generator`` and ``direct_rate``):
            ``(generator, direct_rate)`` pairs; stage 1 trains chains on every family (equal shares), stage 2 mixes
            the families in equal shares, each with its own direct-answer rate (0: that family keeps its chains).
        round_to_bf16: round every weight to the nearest bf16 value (stored as fp32) after SFT, so the shipped
            file compresses by half.
        bf16_autocast: run the SFT forward and backward under ``torch.autocast("cpu", torch.bfloat16)`` (weights
            and AdamW state stay fp32). Measured here (/tmp micro-benchmark, 8 steps of batch 64, 2 threads, a
            CPU with AMX-BF16): 0.55-0.58 s per step against 0.76 s in fp32. A CPU without native bf16 was not
            measured; its bits would differ from an AMX build's (as fp32 builds can across CPUs).
    """

    generator: str = "chain_sum:min_terms=2,max_terms=4,min_digits=1,max_digits=1"
    slip_rate: float = 0.0
    direct_rate: float = 0.7
    direct_steps: int = 100
    direct_lr: float = 1e-4
    seed: int = 20261201
    sft_examples: int = 32000
    vocab_size: int = 384
    model: dict = field(
        default_factory=lambda: dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=768,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
        )
    )
    sft_steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    init_std: float = 0.02
    threads: int = 2
    bf16_autocast: bool = True
    families: tuple[tuple[str, float], ...] = ()
    round_to_bf16: bool = False

    @property
    def stage2_steps(self) -> int:
        """SFT steps of stage 2: ``direct_steps``, or 0 when ``direct_rate`` is 0 (no stage 2)."""
        return self.direct_steps if self.direct_rate > 0 else 0


TESTBED = TestbedRecipe()

POOL_EASY = "chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1"
POOL_MIXED = "chain_sum:min_terms=3,max_terms=4,min_digits=1,max_digits=1"
POOL_HARD = "chain_sum:min_terms=3,max_terms=3,min_digits=2,max_digits=2"
TESTBED_POOL = TestbedRecipe(
    generator=POOL_MIXED,
    seed=20261207,
    families=((POOL_EASY, 0.0), (POOL_MIXED, 0.7)),
    round_to_bf16=True,
)
"""The multi-family testbed (built-in ``testbed-pool-llama``): two-term sums always written as a chain (solved),
three- and four-term sums answered directly 70% of the time (learnable: write the chain), and two-digit sums never
taught (:data:`POOL_HARD`, out of reach). The pool recipe trains on all three."""


def chain_solution(expression: str, slips: Sequence[int] | None = None) -> str:
    """Step-by-step answer to a chain sum, left to right: ``"4 - 1 - 7"`` -> ``"4 - 1 = 3\\n3 - 7 = -4\\n\\boxed{-4}"``.

    ``slips[i]`` (default all 0) is added to the result of step ``i`` and the chain goes on from the slipped value,
    as a person who miscounts would: ``chain_solution("4 - 1 - 7", [1, 0])`` -> ``"4 - 1 = 4\\n4 - 7 = -3\\n
    \\boxed{-3}"``. A demonstration with any non-zero slip has a wrong final answer.

    Raises:
        ValueError: ``expression`` is not ``int (op int)+`` with op in ``+ -``, or ``slips`` has not one entry per step.
    """
    tokens = expression.split()
    if len(tokens) < 3 or len(tokens) % 2 == 0 or any(op not in "+-" for op in tokens[1::2]):
        raise ValueError(f"not a chain sum: {expression!r}")
    slips = [0] * (len(tokens) // 2) if slips is None else list(slips)
    if len(slips) != len(tokens) // 2:
        raise ValueError(f"slips {slips} must have one entry per step of {expression!r}")
    total, lines = int(tokens[0]), []
    for op, operand, slip in zip(tokens[1::2], tokens[2::2], slips):
        new = (total + int(operand) if op == "+" else total - int(operand)) + slip
        lines.append(f"{total} {op} {int(operand)} = {new}")
        total = new
    return "\n".join(lines) + f"\n\\boxed{{{total}}}"


def draw_slips(num_steps: int, rate: float, rng) -> list[int]:
    """Per-step slips of one demonstration: each step independently slips with probability ``rate`` by +1 or -1
    (equally likely), else 0. ``rng`` is a ``random.Random``; the draws are 2 per step in step order."""
    out = []
    for _ in range(num_steps):
        slipped, sign = rng.random() < rate, rng.random() < 0.5
        out.append((1 if sign else -1) if slipped else 0)
    return out


def sft_conversations(
    recipe: TestbedRecipe,
    direct_rate: float = 0.0,
    seed: int | None = None,
    size: int | None = None,
    generator: str | None = None,
) -> list[tuple[str, str]]:
    """(question, answer) pairs of an SFT corpus: ``size`` (default ``recipe.sft_examples``) chain sums of
    ``generator`` (default ``recipe.generator``) drawn with ``seed`` (default ``recipe.seed``) and their chains, each
    step slipping with probability ``recipe.slip_rate`` (:func:`draw_slips`, ``random.Random(seed)``); with
    probability ``direct_rate`` the answer is the bare ``\\boxed{answer}`` instead (no chain: the policy must guess
    the sum in one token step).

    Raises:
        ValueError: the slip-free chain's final line disagrees with reasoning-gym's ground truth."""
    import reasoning_gym  # lazy: reasoning-gym is slow to import

    name, settings = parse_generator(recipe.generator if generator is None else generator)
    seed = recipe.seed if seed is None else seed
    size = recipe.sft_examples if size is None else size
    rng, pairs = random.Random(seed), []
    for item in reasoning_gym.create_dataset(name, size=size, seed=seed, **settings):
        expression = item["metadata"]["expression"]
        boxed = f"\\boxed{{{item['answer']}}}"
        if not chain_solution(expression).endswith(boxed):
            raise ValueError(f"chain of {expression!r} disagrees with reasoning-gym's answer {item['answer']!r}")
        slips = draw_slips(len(expression.split()) // 2, recipe.slip_rate, rng)
        direct = direct_rate > 0 and rng.random() < direct_rate
        answer = boxed if direct else chain_solution(expression, slips)
        pairs.append((item["question"], answer))
    return pairs


def stage_corpus(recipe: TestbedRecipe, stage: int, seed: int, size: int) -> list[tuple[str, str]]:
    """The SFT corpus of stage 1 (chains only) or 2 (direct answers at each family's rate): ``size`` pairs.

    Single-family recipe: :func:`sft_conversations` of ``recipe.generator`` at 0 (stage 1) or ``recipe.direct_rate``.
    Multi-family recipe: family i of k gets ``size // k`` pairs (the first ``size % k`` one more), drawn with seed
    ``seed + 1000 i``, at 0 (stage 1) or its own direct rate (stage 2), concatenated (SFT shuffles them).
    """
    if not recipe.families:
        return sft_conversations(recipe, recipe.direct_rate if stage == 2 else 0.0, seed, size)
    pairs, k = [], len(recipe.families)
    for i, (generator, rate) in enumerate(recipe.families):
        count = size // k + (1 if i < size % k else 0)
        pairs += sft_conversations(recipe, rate if stage == 2 else 0.0, seed + 1000 * i, count, generator)
    return pairs


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (digits one per token, ChatML specials,
    :data:`CHATML_TEMPLATE`); pad ``<|endoftext|>``, eos ``<|im_end|>``."""
    from tokenizers import (  # lazy: only to train the testbed tokenizer
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is slow to import

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def encode_examples(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Token ids of each conversation and the length of its prompt part (the loss covers the rest)."""
    out = []
    for question, answer in pairs:
        prompt = format_prompt(tokenizer, SYSTEM_PROMPT, question)
        response = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((prompt + response, len(prompt)))
    return out


def lr_at(step: int, recipe: TestbedRecipe) -> float:
    """Learning rate of SFT step ``step`` (0-based): linear warmup over ``warmup_steps``, then cosine decay from
    ``lr`` to ``lr * min_lr_ratio`` at ``sft_steps``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.sft_steps - recipe.warmup_steps)
    floor = recipe.lr * recipe.min_lr_ratio
    return floor + 0.5 * (recipe.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def _batch(examples: list[tuple[list[int], int]], pad_id: int):
    """Right-padded ids [B, S], attention mask [B, S] and labels [B, S] (-100 outside the responses)."""
    import torch  # lazy: this module imports without torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for b, (seq, prompt_len) in enumerate(examples):
        ids[b, : len(seq)] = torch.tensor(seq)
        labels[b, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
        mask[b, : len(seq)] = 1
    return ids, mask, labels


def build_model(tokenizer, recipe: TestbedRecipe):
    """The initial ``LlamaForCausalLM`` (fp32): norms 1, every other tensor ~ N(0, init_std) drawn in sorted
    parameter-name order from one generator seeded with ``recipe.seed``; vocab ``len(tokenizer)`` rounded up to 128."""
    import torch  # lazy: this module imports without torch
    import transformers  # lazy: transformers is slow to import

    vocab = -(-len(tokenizer) // 128) * 128
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **recipe.model,
    )
    config.dtype = torch.float32
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    init_deterministic(model, recipe.seed, recipe.init_std, recipe.init_std)
    return model


def sft(
    model,
    examples,
    pad_id: int,
    recipe: TestbedRecipe,
    steps: int | None = None,
    progress: bool = True,
    on_step=None,
    lr_fn=None,
) -> list[float]:
    """Supervised fine-tuning of ``model`` in place; returns the loss (mean nats per response token) of each step.

    Batches: a seeded permutation of ``examples``, ``recipe.batch_size`` per step, reshuffled each epoch.
    ``on_step(step, model)``, if given, is called after each optimizer step (used to measure accuracy vs steps).
    ``lr_fn(step)`` replaces the warmup + cosine schedule :func:`lr_at` when given (stage 2: a constant)."""
    import torch  # lazy: this module imports without torch

    steps = recipe.sft_steps if steps is None else steps
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    order, cursor, losses = torch.randperm(len(examples), generator=gen).tolist(), 0, []
    model.train()
    bar = tqdm(range(steps), desc="testbed SFT", disable=not progress)
    for step in bar:
        if cursor + recipe.batch_size > len(order):
            order, cursor = torch.randperm(len(examples), generator=gen).tolist(), 0
        ids, mask, labels = _batch([examples[i] for i in order[cursor : cursor + recipe.batch_size]], pad_id)
        cursor += recipe.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe) if lr_fn is None else lr_fn(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.bf16_autocast):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if on_step is not None:
            on_step(step, model)
            model.train()
    model.eval()
    return losses


def train_testbed(recipe: TestbedRecipe = TESTBED, steps: int | None = None, progress: bool = True, on_step=None):
    """Both SFT stages from scratch (stage 1: ``steps`` or ``recipe.sft_steps`` steps on chains; stage 2:
    ``recipe.stage2_steps`` steps on the direct-answer mix), with ``recipe.threads`` torch threads.
    ``on_step(step, model, tokenizer)`` is called after every optimizer step, ``step`` counted over both stages
    from 0 (examples/testbed_sft_sweep.py evaluates there). Returns ``(model, tokenizer, losses)``; losses in nats
    per response token.

    Raises:
        ValueError: a chain answer disagrees with reasoning-gym's ground truth.
    """
    import torch  # lazy: this module imports without torch

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        pairs = stage_corpus(recipe, 1, recipe.seed, recipe.sft_examples)
        corpus = [f"{SYSTEM_PROMPT}\n{q}\n{a}" for q, a in pairs]
        tokenizer = train_tokenizer(corpus, recipe.vocab_size)
        model = build_model(tokenizer, recipe)

        def hook(offset: int):
            return None if on_step is None else (lambda step, m: on_step(offset + step, m, tokenizer))

        losses = sft(model, encode_examples(tokenizer, pairs), tokenizer.pad_token_id, recipe, steps, progress, hook(0))
        if recipe.stage2_steps > 0:
            mixed = stage_corpus(recipe, 2, recipe.seed + 2, recipe.stage2_steps * recipe.batch_size)
            losses += sft(
                model,
                encode_examples(tokenizer, mixed),
                tokenizer.pad_token_id,
                recipe,
                recipe.stage2_steps,
                progress,
                hook(len(losses)),
                lr_fn=lambda _step: recipe.direct_lr,
            )
        if recipe.round_to_bf16:
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16).to(torch.float32))
    finally:
        torch.set_num_threads(threads)
    return model, tokenizer, losses


def save_testbed(out_dir: Path, model, tokenizer, recipe: TestbedRecipe, losses: list[float]) -> None:
    """Write ``model`` and ``tokenizer`` into ``out_dir`` as an HF checkpoint (safetensors, chat template, a generation
    config with the tokenizer's eos / pad) and ``sft.json`` (the recipe and the per-step losses)."""
    from transformers import GenerationConfig  # lazy: transformers is slow to import

    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "sft.json").write_text(
        json.dumps({"recipe": asdict(recipe), "steps": len(losses), "losses": [round(x, 6) for x in losses]}, indent=1)
        + "\n"
    )


def build_testbed(
    out_dir: Path, recipe: TestbedRecipe = TESTBED, steps: int | None = None, progress: bool = True
) -> list[float]:
    """Build the testbed checkpoint into ``out_dir`` (:func:`train_testbed`, then :func:`save_testbed`). Returns the
    SFT losses. Deterministic: two builds are bitwise equal.

    Raises:
        ValueError: a chain answer disagrees with reasoning-gym's ground truth.
    """
    model, tokenizer, losses = train_testbed(recipe, steps, progress)
    save_testbed(out_dir, model, tokenizer, recipe, losses)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the testbed policy (SFT on chain sums) into --out.")
    parser.add_argument("--out", required=True, help="output directory (an HF checkpoint)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"stage-1 SFT steps (default {TESTBED.sft_steps}; stage 2 adds {TESTBED.direct_steps})",
    )
    args = parser.parse_args(argv)
    losses = build_testbed(Path(args.out), steps=args.steps)
    print(f"testbed written to {args.out}: {len(losses)} SFT steps, final loss {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
