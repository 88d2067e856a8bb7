"""Structured outputs at the token level: the byte automata of json_grammar.py over one
vocabulary.

Every sampling step a constrained row may only pick tokens whose bytes keep the automaton
alive. The allowed set of a state is found by walking a trie of the vocabulary's token bytes
from that state, pruning a branch at the first byte the automaton refuses; it is cached per
state (states are interned to ints), so a schema's masks are computed once and reused by
every request and every sample that reaches the same state. Transitions are memoized too.
Stop tokens are allowed only where the output may end; where nothing may follow (a closed
object), the engine finishes the sample without one.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .json_grammar import ByteGrammar, GrammarBudgetError, State, WorkMeter
from .params import MAX_GRAMMARS, StructuredOutputsParams
from .vocabulary import TokenVocabulary

# Masks kept per grammar (each is one bool per vocabulary entry): a schema's states number in
# the tens to hundreds; free JSON's grow with nesting depth. At most 4,096, and at most 64 MB
# of them (441 masks for a 152k vocabulary).
MAX_MASKS_PER_GRAMMAR = 4096
MASK_BYTES_PER_GRAMMAR = 64 << 20
# Work one token mask may take, in grammar steps (WorkMeter: an alternative advanced by a byte,
# an anyOf node expanded, an enum word or a property name tried; about a microsecond each).
# Measured with SmolLM2's vocabulary: at most 636 for the test schemas, 14,082 for a union of
# 128 objects of 10 properties, 40,960 for an enum of 4,096 values. A mask that needs more
# belongs to a schema too ambiguous to serve: its request fails within the step instead of
# stalling every other one.
MAX_MASK_WORK = 1 << 18
# Trie nodes with more children than this are walked only along the bytes the state can take
# (ByteGrammar.first_bytes): the root has about 230, and trying each costs every alternative.
_FILTER_FROM = 8
# Interned states per grammar before new requests get a fresh one. A schema's structure has
# a few hundred states, but a bounded number, a counted string or a date makes one per
# distinct text read, so a server writing numbers and dates for days would grow its states
# and memoized transitions without end. The old grammar serves the samples that hold it and
# goes with the last of them; the new one computes its masks again (about 1.5 ms each).
MAX_STATES_PER_GRAMMAR = 50_000


class TokenGrammar:
    """A byte grammar over one vocabulary: interned states, memoized transitions and the
    allowed-token mask of each state. Shared by every request with the same constraint."""

    def __init__(self, grammar: ByteGrammar, vocab: TokenVocabulary) -> None:
        self.grammar = grammar
        self.vocab = vocab
        self._ids: dict[State, int] = {}
        self._states: list[State] = []
        self._next: dict[tuple[int, int], int] = {}  # (state, byte) -> state, -1 dead
        # What computing each transition cost (WorkMeter units): charged again when a mask
        # reuses it, so whether a state's mask fits the budget does not depend on what other
        # requests computed before; and the states whose mask did not fit.
        self._cost: dict[tuple[int, int], int] = {}
        self._over_budget: set[int] = set()
        self._first: dict[int, frozenset[int] | None] = {}  # sid -> ByteGrammar.first_bytes
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._max_masks = max(16, min(MAX_MASKS_PER_GRAMMAR,
                                      MASK_BYTES_PER_GRAMMAR // max(vocab.size, 1)))
        self._terminal: dict[int, bool] = {}
        self.initial = self._intern(grammar.initial)
        self.mask_seconds = 0.0  # time spent computing masks not yet cached (benchmarks)
        # The budget of the mask being computed (None: no mask is).
        self._meter: WorkMeter | None = None

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
        """The state after one byte; -1 when the byte is refused. While a mask is computed
        (`_meter`), its cost is charged to the mask's budget, memoized or not."""
        key = (sid, byte)
        nxt = self._next.get(key)
        if nxt is None:
            meter = self._meter if self._meter is not None else WorkMeter(1 << 62, "")
            before = meter.used
            state = self.grammar.step(self._states[sid], byte, meter)
            nxt = self._next[key] = -1 if state is None else self._intern(state)
            self._cost[key] = meter.used - before
        elif self._meter is not None:
            self._meter.charge(self._cost[key])
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

    def _first_bytes(self, sid: int) -> frozenset[int] | None:
        first = self._first.get(sid, False)
        if first is False:
            first = self._first[sid] = self.grammar.first_bytes(self._states[sid])
        return first

    def accepting(self, sid: int) -> bool:
        return self.grammar.accepting(self._states[sid])

    def terminal(self, sid: int) -> bool:
        """ByteGrammar.terminal, memoized: asked after every token; within the mask budget."""
        done = self._terminal.get(sid)
        if done is None:
            meter = WorkMeter(MAX_MASK_WORK, f"the end test of {self.grammar.description}")
            done = self._terminal[sid] = self.grammar.terminal(self._states[sid], meter)
        return done

    def mask(self, sid: int) -> torch.Tensor:
        """[vocab] bool: the tokens whose every byte the grammar accepts from state `sid`
        (stop tokens not included: the caller adds them where the output may end)."""
        mask = self._masks.get(sid)
        if mask is not None:
            self._masks.move_to_end(sid)
            return mask
        if sid in self._over_budget:
            raise GrammarBudgetError(f"structured output: one token mask of "
                                     f"{self.grammar.description} needs more than "
                                     f"{MAX_MASK_WORK} grammar steps (a too ambiguous schema)")
        start = time.perf_counter()
        self._meter = WorkMeter(MAX_MASK_WORK,
                                f"one token mask of {self.grammar.description}")
        try:
            mask = self._compute_mask(sid)
        except GrammarBudgetError:
            self._over_budget.add(sid)  # the next request here fails at once
            raise
        finally:
            self._meter = None
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
            branches = children[node]
            if len(branches) > _FILTER_FROM:  # only the bytes the state can take
                first = self._first_bytes(state)
                if first is not None:
                    branches = {b: branches[b] for b in first if b in branches}
            for b, child in branches.items():
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

    def states_after(self, tokens: list[int]) -> list[int]:
        """The states after each of `tokens` in turn from this one, as far as the grammar
        takes them: up to the first it refuses or the first after a complete output
        (speculative drafts: the part worth verifying, and each drafted row's state)."""
        states, state = [], self.state
        for token in tokens:
            if self.grammar.terminal(state):
                break
            state = self.grammar.advance(state, token)
            if state < 0:
                break
            states.append(state)
        return states

    def at(self, state: int) -> GrammarMatcher:
        """A matcher of the same grammar at `state` (one of `states_after`)."""
        other = GrammarMatcher(self.grammar)
        other.state = state
        return other


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
            grammar = self._grammars[key] = TokenGrammar(params.grammar, self._vocab)
            if len(self._grammars) > MAX_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return GrammarMatcher(grammar)
