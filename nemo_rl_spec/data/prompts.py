"""Prompt formatting through the tokenizer's own chat template."""

from __future__ import annotations


def format_prompt(tokenizer, system_prompt: str | None, question: str, **chat_template_kwargs) -> list[int]:
    """Token ids of ``[system, user]`` chat messages rendered by the tokenizer's chat template, ending with the
    assistant header (``add_generation_prompt=True``) so generation starts the answer.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        system_prompt: system message; None or "" omits it (the template may then insert its own default).
        question: the user message.
        chat_template_kwargs: extra template variables (``policy.tokenizer.chat_template_kwargs``, e.g.
            ``enable_thinking`` for Qwen3).

    Returns:
        list[int] of token ids (special tokens as the template writes them; nothing added on top).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **chat_template_kwargs)
    if not isinstance(ids, list):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
