"""Damped stale tokens (`recompute_damping`): the question and the generated tokens read each
chunk token whose cached KV is not a full prefill's (after the first document, not
recomputed) with its attention logit lowered by the damping.

Exact against HF transformers in float32 (greedy tokens identical, log-probabilities within
1e-4): the one-pass reference is the sequential-isolated layout with selective recompute, each
later chunk given a hidden copy of S and of its own tokens as cached (what its stale tokens
read), each recomputed token seeing everything before it, and an additive -damping on the
stale tokens' columns of the question's and the generated tokens' rows. Cold, warm and
reordered, alone and batched with another damping, for every family (the sliding-window ones
included), with `check_integrity()` after each.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MAIN_FAMILIES, random_prompt
from reference import attention_masks, extend_layout
from test_rag import GREEDY, TOL, make_llm

from ragkv import SamplingParams
from ragkv.inputs.layout import PromptLayout
from ragkv.inputs.prompt import RAGPrompt
from ragkv.recompute.selection import RecomputeSpec


def damped(system, chunks, question, sinks: int, damping: float, method: str = "sink",
           ratio: float = 0.5) -> RAGPrompt:
    return RAGPrompt(system, chunks, question, position_strategy="sequential",
                     chunk_attention="isolated", recompute=method, recompute_ratio=ratio,
                     recompute_sink_tokens=sinks if method == "sink" else None,
                     recompute_damping=damping)


def reference_layout(system, chunks, question, recomputed: int, primer=()):
    """Token ids, positions, visibility [T, T], hidden [T] and stale [T] (bool) of the
    one pass, and the question's first index: `recomputed` first tokens of each chunk after
    the first are recomputed; with a `primer` P those chunks are cached after S + P (the
    chunk primer, tests/test_primer.py)."""
    s = len(system) + len(primer)  # what a later chunk's cached KV follows
    ids, positions = list(system), list(range(len(system)))
    rows: list[list[int]] = [list(range(t + 1)) for t in range(len(system))]
    hidden: set[int] = set()
    stale: set[int] = set()
    seen: list[int] = list(range(len(system)))  # what the question sees: S and every chunk
    target = len(system)
    for c, chunk in enumerate(chunks):
        if c == 0:  # after S where it was computed: a full prefill's KV
            start = len(ids)
            ids += chunk
            positions += range(target, target + len(chunk))
            rows += [list(range(start + j + 1)) for j in range(len(chunk))]
        else:
            # The chunk as cached: a copy of S (+ P) right before it, its tokens after that.
            copy = len(ids)
            ids += list(system) + list(primer) + chunk
            positions += list(range(target - s, target)) + list(range(target, target + len(chunk)))
            rows += [list(range(copy, copy + j + 1)) for j in range(s + len(chunk))]
            hidden.update(range(copy, copy + s + len(chunk)))
            old = copy + s
            start = len(ids)
            ids += chunk
            positions += range(target, target + len(chunk))
            for j in range(len(chunk)):
                if j < recomputed:  # everything before it, as the prompt lies
                    rows.append(seen + list(range(start, start + j + 1)))
                else:  # its cached KV: the copy of S, the cached tokens before it, itself
                    rows.append(list(range(copy, old + j)) + [start + j])
                    stale.add(start + j)
        seen = seen + list(range(start, start + len(chunk)))
        target += len(chunk)
    start = len(ids)
    ids += question
    positions += range(target, target + len(question))
    rows += [seen + list(range(start, start + j + 1)) for j in range(len(question))]
    visible = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    for t, cols in enumerate(rows):
        visible[t, cols] = True
    flags = [torch.zeros(len(ids), dtype=torch.bool) for _ in range(2)]
    flags[0][sorted(hidden)] = True
    if stale:
        flags[1][sorted(stale)] = True
    return ids, positions, visible, flags[0], flags[1], start


@torch.inference_mode()
def check_damped(llm, hf, prompt: RAGPrompt, out, recomputed: int) -> None:
    """`out` (greedy, logprobs) teacher-forced against the one pass with its damping."""
    system, chunks, question = prompt.system, prompt.chunks, prompt.question
    assert out.prompt_token_ids == system + [t for c in chunks for t in c] + question
    teacher_forced(hf, out, *reference_layout(system, chunks, question, recomputed),
                   prompt.recompute_damping)
    assert out.metrics.num_recomputed_tokens == sum(min(recomputed, len(c)) for c in chunks[1:])


def teacher_forced(hf, out, ids, positions, visible, hidden, stale, q0, damping) -> None:
    """`out`'s greedy tokens and logprobs against one pass over `ids` and its answer (the
    tokens after `ids` see what the question sees), `damping` subtracted from the logits of
    the `stale` columns in the rows from `q0` on."""
    got = out.outputs[0]
    fed = got.token_ids[:-1]
    positions, visible = extend_layout(positions, visible, len(fed), hidden)
    masks = attention_masks(hf.config, positions, visible)
    if damping:
        stale = torch.cat([stale, torch.zeros(len(fed), dtype=torch.bool)])
        offsets = torch.zeros(visible.shape)
        offsets[q0:, stale] = -damping
        masks = ({k: m + offsets for k, m in masks.items()} if isinstance(masks, dict)
                 else masks + offsets)
    logits = hf(input_ids=torch.tensor([ids + fed]), attention_mask=masks,
                position_ids=torch.tensor([positions])).logits[0, len(ids) - 1:]
    logp = logits.float().log_softmax(-1)
    assert logp.argmax(-1).tolist() == got.token_ids
    for step, top in enumerate(got.logprobs):
        for tid, lp in top.items():
            assert abs(lp.logprob - logp[step, tid].item()) < TOL, (step, tid, lp.logprob)


def prompts():
    S = random_prompt(9, seed=1)
    A, B, C = (random_prompt(n, seed=40 + n) for n in (14, 21, 8))
    return S, A, B, C, random_prompt(6, seed=2)


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_damping_matches_the_one_pass_reference(family, checkpoint, hf_model):
    """Cold, warm and reordered; then two warm prompts with different dampings and
    recomputed tokens in one batch (their decode rows padded together)."""
    path = checkpoint(family)
    hf = hf_model(path)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    S, A, B, C, Q = prompts()
    for prompt in (damped(S, [A, B, C], Q, 4, 1.5), damped(S, [C, A, B], Q, 4, 1.5)):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        llm.check_integrity()
        check_damped(llm, hf, prompt, out, 4)
    pair = [damped(S, [B, C, A], Q, 2, 0.7), damped(S, [A, C], Q[:4], 6, 3.0)]
    for prompt, out in zip(pair, llm.generate(pair, GREEDY, use_tqdm=False), strict=True):
        check_damped(llm, hf, prompt, out, prompt.recompute_sink_tokens)
    llm.check_integrity()


def test_damping_without_recomputed_tokens_and_with_a_probe(checkpoint, hf_model):
    """`query` at r = 0 recomputes nothing (probe skipped) and damps every later chunk token;
    at r = 1 nothing is stale, so damping changes nothing: the full prefill; a probed
    `query` at r = 0.3 runs too (its tokens are not reference-checked: the probe picks them)."""
    path = checkpoint("llama")
    hf = hf_model(path)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    S, A, B, C, Q = prompts()
    prompt = damped(S, [A, B, C], Q, 0, 2.0, method="query", ratio=0.0)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    check_damped(llm, hf, prompt, out, 0)
    prompt = damped(S, [B, A, C], Q, 0, 2.0, method="query", ratio=1.0)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    check_damped(llm, hf, prompt, out, max(len(A), len(C)))
    probed = damped(S, [C, B, A], Q, 0, 2.0, method="query", ratio=0.3)
    plain = damped(S, [C, B, A], Q, 0, 0.0, method="query", ratio=0.3)
    first, second = llm.generate([probed, plain], GREEDY, use_tqdm=False)
    assert first.metrics.num_recomputed_tokens == second.metrics.num_recomputed_tokens > 0
    llm.check_integrity()


def test_engine_setting_profile_key_and_bad_values(checkpoint):
    """The engine's `recompute_damping` serves prompts that give none; 0 equals no damping
    at all; bad values are clear errors that lose nothing."""
    path = checkpoint("llama")
    S, A, B, C, Q = prompts()
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = {}
    for d in (None, 0.0, 2.0):
        llm = make_llm(path, position_strategy="sequential", recompute="sink",
                       recompute_ratio=0.5, recompute_sink_tokens=3, recompute_damping=d)
        prompt = RAGPrompt(S, [A, B, C], Q)
        outs[d] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs
        assert llm.engine.recompute_settings()["recompute_damping"] == (d or 0.0)
        for bad in (-1.0, "1", 21.0, True):
            with pytest.raises(ValueError, match="recompute_damping"):
                llm.generate([RAGPrompt(S, [A, B], Q, recompute_damping=bad)], params,
                             use_tqdm=False)
        llm.check_integrity()
    assert outs[None] == outs[0.0] and outs[0.0] != outs[2.0]
    with pytest.raises(ValueError, match="recompute_damping"):
        make_llm(path, recompute_damping=-0.5)


def test_stale_ranges():
    layout = PromptLayout.build(3, [4, 5, 2], "sequential", "isolated")  # chunks 3-7, 7-12, 12-14
    spec = RecomputeSpec("sink", 0.5, 2, (), damping=1.0)
    assert spec.stale(layout, (7, 8, 12, 13)) == ((9, 12),)
    assert spec.stale(layout, ()) == ((7, 14),)
    assert spec.stale(layout, (9, 13)) == ((7, 9), (10, 13))
    assert RecomputeSpec("sink", 0.5, 2, ()).stale(layout, ()) == ()
