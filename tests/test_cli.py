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
    return path, hf_model(path), LLM(path, chunk_separator="##")


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
              "--ignore-eos", "--chunk-separator", "##", "--prompt", RAG_TEXT, *flags)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["num_prompt_tokens"] == num_prompt_tokens
    return out["token_ids"]


def test_generate_json_rag_prompt():
    """With --chunk-separator a `##` prompt is split into system, documents and question
    (fewer tokens: the separators are markup); without it, it is text like any other."""
    prompts = ("--prompt", "Sys ## doc one ## doc two ## question?", "--prompt", "plain")
    runs = {}
    for flags in ((), ("--chunk-separator", "##")):
        r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "5",
                  *flags, *prompts)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(line) for line in r.stdout.splitlines()]
        assert [x["prompt"] for x in lines] == ["Sys ## doc one ## doc two ## question?",
                                                 "plain"]
        assert all(len(x["token_ids"]) <= 5 and x["finish_reason"] for x in lines)
        runs[flags] = [x["num_prompt_tokens"] for x in lines]
    assert runs[()][0] > runs["--chunk-separator", "##"][0]
    assert runs[()][1] == runs["--chunk-separator", "##"][1]


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
    adaptive recompute: 10% to 50% of the document tokens, the chunk primer), cold and warm;
    each printed answer equals the same prompt computed with the caches off (an engine built
    here, and the demo's own check). Its exact-reuse answers (shared positions, no
    recompute) are HF's one-pass reference answers, decoded and printed as the demo prints
    them."""
    path, hf, llm = llama
    # 8 requests: the first whose documents are all cached in their roles (first, or after
    # the chunk primer) is the seventh.
    r = ragkv("demo", "--model", path, "--num-requests", "8", "--max-tokens", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("Default RAG mode: positions sequential, chunk attention isolated, recompute "
            "query, the fewest tokens holding 0.9 of the scores, 0.1 to 0.5") in r.stdout
    assert ("later documents after the chunk primer (no calibrated profile for this model"
            in r.stdout)
    assert "default mode: 8/8 answers identical token for token" in r.stdout
    assert "exact chunk reuse: 8/8 answers identical token for token" in r.stdout
    assert "hit rate" in r.stdout and "speedup" in r.stdout
    rows = [m for line in r.stdout.splitlines() if (m := DEMO_ROW.match(line))]
    exact = [m for line in r.stdout.splitlines() if (m := EXACT_ROW.match(line))]
    requests = _requests(llm, 8)
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


# ------------------------------------------------------------------- vLLM's CLI conventions


def test_every_flag_of_every_command_has_help():
    """`ragkv CMD --help` explains every flag (no bare names)."""
    import argparse

    from ragkv.entrypoints.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) >= {"serve", "generate", "bench", "eval", "calibrate", "demo",
                                     "precompute"}
    for name, command in commands.choices.items():
        bare = [a.option_strings or a.dest for a in command._actions
                if not (a.help or "").strip()]
        assert not bare, f"ragkv {name}: flags without help: {bare}"


def test_model_as_argument_or_flag_on_every_command(monkeypatch, capsys):
    """MODEL and --model name the same thing, on every command that loads one; both, if they
    differ, or neither where the command has no default, is a clear error."""
    from ragkv.entrypoints import cli

    seen = []
    monkeypatch.setattr(cli, "_generate", lambda args: seen.append(args.model) or 0)
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(args.model) or 0)
    for argv in (["generate", "builtin:tiny", "--prompt", "q"],
                 ["generate", "--model", "builtin:tiny", "--prompt", "q"],
                 ["generate", "builtin:tiny", "--model", "builtin:tiny", "--prompt", "q"],
                 ["serve", "builtin:tiny"], ["serve", "--model", "builtin:tiny"]):
        assert cli.main(argv) == 0
    assert seen == ["builtin:tiny"] * 5
    assert cli.main(["generate", "--prompt", "q"]) == 0 and seen[-1] == "builtin:small"
    for argv, fragment in ((["serve"], "no model given"),
                           (["serve", "a", "--model", "b"], "two models given")):
        assert cli.main(argv) == 2 and fragment in capsys.readouterr().err


def test_config_file_gives_flags_the_command_line_overrides(tmp_path, monkeypatch, capsys):
    """--config FILE (vLLM's YAML: keys are flag names, either spelling) gives the command's
    defaults: a switch takes true or false, a flag of several values (or a repeatable one) a
    list, a value may start with a dash; the command line (its MODEL too) wins. An unknown
    key, a null, a list for a one-value flag, a second or abbreviated --config are errors."""
    from ragkv.entrypoints import cli

    got = []
    monkeypatch.setattr(cli, "_serve", lambda args: got.append(args) or 0)
    monkeypatch.setattr(cli, "_generate", lambda args: got.append(args) or 0)
    config = tmp_path / "serve.yaml"

    def run(text: str, *argv: str) -> int:
        config.write_text(text)
        return cli.main([*argv[:1], "--config", str(config), *argv[1:]])

    assert run("model: builtin:tiny\nmax-model-len: 512\nport: 9001\n"
               "enable_prefix_caching: false\nserved-model-name: [a, b]\n"
               "chunk-separator: '##'\nvllm-metric-names: false\n", "serve", "--port", "9002") == 0
    args = got[-1]
    assert (args.model, args.max_model_len, args.port, args.enable_prefix_caching,
            args.served_model_name, args.chunk_separator, args.vllm_metric_names) == (
        "builtin:tiny", 512, 9002, False, ["a", "b"], "##", False)
    # One name for a flag of several, the command line's MODEL over the file's, a dash value.
    assert run("model: builtin:small\nserved-model-name: foo\nchunk-separator: '--'\n"
               "recompute-check-layers: '1,2'\n", "serve", "builtin:tiny") == 0
    args = got[-1]
    assert (args.model, args.served_model_name, args.chunk_separator,
            args.recompute_check_layers) == ("builtin:tiny", ["foo"], "--", (1, 2))
    assert run("prompt: [one, two]\nmax-tokens: 3\n", "generate") == 0  # --prompt required
    assert (got[-1].prompt, got[-1].max_tokens) == (["one", "two"], 3)
    capsys.readouterr()
    for text, argv, fragment in (
            ("bogus-flag: 1\n", ("serve", "m"), "'bogus-flag' is not a flag"),
            ("chunk-separator: ##\n", ("serve", "m"), "has no value"),
            ("recompute-check-layers: [1, 2]\n", ("serve", "m"), "takes one value"),
            ("enforce-eager: yes please\n", ("serve", "m"), "give true or false"),
            ("port: many\n", ("serve", "m"), "port"),
            ("dtype: [a\n", ("serve", "m"), "not valid YAML")):
        assert run(text, *argv) == 2, text
        assert fragment in capsys.readouterr().err, text
    config.write_text("port: 1\n")
    assert cli.main(["serve", "m", "--config", str(config), "--config", str(config)]) == 2
    assert "more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses a bare --conf without its value
        cli.main(["serve", "m", "--conf"])
    assert cli.main(["serve", "m", "--conf", str(config)]) == 2
    assert "spell out --config" in capsys.readouterr().err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_gpu_memory_utilization_sizes_the_pool_from_the_device():
    """--gpu-memory-utilization: the KV cache gets the share of the device's memory the loaded
    model leaves (less a sixteenth for activations); on CPU it is refused with the flags that
    size a CPU pool."""
    from ragkv.cache.kv_pool import kv_tokens_for_utilization
    from ragkv.config import EngineConfig

    gib = 1 << 30
    # 80 GiB device, 10 GiB in use: 0.9 -> 72 - 10 = 62 GiB, 15/16 of it for the KV cache.
    assert kv_tokens_for_utilization(0.9, 70 * gib, 80 * gib, 1024) == 62 * gib * 15 // 16 // 1024
    with pytest.raises(ValueError, match="leaves no room"):
        kv_tokens_for_utilization(0.1, 70 * gib, 80 * gib, 1024)
    for bad in (0.0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model="builtin:tiny", gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="at most one of"):
        EngineConfig(model="builtin:tiny", gpu_memory_utilization=0.5, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="--kv-cache-tokens"):
        LLM("builtin:tiny", device="cpu", gpu_memory_utilization=0.9)
