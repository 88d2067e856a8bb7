"""The sampler: seeded sampling reproducible whatever the batch and the instance, the
truncations (top-k, top-p, min-p, temperature) on hand-made logits, and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import random_prompt
from reference import causal_layout, reference_greedy

from ragkv import LLM, SamplingParams
from ragkv.sampling.noise import noise_keys, to_uniform_, uniform_noise
from ragkv.sampling.sampler import sample

PROMPT = "The garden is green and"
SEEDED = SamplingParams(temperature=1.0, seed=123, max_tokens=10)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny")


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# --------------------------------------------------------------------------- through the engine


def test_seeded_sampling_reproducible_alone_batched_and_fresh(llm):
    alone = tokens(llm, PROMPT, SEEDED)[0]
    assert len(alone) >= 1
    assert tokens(llm, PROMPT, SEEDED)[0] == alone
    others = ["Once upon a time", "some text", {"prompt_token_ids": [1, 300, 301, 302, 303]}]
    prompts = [others[0], others[1], PROMPT, others[2]]
    # The batch mixes unseeded, greedy and differently seeded rows with the seeded one.
    params = [SamplingParams(temperature=0.7, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=5),
              SEEDED,
              SamplingParams(temperature=1.3, top_k=50, seed=5, max_tokens=10)]
    assert tokens(llm, prompts, params)[2] == alone
    assert tokens(llm, prompts[::-1], params[::-1])[1] == alone
    fresh = LLM("builtin:tiny", seed=99)
    assert tokens(fresh, PROMPT, SEEDED)[0] == alone
    llm.check_integrity()
    fresh.check_integrity()


def test_different_seeds_give_different_sequences(llm):
    seeds = [123, 124, 1, 2]
    params = [SEEDED.clone(seed=s, ignore_eos=True) for s in seeds]
    outs = tokens(llm, [PROMPT] * len(seeds), params)
    assert len({tuple(t) for t in outs}) == len(seeds)
    llm.check_integrity()


def test_unseeded_requests_differ_from_each_other(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = tokens(llm, [PROMPT] * 3, params)
    assert len({tuple(t) for t in outs}) == 3
    llm.check_integrity()


def test_greedy_ignores_seed_and_matches_argmax_chain(checkpoint, hf_model):
    """Greedy decoding (temperature 0 with any seed, or top_k=1 at any temperature) is the
    argmax chain of logits computed independently: HF transformers re-running the whole
    sequence at each step, float32."""
    path = checkpoint("llama")
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    prompt = {"prompt_token_ids": random_prompt(12, seed=5)}
    want, _ = reference_greedy(hf_model(path), prompt["prompt_token_ids"],
                               *causal_layout(12), max_tokens=8)
    for params in (SamplingParams(temperature=0, seed=1),
                   SamplingParams(temperature=0, seed=2),
                   SamplingParams(temperature=1.5, top_k=1, seed=3)):
        params = params.clone(max_tokens=8, ignore_eos=True)
        assert tokens(llm, prompt, params)[0] == want
    llm.check_integrity()


# --------------------------------------------------------------------------- sample() directly


def seeds(n: int, base: int = 0) -> tuple[list[int], list[int]]:
    """Seeds base .. base + n - 1, each at step 0."""
    return list(range(base, base + n)), [0] * n


def random_logits(rows: int = 8, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=3.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=2.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=0.5, min_p=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1e-6),
    SamplingParams(temperature=0.0, top_k=5, top_p=0.5),
], ids=["top_k1", "top_k1_hot", "top_p_tiny", "top_p_tiny_hot", "min_p1", "min_p1_cold",
        "temp0", "temp_below_eps", "temp0_with_filters"])
def test_degenerate_settings_equal_argmax(params):
    logits = random_logits()
    result = sample(logits, [params] * 8, *seeds(8))
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.token_logprobs == [None] * 8


def test_rows_are_independent_of_the_batch():
    logits = random_logits(rows=6, vocab=200, seed=4)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0),
                                 (1.2, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.0, 3, 0.5, 0.0)]]
    batched = sample(logits, params, *seeds(6, base=10)).token_ids
    for i in range(6):
        alone = sample(logits[i:i + 1], [params[i]], [10 + i], [0])
        assert alone.token_ids == [batched[i]]
    # The same seed and step give the same draws again.
    assert sample(logits, params, *seeds(6, base=10)).token_ids == batched


def test_noise_is_uniform_and_independent_across_seeds_steps_and_tokens():
    """The counter-based stream: a chi-square test on 64 bins, the mean and variance of a
    uniform, no correlation between neighbouring tokens, steps or seeds, and no value of
    exactly 0 or 1. Seeds over the whole 64-bit range."""
    seeds_ = torch.tensor([0, 1, -1, 12345, -(1 << 63), (1 << 63) - 1] * 50)
    steps = torch.arange(300) // 6
    u = uniform_noise(seeds_, steps, 4096).double()
    assert u.shape == (300, 4096) and bool((u > 0).all()) and bool((u < 1).all())
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u.float(), bins=64, min=0, max=1)
    chi2 = (((counts - n / 64) ** 2) / (n / 64)).sum().item()
    assert chi2 < 120, chi2  # 63 degrees of freedom: p < 1e-5 beyond ~120
    c = u - 0.5
    for a, b in ((c[:, 1:], c[:, :-1]), (c[6:], c[:-6]), (c[1:], c[:-1])):
        corr = (a * b).mean().item() / (1 / 12)
        assert abs(corr) < 0.01, corr
    # The same key gives the same draws; another step of the same seed does not.
    again = uniform_noise(seeds_[:6], steps[:6], 4096).double()
    assert torch.equal(again, u[:6])
    assert not torch.equal(uniform_noise(seeds_[:1], steps[:1] + 1, 4096), u[:1].float())


def test_uniforms_never_reach_0_or_1_and_truncation_is_never_escaped():
    """The extreme hashes map strictly inside (0, 1), so the exponential race never divides
    a zero probability by zero (the 24-bit version mapped the largest hash to exactly 1,
    and then picked a token outside top-k about once per 16,000 tokens of vocabulary drawn
    over); and over many draws no token outside top-k (or below min-p) is picked."""
    x = torch.tensor([0, 1, (1 << 31), (1 << 32) - 2, (1 << 32) - 1])
    u = to_uniform_(x.clone())
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((-u.log() > 0).all())
    logits = torch.randn(2000, 4096, generator=torch.Generator().manual_seed(0))
    for params in (SamplingParams(temperature=1.0, top_k=3), SamplingParams(min_p=0.9)):
        picked = torch.tensor(sample(logits, [params] * 2000, list(range(2000)),
                                     [0] * 2000).token_ids)
        allowed = logits.topk(3).indices if params.top_k else logits.argmax(-1, keepdim=True)
        if params.min_p:  # min_p 0.9: tokens within log(0.9) of the best
            allowed_mask = logits >= logits.max(-1, keepdim=True).values + math.log(0.9)
        else:
            allowed_mask = torch.zeros_like(logits, dtype=torch.bool).scatter(1, allowed, True)
        assert bool(allowed_mask.gather(1, picked[:, None]).all())


def test_noise_kernel_is_bit_identical_to_the_torch_noise():
    """CUDA draws the noise with one Triton kernel (interpreted here without a GPU): the same
    bits as the torch computation, so a seed gives the same tokens on any device."""
    from ragkv.sampling import noise

    if noise.triton is None:
        pytest.skip("Triton is not installed")
    seeds_ = torch.tensor([3, (1 << 63) - 1, 99])
    steps = torch.tensor([0, 7, 123456])
    vocab = 128_256 if torch.cuda.is_available() else 3000
    want = uniform_noise(seeds_, steps, vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k1, k2 = noise_keys(seeds_.to(device), steps.to(device))
    assert torch.equal(noise.triton_uniform_noise(k1, k2, vocab).cpu(), want)
    if torch.cuda.is_available():
        assert torch.equal(uniform_noise(seeds_.cuda(), steps.cuda(), vocab).cpu(), want)


PROBS = [0.5, 0.3, 0.2]
DRAWS = 2000


def draw_counts(params: SamplingParams, seed: int = 0, probs=PROBS) -> Counter:
    """DRAWS draws: one sequence's first DRAWS steps (even seeds) or the first step of DRAWS
    sequences (odd seeds), so both directions of the random streams are tested."""
    logits = torch.tensor(probs).log().repeat(DRAWS, 1)
    if seed % 2 == 0:
        keys = [seed] * DRAWS, list(range(DRAWS))
    else:
        keys = list(range(seed, seed + DRAWS)), [0] * DRAWS
    return Counter(sample(logits, [params] * DRAWS, *keys).token_ids)


@pytest.mark.parametrize("seed", [0, 1], ids=["steps", "seeds"])
def test_plain_sampling_follows_the_distribution(seed):
    counts = draw_counts(SamplingParams(temperature=1.0), seed)
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / DRAWS - p) < 0.05


@pytest.mark.parametrize("seed", [0, 1], ids=["steps", "seeds"])
def test_top_k_2_renormalises_over_the_two_best(seed):
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=2), seed)
    assert counts[2] == 0
    assert abs(counts[0] / DRAWS - 0.625) < 0.05
    assert abs(counts[1] / DRAWS - 0.375) < 0.05


def test_top_k_at_least_vocab_is_no_filter():
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=10))
    assert set(counts) == {0, 1, 2}


@pytest.mark.parametrize("seed", [0, 1], ids=["steps", "seeds"])
def test_top_p_keeps_the_smallest_set_reaching_p(seed):
    # 0.5 < 0.6, so token 1 is needed; 0.8 >= 0.6, so token 2 is not.
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.6), seed)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / DRAWS - 0.625) < 0.05
    # Below the mass of the top token, the top token alone suffices.
    assert set(draw_counts(SamplingParams(temperature=1.0, top_p=0.45))) == {0}
    assert set(draw_counts(SamplingParams(temperature=1.0, top_p=0.85))) == {0, 1, 2}


@pytest.mark.parametrize("seed", [0, 1], ids=["steps", "seeds"])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(seed):
    # Threshold 0.5 * 0.5 = 0.25: token 2 (0.2) goes, token 1 (0.3) stays.
    counts = draw_counts(SamplingParams(temperature=1.0, min_p=0.5), seed)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / DRAWS - 0.625) < 0.05
    assert set(draw_counts(SamplingParams(temperature=1.0, min_p=0.3))) == {0, 1, 2}


@pytest.mark.parametrize("seed", [0, 1], ids=["steps", "seeds"])
def test_temperature_sharpens_and_flattens(seed):
    cold = draw_counts(SamplingParams(temperature=0.25), seed)
    hot = draw_counts(SamplingParams(temperature=4.0), seed)
    # p^(1/T) renormalised: T=0.25 gives token 0 about 0.87, T=4 brings token 2 near 0.29.
    assert abs(cold[0] / DRAWS - 0.5**4 / sum(p**4 for p in PROBS)) < 0.05
    want_hot = 0.2**0.25 / sum(p**0.25 for p in PROBS)
    assert abs(hot[2] / DRAWS - want_hot) < 0.05


def test_sample_logprobs_are_of_the_raw_distribution():
    logits = random_logits(rows=4, vocab=30, seed=7)
    params = [SamplingParams(temperature=0.5, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=2.0,
                                                                         logprobs=5)]
    result = sample(logits, params, *seeds(4))
    logp = logits.log_softmax(dim=-1)
    assert result.token_logprobs[1] is None and result.top_logprobs[1] is None
    for i in (0, 2, 3):
        tok = result.token_ids[i]
        assert math.isclose(result.token_logprobs[i], logp[i, tok].item(), abs_tol=1e-5)
        ids, vals, rank = result.top_logprobs[i]
        k = params[i].logprobs
        assert ids == logp[i].topk(k).indices.tolist()
        assert all(math.isclose(v, logp[i, t].item(), abs_tol=1e-5) for t, v in zip(ids, vals,
                                                                                     strict=True))
        assert rank == int((logp[i] > logp[i, tok]).sum()) + 1
    assert result.top_logprobs[2][2] == 1  # greedy: the sampled token ranks first


# --------------------------------------------------------------------------- logprobs in outputs


def test_logprobs_greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(logprobs=3, temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for tok, step in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in step
        assert 1 <= len(step) <= 4
        assert all(lp.logprob <= 0 for lp in step.values())
        assert step[tok].rank == 1
        assert step[tok].logprob == max(lp.logprob for lp in step.values())
        ranked = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, len(step) + 1))
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
        assert all(isinstance(lp.decoded_token, str) for lp in step.values())
        total += step[tok].logprob
    assert out.cumulative_logprob is not None
    assert math.isclose(total, out.cumulative_logprob, abs_tol=1e-5)
    llm.check_integrity()


def test_logprobs_sampled_token_outside_top_k(llm):
    params = SamplingParams(logprobs=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 10
    total = 0.0
    outside = 0
    for tok, step in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in step and 2 <= len(step) <= 3
        top = {t: lp for t, lp in step.items() if lp.rank <= 2}
        assert sorted(lp.rank for lp in top.values()) == [1, 2]
        if tok not in top:
            outside += 1
            assert step[tok].rank > 2
            assert step[tok].logprob <= min(lp.logprob for lp in top.values())
        total += step[tok].logprob
    # A near-uniform random model over 4096 tokens rarely samples its top 2.
    assert outside > 0
    assert math.isclose(total, out.cumulative_logprob, abs_tol=1e-5)
    llm.check_integrity()


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    for temperature in (0.0, 1.0):
        params = SamplingParams(logprobs=0, temperature=temperature, seed=4, max_tokens=5)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert len(out.logprobs) == len(out.token_ids)
        for tok, step in zip(out.token_ids, out.logprobs, strict=True):
            assert list(step) == [tok]
            assert step[tok].logprob <= 0
        assert math.isclose(sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs,
                                                             strict=True)),
                            out.cumulative_logprob, abs_tol=1e-5)
    llm.check_integrity()


def test_logprobs_match_between_greedy_and_seeded_runs_of_the_same_token(llm):
    """The reported logprobs are of the raw model distribution, whatever the temperature."""
    cold = llm.generate(PROMPT, SamplingParams(logprobs=1, temperature=0, max_tokens=1),
                        use_tqdm=False)[0].outputs[0]
    hot = llm.generate(PROMPT, SamplingParams(logprobs=1, temperature=5.0, seed=0,
                                              max_tokens=1), use_tqdm=False)[0].outputs[0]
    top_cold = next(t for t, lp in cold.logprobs[0].items() if lp.rank == 1)
    top_hot = next(t for t, lp in hot.logprobs[0].items() if lp.rank == 1)
    assert top_cold == top_hot
    assert math.isclose(cold.logprobs[0][top_cold].logprob, hot.logprobs[0][top_hot].logprob,
                        abs_tol=1e-5)
    llm.check_integrity()


def test_seed_must_fit_64_bits_and_negative_seeds_are_their_own_streams(llm):
    for bad in (1 << 64, -(1 << 63) - 1, 10**30):
        with pytest.raises(ValueError, match="64-bit integer"):
            SamplingParams(seed=bad)
    # -1 and 2**64 - 1 are the same 64-bit pattern; -1 and 1 are not.
    params = [SEEDED.clone(seed=s, ignore_eos=True) for s in (-1, (1 << 64) - 1, 1)]
    a, b, c = tokens(llm, [PROMPT] * 3, params)
    assert a == b and a != c
    llm.check_integrity()
