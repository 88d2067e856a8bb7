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

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # stable text: never changes once emitted
        self.num_seen = 0  # tokens of the output processed so far
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, token_ids: list[int]) -> int:
        """Take in the tokens of `token_ids` (the whole output so far; earlier calls saw a
        prefix of it) not seen yet. Returns how many characters `text` grew by."""
        before = len(self.text)
        for n in range(self.num_seen + 1, len(token_ids) + 1):
            prefix, full = self._window(token_ids, n)
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                self.text += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = n
        self.num_seen = max(self.num_seen, len(token_ids))
        return len(self.text) - before

    def finish(self, token_ids: list[int]) -> str:
        """The final text of `token_ids`, including a trailing incomplete character."""
        self.update(token_ids)
        prefix, full = self._window(token_ids, len(token_ids))
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset = len(token_ids)
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
