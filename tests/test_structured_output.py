"""Structured outputs through the engine: the per-state token masks against a token-by-token
check, constrained greedy decoding against a brute-force loop over HF transformers' logits (RAG
prompt, cold and warm, beside an unconstrained request), sampled outputs that parse, choices,
and bad constraints as clear errors. The byte automata alone: test_json_grammar.py."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
from conftest import random_prompt
from reference import extend_layout, layout_reference, reference_logits

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.structured import json_grammar, token_grammar
from ragkv.structured.json_schema import json_schema_grammar
from ragkv.structured.params import StructuredOutputsParams
from ragkv.structured.token_grammar import StructuredOutputs, TokenGrammar
from ragkv.structured.vocabulary import TokenVocabulary, token_bytes

# Every value is bounded (whitespace runs too), so any model must close the object: a
# constrained sample always ends with finish_reason "stop".
BOUNDED = {"type": "object",
           "properties": {"ok": {"type": "boolean"},
                          "kind": {"enum": ["cat", "dog", 3, None]},
                          "tags": {"type": "array", "items": {"const": "x"}, "maxItems": 2}},
           "required": ["ok", "kind"]}
OPEN = {"type": "object", "properties": {"name": {"type": "string"},
                                         "n": {"type": "integer"},
                                         "next": {"anyOf": [{"type": "null"},
                                                            {"type": "number"}]}},
        "required": ["name"]}


# Bounds, lengths, formats and a tuple, every value bounded: samples end by themselves.
SCALARS = {"type": "object",
           "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                          "n": {"type": "integer", "exclusiveMinimum": -20, "maximum": 300},
                          "s": {"type": "string", "minLength": 2, "maxLength": 6},
                          "d": {"type": "string", "format": "date-time"},
                          "t": {"type": "array", "items": False,
                                "prefixItems": [{"type": "integer", "minimum": 0,
                                                 "maximum": 9},
                                                {"type": "string", "maxLength": 3}]}},
           "required": ["p", "s", "d"]}


def tokens(n: int, seed: int) -> dict:
    return {"prompt_token_ids": random_prompt(n, seed=seed)}


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


@pytest.fixture(scope="module")
def llm(llama):
    engine = LLM(llama[0], kv_cache_tokens=4096, chunk_cache_tokens=1024,
                 position_strategy="shared")
    yield engine
    engine.check_integrity()


def byte_allowed(g, state, spelled: list[bytes | None]) -> torch.Tensor:
    """Token t is allowed iff all its bytes step the byte automaton (no trie, no cache)."""
    out = torch.zeros(len(spelled), dtype=torch.bool)
    for tid, data in enumerate(spelled):
        s = state
        for b in data or b"":
            s = g.step(s, b)
            if s is None:
                break
        out[tid] = bool(data) and s is not None
    return out


def brute_force_mask(grammar: TokenGrammar, sid: int) -> torch.Tensor:
    return byte_allowed(grammar.grammar, grammar._states[sid], grammar.vocab.bytes_of)


@pytest.mark.parametrize("params,text", [
    (StructuredOutputsParams(json=OPEN),
     '{"n": -12, "name": "a \\"b\\" \\u00e9 é\\n", "next": 1.5e-3}'),
    (StructuredOutputsParams(json_object=True), '[{"a": [1, {"b": "c d"}]}, "é", true, null]'),
    (StructuredOutputsParams(choice=["yes", "yes sir", "no"]), "yes sir"),
    # A maximum past int32 (the per-token counts' type) is no limit, not a wrapped one.
    (StructuredOutputsParams(json={"type": "string", "minLength": 3, "maxLength": 2 ** 32 + 5}),
     '"abcdefgh é"'),
    (StructuredOutputsParams(json=SCALARS),
     '{"p": 0.25, "n": -19, "s": "é\\n\\u00e9x", "d": "2024-02-29T23:59:59.5+05:30", '
     '"t": [7, "ab"]}'),
])
def test_masks_equal_a_token_by_token_check(llm, params, text):
    """Along a document, byte by byte (so string states with escapes and multi-byte
    characters are reached), every state's mask equals the brute-force one: the trie walk
    and the in-string shortcut agree with the automaton."""
    engine = llm.engine
    grammar = engine.structured.matcher(params).grammar
    sid = grammar.initial
    for b in text.encode():
        assert torch.equal(grammar.mask(sid), brute_force_mask(grammar, sid))
        sid = grammar.step(sid, b)
        assert sid >= 0
    assert grammar.accepting(sid)
    assert torch.equal(grammar.mask(sid), brute_force_mask(grammar, sid))


def test_sentencepiece_vocabularies_spell_bytes_and_spaces():
    """"▁" is a space and <0xNN> a byte in SentencePiece vocabularies; special tokens have
    no bytes; a byte-level (GPT-2 alphabet) vocabulary maps each character to its byte."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>", "▁{", "\"a\"", ":▁1}", "▁"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    got = token_bytes(fast, len(pieces) + 2)
    assert got == [None, None, None, b"\n", b"\xc3", b"\xa9", b" {", b'"a"', b": 1}", b" ",
                   None, None]
    vocab = TokenVocabulary(fast, len(pieces))
    grammar = TokenGrammar(json_schema_grammar({"type": "object", "properties": {
        "a": {"type": "integer"}}}), vocab)
    sid = grammar.initial
    for token in (6, 7, 8):  # ' {', '"a"', ': 1}'
        assert grammar.mask(sid)[token]
        sid = grammar.advance(sid, token)
    assert grammar.terminal(sid)


def test_byte_level_vocabulary_matches_decode(llm):
    tok = llm.engine.tokenizer
    spelled = token_bytes(tok, llm.engine.model_config.vocab_size)
    ids = tok.encode('{"key": "välue\n", "n": [1, 2]}', add_special_tokens=False)
    assert b"".join(spelled[i] for i in ids).decode() == tok.decode(ids)
    assert all(spelled[i] is None for i in tok.all_special_ids)


def reference_constrained_greedy(hf, grammar, S, C, Q, eos: set[int], max_tokens: int):
    """Greedy decoding over the one-pass reference's logits (HF transformers) where each
    step's candidates are the tokens whose bytes, one by one, step the byte automaton (and EOS
    where the output may end), stopping when the output is complete. Brute force, no trie,
    no mask cache, no budget: it shares only the byte automaton with the engine, which
    test_json_grammar.py checks against json.loads and random schema instances."""
    ids, positions, visible, hidden = layout_reference(S, C, Q)
    spelled = grammar.vocab.bytes_of
    state, out = grammar.grammar.initial, []
    g = grammar.grammar
    for _ in range(max_tokens):
        logits = reference_logits(hf, ids + out, positions, visible)
        allowed = byte_allowed(g, state, spelled)
        if g.accepting(state):
            allowed[list(eos)] = True
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token in eos:
            break
        for b in spelled[token]:
            state = g.step(state, b)
        if g.terminal(state):
            break
        positions, visible = extend_layout(positions, visible, 1, hidden)
        hidden = torch.cat([hidden, torch.zeros(1, dtype=torch.bool)])
    return out


@pytest.mark.parametrize("schema", [BOUNDED, OPEN, SCALARS])
def test_constrained_greedy_equals_a_brute_force_mask_loop_cold_and_warm(llama, schema):
    """The engine's constrained greedy tokens (RAG prompt, chunk cache cold and warm, beside
    an unconstrained request) equal `reference_constrained_greedy`'s, and a finished output
    validates against its schema by an independent validator (the jsonschema package)."""
    import jsonschema

    path, hf = llama
    llm = LLM(path, kv_cache_tokens=2048, chunk_cache_tokens=512, position_strategy="shared")
    S, C = random_prompt(5, seed=21), [random_prompt(6, seed=22), random_prompt(4, seed=23)]
    Q = random_prompt(3, seed=24)
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so)
    grammar = llm.engine.structured.matcher(so).grammar
    want = reference_constrained_greedy(hf, grammar, S, C, Q, llm.engine.eos_token_ids,
                                        params.max_tokens)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    others = []
    for warm in (False, True):
        # Beside an unconstrained request in the same batches.
        out, other = llm.generate([RAGPrompt(S, C, Q)] * 2, [params, free], use_tqdm=False)
        assert (out.metrics.num_chunk_hits == 2) == warm
        got = out.outputs[0]
        assert got.token_ids == want
        others.append(other.outputs[0].token_ids)
        if got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.text), schema)
        else:
            assert got.finish_reason == "length" and len(want) == params.max_tokens
    if schema is BOUNDED:
        assert got.finish_reason == "stop"
    alone = llm.generate(RAGPrompt(S, C, Q), free, use_tqdm=False)[0].outputs[0].token_ids
    assert others == [alone, alone]  # the unconstrained request's tokens are unchanged
    llm.check_integrity()


def test_sampled_outputs_follow_the_schema(llm):
    """n samples at temperature 1.5: each ends by itself (every value is bounded) and
    parses to an object the schema allows."""
    params = SamplingParams(n=6, temperature=1.5, seed=3, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=BOUNDED))
    out = llm.generate(tokens(7, seed=31), params, use_tqdm=False)[0]
    texts = set()
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text
        value = json.loads(sample.text)
        assert isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog", 3, None)
        assert set(value) <= {"ok", "kind", "tags"} and value.get("tags", []) in (
            [], ["x"], ["x", "x"])
        texts.add(sample.text)
    assert len(texts) > 1  # sampling varied within the constraint


def test_sampled_outputs_keep_bounds_lengths_and_formats(llm):
    """Sampled at temperature 1.5 under SCALARS: each sample ends by itself and its values
    pass Python's own checks (comparisons, len, datetime.fromisoformat)."""
    params = SamplingParams(n=6, temperature=1.5, seed=5, max_tokens=400,
                            structured_outputs=StructuredOutputsParams(json=SCALARS))
    out = llm.generate(tokens(7, seed=32), params, use_tqdm=False)[0]
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text
        value = json.loads(sample.text)
        assert {"p", "s", "d"} <= set(value) <= set(SCALARS["properties"])
        assert 0 <= value["p"] <= 1 and not isinstance(value["p"], bool)
        assert 2 <= len(value["s"]) <= 6
        assert datetime.datetime.fromisoformat(value["d"]).tzinfo is not None
        if "n" in value:
            assert isinstance(value["n"], int) and -20 < value["n"] <= 300
        if "t" in value:
            assert len(value["t"]) <= 2 and all(
                check(v) for check, v in zip((lambda v: isinstance(v, int) and 0 <= v <= 9,
                                              lambda v: isinstance(v, str) and len(v) <= 3),
                                             value["t"], strict=False))


def test_choice_and_json_object(llm):
    choices = ["red", "green", "blue sky"]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    for sample in llm.generate(tokens(5, seed=32), params, use_tqdm=False)[0].outputs:
        assert sample.text in choices and sample.finish_reason == "stop"
    params = SamplingParams(temperature=0.0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(json_object=True),
                            logit_bias={t: 5.0 for t in llm.get_tokenizer().encode(
                                "{}[]", add_special_tokens=False)})
    out = llm.generate(tokens(5, seed=33), params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), (dict, list))


def test_min_tokens_and_stop_tokens_with_a_grammar(llm):
    """Where the output may end (a top-level number), a stop token is allowed only from
    min_tokens on; a complete object ends the sample without one."""
    so = StructuredOutputsParams(json={"type": "integer"})
    eos = sorted(llm.engine.eos_token_ids)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, logit_bias={eos: 100},
                            structured_outputs=so)
    out = llm.generate(tokens(5, seed=34), params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos  # 4 digits' tokens, then EOS
    assert out.finish_reason == "stop" and int(out.text) >= 0
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])
    # "0" is complete and no digit may follow: the sample ends there even without a stop
    # token (ignore_eos) instead of reaching a state with nothing to sample.
    zero = llm.get_tokenizer().convert_tokens_to_ids("0")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                            logit_bias={zero: 100}, structured_outputs=so)
    out = llm.generate(tokens(5, seed=35), params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("0", [zero], "stop")
    # A stop token with text is banned where the output may not end, even where its text
    # fits: here the digit "1" inside the object; the sample ends by closing the object.
    one = llm.get_tokenizer().convert_tokens_to_ids("1")
    params = SamplingParams(temperature=0.0, max_tokens=200, stop_token_ids=[one],
                            logit_bias={one: 100}, structured_outputs=StructuredOutputsParams(
                                json={"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"]}))
    out = llm.generate(tokens(5, seed=36), params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and one not in out.token_ids
    assert set(json.loads(out.text)) == {"n"}


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(json={"type": "string", "pattern": "a+"}), "'pattern'"),
    (dict(json={"type": "object", "properties": {}, "required": ["a"]}), "'a'"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"$ref": "#/$defs/missing"}), "points nowhere"),
    (dict(), "exactly one"),
    (dict(json_object=True, choice=["a"]), "exactly one"),
    (dict(json_object="yes"), "json_object must be a boolean"),
    (dict(json={"type": "string", "enum": [1]}), "not of type"),
    (dict(json={"const": 1, "properties": {}}), "beside enum or const"),
    (dict(json={"required": ["a"]}), "'a' is not in properties"),
    (dict(json={"$defs": {"l": {"$ref": "#/$defs/l"}}, "type": "array",
                "items": {"$ref": "#/$defs/l"}}), "only refers to itself"),
    (dict(json='{"items":' * 3000 + "{}" + "}" * 3000), "nests too deeply"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty strings"),
])
def test_bad_constraints_are_clear_errors(llm, kwargs, fragment):
    with pytest.raises(ValueError, match=None) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json_object": True})
    llm.check_integrity()


def test_a_grammar_with_many_states_is_replaced_for_new_requests(llm, monkeypatch):
    """Bounded numbers make a state per text read: past MAX_STATES_PER_GRAMMAR the grammar
    is replaced for new requests, while a sample holding the old one goes on in it; and
    generation across replacements keeps every output valid."""
    monkeypatch.setattr(token_grammar, "MAX_STATES_PER_GRAMMAR", 8)
    engine = llm.engine
    so = StructuredOutputsParams(json={"type": "array", "maxItems": 3, "items": {
        "type": "integer", "minimum": 0, "maximum": 10 ** 6}})
    structured = StructuredOutputs(engine.tokenizer, engine.model_config.vocab_size)
    old = structured.matcher(so)
    assert structured.matcher(so).grammar is old.grammar
    for token in engine.tokenizer.encode("[1234,5678", add_special_tokens=False):
        old.advance(token)
    assert old.grammar.num_states > 8
    new = structured.matcher(so)
    assert new.grammar is not old.grammar and new.state == new.grammar.initial
    for token in engine.tokenizer.encode("9]", add_special_tokens=False):
        old.advance(token)  # the old grammar still serves its sample
    assert old.terminal
    params = SamplingParams(n=4, temperature=1.5, seed=9, max_tokens=60,
                            structured_outputs=so)
    grammars = set()
    for seed in range(3):
        out = llm.generate(tokens(6, seed=40 + seed), params, use_tqdm=False)[0]
        grammars.add(id(engine.structured.matcher(so).grammar))
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            value = json.loads(sample.text)
            assert len(value) <= 3 and all(0 <= v <= 10 ** 6 for v in value)
    assert len(grammars) > 1
    llm.check_integrity()


def test_grammars_are_shared_and_bounded(llm):
    engine = llm.engine
    structured = StructuredOutputs(engine.tokenizer, engine.model_config.vocab_size)
    a = structured.matcher(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}}))
    b = structured.matcher(StructuredOutputsParams(json=json.dumps({"properties": {
        "a": {"type": "integer"}}, "type": "object"})))
    assert a.grammar is b.grammar and a is not b  # one grammar, one matcher per sample
    a.advance(engine.tokenizer.encode("{", add_special_tokens=False)[0])
    assert b.state == b.grammar.initial
    with pytest.raises(ValueError, match="does not follow"):
        b.advance(engine.tokenizer.encode("x", add_special_tokens=False)[0])


# ---------------------------------------------------- bounded work: one request cannot stall


def _diamond(levels: int) -> dict:
    """Each level an anyOf of two $refs to the next: 2**levels paths to the last one."""
    defs = {f"n{i}": {"anyOf": [{"$ref": f"#/$defs/n{i + 1}"}] * 2} for i in range(levels)}
    defs[f"n{levels}"] = {"type": "string", "maxLength": 4}
    return {"$ref": "#/$defs/n0", "$defs": defs}


# anyOf of two array schemas of itself: every "[" doubles the alternatives of the state.
AMBIGUOUS = {"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                       {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}]}


def test_a_diamond_of_refs_is_expanded_once(monkeypatch):
    """A $ref shared by many anyOf branches is expanded once per node, not once per path: a
    diamond of 22 levels (4 million paths, minutes per byte before) starts a value in a
    handful of expansions, and a chain of 280 refs compiles (its check is one pass)."""
    from ragkv.structured import json_grammar

    g = json_schema_grammar(_diamond(22))
    calls = []
    start = json_grammar.ByteGrammar._start_value
    monkeypatch.setattr(json_grammar.ByteGrammar, "_start_value",
                        lambda self, *a: calls.append(1) or start(self, *a))
    assert g.step(g.initial, ord('"')) is not None and len(calls) < 10
    assert g.matches(b'"ab"') and not g.matches(b'"abcde"')
    chain = {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(280)}
    chain["n280"] = {"type": "integer"}
    assert json_schema_grammar({"$ref": "#/$defs/n0", "$defs": chain}).matches(b"12")
    with pytest.raises(ValueError, match="only refers to itself"):
        json_schema_grammar({"$ref": "#/$defs/a", "$defs": {
            "a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}})


def test_ambiguous_recursion_meets_the_alternatives_budget():
    from ragkv.structured.json_grammar import MAX_ALTERNATIVES, GrammarBudgetError

    g = json_schema_grammar(AMBIGUOUS)
    state, depth = g.initial, 0
    with pytest.raises(GrammarBudgetError, match="alternatives"):
        while True:
            state = g.step(state, ord("["))
            depth += 1
            assert len(state) <= MAX_ALTERNATIVES
    assert 2 ** (depth + 1) > MAX_ALTERNATIVES  # it failed where the doubling passed it
    assert g.matches(b"[[],[[]]]")  # shallow values are served as before


def test_a_schema_over_budget_fails_its_request_alone(llm, monkeypatch):
    """A request whose grammar needs more than its budget (alternatives per state, work per
    token mask) ends with finish_reason "error" and the reason, within a step of reaching
    it; the requests beside it in the same steps get exactly their solo tokens."""
    engine = llm.engine
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate([tokens(7, seed=60)], plain, use_tqdm=False)[0].outputs[0].token_ids
    bracket = engine.tokenizer.encode("[", add_special_tokens=False)
    assert len(bracket) == 1
    hostile = SamplingParams(max_tokens=40, temperature=0, logit_bias={bracket[0]: 100},
                             structured_outputs=StructuredOutputsParams(json=AMBIGUOUS))
    outs = llm.generate([tokens(6, seed=61), tokens(7, seed=60)], [hostile, plain],
                        use_tqdm=False)
    bad, good = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "error" and "GrammarBudgetError" in outs[0].error
    assert outs[0].bad_request and not outs[1].bad_request  # the request's own doing
    # It failed where the nesting (alternatives doubling per "[") passed the budget.
    assert len(bad.token_ids) <= json_grammar.MAX_ALTERNATIVES.bit_length()
    assert good.token_ids == want and outs[1].error is None
    llm.check_integrity()
    # The work budget of one new token mask, made tiny: an ordinary schema goes over it.
    monkeypatch.setattr(token_grammar, "MAX_MASK_WORK", 2)
    fresh = StructuredOutputsParams(json={"type": "object", "properties": {
        "zz": {"type": "integer"}}, "required": ["zz"]})
    outs = llm.generate([tokens(6, seed=62), tokens(7, seed=60)],
                        [SamplingParams(max_tokens=20, structured_outputs=fresh), plain],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "token mask" in outs[0].error
    # Deterministic: the same state fails again, at once, whatever was cached meanwhile.
    again = llm.generate(tokens(6, seed=63), SamplingParams(max_tokens=20,
                                                             structured_outputs=fresh),
                         use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "error" and "token mask" in again.error
    assert outs[1].outputs[0].token_ids == want
    llm.check_integrity()
