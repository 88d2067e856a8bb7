"""Presence, frequency and repetition penalties and logit_bias: the formulas on hand-made
logits against a plain reference, greedy decoding against HF transformers (its own
`repetition_penalty`, and a reference loop over its logits for the others, RAG prompts
included), and bad values as clear errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import random_prompt
from reference import extend_layout, layout_reference, reference_logits

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.sampling.penalties import TokenHistory, apply_penalties
from ragkv.sampling.sampler import sample

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def penalized(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    """One row by the definitions, token by token (vLLM's order: bias, then repetition,
    frequency and presence)."""
    row = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            value = row[token]
            row[token] = (value / params.repetition_penalty if value > 0
                          else value * params.repetition_penalty)
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def test_penalties_on_hand_made_logits_equal_the_definitions():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [SamplingParams(repetition_penalty=1.7),
              SamplingParams(),  # no penalty: the row is untouched
              SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.5,
                             presence_penalty=2.0, logit_bias={3: 7.5, 39: -100.0}),
              SamplingParams(logit_bias={0: 1.25})]
    prompts = [[1, 2, 2, 5], [1], [7, 8], [3, 4, 4, 9, 30], [6]]
    outputs = [[5, 6, 6], [2, 2], [8, 8, 8, 11], [4, 12, 12, 39], []]
    history = [TokenHistory(Counter(o), torch.tensor(p))
               for p, o in zip(prompts, outputs, strict=True)]
    history[1] = None  # rows without penalties need none
    got = apply_penalties(logits, params, history)
    for i, p in enumerate(params):
        want = penalized(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])
    # Nothing to do: the same tensor back.
    assert apply_penalties(logits, [SamplingParams()] * 5, [None] * 5) is logits
    # bf16 and non-contiguous logits give the float32 result of the same values.
    half = logits.bfloat16()
    torch.testing.assert_close(apply_penalties(half, params, history),
                               apply_penalties(half.float(), params, history))
    wide = logits.t().contiguous().t()
    assert not wide.is_contiguous()
    torch.testing.assert_close(apply_penalties(wide, params, history), got)
    # A row without a history has generated nothing: a bias alone needs none, a repetition
    # penalty needs the prompt.
    only_bias = apply_penalties(logits, [SamplingParams(logit_bias={2: 5.0})] * 5, None)
    torch.testing.assert_close(only_bias[:, 2], logits[:, 2] + 5.0)
    with pytest.raises(ValueError, match="needs its prompt"):
        apply_penalties(logits, params, None)


def test_greedy_follows_the_penalized_logits_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 4.0, 3.0, -1.0], [0.0, 4.0, 3.0, -1.0]])
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.5)]
    history = [None, TokenHistory({1: 1})]
    out = sample(logits, params, [0, 0], [1, 1], history)
    assert out.token_ids == [1, 2]  # token 1 already generated: 4 - 1.5 < 3
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_logprobs[1] == pytest.approx(float(raw[2]))
    assert out.top_logprobs[1][0] == out.top_logprobs[0][0] == [1, 2]
    assert out.top_logprobs[1][2] == 2  # the sampled token's rank in the raw distribution


def test_seeded_sampling_with_penalties_is_the_same_alone_and_batched():
    llm = LLM("builtin:tiny")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True,
                            frequency_penalty=1.0, repetition_penalty=1.2)
    alone = llm.generate("The garden is green and", params, use_tqdm=False)[0]
    batch = llm.generate(["Once upon a time", "The garden is green and"],
                         [SamplingParams(temperature=0.7, max_tokens=9), params],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    llm.check_integrity()


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


def test_repetition_penalty_equals_hf_generate(llama):
    path, hf = llama
    llm = LLM(path, kv_cache_tokens=1024)
    prompt = random_prompt(6, seed=5) * 3  # repeated tokens for the penalty to act on
    plain = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    for penalty in (1.8, 0.5):
        params = GREEDY.clone(repetition_penalty=penalty)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                           do_sample=False, max_new_tokens=GREEDY.max_tokens,
                           repetition_penalty=penalty, pad_token_id=0)[0, len(prompt):]
        assert out.outputs[0].token_ids == want.tolist()
        assert out.outputs[0].token_ids != plain.outputs[0].token_ids  # the penalty acted
    llm.check_integrity()


@pytest.mark.parametrize("penalties", [
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=2.0, presence_penalty=-0.5, logit_bias={40: 3.0}),
])
def test_penalties_on_a_rag_prompt_equal_a_reference_loop(llama, penalties):
    """Cold and warm: the penalties read the whole prompt (S, every chunk, Q)."""
    path, hf = llama
    llm = LLM(path, kv_cache_tokens=2048, chunk_cache_tokens=512, position_strategy="shared")
    S, C = random_prompt(5, seed=11), [random_prompt(7, seed=12), random_prompt(4, seed=13)]
    Q = random_prompt(3, seed=14)
    params = GREEDY.clone(**penalties)
    ids, positions, visible, hidden = layout_reference(S, C, Q)
    want: list[int] = []
    for _ in range(params.max_tokens):
        logits = reference_logits(hf, ids + want, positions, visible)
        token = int(penalized(logits, params, ids, want).argmax())
        want.append(token)
        positions, visible = extend_layout(positions, visible, 1, hidden)
        hidden = torch.cat([hidden, torch.zeros(1, dtype=torch.bool)])
    cold = llm.generate(RAGPrompt(S, C, Q), params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == want
    warm = llm.generate(RAGPrompt(S, C, Q), params, use_tqdm=False)[0]
    assert warm.metrics.num_chunk_hits == 2 and warm.outputs[0].token_ids == want
    plain = llm.generate(RAGPrompt(S, C, Q), GREEDY, use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != want  # the penalties acted
    llm.check_integrity()


def test_logit_bias_forces_and_bans_tokens():
    llm = LLM("builtin:tiny")
    prompt = "The garden is green and"
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(prompt, GREEDY.clone(logit_bias={77: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [77] * GREEDY.max_tokens
    banned = llm.generate(prompt, GREEDY.clone(logit_bias={plain[0]: -100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != plain[0]
    llm.check_integrity()


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number in [0.001, 1000]"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias has 301 entries; at most 300"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token id"),
    (dict(logit_bias={5: 101.0}), "[-100, 100]"),
])
def test_bad_values_are_clear_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused_and_loses_nothing():
    llm = LLM("builtin:tiny")
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias names token {vocab}, outside"):
        llm.generate(["a", "b"], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    llm.check_integrity()
    assert llm.generate("a", SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0}),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_min_tokens_holds_back_stop_tokens_and_strings():
    llm = LLM("builtin:tiny")
    eos = llm.engine.tokenizer.eos_token_id
    prompt = "The garden is green and"
    # EOS pushed to the top: it ends the sample at once, unless min_tokens bans it.
    eager = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    out = llm.generate(prompt, eager, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate(prompt, eager.clone(min_tokens=5, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids[:5]
    assert out.token_ids[5] == eos and out.finish_reason == "stop"
    # A stop string counts only in text after the first min_tokens tokens (vLLM's rule): one
    # completed by token k ends the sample at k with min_tokens < k, not with min_tokens >= k.
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    decode = llm.engine.tokenizer.decode
    first, second = decode(plain.token_ids[:1]), decode(plain.token_ids[1:2])
    stop = GREEDY.clone(stop=[first])
    assert llm.generate(prompt, stop, use_tqdm=False)[0].outputs[0].token_ids == plain.token_ids[:1]
    for min_tokens in (1, 4):
        late = llm.generate(prompt, stop.clone(min_tokens=min_tokens),
                            use_tqdm=False)[0].outputs[0]
        assert len(late.token_ids) > 1 and late.token_ids[:4] == plain.token_ids[:4]
    if first not in second:  # the second token's text ends a sample only past min_tokens=1
        at_two = llm.generate(prompt, GREEDY.clone(stop=[second], min_tokens=1),
                              use_tqdm=False)[0].outputs[0]
        assert at_two.token_ids == plain.token_ids[:2] and at_two.finish_reason == "stop"
    with pytest.raises(ValueError, match="min_tokens=5 exceeds max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    # Checked again against what max_model_len leaves after the prompt.
    short = LLM("builtin:tiny", max_model_len=32)
    with pytest.raises(ValueError, match="min_tokens=40 exceeds the"):
        short.generate(prompt, SamplingParams(max_tokens=None, min_tokens=40), use_tqdm=False)
    short.check_integrity()
    llm.check_integrity()


def test_logprobs_stay_raw_under_a_bias():
    llm = LLM("builtin:tiny")
    prompt = "The garden is green and"
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    top = list(plain.logprobs[0])
    lifted = top[-1]  # the fifth most likely, pushed to the top by the bias
    out = llm.generate(prompt, params.clone(logit_bias={lifted: 50.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [lifted]
    assert out.logprobs[0][lifted].logprob == pytest.approx(plain.logprobs[0][lifted].logprob)
    assert out.logprobs[0][lifted].rank == 5
    llm.check_integrity()


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    """Before the check, one such id with min_tokens banned a token of the next row."""
    llm = LLM("builtin:tiny")
    vocab = llm.engine.model_config.vocab_size
    for bad in (vocab, vocab + 5, 10**12):
        with pytest.raises(ValueError, match=f"stop_token_ids names token {bad}, outside"):
            llm.generate("a", SamplingParams(stop_token_ids=[bad], min_tokens=2),
                         use_tqdm=False)
    llm.check_integrity()


def test_min_tokens_and_logit_bias_equal_hf_generate(llama):
    """HF's min_new_tokens and sequence_bias on the same forced end-of-sequence token."""
    path, hf = llama
    llm = LLM(path, kv_cache_tokens=1024)
    eos = llm.engine.tokenizer.eos_token_id
    prompt = random_prompt(9, seed=21)
    for min_tokens in (0, 3):
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=min_tokens,
                                logit_bias={eos: 100.0})
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                           do_sample=False, max_new_tokens=8, min_new_tokens=min_tokens,
                           sequence_bias={(eos,): 100.0}, eos_token_id=eos,
                           pad_token_id=eos)[0, len(prompt):]
        assert out.token_ids == want.tolist() and len(out.token_ids) == min_tokens + 1
    llm.check_integrity()
