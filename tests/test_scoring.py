"""Teacher-forced scoring (`Engine.add_request(..., score_tokens=m)`, used by `ragkv eval`): the
log-probabilities after each of the last m prompt tokens equal the one-pass reference's, for
plain and RAG prompts, cold and warm, with chunked prefill splitting the scored tokens, and with
a prefix cache that already holds the scored tokens (they must be computed, not read)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from reference import causal_layout, rag_layout

from ragkv import LLM, RAGPrompt, SamplingParams

TOL = 1e-4


@torch.inference_mode()
def reference_rows(hf, ids: list[int], positions: list[int], visible: torch.Tensor,
                   m: int) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask.masked_fill_(~visible, float("-inf"))
    logits = hf(input_ids=torch.tensor([ids]), attention_mask=mask[None, None],
                position_ids=torch.tensor([positions])).logits[0, -m:]
    return logits.float().log_softmax(-1)


def score(llm: LLM, prompt, m: int, max_tokens: int = 1):
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True), score_tokens=m)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    llm.check_integrity()
    return result


@pytest.fixture(scope="module")
def setup(checkpoint, hf_model):
    path = checkpoint("llama")
    # A small token budget splits the question over several steps.
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16,
              position_strategy="shared")
    return llm, hf_model(path)


def test_plain_prompt_scores_match_reference(setup):
    llm, hf = setup
    ids = random_prompt(40, seed=1)
    positions, visible = causal_layout(len(ids))
    want = reference_rows(hf, ids, positions, visible, 9)
    for _ in range(2):  # the second run finds the whole prompt in the prefix cache
        out = score(llm, {"prompt_token_ids": ids}, 9, max_tokens=3)
        assert out.score_logprobs.shape == want.shape
        assert (out.score_logprobs - want).abs().max() < TOL
        assert out.outputs[0].token_ids[0] == int(want[-1].argmax())


def test_rag_prompt_scores_match_reference_cold_and_warm(setup):
    llm, hf = setup
    system, question = random_prompt(7, seed=2), random_prompt(20, seed=3)
    chunks = [random_prompt(n, seed=10 + n) for n in (11, 23, 5)]
    for order in ([0, 1, 2], [2, 0, 1]):
        prompt = RAGPrompt(system=system, chunks=[chunks[i] for i in order], question=question)
        ids = system + [t for i in order for t in chunks[i]] + question
        positions, visible = rag_layout(len(system), [len(chunks[i]) for i in order],
                                        len(question))
        want = reference_rows(hf, ids, positions, visible, 20)
        out = score(llm, prompt, 20)
        assert (out.score_logprobs - want).abs().max() < TOL


def test_score_tokens_are_validated(setup):
    llm, _ = setup
    prompt = RAGPrompt(system=[11, 12], chunks=[[13, 14, 15]], question=[16, 17])
    for bad in (3, -1, True, 1.5):
        with pytest.raises(ValueError, match="score_tokens"):
            llm.engine.add_request(prompt, score_tokens=bad)
    assert not llm.engine.has_unfinished_requests()
    llm.check_integrity()


def test_prompt_logprobs_match_reference(setup):
    """SamplingParams.prompt_logprobs (vLLM's): each prompt token's log-probability given the
    tokens before it, its rank, and the k most likely there, against HF; the first token
    (and in a RAG prompt every token up to the question's first) has none; cold, from the
    prefix cache, chunked over steps; max_tokens=0 scores the prompt and generates nothing."""
    llm, hf = setup
    ids = random_prompt(30, seed=4)
    positions, visible = causal_layout(len(ids))
    want = reference_rows(hf, ids, positions, visible, len(ids))  # row j: token j + 1
    for max_tokens in (2, 0, 0):  # the last run finds the prompt in the prefix cache
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=3)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        llm.check_integrity()
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for j in range(1, len(ids)):
            row = want[j - 1]
            actual = got[j][ids[j]]
            assert abs(actual.logprob - float(row[ids[j]])) < TOL
            assert actual.rank == int((row > row[ids[j]]).sum()) + 1
            top = row.topk(3)
            for r, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                            strict=True)):
                assert got[j][t].rank == r + 1 and abs(got[j][t].logprob - lp) < TOL
            assert set(got[j]) == set(top.indices.tolist()) | {ids[j]}
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.outputs[0].finish_reason == "length"
    system, question = random_prompt(5, seed=5), random_prompt(9, seed=6)
    chunks = [random_prompt(12, seed=7), random_prompt(8, seed=8)]
    prompt = RAGPrompt(system=system, chunks=chunks, question=question)
    flat = system + chunks[0] + chunks[1] + question
    positions, visible = rag_layout(len(system), [12, 8], len(question))
    want = reference_rows(hf, flat, positions, visible, len(question))
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    first = len(flat) - len(question) + 1
    assert all(e is None for e in out.prompt_logprobs[:first])
    for j in range(first, len(flat)):
        assert set(out.prompt_logprobs[j]) == {flat[j]}  # k = 0: the actual token alone
        assert abs(out.prompt_logprobs[j][flat[j]].logprob
                   - float(want[j - first][flat[j]])) < TOL
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("x", SamplingParams(prompt_logprobs=10_000), use_tqdm=False)
    llm.check_integrity()


def test_prompt_logprobs_with_several_samples(setup):
    """n samples of one prompt: its prompt logprobs once, the same as with one sample."""
    llm, _ = setup
    ids = random_prompt(12, seed=9)
    one = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    many = llm.generate({"prompt_token_ids": ids},
                        SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1,
                                       prompt_logprobs=1), use_tqdm=False)[0]
    llm.check_integrity()
    assert len(many.outputs) == 3 and len(many.prompt_logprobs) == len(ids)
    for a, b in zip(one.prompt_logprobs[1:], many.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < TOL for t in a)
