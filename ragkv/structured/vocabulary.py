"""The vocabulary's token bytes, as a trie that the grammars' token masks walk."""

from __future__ import annotations

import gc
import json
from functools import lru_cache

import torch

from .json_grammar import counted_string_step, string_step


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id adds to the output, None for ids that add no text (special
    tokens, ids past the tokenizer). Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) spell
    bytes in GPT-2's alphabet; SentencePiece ones use "▁" for a space and <0xNN> for a byte."""
    size = min(vocab_size, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(tokenizer.all_special_ids)
    added = {}
    for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            special.add(tid)
        else:
            added[tid] = tok.content
    decoder = _byte_decoder()
    byte_level = _decodes_bytes(tokenizer)
    if byte_level is None:  # no backend to ask: a byte-level vocabulary spells only its alphabet
        ordinary = [p for i, p in enumerate(pieces) if p and i not in special and i not in added]
        byte_level = all(c in decoder for p in ordinary for c in p)
    out: list[bytes | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if i in special or not piece:
            continue
        if i in added:
            out[i] = added[i].encode()
        elif byte_level:
            out[i] = bytes(decoder[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return out


def _decodes_bytes(tokenizer) -> bool | None:
    """Whether a fast tokenizer's decoder is byte-level (GPT-2's alphabet); None if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return None
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    if "ByteLevel" in kinds:
        return True
    if {"Metaspace", "ByteFallback", "Replace"} & set(kinds):
        return False
    return None


class TokenVocabulary:
    """The vocabulary's token bytes as a trie: node 0 is the root; `children[n]` maps a byte
    to a node, `ends[n]` lists the token ids spelled by the path to n."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.size = vocab_size
        self.children: list[dict[int, int]] = [{}]
        ends: list[list[int]] = [[]]
        self.bytes_of = token_bytes(tokenizer, vocab_size)
        # 100,000 nodes for a 49k vocabulary: with the collector running, building them set
        # off full collections (3 of them, 344 ms on SmolLM2's, on the engine thread), and
        # kept as lists they lengthened every later one. Dicts of ints and tuples of ints
        # are not tracked by the collector, so the finished trie costs it nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for tid, data in enumerate(self.bytes_of):
                if not data:
                    continue
                node = 0
                for b in data:
                    nxt = self.children[node].get(b)
                    if nxt is None:
                        nxt = len(self.children)
                        self.children[node][b] = nxt
                        self.children.append({})
                        ends.append([])
                    node = nxt
                ends[node].append(tid)
            self.ends: list[tuple[int, ...]] = [tuple(e) for e in ends]
        finally:
            if collecting:
                gc.enable()
        self._in_string: dict[tuple[int, bool], tuple] = {}
        self.max_chars = max((len(b) for b in self.bytes_of if b), default=0)  # >= any count

    def in_string(self, sub: int, counted: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """From string sub-state `sub`: the mask of tokens that stay inside the string, how
        many characters each of them begins (`counted`, for strings of bounded length: None
        otherwise) and the ids of those that close it (valid up to the closing quote). Inside
        a string most of the vocabulary is allowed, so a trie walk would visit nearly all of
        it; this leaves the grammar only the few tokens with a closing quote."""
        cached = self._in_string.get((sub, counted))
        if cached is None:
            step = counted_string_step if counted else string_step
            inside: list[int] = []
            chars: list[int] = []
            closing: list[int] = []
            for tid, data in enumerate(self.bytes_of):
                if not data:
                    continue
                s: int | None = sub
                begun = 0
                for b in data:
                    begun += s == 0 and b != ord('"')  # a character begins (as _counted_step)
                    s = step(s, b)
                    if s is None or s < 0:
                        break
                if s is None:
                    closing.append(tid)
                elif s >= 0:
                    inside.append(tid)
                    chars.append(begun)
            ids = torch.tensor(inside, dtype=torch.int64)
            mask = torch.zeros(self.size, dtype=torch.bool)
            mask[ids] = True
            counts = None
            if counted:
                counts = torch.zeros(self.size, dtype=torch.int32)
                counts[ids] = torch.tensor(chars, dtype=torch.int32)
            cached = self._in_string[(sub, counted)] = (mask, counts, closing)
        return cached
