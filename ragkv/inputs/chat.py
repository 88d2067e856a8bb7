"""Chat requests as RAG prompts: the model's own chat template rendered once, with the documents
cut out where they go, so any template works."""

from __future__ import annotations

import functools
from dataclasses import replace

from .prompt import (
    RAG_OPTIONS,
    ChunkedPrompt,
    RAGPrompt,
    check_text,
    reused_tokenizer,
    split_at_separator,
)
from .token_cache import TokenCache
from .tools import render_inputs

# Where the documents go when a chat template is rendered; split out again afterwards.
_DOC_SENTINEL = "\u2063ragkv-documents\u2063"


def content_text(content: object) -> str:
    """A chat message's content as the template takes it: a string as is, null as empty, a
    list of {"type": "text", "text": ...} parts joined (other parts are a ValueError)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string, null or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"unsupported content part type {kind!r}: only text is supported")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        parts.append(part["text"])
    return "".join(parts)


def split_chat_prompt(tokenizer, messages: list[dict], documents: list[str] | None = None,
                      separator: str | None = None, cache_salt: str | None = None,
                      max_chars: int | None = None, cache: TokenCache | None = None,
                      add_generation_prompt: bool = True, chat_template: str | None = None,
                      tools: list[dict] | None = None) -> tuple[ChunkedPrompt, str]:
    """Render a chat with the model's own template and cut it where the documents go.

    Documents come from `documents`, or else, when a `separator` is set, from separators in
    the last user message (every part before the last is a document, the last part is the
    question; trimmed like a separated prompt's). They are placed at
    the start of the conversation, so that the system part S does not depend on the history:
    - with a leading system message: at the end of its content, each document after a blank
      line ("\n\n" + document); S is the rendered text up to there;
    - without one: at the start of the first user message, each document followed by a blank
      line; S is the rendered text up to there (template preamble, the first user header).
    Everything after the documents (the rest of the conversation, the question, the assistant
    header) is the question part. The same system message and documents therefore give the
    same S and chunks whatever the history, and the chunks are reused (`cache`: their token
    ids by their text). `chat_template` replaces the tokenizer's; `add_generation_prompt`
    False ends the text after the last message (no assistant header); `tools` (OpenAI's
    function definitions) and the messages' tool calls and results render as the template
    writes them, else in the Hermes format (inputs/tools.py). Returns the prompt and the full
    rendered text.
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        raise ValueError("a chat request needs at least one user message")
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        check_text(f"messages[{i}].content", m["content"])
    for i, d in enumerate(documents or []):
        if not isinstance(d, str):
            raise ValueError(f"documents[{i}] must be a string")
        check_text(f"documents[{i}]", d)
    total = sum(len(m["content"]) for m in messages) + sum(map(len, documents or []))
    if max_chars is not None and total > max_chars:
        raise ValueError(f"the chat has {total} characters; no text over {max_chars} "
                         "characters fits max_model_len")
    content = messages[last_user]["content"]
    if documents is None and separator and separator in content:
        head, documents, content = split_at_separator(content, separator)
        documents = [head, *documents]
    docs = [d.strip() for d in (documents or []) if d.strip()]
    if documents is not None and not content.strip():
        raise ValueError("the question (the last user message) is empty")
    rendered_msgs = [dict(m) for m in messages]
    rendered_msgs[last_user]["content"] = content
    render = functools.partial(_render, tokenizer, add_generation_prompt=add_generation_prompt,
                               chat_template=chat_template, tools=tools)
    if not docs:
        text = render(rendered_msgs)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ChunkedPrompt([], [], ids, text, cache_salt), text
    if rendered_msgs[0].get("role") == "system":
        where, chunk_texts = 0, ["\n\n" + d for d in docs]
        rendered_msgs[0]["content"] += _DOC_SENTINEL
    else:
        where = next(i for i, m in enumerate(rendered_msgs) if m.get("role") == "user")
        chunk_texts = [d + "\n\n" for d in docs]
        rendered_msgs[where]["content"] = _DOC_SENTINEL + rendered_msgs[where]["content"]
    text = render(rendered_msgs)
    if text.count(_DOC_SENTINEL) != 1:
        raise ValueError("the chat template does not keep the messages intact")
    head, tail = text.split(_DOC_SENTINEL)
    reused = reused_tokenizer(tokenizer, cache, cache_salt)
    prompt = ChunkedPrompt(
        system=reused(head, False),
        chunks=[reused(c, False) for c in chunk_texts],
        question=tokenizer.encode(tail, add_special_tokens=False),
        text=head + "".join(chunk_texts) + tail,
        cache_salt=cache_salt,
    )
    return prompt, prompt.text


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
            chat_template: str | None = None, tools: list[dict] | None = None) -> str:
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template (give chat_template)")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a string (a Jinja template)")
    messages, tools = render_inputs(tokenizer, chat_template, messages, tools)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools)
    except Exception as e:  # noqa: BLE001 (a template may raise anything, e.g. on a role)
        raise ValueError(f"the chat template rejected the messages: {e}") from None


def split_rag_chat(p: RAGPrompt, tokenizer, max_chars: int | None = None,
                   cache: TokenCache | None = None) -> ChunkedPrompt:
    """A RAGPrompt with `chat=True`: the chat request it stands for (its system message, the
    chunks as documents, the question as the user message), split as one is."""
    chunks = p.chunks if isinstance(p.chunks, (list, tuple)) else None
    if chunks is None or not all(isinstance(x, str) for x in (p.system, p.question, *chunks)):
        raise ValueError("RAGPrompt(chat=True) takes text: system, chunks and question as "
                         "strings")
    if not p.question.strip():
        raise ValueError("RAGPrompt.question is empty")
    messages = [{"role": "system", "content": p.system}] if p.system.strip() else []
    messages.append({"role": "user", "content": p.question})
    prompt, _ = split_chat_prompt(tokenizer, messages, list(chunks), None, p.cache_salt,
                                  max_chars, cache)
    return replace(prompt, **{name: getattr(p, name) for name in RAG_OPTIONS})
