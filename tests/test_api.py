"""The offline API (`LLM.generate`) and what it does with bad input: vLLM-shaped outputs,
input order, per-prompt SamplingParams, ValueErrors that name the field and leave the engine
usable, SamplingParams validation, model-loading errors, sharded checkpoints, EOS ids from
generation_config.json, stop strings, n > 1 and max_tokens=None."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from conftest import VOCAB, random_prompt

from ragkv import LLM, CompletionOutput, RequestOutput, SamplingParams
from ragkv.model.builtin import save_builtin_tokenizer

GREEDY5 = SamplingParams(max_tokens=5, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny")


@pytest.fixture(scope="module")
def llm64():
    return LLM("builtin:tiny", max_model_len=64)


def greedy(llm: LLM, prompt, max_tokens: int = 8, **kw) -> CompletionOutput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def assert_idle(llm: LLM) -> None:
    """No request is left queued or running and the KV accounting adds up."""
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_running == 0 and stats.num_waiting == 0
    llm.check_integrity()


# --------------------------------------------------------------------------- output shape


def test_generate_returns_vllm_shaped_request_output(llm):
    outs = llm.generate("some text", GREEDY5, use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput)
    assert isinstance(out.request_id, str) and out.request_id
    assert out.prompt == "some text"
    assert out.prompt_token_ids[0] == 1  # BOS
    assert out.prompt_token_ids == llm.get_tokenizer().encode("some text")
    assert out.finished is True
    assert len(out.outputs) == 1
    comp = out.outputs[0]
    assert isinstance(comp, CompletionOutput)
    assert comp.index == 0
    assert isinstance(comp.text, str)
    assert 1 <= len(comp.token_ids) <= 5
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in comp.token_ids)
    assert comp.finish_reason in {"length", "stop"}
    assert comp.finished()
    assert comp.cumulative_logprob is None and comp.logprobs is None
    assert isinstance(out.num_cached_tokens, int) and out.num_cached_tokens >= 0
    metrics = out.metrics
    assert metrics is not None
    assert metrics.first_token_time is not None
    assert metrics.ttft is not None and metrics.ttft > 0
    assert metrics.finished_time is not None and metrics.e2e_latency >= metrics.ttft
    # The text is the detokenized output (no stop token to strip at length).
    if comp.finish_reason == "length":
        assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
    llm.check_integrity()


def test_mixed_prompts_come_back_in_input_order(llm):
    ids = random_prompt(7, seed=3)
    prompts = ["Once upon a time", {"prompt_token_ids": ids}, "The garden is green",
               {"prompt_token_ids": [1, 50, 60]}]
    outs = llm.generate(prompts, GREEDY5, use_tqdm=False)
    assert len(outs) == 4
    assert outs[0].prompt == "Once upon a time"
    assert outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert outs[2].prompt == "The garden is green"
    assert outs[3].prompt_token_ids == [1, 50, 60]
    assert len({o.request_id for o in outs}) == 4
    # Each equals the same prompt run alone.
    for prompt, out in zip(prompts, outs, strict=True):
        assert greedy(llm, prompt, 5).token_ids == out.outputs[0].token_ids
    llm.check_integrity()


def test_one_sampling_params_per_prompt(llm):
    prompts = ["Once upon a time", {"prompt_token_ids": [1, 70, 80, 90]}, "some text"]
    params = [SamplingParams(max_tokens=2, temperature=0),
              SamplingParams(max_tokens=4, temperature=0, logprobs=1),
              SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][1] == [1, 70, 80, 90]
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens[0] <= 2 and lens[1] <= 4 and lens[2] == 3
    assert outs[0].outputs[0].logprobs is None
    assert outs[1].outputs[0].logprobs is not None
    assert len(outs[1].outputs[0].logprobs) == lens[1]
    # A tuple works as well as a list.
    again = llm.generate(prompts, tuple(params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    llm.check_integrity()


@pytest.mark.parametrize("num_params", [1, 3])
def test_wrong_number_of_sampling_params_raises(llm, num_params):
    params = [SamplingParams(max_tokens=2)] * num_params
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], params, use_tqdm=False)
    assert_idle(llm)


def test_empty_prompt_list_returns_empty_list(llm):
    assert llm.generate([], GREEDY5, use_tqdm=False) == []
    assert_idle(llm)


# --------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "string_too_long": ("word " * 200, None, r"max_model_len=64"),
    "ids_too_long": ({"prompt_token_ids": [1] + [50] * 64}, None, r"65 tokens.*max_model_len=64"),
    "empty_string": ("", None, r"prompt is empty"),
    "empty_ids": ({"prompt_token_ids": []}, None, r"empty"),
    "id_eq_vocab": ({"prompt_token_ids": [1, 20, VOCAB]}, None, rf"{VOCAB}.*vocabulary"),
    "id_above_vocab": ({"prompt_token_ids": [1, 10**6]}, None, r"1000000.*vocabulary"),
    "negative_id": ({"prompt_token_ids": [1, -1, 20]}, None, r"-1.*vocabulary"),
    "non_int_id": ({"prompt_token_ids": [1, "a"]}, None, r"prompt_token_ids"),
    "bool_id": ({"prompt_token_ids": [1, True]}, None, r"prompt_token_ids"),
    "ids_not_a_list": ({"prompt_token_ids": "1 2 3"}, None, r"prompt_token_ids"),
    "dict_without_ids": ({"text": "hello"}, None, r"prompt_token_ids"),
    "int_prompt_in_list": ([5], None, r"unsupported prompt type int"),
    "none_prompt_in_list": ([None], None, r"unsupported prompt type NoneType"),
    "float_prompt_in_list": ([1.5], None, r"unsupported prompt type float"),
    "logprobs_21": ("hello", SamplingParams(logprobs=21), r"logprobs=21.*max_logprobs=20"),
    "params_not_sampling_params": ("hello", [{"temperature": 0}], r"sampling_params"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_value_error_and_engine_survives(llm64, case):
    prompt, params, match = BAD_INPUTS[case]
    before = llm64.engine.stats()
    with pytest.raises(ValueError, match=match):
        llm64.generate(prompt, params, use_tqdm=False)
    after = llm64.engine.stats()
    assert after.kv_free_tokens == before.kv_free_tokens
    assert_idle(llm64)
    out = greedy(llm64, "The garden is green", 4)
    assert 1 <= len(out.token_ids) <= 4
    assert_idle(llm64)


def test_max_model_len_bounds_prompt_plus_output_exactly(llm64):
    """Regression (issue 8, defect 9): a prompt of exactly max_model_len tokens was accepted
    and then generated a token (65 tokens in a 64-token sequence). max_model_len bounds prompt
    plus output: 63 prompt tokens generate exactly one token, 64 are refused."""
    with pytest.raises(ValueError, match=r"64 tokens.*max_model_len=64.*at most 63"):
        llm64.generate({"prompt_token_ids": random_prompt(64, seed=9)},
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert_idle(llm64)
    out = llm64.generate({"prompt_token_ids": random_prompt(63, seed=9)},
                         SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert_idle(llm64)


@pytest.mark.parametrize("prompt", [5, None])
def test_bare_unsupported_prompt_raises_value_error(llm64, prompt):
    with pytest.raises(ValueError, match="unsupported prompt type"):
        llm64.generate(prompt, GREEDY5, use_tqdm=False)
    assert_idle(llm64)


@pytest.mark.parametrize("bad", [
    ("", SamplingParams(max_tokens=3)),
    ({"prompt_token_ids": [1, VOCAB + 5]}, SamplingParams(max_tokens=3)),
    ("fine prompt", SamplingParams(max_tokens=3, logprobs=99)),
], ids=["empty", "bad_id", "logprobs"])
def test_batch_with_only_last_prompt_bad_runs_nothing(llm64, bad):
    engine = llm64.engine
    greedy(llm64, "warm the prefix cache", 3)
    before = engine.stats()
    prompts = ["Once upon a time", {"prompt_token_ids": random_prompt(30, seed=1)},
               "The garden is green", bad[0]]
    params = [SamplingParams(max_tokens=3)] * 3 + [bad[1]]
    with pytest.raises(ValueError):
        llm64.generate(prompts, params, use_tqdm=False)
    after = engine.stats()
    # Nothing was scheduled: no prefix lookups, no slots taken, nothing queued.
    assert after.prefix_queried_tokens == before.prefix_queried_tokens
    assert after.kv_free_tokens == before.kv_free_tokens
    assert_idle(llm64)
    outs = llm64.generate(prompts[:3], SamplingParams(max_tokens=3, temperature=0),
                          use_tqdm=False)
    assert len(outs) == 3 and all(o.finished for o in outs)
    assert_idle(llm64)


def test_logprobs_above_vocab_size_rejected_up_front():
    llm = LLM("builtin:tiny", max_logprobs=VOCAB + 100)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hello", SamplingParams(max_tokens=2, logprobs=VOCAB + 1), use_tqdm=False)
    assert_idle(llm)


# --------------------------------------------------------------------------- SamplingParams

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"max_tokens": -1}, "max_tokens"),  # 0 is valid: the prompt is only scored
    ({"max_tokens": -3}, "max_tokens"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 2}, "stop_token_ids"),
    ({"seed": "a"}, "seed"),
    ({"seed": 1.0}, "seed"),
]


@pytest.mark.parametrize("kwargs,name", BAD_PARAMS, ids=[
    f"{k}={v!r}" for (kw, _) in BAD_PARAMS for k, v in kw.items()])
def test_sampling_params_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_rejects_nan_temperature():
    with pytest.raises(ValueError, match=r"^temperature\b"):
        SamplingParams(temperature=float("nan"))


def test_sampling_params_normalisation_and_defaults():
    p = SamplingParams(top_k=-1, stop="x")
    assert p.top_k == 0
    assert p.stop == ["x"]
    d = SamplingParams()
    assert (d.n, d.temperature, d.top_p, d.top_k, d.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert d.max_tokens == 16 and d.seed is None and d.logprobs is None
    assert d.stop == [] and d.stop_token_ids == []
    assert not d.ignore_eos and d.skip_special_tokens
    assert SamplingParams(temperature=0).is_greedy and not d.is_greedy
    # Boundary values are accepted.
    SamplingParams(top_p=1.0, min_p=0.0, logprobs=0, max_tokens=None, seed=0, temperature=0)
    SamplingParams(top_p=1e-9, min_p=1.0, top_k=1, stop_token_ids=[0], stop=["a", "b"])
    c = p.clone(temperature=0.5)
    assert c.temperature == 0.5 and c.stop == ["x"] and c.top_k == 0
    with pytest.raises(ValueError, match="^top_p"):
        p.clone(top_p=2.0)


# --------------------------------------------------------------------------- model loading


def _copy_config(src: str, dst) -> None:
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))


def test_model_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(missing)


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_model_dir_without_safetensors(tmp_path, checkpoint):
    _copy_config(checkpoint("llama"), tmp_path / "noweights")
    save_builtin_tokenizer(str(tmp_path / "noweights"))
    with pytest.raises(ValueError, match=r"safetensors"):
        LLM(str(tmp_path / "noweights"))


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 100,
        "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}))
    with pytest.raises(ValueError) as info:
        LLM(str(d))
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert arch in msg


def test_unknown_keyword_argument_is_type_error():
    with pytest.raises(TypeError, match="max_batch_size"):
        LLM("builtin:tiny", max_batch_size=4)


def test_kv_cache_smaller_than_explicit_max_model_len():
    with pytest.raises(ValueError, match=r"max_model_len=64"):
        LLM("builtin:tiny", kv_cache_tokens=32, max_model_len=64)


def test_small_kv_cache_caps_implicit_max_model_len():
    llm = LLM("builtin:tiny", kv_cache_tokens=48)
    limit = llm.engine.max_model_len
    assert 1 < limit <= 48
    with pytest.raises(ValueError, match=f"max_model_len={limit}"):
        llm.generate({"prompt_token_ids": [1] + [60] * limit}, GREEDY5, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 60, 61]},
                       SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == limit
    assert_idle(llm)


@pytest.mark.parametrize("kwargs,name", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"kv_cache_tokens": 10, "kv_cache_memory_bytes": 10**6}, "kv_cache_tokens"),
    ({"dtype": "float8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"max_model_len": 10**6}, "max_model_len"),
])
def test_bad_engine_config_raises_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM("builtin:tiny", **kwargs)


def test_unknown_builtin_model():
    with pytest.raises(ValueError, match=r"builtin:nope|nope.*builtin:tiny"):
        LLM("builtin:nope")


def test_sharded_checkpoint_matches_unsharded(tmp_path, checkpoint, hf_model):
    path = checkpoint("llama")
    sharded = tmp_path / "sharded"
    hf_model(path).save_pretrained(str(sharded), max_shard_size="100KB")
    save_builtin_tokenizer(str(sharded))
    assert (sharded / "model.safetensors.index.json").is_file()
    shards = [n for n in os.listdir(sharded) if n.endswith(".safetensors")]
    assert len(shards) > 1
    assert not (sharded / "model.safetensors").exists()
    one, many = LLM(path), LLM(str(sharded))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (5, 23)]
    a = one.generate(prompts, params, use_tqdm=False)
    b = many.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert math.isclose(x.outputs[0].cumulative_logprob, y.outputs[0].cumulative_logprob,
                            abs_tol=1e-5)
    one.check_integrity()
    many.check_integrity()


def test_sharded_index_naming_a_missing_shard(tmp_path, checkpoint, hf_model):
    sharded = tmp_path / "broken"
    hf_model(checkpoint("llama")).save_pretrained(str(sharded), max_shard_size="100KB")
    save_builtin_tokenizer(str(sharded))
    victim = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))[0]
    os.remove(sharded / victim)
    with pytest.raises(ValueError, match="missing shards"):
        LLM(str(sharded))


def test_eos_ids_come_from_generation_config(llm):
    assert {2, 5} <= set(llm.engine.eos_token_ids)


# --------------------------------------------------------------------------- generation


def _clean_window(text: str, lo: int, width: int) -> int:
    """Index of the first window at or after `lo` that is not blank, holds no partial UTF-8
    character and does not occur earlier in the text."""
    for i in range(lo, len(text) - width + 1):
        window = text[i:i + width]
        if "\ufffd" not in window and window.strip() and text.find(window) == i:
            return i
    raise AssertionError(f"no clean window in {text!r} after {lo}")


def test_stop_string_cuts_text_before_it(llm):
    tok = llm.get_tokenizer()
    prompt = "The garden is green and"
    full = greedy(llm, prompt, 16, ignore_eos=True)
    text = full.text
    assert len(full.token_ids) == 16
    # Clean windows (no partial UTF-8 character) from the middle and the end of the text.
    start = _clean_window(text, len(text) // 3, 4)
    stop = text[start:start + 4]
    cut = text.find(stop)
    # The output keeps the tokens up to the one that completed the stop string.
    k = next(k for k in range(1, 17)
             if stop in tok.decode(full.token_ids[:k], skip_special_tokens=True))
    out = greedy(llm, prompt, 16, ignore_eos=True, stop=[stop])
    assert out.text == text[:cut]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == full.token_ids[:k]
    # With two stop strings, the first to appear wins whatever the list order.
    late = _clean_window(text, start + 6, 3)
    later = text[late:late + 3]
    both = greedy(llm, prompt, 16, ignore_eos=True, stop=[later, stop])
    assert both.text == text[:cut] and both.stop_reason == stop
    # A stop string that never appears changes nothing.
    none = greedy(llm, prompt, 16, ignore_eos=True, stop=["\x00never\x00"])
    assert none.token_ids == full.token_ids and none.text == text
    assert none.finish_reason == "length" and none.stop_reason is None
    llm.check_integrity()


def test_stop_token_id_is_kept_in_ids_but_not_in_text(llm):
    tok = llm.get_tokenizer()
    full = greedy(llm, "Once upon a time", 10, ignore_eos=True)
    stop_id = full.token_ids[4]
    k = full.token_ids.index(stop_id) + 1
    out = greedy(llm, "Once upon a time", 10, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[:k]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == tok.decode(full.token_ids[:k - 1], skip_special_tokens=True)
    llm.check_integrity()


def test_n_completions_sampled_and_greedy(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6)
    out = llm.generate("Once upon a time", params, use_tqdm=False)
    assert len(out) == 1
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert all(1 <= len(c.token_ids) <= 6 and c.finish_reason for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) > 1
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]

    pair = llm.generate("Once upon a time", SamplingParams(n=2, temperature=0, max_tokens=6),
                        use_tqdm=False)[0].outputs
    assert [c.index for c in pair] == [0, 1]
    assert pair[0].token_ids == pair[1].token_ids and pair[0].text == pair[1].text
    assert pair[0].token_ids == greedy(llm, "Once upon a time", 6).token_ids
    llm.check_integrity()


def test_n_completions_in_a_batch_keep_prompt_order(llm):
    prompts = ["Once upon a time", "some text"]
    params = [SamplingParams(n=2, temperature=0, max_tokens=4),
              SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs) for o in outs] == [2, 3]
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    llm.check_integrity()


def test_max_tokens_none_runs_to_max_model_len():
    llm = LLM("builtin:tiny", max_model_len=40)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    outs = llm.generate(["some text", {"prompt_token_ids": random_prompt(25, seed=2)}], params,
                        use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert len(out.prompt_token_ids) + len(comp.token_ids) == 40
        assert comp.finish_reason == "length"
    # An explicit max_tokens beyond the room left is capped the same way.
    capped = llm.generate("some text", params.clone(max_tokens=1000), use_tqdm=False)[0]
    assert len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids) == 40
    assert capped.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_idle(llm)


def test_request_metrics_of_n_samples_end_with_the_last(llm):
    """A request with n samples finishes when its last one does: its metrics say so (the
    server's end-to-end latency and preemption series read them)."""
    engine = llm.engine
    rid = engine.add_request("Once upon a time", SamplingParams(n=2, max_tokens=6,
                                                               ignore_eos=True))
    children = list(engine.outputs._parents[rid])
    children[0].max_tokens = 2  # sample 0 finishes steps before sample 1
    children[1].metrics.num_preemptions = 3  # as if the scheduler had preempted it
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid), final)
    assert [len(o.token_ids) for o in final.outputs] == [2, 6]
    assert children[0].metrics.finished_time < children[1].metrics.finished_time
    assert final.metrics.finished_time == children[1].metrics.finished_time
    assert final.metrics.num_preemptions == 3
    llm.check_integrity()
