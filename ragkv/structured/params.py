"""What a request asks its output to be (vLLM's StructuredOutputsParams), and the compiled
byte grammar of each distinct constraint."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

from .json_grammar import ByteGrammar, choice_grammar, json_object_grammar
from .json_schema import json_schema_grammar

# Grammars kept per engine, by their request's key (schema text, choice list), and compiled
# byte grammars kept per process.
MAX_GRAMMARS = 16


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
    # The compiled byte grammar, kept with the request: the engine thread never compiles.
    grammar: ByteGrammar = field(init=False, repr=False, compare=False)

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
        # Compiled now, on the caller's thread: errors reach the caller before queuing.
        object.__setattr__(self, "grammar", byte_grammar(self.key))

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
