"""Forward FLOPs of a prefill, for the FLOP bound of a warm RAG request (full prefill FLOPs
over question-only FLOPs on the same context)."""

from __future__ import annotations

import math


def prefill_flops(mc, query_kv_lens: list[int], layers: int | None = None,
                  head: bool = True) -> float:
    """FLOPs of computing the given query tokens, each attending to its KV length; projections,
    MLP and attention per token in `layers` layers (all by default), plus one LM-head row."""
    d, h, kvh, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    layers = mc.num_layers if layers is None else layers
    attn_proj = 2 * d * (h * hd + 2 * kvh * hd) + 2 * h * hd * d  # qkv and o
    per_layer_linear = attn_proj + 3 * 2 * d * mc.intermediate_size  # + gate, up, down
    linear = layers * per_layer_linear * len(query_kv_lens)
    attention = layers * sum(4 * h * hd * k for k in query_kv_lens)
    return linear + attention + (2 * d * mc.vocab_size if head else 0)


def recompute_flops(mc, system: int, chunk_lens: list[int], question: int, ratio: float,
                    probe: str | None, probe_layers: int = 2) -> float:
    """FLOPs of a warm selective-recompute request in the sequential layout (isolated chunks):
    the recomputed chunk tokens, `ratio` of all of them spread evenly over the chunks after the
    first (whose cached KV is already a full prefill's, so it is never recomputed), and the
    question, each attending to everything before it, plus the probe that chooses them:
    `blend` runs the chunk tokens after the first chunk through the probe layers but the last,
    and the last one's K/V projection; `query` the question tokens through the probe layers."""
    context = system + sum(chunk_lens)
    total = sum(chunk_lens)
    first = chunk_lens[0] if chunk_lens else 0
    count = min(total - first, math.ceil(ratio * total - 1e-9))
    picked = ([system + first + 1 + (i * (total - first)) // count for i in range(count)]
              if count else [])
    work = picked + [context + t for t in range(1, question + 1)]
    flops = prefill_flops(mc, work)
    if probe is not None:
        flops += probe_flops(mc, system, total, question, probe, probe_layers, first)
    return flops


def probe_flops(mc, system: int, chunk_tokens: int, question: int, probe: str,
                probe_layers: int, skip: int = 0) -> float:
    """FLOPs of one recompute probe (recompute/probe.py) through `probe_layers` layers: `blend`
    runs the chunk tokens after the first `skip` (the first chunk's) through the layers but the
    last, and the last one's K/V projection; `query` the question tokens."""
    context = system + chunk_tokens
    if probe == "blend":
        d, kvh, hd = mc.hidden_size, mc.num_kv_heads, mc.head_dim
        chunk_kv = [system + t for t in range(skip + 1, chunk_tokens + 1)]
        return (prefill_flops(mc, chunk_kv, layers=probe_layers - 1, head=False)
                + (chunk_tokens - skip) * 2 * d * 2 * kvh * hd)
    question_kv = [context + t for t in range(1, question + 1)]
    return prefill_flops(mc, question_kv, layers=probe_layers, head=False)


def full_prefill_flops(mc, num_tokens: int) -> float:
    """An ordinary causal prefill of `num_tokens` tokens."""
    return prefill_flops(mc, list(range(1, num_tokens + 1)))


def rag_flop_bound(mc, system: int, chunk_lens: list[int], question: int) -> float:
    """Full prefill of S + chunks + Q (chunk-isolated: a chunk token sees S and its own
    prefix) over computing only Q against the whole context."""
    context = system + sum(chunk_lens)
    full = list(range(1, system + 1))
    for n in chunk_lens:
        full += [system + t for t in range(1, n + 1)]
    full += [context + t for t in range(1, question + 1)]
    question_only = [context + t for t in range(1, question + 1)]
    return prefill_flops(mc, full) / prefill_flops(mc, question_only)
