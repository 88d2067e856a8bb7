"""The one-pass reference (docs/rag.md): HF transformers runs the plain model over the whole
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


def layout_reference(system: list[int], chunks: list[list[int]], question: list[int],
                     position_strategy: str = "shared", chunk_attention: str = "isolated",
                     primer: list[int] = ()
                     ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Token ids, positions, visibility [T, T] and hidden tokens [T] (bool: seen by no token
    after the prompt) of one pass over a RAG prompt in any layout (docs/rag.md).

    - positions `shared`: every chunk at s..; `sequential`: chunk i where it lies in the flat
      prompt; Q after the longest chunk (shared) or the last one (sequential);
    - attention `isolated`: a chunk sees S and itself, `standalone`: only itself; Q sees S,
      every chunk and itself.
    An isolated chunk sees S as if S ended right before the chunk: its KV is computed once
    after S and re-positioned by rotating its keys, so a chunk placed at t_i > s sees S at
    t_i-s .. t_i-1. The one-pass reference says exactly that with a copy of S at those
    positions that only the chunk sees (`hidden`: nothing after the chunk sees the copy).
    With `shared` positions, or for the first chunk, the copy would be S itself. A `primer`
    P (sequential, isolated) puts a copy of S + P before every chunk after the first."""
    s = len(system)
    ids = list(system)
    positions = list(range(s))
    sees: list[list[int]] = [list(range(t + 1)) for t in range(s)]  # attended token indices
    hidden: set[int] = set()
    visible_after: list[int] = list(range(s))  # what the question sees
    flat = s
    primed = position_strategy == "sequential" and chunk_attention == "isolated"
    for i, chunk in enumerate(chunks):
        target = flat if position_strategy == "sequential" else s
        context: list[int] = []
        before = list(system) + (list(primer) if primed and i else [])
        if chunk_attention == "isolated" and before:
            if target == s and len(before) == s:
                context = list(range(s))
            else:  # a copy of S (+ P) right before the chunk, hidden from everything else
                n = len(before)
                base = len(ids)
                ids.extend(before)
                positions.extend(range(target - n, target))
                context = list(range(base, base + n))
                sees.extend(context[:j + 1] for j in range(n))
                hidden.update(context)
        start = len(ids)
        ids.extend(chunk)
        positions.extend(range(target, target + len(chunk)))
        sees.extend(context + list(range(start, start + j + 1)) for j in range(len(chunk)))
        visible_after.extend(range(start, start + len(chunk)))
        flat += len(chunk)
    if not chunks:
        q_pos = s
    elif position_strategy == "sequential":
        q_pos = flat
    else:
        q_pos = s + max(map(len, chunks))
    start = len(ids)
    ids.extend(question)
    positions.extend(range(q_pos, q_pos + len(question)))
    sees.extend(visible_after + list(range(start, start + j + 1)) for j in range(len(question)))
    visible = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    for t, cols in enumerate(sees):
        visible[t, cols] = True
    hidden_mask = torch.zeros(len(ids), dtype=torch.bool)
    hidden_mask[sorted(hidden)] = True
    return ids, positions, visible, hidden_mask


def extend_layout(positions: list[int], visible: torch.Tensor, num_new: int,
                  hidden: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """Append generated tokens: each sees everything before it (but `hidden` tokens),
    positions continue."""
    t = visible.shape[0]
    grown = torch.zeros(t + num_new, t + num_new, dtype=torch.bool)
    grown[:t, :t] = visible
    grown[t:, :] = torch.ones(num_new, t + num_new, dtype=torch.bool).tril(t)
    if hidden is not None:
        grown[t:, :t] &= ~hidden
    last = positions[-1]
    return positions + list(range(last + 1, last + 1 + num_new)), grown


def windowed(positions: list[int], visible: torch.Tensor, window: int) -> torch.Tensor:
    """`visible` under a sliding window: a token at position p sees only tokens at positions
    > p - window (docs/rag.md)."""
    pos = torch.tensor(positions)
    return visible & (pos[:, None] - pos[None, :] < window)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, None]


def attention_masks(config, positions: list[int], visible: torch.Tensor):
    """The explicit mask HF's model takes: one 4-D additive mask, or, for a model with full
    and sliding-window layers, one per layer type (HF applies no window of its own to an
    explicit mask)."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        layer_types = getattr(config, "layer_types", None) or ()
        if "full_attention" in layer_types:
            return {"full_attention": _additive(visible),
                    "sliding_attention": _additive(windowed(positions, visible, window))}
        if not layer_types or "sliding_attention" in layer_types:
            return _additive(windowed(positions, visible, window))
    return _additive(visible)


@torch.inference_mode()
def reference_logits(hf_model, token_ids: list[int], positions: list[int],
                     visible: torch.Tensor) -> torch.Tensor:
    """Next-token logits after the last token, float32 [vocab]."""
    return hf_model(
        input_ids=torch.tensor([token_ids]),
        attention_mask=attention_masks(hf_model.config, positions, visible),
        position_ids=torch.tensor([positions]),
    ).logits[0, -1].float()


def reference_logprobs(hf_model, token_ids: list[int], positions: list[int],
                       visible: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities after the last token, float32 [vocab]."""
    return reference_logits(hf_model, token_ids, positions, visible).log_softmax(-1)


def reference_greedy(hf_model, token_ids: list[int], positions: list[int], visible: torch.Tensor,
                     max_tokens: int, stop_ids: set[int] = frozenset(),
                     hidden: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy generation by re-running the whole sequence each step. Returns the tokens and
    the first step's log-probabilities. Generated tokens do not see `hidden` tokens."""
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
        pos, vis = extend_layout(pos, vis, 1, hidden)
        if hidden is not None:
            hidden = torch.cat([hidden, torch.zeros(1, dtype=torch.bool)])
    return out, first


@torch.inference_mode()
def generate_and_check(llm, hf, prompt, ids, positions, visible, max_tokens: int, tol: float,
                       hidden=None, prompt_ids=None, first_tol: float | None = None):
    """ragkv's greedy output, checked teacher-forced in one HF pass over the prompt and the
    generated tokens (each generated token sees everything before it but `hidden` reference
    tokens): every token must be HF's argmax after the tokens before it, which by induction
    is HF's greedy sequence, and every returned log-probability within `tol` of HF's
    (`first_tol` for the first token's, where given). `prompt_ids`: the engine's prompt
    tokens where the reference's `ids` hold more (copies of S for sequential layouts)."""
    from ragkv import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    got = out.outputs[0]
    assert out.prompt_token_ids == (ids if prompt_ids is None else prompt_ids)
    fed = got.token_ids[:-1]
    positions, visible = extend_layout(positions, visible, len(fed), hidden)
    logits = hf(input_ids=torch.tensor([ids + fed]),
                attention_mask=attention_masks(hf.config, positions, visible),
                position_ids=torch.tensor([positions])).logits[0, len(ids) - 1:]
    logp = logits.float().log_softmax(-1)
    assert logp.argmax(-1).tolist() == got.token_ids
    eos = set(llm.engine.eos_token_ids)
    assert got.token_ids[-1] in eos or len(got.token_ids) == max_tokens
    assert not eos & set(got.token_ids[:-1])
    for step, top in enumerate(got.logprobs):
        limit = first_tol if step == 0 and first_tol is not None else tol
        for tid, lp in top.items():
            assert abs(lp.logprob - logp[step, tid].item()) < limit, (step, tid, lp.logprob)
    llm.check_integrity()
    return out
