"""`ragkv precompute` fills the chunk store for a system prompt; a later engine or server on the
same store serves every chunk of the corpus as a hit, with the one-pass reference's tokens. Bad
corpora and settings get precise errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from conftest import running_server, server_wait_idle
from reference import layout_reference, reference_greedy

from ragkv import LLM, SamplingParams

SYSTEM = "You answer questions from the documents."
TEXTS = [f"Document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(12 + 3 * i))
         for i in range(4)]


# Servers of these tests store and load documents computed without the chunk primer.
NO_PRIMER = ("--chunk-primer", "none")


def write_corpus(path, texts=TEXTS) -> str:
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    return str(path)


def precompute(model: str, corpus: str, store: str, *args: str) -> subprocess.CompletedProcess:
    # Without a primer unless a test gives one (the quality mode's default primer would store
    # each document twice: test_precompute_with_a_chunk_primer_stores_both_copies).
    if "--chunk-primer" not in args:
        args = (*args, *NO_PRIMER)
    return subprocess.run(
        [sys.executable, "-m", "ragkv", "precompute", "--model", model, "--documents",
         corpus, "--system", SYSTEM, "--store", store, "--no-progress", "--batch-size", "3",
         *args],
        capture_output=True, text=True, timeout=300)


def summary_field(stdout: str, name: str) -> int:
    m = re.search(rf"^\s*{name}\s+(\d+)", stdout, re.MULTILINE)
    assert m, stdout
    return int(m.group(1))


def chat(documents: list[str], question: str = "Which document mentions w3?") -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


def test_precompute_then_serve_every_chunk_hits(llama, tmp_path):
    path, hf = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    store = f"disk:{tmp_path / 'store'}:1GiB"
    first = precompute(path, corpus, store)
    assert first.returncode == 0, first.stderr
    assert summary_field(first.stdout, "documents") == 4
    assert summary_field(first.stdout, "computed") == 4
    assert summary_field(first.stdout, "skipped") == 0
    assert summary_field(first.stdout, "bytes written") > 0
    assert len(list((tmp_path / "store").iterdir())) == 4
    # Resumable: a second run finds everything stored.
    again = precompute(path, corpus, store)
    assert again.returncode == 0, again.stderr
    assert summary_field(again.stdout, "computed") == 0
    assert summary_field(again.stdout, "skipped") == 4

    # A fresh engine serving the corpus (other orders, other questions): every chunk is a
    # store hit, and greedy tokens equal the one-pass reference.
    llm = LLM(path, kv_cache_tokens=2048, chunk_store=store, position_strategy="shared")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # Chunks met for the first time come from the store, the others from the pool.
    for docs, question, from_store in (([TEXTS[2], TEXTS[0]], "What is w5?", 2),
                                       (TEXTS[::-1], "And w9?", 2)):
        prompt = llm.engine.process_chat(chat(docs, question), documents=docs)
        before = llm.get_chunk_cache_stats()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        after = llm.get_chunk_cache_stats()
        assert out.metrics.num_chunk_misses == 0
        assert out.metrics.num_chunk_hits == len(docs)
        assert after.store_hits - before.store_hits == from_store
        ids, positions, visible, hidden = layout_reference(prompt.system, prompt.chunks,
                                                           prompt.question)
        want, _ = reference_greedy(hf, ids, positions, visible, 4, hidden=hidden)
        assert out.outputs[0].token_ids == want
        llm.check_integrity()
    assert llm.get_chunk_cache_stats().store_hits == 4
    llm.engine.close()


def test_precompute_with_a_chunk_primer_stores_both_copies(llama, tmp_path):
    """With a chunk primer each document is stored first and primed (and the primer once): a
    primed engine on the store hits every document wherever it lies, with the one-pass
    reference's tokens."""
    path, hf = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    store = f"disk:{tmp_path / 'store'}:1GiB"
    done = precompute(path, corpus, store, "--chunk-primer", "river")
    assert done.returncode == 0, done.stderr
    assert summary_field(done.stdout, "computed") == 4
    assert len(list((tmp_path / "store").iterdir())) == 2 * 4 + 1
    llm = LLM(path, kv_cache_tokens=2048, chunk_store=store, position_strategy="sequential",
              recompute="none", chunk_primer="river")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    docs = [TEXTS[3], TEXTS[0], TEXTS[2]]
    prompt = llm.engine.process_chat(chat(docs, "What is w5?"), documents=docs)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert (out.metrics.num_chunk_hits, out.metrics.num_chunk_misses) == (3, 0)
    ids, positions, visible, hidden = layout_reference(
        prompt.system, prompt.chunks, prompt.question, "sequential", "isolated",
        list(llm.engine.inputs.primer))
    assert out.outputs[0].token_ids == reference_greedy(hf, ids, positions, visible, 4,
                                                        hidden=hidden)[0]
    llm.check_integrity()
    llm.engine.close()


def test_precompute_text_format_and_salt_match_separator_prompts(llama, tmp_path):
    path, _ = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl", TEXTS[:2])
    store = f"disk:{tmp_path / 'store'}:1GiB"
    done = precompute(path, corpus, store, "--prompt-format", "text", "--cache-salt", "t1")
    assert done.returncode == 0, done.stderr
    llm = LLM(path, kv_cache_tokens=2048, chunk_store=store, position_strategy="shared",
              chunk_separator="##")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    text = SYSTEM + "##" + TEXTS[1] + "##" + TEXTS[0] + "##What is w1?"
    salted = llm.generate([{"prompt": text, "cache_salt": "t1"}], params, use_tqdm=False)[0]
    assert (salted.metrics.num_chunk_hits, salted.metrics.num_chunk_misses) == (2, 0)
    # Another tenant's salt never sees those entries.
    other = llm.generate([{"prompt": text, "cache_salt": "t2"}], params, use_tqdm=False)[0]
    assert (other.metrics.num_chunk_hits, other.metrics.num_chunk_misses) == (0, 2)
    assert other.outputs[0].token_ids == salted.outputs[0].token_ids
    llm.check_integrity()
    llm.engine.close()


def test_precompute_errors(llama, tmp_path):
    path, _ = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    disk = f"disk:{tmp_path / 'store'}:1GiB"
    cases = [
        (["--store", "host:1GiB"], "shared tiers: give a disk or redis"),
        (["--store", "nfs:/x"], "unknown tier 'nfs:/x'"),
    ]
    for args, message in cases:
        r = subprocess.run([sys.executable, "-m", "ragkv", "precompute", "--model", path,
                            "--documents", corpus, "--no-progress", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "ragkv", "precompute", "--model", path,
                        "--documents", corpus], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs --store" in r.stderr, r.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "fine"}\n\nnot json\n')
    r = precompute(path, str(bad), disk)
    assert r.returncode == 2 and "bad.jsonl:3: not JSON" in r.stderr, r.stderr
    bad.write_text('{"id": "a", "text": "fine"}\n{"id": "a", "text": "again"}\n')
    r = precompute(path, str(bad), disk)
    assert r.returncode == 2 and "duplicate id 'a'" in r.stderr, r.stderr
    bad.write_text('{"id": "a", "body": "no text"}\n')
    r = precompute(path, str(bad), disk)
    assert r.returncode == 2 and "expected an object with a string 'text'" in r.stderr

    # A document over max_chunk_tokens fails alone, named; the others are stored.
    long = write_corpus(tmp_path / "long.jsonl", [TEXTS[0], " ".join(["w1"] * 200)])
    r = precompute(path, long, disk, "--max-chunk-tokens", "64")
    assert r.returncode == 1, r.stderr
    assert summary_field(r.stdout, "computed") == 1
    assert summary_field(r.stdout, "failed") == 1
    assert "failed doc-1: a chunk has" in r.stdout


def test_replicas_share_redis_precomputed_corpus_with_metrics(llama, tmp_path, redis_server):
    """Precompute into Redis; a `ragkv serve` replica on the same Redis serves a chat request
    over the corpus with every chunk a Redis hit, visible in /metrics."""
    path, hf = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    done = precompute(path, corpus, redis_server.url)
    assert done.returncode == 0, done.stderr
    assert summary_field(done.stdout, "computed") == 4
    llm = LLM(path, kv_cache_tokens=2048, chunk_primer="none")  # no store: expected tokens
    docs = [TEXTS[3], TEXTS[1], TEXTS[0]]
    prompt = llm.engine.process_chat(chat(docs), documents=docs)
    ids, positions, visible, hidden = layout_reference(prompt.system, prompt.chunks,
                                                       prompt.question)
    want, _ = reference_greedy(hf, ids, positions, visible, 3, hidden=hidden)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == want
    with running_server(path, "--chunk-store", redis_server.url, *NO_PRIMER) as base:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": path, "messages": chat(docs), "documents": docs, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected.text
        server_wait_idle(base, None)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text

    def value(name: str, tier: str = "redis") -> float:
        m = re.search(rf'^{re.escape(name)}{{model_name="[^"]*",tier="{tier}"}} (\S+)$',
                      metrics, re.MULTILINE)
        assert m, name
        return float(m.group(1))

    assert value("ragkv:chunk_store_hits_total") == 3
    assert value("ragkv:chunk_store_misses_total") == 0
    assert value("ragkv:chunk_store_corrupt_entries_total") == 0
    assert value("ragkv:chunk_store_available") == 1
    assert value("ragkv:chunk_store_read_bytes_total") > 0
    assert value("ragkv:chunk_store_load_seconds_count") == 3


def test_two_servers_share_one_redis(llama, redis_server):
    """Two `ragkv serve` replicas on one Redis: documents one computes are hits in the other,
    with identical output."""
    import redis

    path, _ = llama
    docs = [TEXTS[1], TEXTS[2]]
    body = {"model": path, "messages": chat(docs), "documents": docs, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    client = redis.Redis.from_url(redis_server.url)
    with running_server(path, "--chunk-store", redis_server.url, *NO_PRIMER) as first, \
            running_server(path, "--chunk-store", redis_server.url, *NO_PRIMER) as second:
        a = httpx.post(f"{first}/v1/chat/completions", json=body, timeout=120)
        assert a.status_code == 200, a.text
        deadline = time.monotonic() + 30  # the write-through lands off the request's path
        while len(client.keys("ragkv:chunk:*")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(client.keys("ragkv:chunk:*")) == 2
        b = httpx.post(f"{second}/v1/chat/completions", json=body, timeout=120)
        assert b.status_code == 200, b.text
        assert b.json()["choices"][0]["message"]["content"] == \
            a.json()["choices"][0]["message"]["content"]
        hits = []
        for base in (first, second):
            server_wait_idle(base, None)
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
            m = re.search(r'^ragkv:chunk_store_hits_total\{[^}]*tier="redis"\} (\S+)$', metrics,
                          re.MULTILINE)
            hits.append(float(m.group(1)))
        assert hits == [0, 2]
        # The second replica's cached tokens count the documents it did not compute.
        usage = b.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= sum(
            len(c) for c in LLM(path).engine.process_chat(chat(docs), documents=docs).chunks)
    client.close()


def test_precompute_reports_chunks_that_were_not_stored(llama, tmp_path):
    """A chunk larger than the chunk region is computed but never cached, so never stored:
    the document is reported as failed (and computed again by a rerun), not as done."""
    path, _ = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl", TEXTS[:2])
    store = f"disk:{tmp_path / 'store'}:1GiB"
    r = precompute(path, corpus, store, "--chunk-cache-tokens", "8")
    assert r.returncode == 1, r.stderr
    assert summary_field(r.stdout, "computed") == 0 and summary_field(r.stdout, "failed") == 2
    assert "failed doc-0: its KV did not reach every shared tier" in r.stdout
    r = precompute(path, corpus, store, "--batch-size", "300")
    assert r.returncode == 2 and "exceeds the chunk store's write queue" in r.stderr


def test_precompute_refills_a_tier_that_lost_its_entries(llama, tmp_path, redis_server):
    """Resuming skips a document only when every shared tier holds it: after Redis is
    emptied, a rerun copies the disk tier's entries there (nothing is recomputed)."""
    import redis

    path, _ = llama
    corpus = write_corpus(tmp_path / "corpus.jsonl", TEXTS[:3])
    store = f"disk:{tmp_path / 'store'}:1GiB,{redis_server.url}"
    first = precompute(path, corpus, store)
    assert first.returncode == 0 and summary_field(first.stdout, "computed") == 3
    client = redis.Redis.from_url(redis_server.url)
    assert len(client.keys("ragkv:chunk:*")) == 3
    client.flushall()
    again = precompute(path, corpus, store)
    assert again.returncode == 0, again.stdout + again.stderr
    counts = [summary_field(again.stdout, f) for f in ("computed", "skipped", "copied")]
    assert counts == [0, 0, 3]  # read from the disk tier, written to Redis
    assert len(client.keys("ragkv:chunk:*")) == 3
    done = precompute(path, corpus, store)
    assert summary_field(done.stdout, "skipped") == 3
    client.close()
