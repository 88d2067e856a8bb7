"""The tokenizer cache (inputs/token_cache.py): a hit returns exactly what the tokenizer gives, with
and without special tokens; it stays within its bytes, least recently used out first; prompts
parse to the same token lists through it; only system parts and documents go in."""

from __future__ import annotations

import threading

import pytest

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.config import EngineConfig
from ragkv.inputs.chat import split_chat_prompt
from ragkv.inputs.prompt import PromptRules, parse_prompt
from ragkv.inputs.token_cache import TokenCache

TEXTS = ["The first document talks about rivers and boats.",
         " The second one, about mountains; and snow!",
         "Ünïcode and emoji \U0001F600 survive the round trip.",
         "a" * 300, " "]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from ragkv.model.builtin import builtin_model_path

    return AutoTokenizer.from_pretrained(builtin_model_path("builtin:tiny"))


class CountingTokenizer:
    """A tokenizer that counts its calls (what the cache saves) and returns ids it chose."""

    def __init__(self, tok=None, ids=None) -> None:
        self.tok, self.ids, self.calls = tok, ids, 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls += 1
        if self.ids is not None:
            return list(self.ids)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def test_hits_equal_the_tokenizer_with_and_without_special_tokens(tok):
    counting = CountingTokenizer(tok)
    cache = TokenCache(counting, 1 << 20)
    for _ in range(3):
        for text in TEXTS:
            for special in (True, False):
                assert cache.encode(text, special) == tok.encode(text, add_special_tokens=special)
    # BOS makes the two forms differ: one entry each, tokenized once each.
    assert tok.encode(TEXTS[0], add_special_tokens=True) != tok.encode(TEXTS[0],
                                                                       add_special_tokens=False)
    assert counting.calls == 2 * len(TEXTS)
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.entries) == (6 * len(TEXTS), 4 * len(TEXTS),
                                                          2 * len(TEXTS))
    cache.check_integrity()


def test_each_caller_gets_its_own_list(tok):
    cache = TokenCache(tok, 1 << 20)
    want = tok.encode(TEXTS[0], add_special_tokens=False)
    for _ in range(3):  # a miss's list, then hits' lists
        got = cache.encode(TEXTS[0], False)
        assert got == want
        got.append(-1)
        got[0] = -2


def test_least_recently_used_leave_first_and_bytes_stay_within_capacity(tok):
    texts = [f"document number {i} " * 20 for i in range(6)]
    probe = TokenCache(tok, 1 << 20)
    probe.encode(texts[0], False)
    one = probe.stats().bytes  # every text here has the same length and token count
    counting = CountingTokenizer(tok)
    cache = TokenCache(counting, 3 * one)
    for text in texts[:3]:
        cache.encode(text, False)
    cache.encode(texts[0], False)  # texts[0] is now the most recent
    cache.encode(texts[3], False)  # evicts texts[1], the least recently used
    assert cache.stats().entries == 3 and cache.stats().bytes <= 3 * one
    calls = counting.calls
    cache.encode(texts[0], False)
    cache.encode(texts[2], False)
    assert counting.calls == calls  # both still cached
    cache.encode(texts[1], False)
    assert counting.calls == calls + 1  # was evicted
    cache.check_integrity()


def test_what_does_not_fit_is_returned_and_not_kept(tok):
    counting = CountingTokenizer(tok)
    small = TokenCache(counting, 64)  # less than any text object
    assert small.encode(TEXTS[0], False) == tok.encode(TEXTS[0], add_special_tokens=False)
    assert small.encode(TEXTS[0], False) == tok.encode(TEXTS[0], add_special_tokens=False)
    assert counting.calls == 2 and small.stats().entries == 0
    huge_ids = CountingTokenizer(ids=[1, 2**40])  # beyond int32: returned, not kept
    cache = TokenCache(huge_ids, 1 << 20)
    assert cache.encode("x", False) == [1, 2**40]
    assert cache.encode("x", False) == [1, 2**40]
    assert huge_ids.calls == 2 and cache.stats().entries == 0
    # A salt is held by its entries, so it counts: a huge one does not fit.
    salted = TokenCache(tok, 1 << 20)
    salted.encode(TEXTS[0], False, salt="s" * (2 << 20))
    salted.encode(TEXTS[0], False, salt="s")
    assert salted.stats().entries == 1
    salted.check_integrity()
    with pytest.raises(ValueError, match="capacity_bytes"):
        TokenCache(tok, -1)


def test_threads_share_one_cache(tok):
    cache = TokenCache(tok, 1 << 20)
    want = {(t, s): tok.encode(t, add_special_tokens=s) for t in TEXTS for s in (True, False)}
    errors = []

    def work(seed: int) -> None:
        for i in range(200):
            key = list(want)[(seed * 7 + i) % len(want)]
            if cache.encode(*key) != want[key]:
                errors.append(key)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.stats().entries == len(want) and cache.stats().queries == 1600
    cache.check_integrity()


def test_prompts_parse_the_same_through_the_cache_and_questions_stay_out(tok):
    rules = PromptRules(vocab_size=4096, separator="##")
    docs = ["Rivers carry boats.", "Mountains hold snow.", "Deserts have wind."]
    counting = CountingTokenizer(tok)
    cache = TokenCache(counting, 1 << 20)
    prompts = ["You answer from documents.##" + "##".join(docs) + "##Which is cold?",
               RAGPrompt("You answer from documents.", docs[::-1], "Which is dry?"),
               RAGPrompt([5, 6, 7], [docs[0], [8, 9]], "A question in text?")]
    for prompt in prompts:
        for _ in range(2):
            assert parse_prompt(prompt, tok, rules, cache) == parse_prompt(prompt, tok, rules)
    # Entries: the system part (with BOS) and the three documents; never a question.
    assert cache.stats().entries == 4
    assert counting.calls == 4
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Which is wet?"}]
    for _ in range(2):
        assert (split_chat_prompt(tok, messages, docs, cache=cache)
                == split_chat_prompt(tok, messages, docs))
    assert cache.stats().entries == 4 + 1 + 3  # the rendered head, the documents as placed


def test_engine_outputs_do_not_change_and_the_cache_can_be_turned_off():
    prompt = ("You answer from documents.## Rivers carry boats.## Mountains hold snow."
              "##Which is cold?")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = LLM("builtin:tiny", chunk_separator="##")
    first = cached.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    again = cached.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stats = cached.engine.token_cache_stats()
    assert (stats.queries, stats.hits, stats.entries) == (6, 3, 3)
    cached.check_integrity()
    off = LLM("builtin:tiny", tokenizer_cache_mb=0, chunk_separator="##")
    assert off.engine.token_cache is None
    plain = off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again == plain
    assert off.engine.token_cache_stats().queries == 0


@pytest.mark.parametrize("value", [-1, True, 1.5, "64"])
def test_bad_capacity_is_refused(value):
    with pytest.raises(ValueError, match="tokenizer_cache_mb"):
        EngineConfig(model="builtin:tiny", tokenizer_cache_mb=value)


def test_a_salt_keeps_its_own_entries(tok):
    """Like the chunk cache, the tokenizer cache is keyed by the request's cache_salt: a
    tenant's document is not answered faster for another tenant."""
    rules = PromptRules(vocab_size=4096, separator="##")
    counting = CountingTokenizer(tok)
    cache = TokenCache(counting, 1 << 20)
    text = "Sys## A document shared by two tenants.##Question?"
    plain = parse_prompt(text, tok, rules)
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        got = parse_prompt({"prompt": text, "cache_salt": salt}, tok, rules, cache)
        assert (got.system, got.chunks, got.question) == (plain.system, plain.chunks,
                                                         plain.question)
        assert got.cache_salt == salt
    assert counting.calls == 3 * 2  # system and document once per salt; tenant-a hits
    assert cache.stats().hits == 2
    # A salt that is not a string is refused as without the cache, after the checks that
    # come first, and never keys an entry.
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        parse_prompt(RAGPrompt("Sys", ["doc"], "q?", cache_salt=["x"]), tok, rules, cache)
    with pytest.raises(ValueError, match="RAGPrompt.question is empty"):
        parse_prompt(RAGPrompt("Sys", ["doc"], "", cache_salt=["x"]), tok, rules, cache)
    prompt, _ = split_chat_prompt(tok, [{"role": "user", "content": "q?"}], ["doc"],
                                  cache_salt=3, cache=cache)
    assert prompt.cache_salt == 3  # refused later, by parse_prompt, as before
    assert cache.stats().entries == 3 * 2  # nothing new
