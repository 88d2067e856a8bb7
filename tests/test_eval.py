"""`ragkv eval` on a tiny random model: the report's counts add up, a mode identical to the
reference scores KL 0 and full top-1 agreement, and the reuse modes' figures are well formed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from ragkv import LLM, SamplingParams
from ragkv.eval.evaluate import _run, _run_all, evaluate, pick_items, summarize, wilson_interval
from ragkv.eval.modes import MODES, EvalMode, get_mode, recompute_mode_settings, register_mode
from ragkv.eval.suite import TASKS, build_suite


@pytest.fixture(scope="module")
def tiny():
    return LLM("builtin:tiny", dtype="float32", device="cpu")


def test_cli_report_counts_add_up(tmp_path):
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, "-m", "ragkv", "eval", "--model", "builtin:tiny", "--device", "cpu",
         "--limit", "7", "--num-per-task", "4", "--max-tokens", "4", "--json", str(out),
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "overall" in r.stdout
    report = json.loads(out.read_text())
    modes = ["full", "chunk", "sequential", "standalone"]
    assert report["num_items"] == 7 and report["modes"] == modes
    assert len(report["items"]) == 7 * len(modes)
    for mode, data in report["summary"].items():
        overall, by_task = data["overall"], data["by_task"]
        assert overall["n"] == 7 == sum(g["n"] for g in by_task.values())
        assert overall["correct"] == sum(g["correct"] for g in by_task.values())
        assert overall["correct"] == sum(i["correct"] for i in report["items"]
                                         if i["mode"] == mode)
        assert set(by_task) == set(TASKS)  # round-robin: 7 items cover all 5 tasks
        if mode == "full":
            assert overall["kl"] is None and overall["top1_agreement"] is None
        else:
            assert overall["kl"] >= 0 and 0 <= overall["top1_agreement"] <= 1


def test_mode_equal_to_reference_scores_kl_zero(tiny):
    if "full-again" not in MODES:
        full = get_mode("full")
        register_mode(EvalMode("full-again", "the reference again", full.build))
    items = pick_items(build_suite(3, seed=1), 5)
    results = evaluate(tiny, items, ["full-again", "chunk", "sequential", "standalone"],
                       max_tokens=3, progress=False)
    summary = summarize(results)
    assert list(summary) == ["full", "full-again", "chunk", "sequential", "standalone"]
    again = summary["full-again"]["overall"]
    assert again["top1_agreement"] == 1.0
    assert abs(again["kl"]) < 1e-6
    assert again["gold_logprob"] == pytest.approx(summary["full"]["overall"]["gold_logprob"],
                                                  abs=1e-4)
    full_answers = [r.prediction for r in results if r.mode == "full"]
    assert [r.prediction for r in results if r.mode == "full-again"] == full_answers
    for name in ("chunk", "sequential", "standalone"):
        mode = summary[name]["overall"]
        # Random weights: isolated chunks change the distributions, measurably.
        assert mode["kl"] > 1e-6 and math.isfinite(mode["gold_logprob"])
        assert mode["warm_requests"] >= 0
    # Each layout computes something of its own.
    assert len({summary[m]["overall"]["gold_logprob"]
                for m in ("chunk", "sequential", "standalone")}) == 3
    tiny.check_integrity()


def test_recompute_modes_span_sequential_to_full(tiny):
    """`METHOD@RATIO` modes: r = 0 scores exactly like `sequential`, r = 1 like `full`, and
    the probe of `query` does not see the gold answer (the scored tokens), so generation and
    scoring choose the same tokens."""
    items = pick_items(build_suite(3, seed=2), 4)
    results = evaluate(tiny, items, ["sequential", "query@0", "query@0.3", "blend@1"],
                       max_tokens=3, progress=False)
    summary = {m: s["overall"] for m, s in summarize(results).items()}
    assert summary["query@0"]["gold_logprob"] == pytest.approx(
        summary["sequential"]["gold_logprob"], abs=1e-4)
    assert summary["blend@1"]["gold_logprob"] == pytest.approx(
        summary["full"]["gold_logprob"], abs=1e-4)
    assert abs(summary["blend@1"]["kl"]) < 1e-6
    # The probe of `query` leaves the scored answer out: scoring two different answers gives
    # the same distribution after the question (the same recomputed tokens), and that is the
    # distribution generation samples its first token from.
    mode, tokenizer = get_mode("query@0.3"), tiny.get_tokenizer()
    score = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    for item in items:
        prompt = tiny.engine.process_chat(
            [{"role": "system", "content": item.system},
             {"role": "user", "content": item.question}], documents=list(item.documents))
        rows = []
        for answer in (item.answer, "a different answer entirely, and longer"):
            gold = tokenizer.encode(answer, add_special_tokens=False)
            scored = _run(tiny, mode.build(prompt, gold), score, score_tokens=len(gold) + 1)
            rows.append(scored.score_logprobs[0])
        # Float noise between the two batch shapes is ~1e-6; a probe that saw the answer
        # recomputes other tokens and moves the row by ~1e-3.
        assert torch.allclose(rows[0], rows[1], atol=1e-5, rtol=0)
        first = _run(tiny, mode.build(prompt, []), score).outputs[0].token_ids[0]
        assert first == int(rows[0].argmax())
    assert get_mode("sink+query@0.15").description.startswith("sequential-isolated")
    assert get_mode("query@0.1:0.5:0.9/1.5").description.endswith("damped by 1.5")
    assert recompute_mode_settings("query@0.2/1")["recompute_damping"] == 1.0
    assert "recompute_damping" not in recompute_mode_settings("query@0.2")
    for bad, fragment in (("blend@x", "after .@. comes a ratio"), ("blend@2", "recompute_ratio"),
                          ("magic@0.1", "recompute must be one of"),
                          ("query@0.2/x", "after ./. comes a damping"),
                          ("query@0.2/-1", "recompute_damping")):
        with pytest.raises(ValueError, match=fragment):
            get_mode(bad)
    tiny.check_integrity()


def test_primed_modes_on_an_engine_with_a_chunk_primer():
    """`+primer` modes compute later documents after the engine's primer: they score
    otherwise than their base modes, r = 1 still scores like `full`, the base modes are
    untouched by the engine's primer, and `+primer` on a layout it does not apply to, or on
    an engine without a primer, is a clear error."""
    from ragkv.eval.modes import engine_primer

    assert engine_primer(["full", "query@0.2+primer"], None) == "default"
    assert engine_primer(["full", "sequential"], None) is None
    assert engine_primer(["sequential+primer"], "text") == "text"
    primed = LLM("builtin:tiny", dtype="float32", device="cpu", chunk_primer="default")
    items = pick_items(build_suite(3, seed=4), 4)
    names = ["sequential", "sequential+primer", "query@0.3+primer", "blend@1+primer"]
    summary = {m: s["overall"] for m, s in summarize(evaluate(
        primed, items, names, max_tokens=3, progress=False)).items()}
    assert summary["sequential+primer"]["gold_logprob"] != pytest.approx(
        summary["sequential"]["gold_logprob"], abs=1e-4)
    assert summary["blend@1+primer"]["gold_logprob"] == pytest.approx(
        summary["full"]["gold_logprob"], abs=1e-4)
    assert 0 < summary["query@0.3+primer"]["recomputed_mean"] <= 0.31
    plain = {m: s["overall"] for m, s in summarize(evaluate(
        LLM("builtin:tiny", dtype="float32", device="cpu"), items, ["sequential"],
        max_tokens=3, progress=False)).items()}
    assert plain["sequential"]["gold_logprob"] == pytest.approx(
        summary["sequential"]["gold_logprob"], abs=1e-4)
    assert get_mode("query@0.2+primer").description.endswith("after the chunk primer")
    with pytest.raises(ValueError, match="sequential-isolated modes"):
        get_mode("chunk+primer")
    with pytest.raises(ValueError, match="chunk_primer=true needs"):
        evaluate(LLM("builtin:tiny", dtype="float32", device="cpu", chunk_primer="none"),
                 items[:1], ["sequential+primer"], max_tokens=2, progress=False)
    primed.check_integrity()


def test_batched_eval_equals_one_request_at_a_time(tiny):
    """Questions and modes in flight together give each request what it gets alone (up to
    the order of float sums): same answers and correctness, gold log-likelihoods within 1e-4;
    the summary's interval and paired counts and the recomputed fractions are well formed."""
    items = pick_items(build_suite(3, seed=3), 6)
    modes = ["chunk", "sequential", "blend@0.5", "query@0.1:0.6:0.7"]
    alone = evaluate(tiny, items, modes, max_tokens=4, progress=False, batch_size=1)
    tiny.check_integrity()
    batched = evaluate(tiny, items, modes, max_tokens=4, progress=False, batch_size=4)
    tiny.check_integrity()
    assert not tiny.engine.has_unfinished_requests()
    assert [(r.item_id, r.mode) for r in alone] == [(r.item_id, r.mode) for r in batched]
    for a, b in zip(alone, batched, strict=True):
        assert (a.prediction, a.correct) == (b.prediction, b.correct), (a.item_id, a.mode)
        assert a.gold_logprob == pytest.approx(b.gold_logprob, abs=1e-4)
        assert a.recomputed_fraction == b.recomputed_fraction
    summary = summarize(batched)
    for mode, data in summary.items():
        g = data["overall"]
        lo, hi = g["accuracy_ci95"]
        assert 0 <= lo <= g["accuracy"] <= hi <= 1
        if mode == "full":
            assert data["agreement"] is None and g["recomputed_mean"] is None
        else:
            assert sum(data["agreement"].values()) == len(items)
            assert data["agreement"]["both"] + data["agreement"]["mode_only"] == g["correct"]
    assert summary["chunk"]["overall"]["recomputed_mean"] == 0
    assert summary["blend@0.5"]["overall"]["recomputed_mean"] == pytest.approx(0.5, abs=0.02)
    adaptive = [r.recomputed_fraction for r in batched if r.mode == "query@0.1:0.6:0.7"]
    assert all(0.1 - 1e-9 <= f <= 0.6 + 0.02 for f in adaptive), adaptive
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(tiny, items, modes, progress=False, batch_size=0)


def test_a_failed_eval_request_leaves_the_engine_idle(tiny):
    bad = {"prompt_token_ids": [10**9]}  # outside the vocabulary: refused at add_request
    good = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        _run_all(tiny, [(good, params, 0), (bad, params, 0)], 2)
    assert not tiny.engine.has_unfinished_requests()
    tiny.check_integrity()


def test_wilson_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(150, 300)
    assert lo == pytest.approx(0.4437, abs=1e-3) and hi == pytest.approx(0.5563, abs=1e-3)
    assert wilson_interval(0, 20)[0] == 0 and wilson_interval(20, 20)[1] == 1


def test_unknown_mode_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="unknown eval mode 'nope'"):
        evaluate(tiny, pick_items(build_suite(1), 1), ["nope"], progress=False)


def test_a_base_model_is_prompted_with_plain_text_and_a_lead_in(tiny, monkeypatch):
    """A tokenizer without a chat template (a base model, e.g. Gemma 3 270M) gets the system
    line, the documents and "Question: ...\\nAnswer:" as text; a chat model its template."""
    from ragkv.eval.evaluate import question_prompt

    engine = tiny.engine
    chat = question_prompt(engine, "Be brief.", ["Doc one.", "Doc two."], "Who?")
    assert len(chat.chunks) == 2
    assert not engine.tokenizer.decode(chat.question).endswith("Answer:")
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    plain = question_prompt(engine, "Be brief.", ["Doc one.", "Doc two."], "Who?")
    decode = engine.tokenizer.decode
    assert decode(plain.system, skip_special_tokens=True) == "Be brief.\n\n"
    assert [decode(c) for c in plain.chunks] == ["Doc one.\n\n", "Doc two.\n\n"]
    assert decode(plain.question) == "Question: Who?\nAnswer:"
    out = tiny.generate(plain, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert out[0].metrics.num_chunk_misses == 2
    tiny.check_integrity()
