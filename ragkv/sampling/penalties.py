"""Penalties, logit bias, banned and allowed tokens: what changes a row's logits before it is
sampled (vLLM's order and formulas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..host_ints import int64_tensor, list_to_device, to_device
from .params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a row's penalties read: how often its sequence has generated each token (the
    engine keeps the counts as tokens are appended), its prompt's token ids on the logits'
    device (None unless it asks for a repetition penalty; repeats are harmless), the
    tokens it may not sample now (its stop tokens, before min_tokens), and with structured
    outputs the only tokens it may sample: a host bool mask (ids past its end are refused)
    plus `also_allowed` ids (its stop tokens where the output may end)."""

    counts: Mapping[int, int]
    prompt: torch.Tensor | None = None
    banned: Sequence[int] = ()
    allowed: torch.Tensor | None = None
    also_allowed: Sequence[int] = ()


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: list[TokenHistory | None] | None) -> torch.Tensor:
    """`logits` [B, V] (float32) after each row's logit_bias, then its repetition, frequency
    and presence penalties, in vLLM's order and with its formulas, and its banned tokens at
    -inf (min_tokens); rows that ask for none are unchanged. A new tensor when any row asks
    (the raw logits stay for logprobs). A row without a history has generated nothing; a
    repetition penalty needs its prompt.

    Every penalty touches only the tokens a row has seen, so each is a gather or scatter at
    (row, token) pairs, not a pass over [B, V]: the generated tokens' pairs and counts are
    built on the host (one transfer with the rest), the prompts are already on the device,
    and nothing waits for the device."""
    history = history or [None] * len(params)
    # A min_tokens row past its minimum has nothing to ban: it costs nothing here.
    rows = [i for i, p in enumerate(params) if p.changes_logits
            or (history[i] is not None and (history[i].banned
                                            or history[i].allowed is not None))]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    bias = [(i, t, b) for i in rows for t, b in (params[i].logit_bias or {}).items()]
    # Each row's distinct generated tokens and how often each occurs.
    seen_rows_host: list[int] = []
    seen_ids_host: list[int] = []
    seen_counts_host: list[int] = []
    repeat_seen: list[int] = []  # which of those pairs are in rows with a repetition penalty
    for i in rows:
        counts = history[i].counts if history[i] is not None else {}
        if params[i].repetition_penalty != 1.0:
            repeat_seen += range(len(seen_ids_host), len(seen_ids_host) + len(counts))
        seen_rows_host += [i] * len(counts)
        seen_ids_host += counts.keys()
        seen_counts_host += counts.values()
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if any(history[i] is None or history[i].prompt is None for i in repeat):
        raise ValueError("a row with a repetition penalty needs its prompt's token ids")
    prompts = [history[i].prompt for i in repeat]
    # Ids past the logits (a checkpoint's EOS beyond its LM head) cannot be sampled anyway.
    banned = [i * vocab + t for i in rows if history[i] is not None
              for t in history[i].banned if t < vocab]
    masked = [i for i in rows if history[i] is not None and history[i].allowed is not None]
    # Ints in one transfer, floats in another (and the masks' bools in a third).
    ints = int64_tensor([i for i, _, _ in bias] + [t for _, t, _ in bias] + seen_rows_host
                        + seen_ids_host + repeat + [ids.numel() for ids in prompts]
                        + repeat_seen + banned + masked)
    ints = to_device(ints, device)
    floats = list_to_device([b for _, _, b in bias] + seen_counts_host
                        + [p.repetition_penalty for p in params]
                        + [p.frequency_penalty for p in params]
                        + [p.presence_penalty for p in params], torch.float32, device)
    nb, ns, nr, batch = len(bias), len(seen_ids_host), len(repeat), len(params)
    bias_rows, bias_ids, seen_rows, seen_ids, rep_rows, rep_lens, rep_seen, ban, mask_rows = (
        ints.split([nb, nb, ns, ns, nr, nr, len(repeat_seen), len(banned), len(masked)]))
    bias_values, seen_counts, repetition, frequency, presence = floats.split(
        [nb, ns, batch, batch, batch])
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    flat = out.view(-1)  # (row, token) pairs as flat indices: 1-D gathers are the cheap kind
    if bias:
        flat.index_add_(0, bias_rows * vocab + bias_ids, bias_values)
    seen_flat = seen_rows * vocab + seen_ids
    if repeat:
        # The prompts' tokens and the generated ones. A token listed twice gets the same
        # value written twice: both are computed from the logit before the penalty.
        prompt_ids = torch.cat(prompts)
        # output_size: the count is known here, so the device is not asked for it (a sync).
        prompt_rows = torch.repeat_interleave(rep_rows, rep_lens, output_size=prompt_ids.numel())
        pairs = torch.cat([prompt_rows * vocab + prompt_ids, seen_flat[rep_seen]])
        values = flat[pairs]
        factor = repetition[torch.cat([prompt_rows, seen_rows[rep_seen]])]
        # HF's and vLLM's rule: a positive logit is divided, a negative one multiplied.
        flat[pairs] = torch.where(values > 0, values / factor, values * factor)
    if ns:
        flat.index_add_(0, seen_flat, -(frequency[seen_rows] * seen_counts + presence[seen_rows]))
    if banned:
        flat.index_fill_(0, ban, float("-inf"))
    if masked:
        _mask_rows(out, mask_rows, [history[i] for i in masked])
    return out


def _mask_rows(logits: torch.Tensor, rows: torch.Tensor, history: list[TokenHistory]) -> None:
    """Every token outside its row's allowed set to -inf (structured outputs), in place:
    `rows` (on the logits' device) are the rows of `history`, whose masks are stacked on the
    host and sent in one transfer."""
    vocab = logits.shape[1]
    allow = torch.zeros(len(history), vocab, dtype=torch.bool)
    for j, h in enumerate(history):
        n = min(vocab, h.allowed.numel())
        allow[j, :n] = h.allowed[:n]
        extra = [t for t in h.also_allowed if t < vocab]
        if extra:
            allow[j, extra] = True
    allow = to_device(allow, logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allow,
                                                                         float("-inf")))
