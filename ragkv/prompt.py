"""Prompt inputs -> token lists.

Accepted inputs: a string (tokenized with the tokenizer's special tokens) or a
`{"prompt_token_ids": [...]}` dict (used as given).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    text: str | None
    token_ids: list[int]


def parse_prompt(prompt: object, tokenizer, vocab_size: int) -> ParsedPrompt:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        parsed = ParsedPrompt(prompt, ids)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError("a dict prompt needs a 'prompt_token_ids' list")
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        parsed = ParsedPrompt(prompt.get("prompt"), list(ids))
    else:
        raise ValueError(
            f"unsupported prompt type {type(prompt).__name__}: give a str or a "
            "{'prompt_token_ids': [...]} dict"
        )
    if not parsed.token_ids:
        raise ValueError("prompt is empty (0 tokens)")
    bad = [t for t in parsed.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab_size})"
        )
    return parsed
