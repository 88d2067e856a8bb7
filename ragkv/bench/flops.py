"""Forward FLOPs of a prefill, for the FLOP bound of a warm RAG request (full prefill FLOPs
over question-only FLOPs on the same context)."""

from __future__ import annotations


def prefill_flops(mc, query_kv_lens: list[int]) -> float:
    """FLOPs of computing the given query tokens, each attending to its KV length; projections,
    MLP and attention per token, plus one LM-head row."""
    d, h, kvh, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    attn_proj = 2 * d * (h * hd + 2 * kvh * hd) + 2 * h * hd * d  # qkv and o
    per_layer_linear = attn_proj + 3 * 2 * d * mc.intermediate_size  # + gate, up, down
    linear = mc.num_layers * per_layer_linear * len(query_kv_lens)
    attention = mc.num_layers * sum(4 * h * hd * k for k in query_kv_lens)
    return linear + attention + 2 * d * mc.vocab_size


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
