"""One bad request never hurts another (issue 8): regression tests for the engine-side defects
and for the mechanisms that contain them — up-front validation, a failure while serving one
request failing that request alone, a failed model step failing only the requests in it, the
async engine surviving cancelled and aborted callers, incremental detokenization and slot
tables, and the streaming formatter. Server-level cases are in test_server*.py."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from conftest import random_prompt

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.outputs import CompletionOutput, RequestOutput
from ragkv.sampling.detokenizer import IncrementalDetokenizer
from ragkv.server.async_engine import AsyncEngine
from ragkv.server.responses import ResponseFormatter

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SYSTEM = "You answer from the documents."
DOCS = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny", kv_cache_tokens=4096, max_model_len=512)


def rag(question: str, salt: str | None = None) -> RAGPrompt:
    return RAGPrompt(SYSTEM, DOCS, question, cache_salt=salt)


def solo(llm: LLM, prompt, params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def drain(engine) -> dict[str, RequestOutput]:
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            done[out.request_id] = out
        engine.check_integrity()
    raise AssertionError("the engine did not drain")


# ---------------------------------------------------------------- defect 1: bad cache_salt

def test_lone_surrogate_cache_salt_is_refused_and_running_requests_go_on(llm):
    """Regression: a cache_salt "\\ud800" was accepted, then raised inside the engine step
    (encoding the chunk-cache key) and failed every request in flight."""
    want = solo(llm, rag("Which is denser?"))
    engine = llm.engine
    engine.add_request(rag("Which is denser?"), GREEDY, request_id="good")
    engine.step()
    for bad in (rag("Which is denser?", salt="\ud800"),
                {"prompt": "plain text", "cache_salt": "x\udfffy"},
                {"prompt_token_ids": [1, 2, 3], "cache_salt": "\ud83d"}):
        with pytest.raises(ValueError, match="cache_salt is not valid Unicode"):
            engine.add_request(bad, GREEDY)
    outs = drain(engine)
    assert outs["good"].outputs[0].token_ids == want and outs["good"].error is None
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["fine", "bad \ud800 text"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"RAGPrompt.chunks is not valid Unicode"):
        llm.generate(RAGPrompt(SYSTEM, ["ok", "\udc00"], "q?"), GREEDY, use_tqdm=False)
    llm.check_integrity()


# ------------------------------------------- mechanism: a failure stays its request's own

def test_failure_while_planning_one_request_fails_only_it(llm, monkeypatch):
    """Any exception raised while the scheduler plans one request (here injected into the
    chunk-cache lookup of one tenant) finishes that request with an error; the others in the
    same steps produce exactly their solo outputs."""
    prompts = {"a": rag("Which is denser?", salt="t1"), "b": rag("What is in bread?"),
               "c": {"prompt_token_ids": random_prompt(20, seed=3)}}
    want = {rid: solo(llm, p) for rid, p in prompts.items()}
    cache = llm.engine.chunk_cache
    original = type(cache).lookup

    def lookup(self, chunk):
        if chunk.namespace.endswith("salt=boom"):
            raise RuntimeError("injected fault")
        return original(self, chunk)

    monkeypatch.setattr(type(cache), "lookup", lookup)
    engine = llm.engine
    for rid, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id=rid)
    engine.add_request(rag("Which is denser?", salt="boom"),
                       SamplingParams(max_tokens=6, n=2, temperature=0), request_id="bad")
    outs = drain(engine)
    bad = outs["bad"]
    assert bad.finished and "injected fault" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    for rid in prompts:
        assert outs[rid].error is None and outs[rid].outputs[0].token_ids == want[rid]
    llm.check_integrity()


def test_failure_while_detokenizing_one_request_fails_only_it(llm, monkeypatch):
    want = solo(llm, "The garden is green")
    original = IncrementalDetokenizer.update
    doomed = set()

    def update(self, token_ids, end=None):
        if id(self) in doomed:
            raise UnicodeError("injected decode fault")
        return original(self, token_ids, end)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    engine = llm.engine
    engine.add_request("The garden is green", GREEDY, request_id="good")
    engine.add_request("Another prompt", SamplingParams(max_tokens=6, stop=["zz"]),
                       request_id="bad")
    doomed.add(id(engine.scheduler.waiting[-1].detokenizer))
    outs = drain(engine)
    assert "injected decode fault" in outs["bad"].error
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert outs["good"].error is None and outs["good"].outputs[0].token_ids == want
    llm.check_integrity()


def test_failed_model_step_fails_its_requests_and_leaves_the_rest_consistent(llm, monkeypatch):
    """If the model cannot run a step, the requests in that step fail; slots, prefix-cache
    locks and chunk entries they were computing come back; later requests (reusing what was
    cached before) are exact."""
    want = solo(llm, rag("Which is denser?"))
    runner = llm.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def execute(works, probes=()):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device fault")
        return original(works, probes)

    monkeypatch.setattr(runner, "execute", execute)
    engine = llm.engine
    engine.add_request(rag("What is in bread?"), GREEDY, request_id="first")
    engine.step()  # step 1 runs
    engine.add_request(RAGPrompt(SYSTEM, ["A brand new document."], "Tell me."), GREEDY,
                       request_id="second")
    outs = drain(engine)  # step 2 fails both
    for rid in ("first", "second"):
        assert outs[rid].finished and "injected device fault" in outs[rid].error
    llm.check_integrity()
    monkeypatch.setattr(runner, "execute", original)
    assert solo(llm, rag("Which is denser?")) == want
    llm.check_integrity()


def test_failure_while_updating_one_request_fails_only_it(llm, monkeypatch):
    """An exception while the scheduler commits one request's step (here injected into the
    prefix cache's insert for one prompt) fails that request alone; the others in the same
    steps give their solo tokens."""
    prompts = {"a": rag("Which is denser?"), "b": {"prompt_token_ids": [5, 6, 7, 8, 9]}}
    want = {rid: solo(llm, p) for rid, p in prompts.items()}
    kv = llm.engine.kv
    original = type(kv).cache

    def cache(self, seq, tokens):
        if list(tokens[:3]) == [11, 12, 13]:
            raise RuntimeError("injected update fault")
        return original(self, seq, tokens)

    monkeypatch.setattr(type(kv), "cache", cache)
    engine = llm.engine
    for rid, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id=rid)
    engine.add_request({"prompt_token_ids": [11, 12, 13, 14]},
                       SamplingParams(max_tokens=6, n=2, temperature=0), request_id="bad")
    outs = drain(engine)
    assert outs["bad"].finished and "injected update fault" in outs["bad"].error
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error", "error"]
    for rid in prompts:
        assert outs[rid].error is None and outs[rid].outputs[0].token_ids == want[rid]
    llm.check_integrity()


def test_a_failed_commit_that_broke_the_caches_stops_the_engine(monkeypatch):
    """A commit that fails midway fails its request; but if it left the caches broken (here it
    took a slot it never returned), serving on could hand one request another's KV: the
    integrity check that follows every failed commit raises InvariantViolation."""
    from ragkv.engine.scheduler import InvariantViolation

    llm = LLM("builtin:tiny", kv_cache_tokens=1024, max_model_len=256)
    kv = llm.engine.kv
    original = type(kv).cache

    def cache(self, seq, tokens):
        if list(tokens[:3]) == [11, 12, 13]:
            self.allocator.alloc(1)  # leaked: no one holds it
            raise RuntimeError("injected update fault")
        return original(self, seq, tokens)

    monkeypatch.setattr(type(kv), "cache", cache)
    llm.engine.add_request({"prompt_token_ids": [11, 12, 13, 14]}, GREEDY, request_id="bad")
    with pytest.raises(InvariantViolation, match="after a failed commit.*capacity"):
        llm.engine.step()


def test_a_corrupt_state_stops_the_engine_loudly():
    """With debug checks on, a scheduler state that breaks its rules (a running request's KV
    list shorter than the tokens it has computed) raises InvariantViolation out of step():
    no request is at fault and the engine must not serve from it."""
    from ragkv.engine.scheduler import InvariantViolation

    llm = LLM("builtin:tiny", kv_cache_tokens=1024, max_model_len=256, debug_checks=True)
    engine = llm.engine
    for rid in ("x", "y"):
        engine.add_request({"prompt_token_ids": [20 + len(rid), 30, 40]},
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           request_id=rid)
    engine.step()
    _, y = engine.scheduler.running
    y.kv.slots.pop(0)  # behind SeqKV's back: a computed token without its slot
    with pytest.raises(InvariantViolation, match="malformed work"):
        engine.step()


# ------------------------------------------------------------------------ defect 2: caps on n

def test_n_is_bounded_by_max_n(llm):
    """Regression: n=1099511627776 hung the engine thread building children."""
    for n in (10**12, 129):
        with pytest.raises(ValueError, match=rf"n={n} exceeds max_n=128"):
            llm.generate("hello", SamplingParams(n=n, max_tokens=1), use_tqdm=False)
    small = LLM("builtin:tiny", max_n=2, kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="max_n=2"):
        small.generate("hello", SamplingParams(n=3, max_tokens=1), use_tqdm=False)
    assert len(small.generate("hello", SamplingParams(n=2, max_tokens=1),
                              use_tqdm=False)[0].outputs) == 2
    llm.check_integrity()


# ------------------------------------------------------- defect 5 and 6: the async engine

def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.fixture
def async_engine(llm):
    ae = AsyncEngine(llm.engine)
    ae.start()
    yield ae
    ae.stop()
    llm.check_integrity()


def test_cancelled_submit_and_call_do_not_kill_the_engine_thread(async_engine):
    """Regression: cancelling `submit()` (or `call()`) before the engine thread took the
    command made its `set_result` raise InvalidStateError and killed the thread: every later
    request got 503."""
    ae = async_engine
    entered, release = threading.Event(), threading.Event()

    def hold(engine):  # keeps the engine thread busy, so the commands below wait in line
        entered.set()
        release.wait(30)

    async def scenario():
        holder = asyncio.ensure_future(ae.call(hold))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        submit = asyncio.ensure_future(ae.submit("The garden", GREEDY, "cancelled"))
        call = asyncio.ensure_future(ae.call(lambda e: 1))
        await asyncio.sleep(0.05)
        submit.cancel()
        call.cancel()
        for task in (submit, call):
            with pytest.raises(asyncio.CancelledError):
                await task
        release.set()
        await holder
        assert await ae.call(lambda e: 41 + 1) == 42
        outs = [o async for o in ae.generate("The garden is green", GREEDY)]
        return outs[-1]

    last = _run(scenario())
    assert last.finished and len(last.outputs[0].token_ids) == 6
    assert ae.alive and not ae.engine.has_request("cancelled")


def test_an_inconsistent_engine_stops_serving_loudly(monkeypatch):
    """An InvariantViolation (the engine's bookkeeping found inconsistent) is no request's
    fault and not passing: the loop stops, the request in flight ends with EngineDeadError
    naming it, later requests are refused (a server answers 503 and exits non-zero through
    `on_fatal`), instead of a reset that serves on from a corrupt state."""
    from ragkv.engine.scheduler import InvariantViolation
    from ragkv.server.async_engine import EngineDeadError

    llm = LLM("builtin:tiny", kv_cache_tokens=1024, max_model_len=256)
    fatal = []
    ae = AsyncEngine(llm.engine, on_fatal=fatal.append)
    steps = {"n": 0}
    step = llm.engine.step

    in_step, queued = threading.Event(), threading.Event()

    def failing_step(include_unfinished=False):
        steps["n"] += 1
        if steps["n"] == 3:
            in_step.set()
            queued.wait(10)  # a command waits in the queue while the loop stops
            raise InvariantViolation("scheduler: slot 7 written twice in one step")
        return step(include_unfinished)

    monkeypatch.setattr(llm.engine, "step", failing_step)
    ae.start()

    async def scenario():
        outputs = await ae.submit("A long story:", SamplingParams(max_tokens=50,
                                                                   ignore_eos=True), "long")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, in_step.wait, 10)
        waiting = asyncio.ensure_future(ae.call(lambda e: 1))
        await asyncio.sleep(0.05)
        queued.set()
        with pytest.raises(EngineDeadError, match="inconsistent.*written twice"):
            async for _ in outputs:
                pass
        # The queued command is answered, not left waiting for a loop that has ended.
        with pytest.raises(EngineDeadError, match="inconsistent"):
            await waiting

    _run(scenario())
    ae._thread.join(10)
    assert not ae.alive and isinstance(ae.fatal, InvariantViolation) and fatal == [ae.fatal]
    with pytest.raises(EngineDeadError):
        _run(ae.submit("again", GREEDY))
    ae.stop()


def test_aborted_request_ends_its_stream(async_engine):
    """Regression: an abort (a non-streaming client leaving) popped the stream without waking
    its reader, which then waited forever (one leaked task per disconnect)."""
    ae = async_engine

    async def abort_midway():
        outputs = await ae.submit("A long story:", SamplingParams(max_tokens=400,
                                                                   ignore_eos=True), "long")
        seen = []

        async def consume():
            async for out in outputs:
                seen.append(out)

        reader = asyncio.ensure_future(consume())
        while not seen:
            await asyncio.sleep(0.01)
        ae.abort("long")
        await asyncio.wait_for(reader, timeout=10)
        return seen

    seen = _run(abort_midway())
    assert not seen[-1].finished and len(seen[-1].outputs[0].token_ids) < 400


def test_prompts_are_tokenized_off_the_engine_thread_and_size_capped(async_engine):
    """Regression: an 8 MB prompt was tokenized on the engine thread and froze running streams
    for seconds before its 400. Prompts are tokenized on the tokenizer thread; text that
    cannot fit max_model_len is refused without tokenizing it at all."""
    ae = async_engine
    tokenizer = ae.engine.tokenizer
    threads = []
    original = type(tokenizer).encode

    def encode(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    type(tokenizer).encode = encode
    ae.engine.token_cache.clear()  # earlier tests sent these documents
    try:
        async def go():
            prepared = await ae.prepare(rag("Which is denser?"), GREEDY)
            outs = [o async for o in ae.generate(prepared, GREEDY)]
            with pytest.raises(ValueError, match=r"prompt has 8000000 characters"):
                await ae.prepare("x" * 8_000_000, GREEDY)
            first = len(threads)
            await ae.prepare(rag("Which is lighter?"), GREEDY)
            return outs[-1], first

        calls_before = len(threads)
        last, first = _run(go())
    finally:
        type(tokenizer).encode = original
    assert last.finished
    assert threads[calls_before:] and all(t.startswith("ragkv-tokenizer") for t in threads)
    assert first == calls_before + 4  # S, two chunks, Q: nothing for the 8 MB text
    assert len(threads) == first + 1  # then S and the chunks come from the tokenizer cache


# --------------------------------------------- defect 10: constant per-step bookkeeping

def test_incremental_detokenizer_equals_full_decode(llm):
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    multibyte = tok.encode("日本語のテキスト, émigré, naïve 🙂 done", add_special_tokens=False)
    for trial in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids[rng.randrange(len(ids)):rng.randrange(len(ids)) + 1] = multibyte
        detok = IncrementalDetokenizer(tok)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
            assert tok.decode(ids[:n], skip_special_tokens=True).startswith(detok.text), trial
        assert detok.finish(ids) == tok.decode(ids, skip_special_tokens=True), trial


def test_per_step_host_work_does_not_grow_with_the_output(llm, monkeypatch):
    """Regression: every step re-detokenized each request's whole output (with stop strings
    offline, always when streaming) and copied every sequence's slot list into a new index
    tensor. Now a decode step decodes a few tokens per request and copies one slot."""
    tok = llm.get_tokenizer()
    decoded_lengths = []
    original_decode = type(tok).decode

    def decode(self, ids, *args, **kwargs):
        decoded_lengths.append(len(ids))
        return original_decode(self, ids, *args, **kwargs)

    copied = []
    table = llm.engine.runner.slot_table
    original_sync = table.sync

    def sync(seqs):
        seqs = list(seqs)
        copied.extend(len(kv.slots) - kv.num_mirrored for kv in seqs)
        return original_sync(seqs)

    monkeypatch.setattr(type(tok), "decode", decode)
    monkeypatch.setattr(table, "sync", sync)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True, stop=["never-appears-here"])
    for i in range(3):
        engine.add_request(f"Story {i}:", params, request_id=f"s{i}")
    for _ in range(2):  # prefill, then a step that re-mirrors slots the prefix cache took over
        engine.step()
    decoded_lengths.clear()
    copied.clear()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step(include_unfinished=True)  # streaming: text of every request every step
        steps += 1
    assert steps >= 190
    assert max(copied) == 1 and len(copied) <= 3 * steps
    # A handful of tokens per decode call (a window), never the whole output; the final
    # full-length decodes are not part of the per-step cost.
    assert sum(1 for n in decoded_lengths if n > 16) <= 3 * 2


# ------------------------------------------------------------- defect 7: stream formatting

def _output(text: str, ids: list[int], finish: str | None = None,
            logprobs=None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                         outputs=[CompletionOutput(0, text, ids, None, logprobs, finish)],
                         finished=finish is not None)


def test_stream_holds_back_a_stop_string_behind_an_incomplete_character(llm):
    """Regression: the stop-string hold-back was counted before trailing U+FFFD were
    stripped, so with a multi-byte stop string its first character leaked into the stream."""
    fmt = ResponseFormatter("id", "m", False, SamplingParams(stop=["日本"]), llm.get_tokenizer())
    sent = ""
    for text, ids, finish in (("abc", [1], None), ("abc日\ufffd", [1, 2], None),
                              ("abc", [1, 2, 3], "stop")):
        for chunk in fmt.delta(0, _output(text, ids, finish)):
            sent += chunk["choices"][0]["text"]
    assert sent == "abc"


def test_stream_sends_each_choice_finish_reason_once():
    """Regression: with n>1 a finished choice re-sent its finish_reason chunk every step
    while its siblings ran."""
    fmt = ResponseFormatter("id", "m", True, SamplingParams(n=2), None)
    finishes = []
    for step in range(5):
        first = CompletionOutput(0, "a", [1], None, None, "stop")
        second = CompletionOutput(1, "b" * (step + 1), [1] * (step + 1), None, None,
                                  "length" if step == 4 else None)
        out = RequestOutput("r", None, [1], [first, second], finished=step == 4)
        for chunk in fmt.delta(0, out):
            choice = chunk["choices"][0]
            if choice["finish_reason"] is not None:
                finishes.append(choice["index"])
    assert finishes == [0, 1]


def test_stream_text_offset_counts_from_the_start_of_the_text(llm):
    """Regression: logprobs.text_offset restarted at 0 in every streamed chunk."""
    from ragkv.outputs import Logprob

    tok = llm.get_tokenizer()
    ids = tok.encode("one two three four", add_special_tokens=False)
    entries = [{t: Logprob(-0.5, rank=1)} for t in ids]
    fmt = ResponseFormatter("id", "m", False, SamplingParams(logprobs=1), tok)
    offsets = []
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        for chunk in fmt.delta(0, _output(text, ids[:n], None if n < len(ids) else "length",
                                          entries[:n])):
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [len(tok.decode(ids[:i])) for i in range(len(ids))]
