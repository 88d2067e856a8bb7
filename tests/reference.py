"""The one-pass reference (DESIGN.md §1): HF transformers runs the plain model over the whole
token sequence with an explicit 4-D additive float mask and explicit position ids."""

from __future__ import annotations

import torch


def causal_layout(num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Positions and boolean visibility [T, T] of an ordinary prompt."""
    visible = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    return list(range(num_tokens)), visible


def rag_layout(s: int, chunk_lens: list[int], q: int) -> tuple[list[int], torch.Tensor]:
    """Positions and visibility of S + C_1..C_n + Q under `shared` positions and `isolated`
    attention: chunks see S and themselves, the question sees everything before it."""
    m = max(chunk_lens, default=0)
    total = s + sum(chunk_lens) + q
    positions = list(range(s))
    visible = torch.zeros(total, total, dtype=torch.bool)
    visible[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
    start = s
    for n in chunk_lens:
        positions.extend(range(s, s + n))
        visible[start:start + n, :s] = True
        visible[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    positions.extend(range(s + m, s + m + q))
    visible[start:, :start] = True
    visible[start:, start:] = torch.ones(q, q, dtype=torch.bool).tril()
    return positions, visible


def extend_layout(positions: list[int], visible: torch.Tensor,
                  num_new: int) -> tuple[list[int], torch.Tensor]:
    """Append generated tokens: each sees everything before it, positions continue."""
    t = visible.shape[0]
    grown = torch.zeros(t + num_new, t + num_new, dtype=torch.bool)
    grown[:t, :t] = visible
    grown[t:, :] = torch.ones(num_new, t + num_new, dtype=torch.bool).tril(t)
    last = positions[-1]
    return positions + list(range(last + 1, last + 1 + num_new)), grown


@torch.inference_mode()
def reference_logprobs(hf_model, token_ids: list[int], positions: list[int],
                       visible: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities after the last token, float32 [vocab]."""
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask.masked_fill_(~visible, float("-inf"))
    logits = hf_model(
        input_ids=torch.tensor([token_ids]),
        attention_mask=mask[None, None],
        position_ids=torch.tensor([positions]),
    ).logits[0, -1]
    return logits.float().log_softmax(-1)


def reference_greedy(hf_model, token_ids: list[int], positions: list[int], visible: torch.Tensor,
                     max_tokens: int, stop_ids: set[int] = frozenset()
                     ) -> tuple[list[int], torch.Tensor]:
    """Greedy generation by re-running the whole sequence each step. Returns the tokens and
    the first step's log-probabilities."""
    out: list[int] = []
    first = None
    ids, pos, vis = list(token_ids), list(positions), visible
    for _ in range(max_tokens):
        logp = reference_logprobs(hf_model, ids, pos, vis)
        if first is None:
            first = logp
        tok = int(logp.argmax())
        out.append(tok)
        if tok in stop_ids:
            break
        ids.append(tok)
        pos, vis = extend_layout(pos, vis, 1)
    return out, first
