"""The command line, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys


def ragkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragkv", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_json_rag_prompt():
    r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "5",
              "--prompt", "Sys ## doc one ## doc two ## question?", "--prompt", "plain")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Sys ## doc one ## doc two ## question?", "plain"]
    assert all(len(x["token_ids"]) <= 5 and x["finish_reason"] for x in lines)


def test_generate_with_a_layout():
    prompt = "Sys ## doc one ## doc two ## question?"
    outs = {}
    for flags in ((), ("--position-strategy", "sequential", "--chunk-attention", "standalone")):
        r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "5",
                  "--prompt", prompt, *flags)
        assert r.returncode == 0, r.stderr
        outs[flags] = json.loads(r.stdout)["token_ids"]
    assert all(len(ids) == 5 for ids in outs.values())
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", prompt,
              "--position-strategy", "zigzag")
    assert r.returncode == 2 and "position-strategy" in r.stderr


def test_generate_with_selective_recompute():
    """--recompute flags reach the engine: at r = 0 the sequential layout's tokens (r = 1
    equals a full prefill: test_recompute.py); without sequential positions, a clear error."""
    doc = "Sys ## doc one ## doc two ## question?"
    outs = {}
    for name, extra in (("r1", ("--recompute", "sink+blend", "--recompute-ratio", "1",
                                "--recompute-check-layers", "0,1")),
                        ("r0", ("--recompute", "query", "--recompute-ratio", "0")),
                        ("seq", ())):
        r = ragkv("generate", "--model", "builtin:tiny", "--json", "--max-tokens", "5",
                  "--prompt", doc, "--position-strategy", "sequential", *extra)
        assert r.returncode == 0, r.stderr
        outs[name] = json.loads(r.stdout)["token_ids"]
    assert outs["r0"] == outs["seq"] and len(outs["r1"]) == 5
    r = ragkv("generate", "--model", "builtin:tiny", "--prompt", doc, "--recompute", "blend")
    assert r.returncode != 0 and "position_strategy='sequential'" in r.stderr


def test_generate_bad_model_is_a_clear_error():
    r = ragkv("generate", "--model", "/does/not/exist", "--prompt", "x")
    assert r.returncode == 2
    assert "does not exist" in r.stderr


def test_demo_checks_exactness():
    r = ragkv("demo", "--model", "builtin:tiny", "--num-requests", "4", "--max-tokens", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RANDOM weights" in r.stdout
    assert "4/4 answers identical token for token" in r.stdout
    assert "hit rate" in r.stdout and "speedup" in r.stdout


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
