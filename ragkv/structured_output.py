"""Structured output: what a request asks for (StructuredOutputsParams, vLLM's names) and the
token-level side of the byte automata in json_grammar.py.

Every sampling step a constrained row may only pick tokens whose bytes keep the automaton
alive. The allowed set of a state is found by walking a trie of the vocabulary's token bytes
from that state, pruning a branch at the first byte the automaton refuses; it is cached per
state (states are interned to ints), so a schema's masks are computed once and reused by
every request and every sample that reaches the same state. Transitions are memoized too.
Stop tokens are allowed only where the output may end; where nothing may follow (a closed
object), the engine finishes the sample without one.
"""

from __future__ import annotations

import gc
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .json_grammar import (
    ByteGrammar,
    State,
    choice_grammar,
    counted_string_step,
    json_object_grammar,
    json_schema_grammar,
    string_step,
)

# Masks kept per grammar (each is one bool per vocabulary entry): a schema's states number in
# the tens to hundreds; free JSON's grow with nesting depth. At most 4,096, and at most 64 MB
# of them (441 masks for a 152k vocabulary).
MAX_MASKS_PER_GRAMMAR = 4096
MASK_BYTES_PER_GRAMMAR = 64 << 20
# Grammars kept per engine, by their request's key (schema text, choice list), and compiled
# byte grammars kept per process.
MAX_GRAMMARS = 16
# Interned states per grammar before new requests get a fresh one. A schema's structure has
# a few hundred states, but a bounded number, a counted string or a date makes one per
# distinct text read, so a server writing numbers and dates for days would grow its states
# and memoized transitions without end. The old grammar serves the samples that hold it and
# goes with the last of them; the new one computes its masks again (about 1.5 ms each).
MAX_STATES_PER_GRAMMAR = 50_000


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must be (vLLM's StructuredOutputsParams): JSON following the schema
    `json` (a dict or its JSON text), any JSON object or array (`json_object`), or one of the
    strings in `choice`. Exactly one. Checked on construction: a schema keyword that cannot
    be enforced is an error, never ignored."""

    json: dict | str | None = None
    json_object: bool = False
    choice: list[str] | None = None
    # A canonical text of the constraint, set on construction: equal constraints share one
    # compiled grammar (byte_grammar) and one TokenGrammar per engine.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        given = [name for name, set_ in (("json", self.json is not None),
                                         ("json_object", self.json_object),
                                         ("choice", self.choice is not None)) if set_]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object and "
                             f"choice; got {', '.join(given) or 'none'}")
        object.__setattr__(self, "key", self._canonical())
        byte_grammar(self.key)  # compile now: errors reach the caller before queuing

    def _canonical(self) -> str:
        if self.json_object:
            return "json_object"
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice)
        schema = self.json
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            return "json:" + json.dumps(schema, sort_keys=True)
        except json.JSONDecodeError as e:
            raise ValueError(f"json schema is not valid JSON: {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"json schema is not JSON data: {e}") from None
        except RecursionError:
            raise ValueError("json schema nests too deeply") from None


@lru_cache(maxsize=MAX_GRAMMARS)
def byte_grammar(key: str) -> ByteGrammar:
    kind, _, text = key.partition(":")
    if kind == "json_object":
        return json_object_grammar()
    if kind == "choice":
        return choice_grammar(json.loads(text))
    return json_schema_grammar(json.loads(text))


# -- the vocabulary's bytes ----------------------------------------------------------------

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


class TokenGrammar:
    """A byte grammar over one vocabulary: interned states, memoized transitions and the
    allowed-token mask of each state. Shared by every request with the same constraint."""

    def __init__(self, grammar: ByteGrammar, vocab: TokenVocabulary) -> None:
        self.grammar = grammar
        self.vocab = vocab
        self._ids: dict[State, int] = {}
        self._states: list[State] = []
        self._next: dict[tuple[int, int], int] = {}  # (state, byte) -> state, -1 dead
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._max_masks = max(16, min(MAX_MASKS_PER_GRAMMAR,
                                      MASK_BYTES_PER_GRAMMAR // max(vocab.size, 1)))
        self._terminal: dict[int, bool] = {}
        self.initial = self._intern(grammar.initial)
        self.mask_seconds = 0.0  # time spent computing masks not yet cached (benchmarks)

    @property
    def num_masks(self) -> int:
        return len(self._masks)

    @property
    def num_states(self) -> int:
        return len(self._states)

    def _intern(self, state: State) -> int:
        sid = self._ids.get(state)
        if sid is None:
            sid = self._ids[state] = len(self._states)
            self._states.append(state)
        return sid

    def step(self, sid: int, byte: int) -> int:
        """The state after one byte; -1 when the byte is refused."""
        key = (sid, byte)
        nxt = self._next.get(key)
        if nxt is None:
            state = self.grammar.step(self._states[sid], byte)
            nxt = self._next[key] = -1 if state is None else self._intern(state)
        return nxt

    def advance(self, sid: int, token: int) -> int:
        """The state after a token's bytes; -1 when refused (or a token without bytes)."""
        data = self.vocab.bytes_of[token] if token < self.vocab.size else None
        if not data:
            return -1
        for b in data:
            sid = self.step(sid, b)
            if sid < 0:
                return -1
        return sid

    def accepting(self, sid: int) -> bool:
        return self.grammar.accepting(self._states[sid])

    def terminal(self, sid: int) -> bool:
        """ByteGrammar.terminal, memoized: asked after every token."""
        done = self._terminal.get(sid)
        if done is None:
            done = self._terminal[sid] = self.grammar.terminal(self._states[sid])
        return done

    def mask(self, sid: int) -> torch.Tensor:
        """[vocab] bool: the tokens whose every byte the grammar accepts from state `sid`
        (stop tokens not included: the caller adds them where the output may end)."""
        mask = self._masks.get(sid)
        if mask is not None:
            self._masks.move_to_end(sid)
            return mask
        start = time.perf_counter()
        mask = self._compute_mask(sid)
        self.mask_seconds += time.perf_counter() - start
        self._masks[sid] = mask
        if len(self._masks) > self._max_masks:
            self._masks.popitem(last=False)
        return mask

    def _compute_mask(self, sid: int) -> torch.Tensor:
        frame = self.grammar.string_frame(self._states[sid])
        if frame is not None:
            counted = frame[0] == "C"
            inside, chars, closing = self.vocab.in_string(frame[1], counted)
            high = self.grammar.length_bounds(frame[3])[1] if counted else None
            # A string of bounded length: the tokens that stay inside and fit what is left
            # (a budget past any token's count, maxLength 2**32 say, is no limit: int32).
            left = None if high is None else high - frame[2]
            mask = (inside.clone() if left is None or left >= self.vocab.max_chars
                    else inside & (chars <= left))
            ends = [t for t in closing if self.advance(sid, t) >= 0]
            if ends:
                mask[torch.tensor(ends)] = True
            return mask
        children, ends, step = self.vocab.children, self.vocab.ends, self.step
        allowed: list[int] = []
        todo = [(0, sid)]
        while todo:
            node, state = todo.pop()
            for b, child in children[node].items():
                nxt = step(state, b)
                if nxt >= 0:
                    allowed += ends[child]
                    if children[child]:
                        todo.append((child, nxt))
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        if allowed:
            mask[torch.tensor(allowed)] = True
        return mask


class GrammarMatcher:
    """One sample's position in its grammar."""

    __slots__ = ("grammar", "state")

    def __init__(self, grammar: TokenGrammar) -> None:
        self.grammar = grammar
        self.state = grammar.initial

    def advance(self, token: int) -> None:
        nxt = self.grammar.advance(self.state, token)
        if nxt < 0:
            raise ValueError(f"token {token} does not follow the structured-output grammar "
                             f"({self.grammar.grammar.description})")
        self.state = nxt

    @property
    def accepting(self) -> bool:
        return self.grammar.accepting(self.state)

    @property
    def terminal(self) -> bool:
        return self.grammar.terminal(self.state)

    def mask(self) -> torch.Tensor:
        return self.grammar.mask(self.state)


class StructuredOutputs:
    """An engine's grammars: the vocabulary trie (built on first use) and one TokenGrammar
    per distinct constraint, least recently used dropped first, and replaced for new
    requests once it has interned MAX_STATES_PER_GRAMMAR states."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._vocab: TokenVocabulary | None = None
        self._grammars: OrderedDict[str, TokenGrammar] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        key = params.key
        grammar = self._grammars.get(key)
        if grammar is None or grammar.num_states > MAX_STATES_PER_GRAMMAR:
            if self._vocab is None:
                self._vocab = TokenVocabulary(self.tokenizer, self.vocab_size)
            grammar = self._grammars[key] = TokenGrammar(byte_grammar(key), self._vocab)
            if len(self._grammars) > MAX_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return GrammarMatcher(grammar)
