"""The command line, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from reference import causal_layout, layout_reference, reference_greedy

from ragkv import LLM, SamplingParams
from ragkv.entrypoints.demo import _requests

# Chunks long enough that the four layouts give four different greedy continuations on the
# checkpoint below (asserted where it matters).
RAG_TEXT = ("You answer from the documents. ## The capital of Freedonia is Sylvania City, on "
            "the river. ## Marx brothers made a film about Freedonia in 1933. ## Which city is "
            "the capital?")
MAX_TOKENS = 5

def ragkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragkv", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    """A tiny checkpoint with spread weights, whose greedy tokens tell layouts apart
    (builtin:tiny's barely depend on the context), HF transformers over the same directory
    (the reference), and an engine that tokenizes prompts as the CLI does."""
    path = checkpoint("llama")
    return path, hf_model(path), LLM(path)


def reference_tokens(hf, prompt, layout: tuple[str, str] | None, max_tokens: int = MAX_TOKENS,
                     stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """HF's greedy tokens for a tokenized prompt in `layout` (position_strategy,
    chunk_attention), or as an ordinary prompt, causal over the flat tokens (None)."""
    if layout is None:
        ids, hidden = prompt.token_ids, None
        positions, visible = causal_layout(len(ids))
    else:
        ids, positions, visible, hidden = layout_reference(prompt.system, prompt.chunks,
                                                           prompt.question, *layout)
    return reference_greedy(hf, ids, positions, visible, max_tokens, stop_ids, hidden)[0]


def generated_ids(model: str, num_prompt_tokens: int, *flags: str) -> list[int]:
    """Greedy token ids of `ragkv generate --json` for RAG_TEXT with `flags`."""
    r = ragkv("generate", "--model", model, "--json", "--max-tokens", str(MAX_TOKENS),
              "--ignore-eos", "--prompt", RAG_TEXT, *flags)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["num_prompt_tokens"] == num_prompt_tokens
    return out["token_ids"]


def test_generate_json_rag_prompt():
    r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "5",
              "--prompt", "Sys ## doc one ## doc two ## question?", "--prompt", "plain")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Sys ## doc one ## doc two ## question?", "plain"]
    assert all(len(x["token_ids"]) <= 5 and x["finish_reason"] for x in lines)


def test_generate_with_a_layout(llama):
    """--position-strategy and --chunk-attention reach the engine: with `shared` the tokens are
    HF's one-pass reference (reference.py) of shared positions and isolated chunks, with
    `sequential`, `standalone` and no recompute that of the sequential-standalone layout, and
    the four layouts' references all differ, so dropping either flag gives other tokens.
    Without flags the prompt gets the quality mode, the same tokens as its settings named.
    A bad name exits 2."""
    path, hf, llm = llama
    prompt = llm.engine.process_prompt(RAG_TEXT)
    want = {layout: reference_tokens(hf, prompt, layout)
            for layout in (("shared", "isolated"), ("shared", "standalone"),
                           ("sequential", "isolated"), ("sequential", "standalone"))}
    assert len({tuple(ids) for ids in want.values()}) == 4
    n = len(prompt.token_ids)
    assert generated_ids(path, n, "--position-strategy", "shared") == want["shared", "isolated"]
    assert generated_ids(path, n, "--position-strategy", "sequential", "--recompute", "none",
                         "--chunk-attention", "standalone") == want["sequential", "standalone"]
    assert generated_ids(path, n) == generated_ids(
        path, n, "--position-strategy", "sequential", "--recompute", "query",
        "--recompute-ratio", "0.5", "--recompute-min-ratio", "0.1",
        "--recompute-score-mass", "0.9")
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", RAG_TEXT,
              "--position-strategy", "zigzag")
    assert r.returncode == 2 and "position-strategy" in r.stderr


def test_generate_with_selective_recompute(llama):
    """--recompute flags reach the engine: with one method, --recompute-ratio 1 gives HF's
    full prefill of the flat prompt and --recompute-ratio 0 the sequential layout's reference
    (the two ends, test_recompute.py), which differ, so a dropped --recompute (no recompute:
    the sequential tokens twice) or --recompute-ratio (0.15 twice: the same tokens twice)
    fails. --recompute-check-layers past the model's depth, or --recompute without sequential
    positions, is a clear error."""
    path, hf, llm = llama
    prompt = llm.engine.process_prompt(RAG_TEXT)
    full = reference_tokens(hf, prompt, None)
    sequential = reference_tokens(hf, prompt, ("sequential", "isolated"))
    assert full != sequential
    for ratio, want in (("1", full), ("0", sequential)):
        got = generated_ids(path, len(prompt.token_ids), "--position-strategy", "sequential",
                            "--recompute", "sink+blend", "--recompute-ratio", ratio,
                            "--recompute-check-layers", "0,1")
        assert got == want, f"--recompute-ratio {ratio}"
    r = ragkv("generate", "--model", path, "--prompt", RAG_TEXT, "--position-strategy",
              "sequential", "--recompute", "blend", "--recompute-check-layers", "0,5")
    assert r.returncode == 2 and "names layer 5; the model has layers 0 .. 1" in r.stderr
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", RAG_TEXT, "--recompute", "blend",
              "--position-strategy", "shared")
    assert r.returncode != 0 and "position_strategy='sequential'" in r.stderr


def test_generate_bad_model_is_a_clear_error():
    r = ragkv("generate", "--model", "/does/not/exist", "--prompt", "x")
    assert r.returncode == 2
    assert "does not exist" in r.stderr


DEMO_ROW = re.compile(r"^ *(\d+)  (\S+) +(\d+)/(\d+) +(\d+)% +[\d.]+ +(?:yes|no)  (.*)$")
EXACT_ROW = re.compile(r"^ *(\d+)  exact +[\d.]+ +(?:yes|no)  (.*)$")


def test_demo_answers_match_reference(llama):
    """The demo answers in the engine's default mode (sequential positions, the model-agnostic
    adaptive recompute: 10% to 50% of the document tokens), cold and warm; each printed answer
    equals the same prompt computed with the caches off (an engine built here, and the demo's
    own check). Its exact-reuse answers (shared positions, no recompute) are HF's one-pass
    reference answers, decoded and printed as the demo prints them."""
    path, hf, llm = llama
    r = ragkv("demo", "--model", path, "--num-requests", "4", "--max-tokens", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("Default RAG mode: positions sequential, chunk attention isolated, recompute "
            "query, the fewest tokens holding 0.9 of the scores, 0.1 to 0.5") in r.stdout
    assert "default mode: 4/4 answers identical token for token" in r.stdout
    assert "exact chunk reuse: 4/4 answers identical token for token" in r.stdout
    assert "hit rate" in r.stdout and "speedup" in r.stdout
    rows = [m for line in r.stdout.splitlines() if (m := DEMO_ROW.match(line))]
    exact = [m for line in r.stdout.splitlines() if (m := EXACT_ROW.match(line))]
    requests = _requests(llm, 4)
    assert len(rows) == len(exact) == len(requests)
    assert any(row[3] == row[4] for row in rows)  # a request with every chunk a hit
    cold = LLM(path, enable_chunk_cache=False, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = cold.generate([p for _, _, p in requests], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for i, (row, ex, out, (_, order, prompt)) in enumerate(
            zip(rows, exact, outs, requests, strict=True)):
        assert (row[1], row[2]) == (str(i), ",".join(map(str, order)))
        assert 10 <= int(row[5]) <= 50, f"request {i} recomputed {row[5]}%"
        assert row[6] == " ".join(out.outputs[0].text.strip().split()), f"request {i}"
        want = reference_tokens(hf, prompt, ("shared", "isolated"), 4, llm.engine.eos_token_ids)
        text = " ".join(tokenizer.decode(want, skip_special_tokens=True).split())
        assert (ex[1], ex[2]) == (str(i), text), f"request {i}"


def test_generate_with_structured_outputs(tmp_path):
    """--json-schema (a file or its text), --choice; a schema keyword that cannot be enforced
    is a clear error before the model loads."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for value in (str(path), json.dumps(schema)):
        r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "60",
                  "--prompt", "Sys ## doc ## question?", "--json-schema", value)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"ok"}
    r = ragkv("generate", "--model", "builtin:tiny", "--json", "--prompt", "q",
              "--choice", "left", "--choice", "right")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] in ("left", "right")
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", "q", "--json-schema",
              '{"type": "string", "format": "email"}')
    assert r.returncode == 2 and "format 'email' is not supported" in r.stderr
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", "q", "--json-object",
              "--choice", "a")
    assert r.returncode == 2 and "not allowed with" in r.stderr
