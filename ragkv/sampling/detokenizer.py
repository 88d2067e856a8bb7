"""Incremental detokenization: a request's output text grown token by token at a cost that
does not depend on how long the output already is.

Decoding a token alone loses context (SentencePiece drops a leading space at the start of a
decode; a multi-byte character may span tokens), so each step decodes a short window: the
tokens since the last emitted text (`read_offset`) plus the window before them
(`prefix_offset`) as context, and emits what the window adds. Text ending in U+FFFD is an
incomplete character: it is held back until a later token completes it, or until `finish`.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "skip_special_tokens", "text", "num_seen", "prefix_offset",
                 "read_offset")

    def __init__(self, tokenizer, skip_special_tokens: bool = True, start: int = 0) -> None:
        """`start`: where the text begins in the token lists given later (the prompt length,
        for a request's prompt + output list), so callers never copy the output out."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # stable text: never changes once emitted
        self.num_seen = start  # tokens processed so far (end index)
        self.prefix_offset = start
        self.read_offset = start

    def update(self, token_ids: list[int], end: int | None = None) -> int:
        """Take in `token_ids[:end]` (earlier calls saw a prefix of the same list) up to the
        end. Returns how many characters `text` grew by."""
        end = len(token_ids) if end is None else end
        before = len(self.text)
        for n in range(self.num_seen + 1, end + 1):
            prefix, full = self._window(token_ids, n)
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                self.text += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = n
        self.num_seen = max(self.num_seen, end)
        return len(self.text) - before

    def finish(self, token_ids: list[int], end: int | None = None) -> str:
        """The final text of `token_ids[:end]`, including a trailing incomplete character."""
        end = len(token_ids) if end is None else end
        self.update(token_ids, end)
        prefix, full = self._window(token_ids, end)
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset = end
        return self.text

    def truncate(self, length: int) -> None:
        """Cut the text (a stop string was found at `length`); later updates are not expected."""
        self.text = self.text[:length]

    def _window(self, token_ids: list[int], n: int) -> tuple[str, str]:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = decode(token_ids[self.prefix_offset:n], skip_special_tokens=skip)
        return prefix, full
