"""The chunk primer (`chunk_primer`): with sequential positions and isolated chunks, every
chunk after the first has its KV computed after S and the primer P, and nothing after the
chunks reads P.

Exact against HF transformers in float32 (greedy tokens identical, log-probabilities within
1e-4): the one-pass reference gives each later chunk a hidden copy of S, P and its own tokens
as cached, placed so that the chunk's copy sits where the chunk lies (its keys turned there);
recomputed tokens see everything before them; damping lowers the stale tokens' logits in the
question's and generated tokens' rows. Cold, warm, reordered and batched, with a first chunk
shorter than P (keys turned backwards), P computed in its own step under a small token
budget, on two ranks, and `check_integrity()` after each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import MAIN_FAMILIES, random_prompt
from reference import layout_reference
from test_damping import prompts, reference_layout, teacher_forced
from test_rag import GREEDY, make_llm

from ragkv.inputs.layout import PromptLayout
from ragkv.inputs.primer import DEFAULT_CHUNK_PRIMER, primer_tokens
from ragkv.inputs.prompt import RAGPrompt

PRIMER = "a short primer about rivers"


def primed(system, chunks, question, sinks: int = 0, damping: float = 0.0,
           **options) -> RAGPrompt:
    if sinks:
        options.update(recompute="sink", recompute_ratio=1.0, recompute_sink_tokens=sinks,
                       recompute_damping=damping)
    return RAGPrompt(system, chunks, question, position_strategy="sequential",
                     chunk_attention="isolated", **options)


@torch.inference_mode()
def check(hf, prompt: RAGPrompt, out, primer: list[int] | None) -> None:
    """`out` (greedy, logprobs) teacher-forced against its one pass: primed (`primer`) with
    the prompt's sink recompute and damping, or the plain sequential layout (None)."""
    system, chunks, question = prompt.system, prompt.chunks, prompt.question
    assert out.prompt_token_ids == system + [t for c in chunks for t in c] + question
    if primer is None or not prompt.recompute_sink_tokens:
        # Without recompute, the general layout reference (its copies of S + P) must agree.
        ids, positions, visible, hidden = layout_reference(system, chunks, question,
                                                           "sequential", "isolated",
                                                           primer or ())
        layout = (ids, positions, visible, hidden, None, len(ids))
    else:
        layout = reference_layout(system, chunks, question, prompt.recompute_sink_tokens,
                                  primer)
    teacher_forced(hf, out, *layout, prompt.recompute_damping)


def primer_of(llm) -> list[int]:
    return list(llm.engine.inputs.primer)


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_primed_chunks_match_the_one_pass_reference(family, checkpoint, hf_model):
    """Cold, warm (every chunk and P from the cache), reordered (a chunk first that was
    computed primed, a primed one that was first), then a batch of two prompts, one with sink
    recompute and damping; P is computed once."""
    path = checkpoint(family)
    hf = hf_model(path)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, chunk_primer=PRIMER)
    P = primer_of(llm)
    assert 0 < len(P) < 14
    S, A, B, C, Q = prompts()
    for prompt in (primed(S, [A, B, C], Q), primed(S, [A, B, C], Q), primed(S, [C, A, B], Q)):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        llm.check_integrity()
        check(hf, prompt, out, P)
    pair = [primed(S, [B, C, A], Q, sinks=3, damping=1.5), primed(S, [A, C], Q[:4])]
    for prompt, out in zip(pair, llm.generate(pair, GREEDY, use_tqdm=False), strict=True):
        check(hf, prompt, out, P)
    llm.check_integrity()
    cache = llm.engine.chunk_cache
    primer_key = llm.engine.inputs.process(pair[0]).primer_key
    assert cache.find(primer_key) is not None and len(primer_key.tokens) == len(P)


def test_first_chunk_shorter_than_the_primer_and_a_small_budget(checkpoint, hf_model):
    """The default passage (longer than the first chunk: later chunks' keys turn backwards)
    with two cold prompts that both need P (one computes it, the other reads it in the same
    step or after it) under a budget of 320 tokens, then a short P and the chunks computed
    over several steps of 32 tokens."""
    path = checkpoint("llama")
    hf = hf_model(path)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=1024, chunk_primer="default",
                   max_num_batched_tokens=320, max_num_seqs=4)
    P = primer_of(llm)
    assert list(primer_tokens(llm.engine.tokenizer, DEFAULT_CHUNK_PRIMER)) == P
    S, A, B, C, Q = prompts()
    assert len(P) > len(A)
    D, E = random_prompt(12, seed=77), random_prompt(30, seed=78)
    pair = [primed(S, [A, D, E], Q), primed(S[:5], [C, B], Q)]
    for prompt, out in zip(pair, llm.generate(pair, GREEDY, use_tqdm=False), strict=True):
        check(hf, prompt, out, P)
    llm.check_integrity()
    small = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=1024,
                     chunk_primer=PRIMER, max_num_batched_tokens=32)
    prompt = primed(S, [A, E, D], Q)
    out = small.generate([prompt], GREEDY, use_tqdm=False)[0]
    check(hf, prompt, out, primer_of(small))
    small.check_integrity()


def test_per_request_switch_other_layouts_and_bad_values(checkpoint, hf_model):
    """`chunk_primer=False` is the plain sequential layout; shared positions and standalone
    chunks ignore the primer; the first chunk's cache entry is shared with unprimed prompts,
    a later one's is not; bad settings are clear errors that lose nothing."""
    path = checkpoint("llama")
    hf = hf_model(path)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, chunk_primer=PRIMER)
    S, A, B, C, Q = prompts()
    off = primed(S, [A, B], Q, chunk_primer=False)
    check(hf, off, llm.generate([off], GREEDY, use_tqdm=False)[0], None)
    assert llm.engine.recompute_settings()["chunk_primer"] == PRIMER
    assert "chunk primer" in make_llm(path, position_strategy="sequential", recompute="none",
                                      chunk_primer=PRIMER).engine.describe_rag_default()
    inputs = llm.engine.inputs
    on, plain = inputs.process(primed(S, [A, B], Q)), inputs.process(off)
    assert on.chunk_keys[0] == plain.chunk_keys[0] and on.chunk_keys[1] != plain.chunk_keys[1]
    assert on.chunk_keys[1].system == tuple(S) + tuple(primer_of(llm))
    assert on.layout.primer_len and not plain.layout.primer_len and plain.primer_key is None
    for strategy, attention in (("shared", "isolated"), ("sequential", "standalone")):
        done = inputs.process(RAGPrompt(S, [A, B], Q, position_strategy=strategy,
                                        chunk_attention=attention))
        assert done.layout.primer_len == 0 and done.primer_key is None
    for bad in (1, "yes", 0.5):
        with pytest.raises(ValueError, match="chunk_primer"):
            llm.generate([primed(S, [A, B], Q, chunk_primer=bad)], GREEDY, use_tqdm=False)
    llm.check_integrity()
    plain_llm = make_llm(path, kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="chunk_primer=true needs"):
        plain_llm.generate([primed(S, [A, B], Q, chunk_primer=True)], GREEDY, use_tqdm=False)
    plain_llm.check_integrity()
    for kwargs in ({"chunk_primer": "  "}, {"chunk_primer": 3}):
        with pytest.raises(ValueError, match="chunk_primer"):
            make_llm(path, **kwargs)
    with pytest.raises(ValueError, match=r"chunk_primer has \d+ tokens, more than "
                       r"max_num_batched_tokens=64 .*chunk_primer='none'"):
        make_llm(path, chunk_primer="default", max_num_batched_tokens=64)
    # The quality mode's own primer (here the model-agnostic default's) is left out instead.
    small = make_llm(path, position_strategy=None, max_num_batched_tokens=64)
    assert small.engine.config.chunk_primer == "none" and not small.engine.inputs.primer
    assert "chunk primer" not in small.engine.describe_rag_default()
    assert make_llm(path, position_strategy=None).engine.config.chunk_primer == "default"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_without_a_chunk_cache_each_request_computes_its_own_primer(family, checkpoint,
                                                                    hf_model):
    """With the chunk cache off (or its region too small for P) P's KV goes to the request's
    own slots: the same one-pass reference, alone and batched, slots all back after."""
    path = checkpoint(family)
    hf = hf_model(path)
    S, A, B, C, Q = prompts()
    for kwargs in ({"enable_chunk_cache": False}, {"chunk_cache_tokens": 3}):
        llm = make_llm(path, kv_cache_tokens=1024, chunk_primer=PRIMER, **kwargs)
        batch = [primed(S, [A, B, C], Q), primed(S, [C, A], Q, sinks=2, damping=0.5)]
        for prompt, out in zip(batch, llm.generate(batch, GREEDY, use_tqdm=False),
                               strict=True):
            check(hf, prompt, out, primer_of(llm))
        llm.check_integrity()


def test_layout_of_a_primed_prompt():
    layout = PromptLayout.build(3, [4, 5, 2], "sequential", "isolated", primer_len=6)
    assert layout.primer_len == 6 and [layout.chunk_base(i) for i in range(3)] == [3, 9, 9]
    assert layout.chunk_deltas == (0, 7 - 9, 12 - 9) and layout.exact_end == 7
    assert layout.positions(7, 12) == [9, 10, 11, 12, 13]
    assert layout.chunk_positions([4, 8, 13]) == ([4, 10, 10], [4, 8, 13])
    assert layout.chunk_kv_spans(1, 9) == ((0, 3), (7, 9))
    assert PromptLayout.build(0, [4, 5], "sequential", "isolated", 6).chunk_kv_spans(1, 6) == (
        (0, 0), (4, 6))
    assert PromptLayout.build(3, [4], "sequential", "isolated", 6).primer_len == 0
    assert PromptLayout.build(3, [4, 5], "shared", "isolated", 6).primer_len == 0


def test_primed_chunks_on_two_ranks(checkpoint, hf_model):
    """P's slots travel with the works to the worker rank: cold, warm and reordered primed
    prompts on two ranks match the reference."""
    from test_tensor_parallel import tp_llm

    path = checkpoint("llama_gqa3")
    hf = hf_model(path)
    S, A, B, C, Q = prompts()
    with tp_llm(path, chunk_cache_tokens=512, chunk_primer=PRIMER) as llm:
        for prompt in (primed(S, [A, B, C], Q), primed(S, [C, B], Q),
                       primed(S, [B, A], Q, sinks=2, damping=1.0)):
            check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0],
                  primer_of(llm))
        llm.check_integrity()


def test_warm_prompts_leave_the_primer_alone_and_a_failed_step_fails_its_readers(checkpoint):
    """A prompt whose later chunks are all cached (or being computed) never pins or computes
    P; a request bound to reuse chunks a failing step was computing is failed with it, never
    left reading KV that was not written; prompts the primer cannot serve are clear errors
    where they ask for it, and served unprimed where it is the engine's default."""
    path = checkpoint("llama")
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, chunk_primer=PRIMER,
                   max_model_len=64)
    S, A, B, C, Q = prompts()
    engine = llm.engine
    llm.generate([primed(S, [A, B], Q)], GREEDY, use_tqdm=False)
    key = engine.inputs.process(primed(S, [A, B], Q)).primer_key
    entry = engine.chunk_cache.find(key)
    engine.add_request(primed(S, [C, B], Q), GREEDY, request_id="warm")
    engine.step()
    assert entry.ref_count == 0 and engine.chunk_cache.find(key) is entry
    while engine.has_unfinished_requests():
        engine.step()
    llm.check_integrity()
    # A cold prompt with a new S computes its P; a second one in the same step reuses the
    # chunks the first computes, so it needs no P.
    sched = engine.scheduler
    S2 = random_prompt(7, seed=5)
    for rid in ("a", "b"):
        engine.add_request(primed(S2, [A, C], Q), GREEDY, request_id=rid)
    out = sched.schedule()
    assert [w.request.request_id for w in out.works if w.computes_primer] == ["a"]
    b = sched.running[1]
    assert b.bindings[-1] is None and all(x.entry in out.completing for x in b.bindings[:2])
    out.discard(b)  # as if "b" had stopped, bound, before any work of its own
    assert sorted(r.request_id for r in sched.fail_step(out, "boom")) == ["a", "b"]
    llm.check_integrity()
    assert engine.chunk_cache.find(engine.inputs.process(primed(S2, [A, C], Q)).primer_key
                                   ) is None
    with pytest.raises(ValueError, match="chunk_primer=true applies to sequential"):
        llm.generate([RAGPrompt(S, [A, B], Q, chunk_primer=True, position_strategy="shared")],
                     GREEDY, use_tqdm=False)
    # Primed positions past max_model_len: an error where the request asked for the primer,
    # else (the engine's default) the prompt is served unprimed, the plain sequential layout.
    long = primed(S, [random_prompt(2, seed=9), random_prompt(46, seed=8)], Q[:2])
    with pytest.raises(ValueError, match="past max_model_len=64"):
        llm.generate([replace(long, chunk_primer=True)], GREEDY, use_tqdm=False)
    done = engine.inputs.process(long)
    assert done.layout.primer_len == 0 and done.primer_key is None
    assert done.chunk_keys[1] == engine.inputs.process(
        replace(long, chunk_primer=False)).chunk_keys[1]
    assert len(llm.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0
    llm.check_integrity()
