"""Prompt parsing (docs/rag.md) with the builtin:tiny tokenizer: separators split the text, not the
tokens; token-id lists are used as given; chunks are checked and split; chat templates are cut
where the documents go."""

from __future__ import annotations

import copy

import pytest

from ragkv.inputs.chat import split_chat_prompt
from ragkv.inputs.prompt import ChunkedPrompt, PromptRules, RAGPrompt, parse_prompt

VOCAB = 4096


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from ragkv.model.builtin import builtin_model_path

    return AutoTokenizer.from_pretrained(builtin_model_path("builtin:tiny"))


def enc(tok, text: str, special: bool = False) -> list[int]:
    return tok.encode(text, add_special_tokens=special)


def rules(**kwargs) -> PromptRules:
    return PromptRules(vocab_size=VOCAB, **kwargs)


def split(**kwargs) -> PromptRules:
    """An engine with `chunk_separator="##"`."""
    return rules(separator="##", **kwargs)


def decoded_tokens(tok, p: ChunkedPrompt) -> list[str]:
    return [tok.decode([t]) for part in (p.system, *p.chunks, p.question) for t in part]


# ------------------------------------------------------------------------------ separators


@pytest.mark.parametrize("sep", ["##", " # # ", "<doc>"])
def test_separator_splits_the_text_then_tokenizes_each_part(tok, sep):
    texts = ["You are terse.", " The cat sat##on the mat. ", "The dog ran.", " Why?"]
    if sep == "##":
        texts[1] = " The cat sat on the mat. "  # "##" itself may not occur inside a part
    text = sep.join(texts)
    p = parse_prompt(text, tok, rules(separator=sep))
    assert p.is_rag and p.text == text
    # Each part trimmed of the whitespace next to a separator.
    assert p.system == enc(tok, texts[0], special=True)
    assert p.system[0] == tok.bos_token_id and p.system.count(tok.bos_token_id) == 1
    assert p.chunks == [enc(tok, texts[1].strip()), enc(tok, texts[2])]
    assert p.question == enc(tok, texts[3].lstrip())
    assert p.token_ids == p.system + p.chunks[0] + p.chunks[1] + p.question
    # The separator is markup: none of its text reaches the model.
    joined = "".join(decoded_tokens(tok, p))
    assert joined == tok.decode(p.token_ids)
    assert sep.strip() not in joined.replace(texts[1].strip(), "")
    if sep == "##":
        assert not any("#" in piece for piece in decoded_tokens(tok, p))


def test_separator_glued_to_words_splits_at_text_level(tok):
    p = parse_prompt("sys##first doc##second doc##question?", tok, split())
    assert p.system == enc(tok, "sys", special=True)
    assert p.chunks == [enc(tok, "first doc"), enc(tok, "second doc")]
    assert p.question == enc(tok, "question?")
    assert not any("#" in piece for piece in decoded_tokens(tok, p))


def test_spacing_around_separators_gives_the_same_tokens(tok):
    """One canonical form: the whitespace next to a separator is trimmed, so the README's
    `S ## doc ## Q` and `S##doc##Q` are the same chunks (and share cache entries)."""
    want = parse_prompt("Be brief.##The cat sat.##Where?", tok, split())
    for text in ("Be brief. ## The cat sat. ## Where?", "Be brief.\n##\n The cat sat.\t##  Where?"):
        p = parse_prompt(text, tok, split())
        assert (p.system, p.chunks, p.question) == (want.system, want.chunks, want.question)
    assert want.chunks == [enc(tok, "The cat sat.")] and want.question == enc(tok, "Where?")


def test_no_separator_or_separator_disabled_is_an_ordinary_prompt(tok):
    text = "Plain text ## with hashes ## inside?"
    for r in (rules(), rules(separator=None)):  # the default: no separator, no split
        p = parse_prompt(text, tok, r)
        assert not p.is_rag and p.system == [] and p.chunks == []
        assert p.question == enc(tok, text, special=True)
    markdown = "# Pets\n## Cats\nCats sleep a lot.\n## Dogs\nWhich sleeps more?"
    p = parse_prompt(markdown, tok, rules())
    assert not p.is_rag and p.token_ids == enc(tok, markdown, special=True)
    p = parse_prompt("Just a question?", tok, split())
    assert not p.is_rag and p.token_ids == enc(tok, "Just a question?", special=True)
    # A different separator: "##" is ordinary text then.
    p = parse_prompt(text, tok, rules(separator=" # # "))
    assert not p.is_rag and p.token_ids == enc(tok, text, special=True)


def test_empty_chunks_are_dropped(tok):
    p = parse_prompt("sys ## first ##  ## \n ##second## question", tok, split())
    assert p.chunks == [enc(tok, "first"), enc(tok, "second")]
    assert p.question == enc(tok, "question")
    # Only empty chunks: no chunks at all, an ordinary prompt of system + question.
    p = parse_prompt("sys ## ##   ## question", tok, split())
    assert not p.is_rag
    assert p.token_ids == enc(tok, "sys", special=True) + enc(tok, "question")
    p = parse_prompt(RAGPrompt([5, 6], [[], [7], ""], [8]), tok, rules())
    assert p.chunks == [[7]]


def test_one_separator_means_no_chunks(tok):
    p = parse_prompt("You are terse. ## What is X?", tok, split())
    assert not p.is_rag and p.chunks == [] and p.system == []
    assert p.question == enc(tok, "You are terse.", special=True) + enc(tok, "What is X?")
    assert p.token_ids == p.question


@pytest.mark.parametrize("prompt", [
    "sys ## doc ## ", "sys ## doc ##", "sys ##", "sys ## doc ##\n \t",
    {"prompt": "sys ## doc ##  "},
    RAGPrompt("sys", ["doc"], ""), RAGPrompt("sys", ["doc"], "   "),
    RAGPrompt([5, 6], [[7]], []), RAGPrompt("sys", [], ""),
])
def test_empty_question_is_an_error(tok, prompt):
    with pytest.raises(ValueError, match="question"):
        parse_prompt(prompt, tok, split())


def test_dict_prompt_text_is_split_and_keeps_its_salt(tok):
    p = parse_prompt({"prompt": "sys ## doc ## q?", "cache_salt": "tenant-1"}, tok, split())
    assert p.cache_salt == "tenant-1"
    assert p.chunks == [enc(tok, "doc")] and p.question == enc(tok, "q?")
    # A prompt's own separator: splits where the engine has none, not where it says None.
    own = parse_prompt({"prompt": "sys ## doc ## q?", "chunk_separator": "##"}, tok, rules())
    assert own.chunks == p.chunks and own.question == p.question
    plain = parse_prompt({"prompt": "sys ## doc ## q?", "chunk_separator": None}, tok, split())
    assert not plain.is_rag and plain.token_ids == enc(tok, "sys ## doc ## q?", special=True)
    for bad in ("  ", 3, ""):
        with pytest.raises(ValueError, match="chunk_separator"):
            parse_prompt({"prompt": "a ## b", "chunk_separator": bad}, tok, rules())
    with pytest.raises(ValueError):
        parse_prompt({"prompt": "sys ## doc ## q?", "cache_salt": 3}, tok, rules())
    with pytest.raises(ValueError):
        parse_prompt({"nothing": 1}, tok, rules())
    with pytest.raises(ValueError):
        parse_prompt(12, tok, rules())


# ---------------------------------------------------------------------------- token-id lists


def test_token_id_lists_are_used_as_given(tok):
    p = parse_prompt(RAGPrompt([5, 6], [[7, 8], [9]], [10, 11], cache_salt="s"), tok, rules())
    assert (p.system, p.chunks, p.question) == ([5, 6], [[7, 8], [9]], [10, 11])
    assert p.cache_salt == "s" and p.token_ids == [5, 6, 7, 8, 9, 10, 11]
    # No BOS is added to an id list, even an empty system prompt.
    p = parse_prompt(RAGPrompt([], [[7, 8]], [10]), tok, rules())
    assert p.system == [] and p.token_ids == [7, 8, 10]
    # A string system prompt gets BOS; id chunks beside it stay as they are.
    p = parse_prompt(RAGPrompt("sys", [[7, 8], " doc"], "q?"), tok, rules())
    assert p.system == enc(tok, "sys", special=True)
    assert p.chunks == [[7, 8], enc(tok, " doc")]
    assert p.question == enc(tok, "q?")
    # A plain id prompt is used as given (separator ids included).
    hashes = enc(tok, "a ## b")
    p = parse_prompt({"prompt_token_ids": hashes}, tok, rules())
    assert not p.is_rag and p.token_ids == hashes


@pytest.mark.parametrize("prompt", [
    RAGPrompt([VOCAB], [[7]], [8]),
    RAGPrompt([5], [[7, VOCAB + 10]], [8]),
    RAGPrompt([5], [[7]], [-1]),
    {"prompt_token_ids": [1, 2, VOCAB]},
    {"prompt_token_ids": [-3]},
    {"prompt_token_ids": [5, 2**64]},  # beyond int64, where the fast check packs the ids
    RAGPrompt([5], [[7], [-2**70]], [8]),
])
def test_out_of_vocabulary_id_is_an_error(tok, prompt):
    with pytest.raises(ValueError, match="vocabulary"):
        parse_prompt(prompt, tok, rules())


@pytest.mark.parametrize("prompt", [
    RAGPrompt([5, "x"], [[7]], [8]),
    RAGPrompt([5], [[7.0]], [8]),
    RAGPrompt([5], [[7]], [True]),
    {"prompt_token_ids": "1 2 3"},
])
def test_non_integer_ids_are_an_error(tok, prompt):
    with pytest.raises(ValueError):
        parse_prompt(prompt, tok, rules())


# ---------------------------------------------------------------------------- oversize chunks


def test_oversize_chunk_error_names_the_limit(tok):
    prompt = RAGPrompt([5], [[7, 8, 9], list(range(10, 16))], [8])
    with pytest.raises(ValueError, match="max_chunk_tokens=4"):
        parse_prompt(prompt, tok, rules(max_chunk_tokens=4))
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        parse_prompt("sys ## " + "word " * 40 + "## q?", tok, split(max_chunk_tokens=8))
    # Exactly at the limit is fine.
    p = parse_prompt(prompt, tok, rules(max_chunk_tokens=6))
    assert p.chunks == [[7, 8, 9], list(range(10, 16))]


def test_oversize_chunk_split_into_pieces(tok):
    long = list(range(10, 20))
    p = parse_prompt(RAGPrompt([5], [[7, 8], long, [9]], [8]), tok,
                     rules(max_chunk_tokens=4, oversize_chunk="split"))
    assert p.chunks == [[7, 8], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19], [9]]
    assert all(len(c) <= 4 for c in p.chunks)
    assert p.token_ids == [5, 7, 8, *long, 9, 8]
    text = "sys ## " + "word " * 40 + "## q?"
    p = parse_prompt(text, tok, split(max_chunk_tokens=8, oversize_chunk="split"))
    whole = enc(tok, ("word " * 40).strip())
    assert len(p.chunks) == -(-len(whole) // 8) and all(len(c) <= 8 for c in p.chunks)
    assert [t for c in p.chunks for t in c] == whole


# ------------------------------------------------------------------------------- chat prompts

SYSTEM_MSG = {"role": "system", "content": "Be brief."}
DOCS = ["Doc one says X is 1.", "Doc two says X is 2."]
QUESTION = "What is X?"


def render(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_chat_split(tok, prompt: ChunkedPrompt, text: str, messages, docs, question):
    """Documents go at the end of the system message, each after a blank line: S is the
    rendered text up to there (no history in it), the question part is the rest of the
    conversation and ends with the assistant header; the decoded parts re-join to the template
    rendered with the documents in that place."""
    placed = [dict(m) for m in messages]
    placed[0]["content"] += "".join("\n\n" + d for d in docs)
    placed[-1]["content"] = question
    full = render(tok, placed)
    assert text == full
    system, chunks = tok.decode(prompt.system), [tok.decode(c) for c in prompt.chunks]
    q = tok.decode(prompt.question)
    assert system + "".join(chunks) + q == full
    assert system == tok.bos_token + "<|im_start|>system\n" + SYSTEM_MSG["content"]
    assert prompt.system[0] == tok.bos_token_id
    assert prompt.chunks == [enc(tok, "\n\n" + d) for d in docs]
    assert q.startswith("<|im_end|>\n") and q.endswith(question + "<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
    assert prompt.is_rag


def test_chat_documents_list(tok):
    messages = [SYSTEM_MSG, {"role": "user", "content": QUESTION}]
    prompt, text = split_chat_prompt(tok, messages, documents=DOCS)
    check_chat_split(tok, prompt, text, messages, DOCS, QUESTION)
    assert tok.decode(prompt.system).count("Be brief.") == 1


def test_chat_history_does_not_change_system_part_or_chunks(tok):
    """Regression (issue 8, defect 12): S used to run up to the last user message, so any
    earlier turn changed S and every chunk missed. Now S and the chunks are the same with any
    history; the history is part of the question."""
    single = [SYSTEM_MSG, {"role": "user", "content": QUESTION}]
    history = [SYSTEM_MSG, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": QUESTION}]
    first, _ = split_chat_prompt(tok, single, documents=DOCS)
    prompt, text = split_chat_prompt(tok, history, documents=DOCS)
    check_chat_split(tok, prompt, text, history, DOCS, QUESTION)
    assert (prompt.system, prompt.chunks) == (first.system, first.chunks)
    assert "Hello." in tok.decode(prompt.question)


def test_chat_without_system_message_puts_documents_in_the_first_user_turn(tok):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": QUESTION}]
    prompt, text = split_chat_prompt(tok, history, documents=DOCS)
    system, chunks = tok.decode(prompt.system), [tok.decode(c) for c in prompt.chunks]
    assert system == tok.bos_token + "<|im_start|>user\n"
    assert chunks == [d + "\n\n" for d in DOCS]
    q = tok.decode(prompt.question)
    assert q.startswith("Hi<|im_end|>") and q.endswith(QUESTION + "<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
    assert system + "".join(chunks) + q == text
    alone, _ = split_chat_prompt(tok, [{"role": "user", "content": QUESTION}], documents=DOCS)
    assert (alone.system, alone.chunks) == (prompt.system, prompt.chunks)


def test_chat_separators_in_last_user_message(tok):
    content = DOCS[0] + "##" + DOCS[1] + "## ##" + QUESTION
    messages = [SYSTEM_MSG, {"role": "user", "content": content}]
    prompt, text = split_chat_prompt(tok, messages, separator="##")
    check_chat_split(tok, prompt, text, messages, DOCS, QUESTION)
    assert "#" not in text
    # Spaces around the separators are trimmed with it.
    spaced = [SYSTEM_MSG, {"role": "user", "content": f"{DOCS[0]} ## {DOCS[1]} ## {QUESTION}"}]
    assert split_chat_prompt(tok, spaced, separator="##") == (prompt, text)
    # Without a separator the message is what it says.
    plain, _ = split_chat_prompt(tok, messages)
    assert not plain.is_rag
    # A custom separator; the documents are stripped.
    content = DOCS[0] + " # # " + DOCS[1] + " # # " + QUESTION
    messages = [SYSTEM_MSG, {"role": "user", "content": content}]
    prompt, text = split_chat_prompt(tok, messages, separator=" # # ")
    check_chat_split(tok, prompt, text, messages, DOCS, QUESTION)


def test_chat_without_documents_is_an_ordinary_prompt(tok):
    messages = [SYSTEM_MSG, {"role": "user", "content": QUESTION}]
    for documents in (None, [], ["  "]):
        prompt, text = split_chat_prompt(tok, messages, documents=documents)
        assert text == render(tok, messages)
        assert not prompt.is_rag and prompt.system == []
        assert prompt.question == enc(tok, text)


def test_chat_errors(tok):
    with pytest.raises(ValueError, match="question"):
        split_chat_prompt(tok, [{"role": "user", "content": "A doc.## "}], separator="##")
    with pytest.raises(ValueError, match="question"):
        split_chat_prompt(tok, [{"role": "user", "content": " "}], documents=DOCS)
    with pytest.raises(ValueError, match="user"):
        split_chat_prompt(tok, [SYSTEM_MSG], documents=DOCS)
    with pytest.raises(ValueError, match=r"documents\[1\] is not valid Unicode"):
        split_chat_prompt(tok, [{"role": "user", "content": "q"}], documents=["a", "\ud800"])
    strict = copy.copy(tok)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template rejected the messages: roles must"):
        split_chat_prompt(strict, [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content is not valid Unicode"):
        split_chat_prompt(tok, [{"role": "user", "content": "q\udfff"}])


def test_rag_prompt_with_chat_renders_like_a_chat_request(tok):
    """RAGPrompt(..., chat=True) is the chat request it stands for (system message, chunks as
    documents, question as the user message), split as a chat is; text parts only."""
    from ragkv import LLM, SamplingParams

    messages = [SYSTEM_MSG, {"role": "user", "content": QUESTION}]
    want, _ = split_chat_prompt(tok, messages, DOCS)
    from ragkv.inputs.chat import split_rag_chat

    got = split_rag_chat(RAGPrompt(SYSTEM_MSG["content"], DOCS, QUESTION, chat=True,
                                   recompute="none"), tok)
    assert (got.system, got.chunks, got.question, got.text) == (
        want.system, want.chunks, want.question, want.text)
    assert got.recompute == "none"
    no_system, _ = split_chat_prompt(tok, [messages[1]], DOCS)
    assert split_rag_chat(RAGPrompt("", DOCS, QUESTION, chat=True), tok).token_ids == (
        no_system.token_ids)
    for bad in (RAGPrompt([1, 2], DOCS, QUESTION, chat=True),
                RAGPrompt("s", [[3, 4]], QUESTION, chat=True),
                RAGPrompt("s", DOCS, "  ", chat=True)):
        with pytest.raises(ValueError, match="chat=True|question"):
            split_rag_chat(bad, tok)
    with pytest.raises(ValueError, match="split_rag_chat"):  # not parsed as plain parts
        parse_prompt(RAGPrompt("s", DOCS, QUESTION, chat=True), tok, rules())
    llm = LLM("builtin:tiny", kv_cache_tokens=1024)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    by_prompt = llm.generate(RAGPrompt(SYSTEM_MSG["content"], DOCS, QUESTION, chat=True),
                             params, use_tqdm=False)[0]
    by_chat = llm.chat(messages, params, use_tqdm=False, documents=DOCS)[0]
    assert by_prompt.prompt_token_ids == by_chat.prompt_token_ids
    assert by_prompt.outputs[0].token_ids == by_chat.outputs[0].token_ids
    llm.check_integrity()
