"""JSON schemas compiled into the byte automata of json_grammar.py: the subset of JSON Schema
that structured outputs enforce, every other keyword a clear error naming it."""

from __future__ import annotations

import json
from urllib.parse import unquote

from .json_grammar import START_RUN, ArraySpec, ByteGrammar, ObjectSpec, any_value
from .json_scalars import FORMATS, NumberBounds

# Schema keywords that only annotate: accepted and ignored.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "readOnly", "writeOnly", "deprecated", "$defs",
                          "definitions"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_LENGTHS = frozenset({"minLength", "maxLength"})
_SUPPORTED = frozenset({"type", "enum", "const", "properties", "required",
                        "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
                        "anyOf", "allOf", "$ref", "format"}) | _BOUNDS | _LENGTHS | _ANNOTATIONS
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def json_schema_grammar(schema: object) -> ByteGrammar:
    """JSON that follows `schema` (a dict, or its JSON text). Objects take their properties
    in any order, each at most once, the required ones before the closing brace, and no other
    keys unless additionalProperties allows them (then the object may have no `properties`):
    as the strict modes of OpenAI and xgrammar, where an absent additionalProperties means
    false (an object schema with neither is any object). Raises ValueError naming the first
    keyword it cannot enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("json schema nests too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a json schema must be an object, got {type(schema).__name__}")
    g = ByteGrammar("JSON following the schema")
    try:
        root = _SchemaCompiler(g, schema).node(schema, "#")
    except RecursionError:
        raise ValueError("json schema nests too deeply") from None
    g.initial = frozenset({((("V", root),), START_RUN)})
    # A $ref that only leads back to itself (or an anyOf of such) can never start a value: the
    # output would reach a state where nothing may follow. An anyOf can start one when a
    # branch can: found backwards from the nodes that are not anyOf, each edge once.
    parents: dict[int, list[int]] = {}
    for i, node in enumerate(g.nodes):
        if node[0] == "anyof":
            for child in node[1]:
                parents.setdefault(child, []).append(i)
    startable = {i for i, node in enumerate(g.nodes) if node[0] != "anyof"}
    todo = list(startable)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in startable:
                startable.add(parent)
                todo.append(parent)
    if len(startable) < len(g.nodes):
        raise ValueError("json schema: a $ref only refers to itself, so no value can follow "
                         "it")
    return g


class _SchemaCompiler:
    def __init__(self, g: ByteGrammar, root: object) -> None:
        self.g = g
        self.root = root
        self.refs: dict[str, int] = {}
        self.any: int | None = None

    def node(self, schema: object, where: str) -> int:
        g = self.g
        if schema is True or schema == {}:
            if self.any is None:
                self.any = any_value(g)
            return self.any
        if schema is False:
            raise ValueError(f"json schema at {where} is false: no value can follow it")
        if not isinstance(schema, dict):
            raise ValueError(f"json schema at {where} must be an object or a boolean, got "
                             f"{schema!r:.80}")
        unknown = sorted(set(schema) - _SUPPORTED)
        if unknown:
            known = ", ".join(sorted(_SUPPORTED - _ANNOTATIONS))
            raise ValueError(f"json schema keyword {unknown[0]!r} (at {where}) is not "
                             f"supported; supported: {known}")
        if "$ref" in schema:
            if len(set(schema) - _ANNOTATIONS) > 1:
                raise ValueError(f"json schema at {where}: $ref beside other keywords is not "
                                 "supported")
            return self._ref(schema["$ref"], where)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(set(schema)
                                                                    - _ANNOTATIONS) > 1:
                raise ValueError(f"json schema at {where}: allOf is supported only with one "
                                 "schema and nothing beside it")
            return self.node(parts[0], f"{where}/allOf/0")
        if "anyOf" in schema:
            parts = schema["anyOf"]
            if not isinstance(parts, list) or not parts:
                raise ValueError(f"json schema at {where}: anyOf must be a non-empty list")
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            if set(rest) - _ANNOTATIONS:
                raise ValueError(f"json schema at {where}: anyOf beside other keywords is not "
                                 "supported")
            return g.add(("anyof", tuple(self.node(p, f"{where}/anyOf/{i}")
                                         for i, p in enumerate(parts))))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"json schema at {where}: enum must be a non-empty list")
            beside = sorted(set(schema) - _ANNOTATIONS - {"enum", "const", "type"})
            if beside or ("enum" in schema and "const" in schema):
                raise ValueError(f"json schema at {where}: "
                                 f"{beside[0] if beside else 'enum'!r} beside enum or const is "
                                 "not supported")
            kinds = schema.get("type")
            kinds = [kinds] if isinstance(kinds, str) else kinds
            wrong = [v for v in values if kinds is not None and not any(
                _is_type(v, k) for k in kinds)]
            if wrong:
                raise ValueError(f"json schema at {where}: enum or const value {wrong[0]!r:.40} "
                                 f"is not of type {schema['type']!r}")
            try:
                words = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False, allow_nan=False,
                                                       separators=(",", ":")).encode()
                                            for v in values))
            except (TypeError, ValueError) as e:  # NaN and infinities are not JSON
                raise ValueError(f"json schema at {where}: enum or const value is not JSON "
                                 f"data: {e}") from None
            return g.add(("literal", words))
        kind = schema.get("type")
        implied = kind is None
        if implied:
            # A type's keywords without a type: held to that type (as required and minItems
            # always were), not "any value, and this rule if it is of that type".
            kind = next((t for t in ("object", "array", "string", "number")
                         if set(schema) & _TYPE_KEYWORDS[t]), None)
            if kind is None:
                return self.node(True, where)
        if isinstance(kind, list):
            if not kind:
                raise ValueError(f"json schema at {where}: type must not be an empty list")
            # Each type keeps the keywords that apply to it.
            return g.add(("anyof", tuple(
                self.node({k: v for k, v in schema.items() if k in _ANNOTATIONS
                           or k in _TYPE_KEYWORDS.get(t, ())} | {"type": t}, where)
                for t in dict.fromkeys(kind))))
        if kind not in _TYPES:
            raise ValueError(f"json schema at {where}: unknown type {kind!r}")
        extra = sorted(set(schema) - _ANNOTATIONS - {"type"} - _TYPE_KEYWORDS[kind])
        if extra:
            raise ValueError(f"json schema at {where}: {extra[0]!r} does not apply to type "
                             f"{kind!r}" + (" (implied by its other keywords: no type is "
                                            "given)" if implied else ""))
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            if set(schema) & _BOUNDS:
                return g.add(("bounded", NumberBounds.of(schema, kind == "integer", where)))
            return g.add(("number", kind == "integer"))
        if kind == "boolean":
            return g.add(("literal", (b"true", b"false")))
        if kind == "null":
            return g.add(("literal", (b"null",)))
        if kind == "array":
            return self._array(schema, where)
        return self._object(schema, where)

    def _string(self, schema: dict, where: str) -> int:
        low, high = _counts(schema, "minLength", "maxLength", where)
        if "format" in schema:
            fmt = schema["format"]
            if fmt not in FORMATS:
                raise ValueError(f"json schema at {where}: format {fmt!r:.40} is not "
                                 f"supported; supported: {', '.join(FORMATS)}")
            if set(schema) & _LENGTHS:
                raise ValueError(f"json schema at {where}: minLength or maxLength beside "
                                 "format is not supported")
            return self.g.add(("format", fmt))
        if (low, high) == (0, None):
            return self.g.add(("string",))
        return self.g.add(("counted", low, high))

    def _array(self, schema: dict, where: str) -> int:
        low, high = _counts(schema, "minItems", "maxItems", where)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"json schema at {where}: prefixItems must be a list of schemas")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise ValueError(f"json schema at {where}: items as a list (draft 4's tuples) is "
                             "not supported; use prefixItems")
        if items is False:  # nothing after the prefix
            if low > len(prefix):
                raise ValueError(f"json schema at {where}: minItems {low} with items false "
                                 f"and {len(prefix)} prefixItems")
            high = len(prefix) if high is None else min(high, len(prefix))
        node_id = self.g.add(("array", None))
        nodes = tuple(self.node(p, f"{where}/prefixItems/{i}") for i, p in enumerate(prefix))
        item = None if items is False else self.node(items, f"{where}/items")
        self.g.nodes[node_id] = ("array", ArraySpec(item, low, high, nodes))
        return node_id

    def _object(self, schema: dict, where: str) -> int:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"json schema at {where}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"json schema at {where}: required must be a list of names")
        missing = [r for r in required if r not in props]
        # Strict mode: without additionalProperties no other keys, except in an object that
        # names no properties either ({"type": "object"}), which is any object.
        extra_schema = schema.get("additionalProperties", "properties" not in schema)
        if extra_schema is not False and props:
            raise ValueError(f"json schema at {where}: additionalProperties beside properties "
                             "is not supported (give one or the other)")
        if missing:
            raise ValueError(f"json schema at {where}: required property {missing[0]!r} is "
                             "not in properties")
        node_id = self.g.add(("object", None))
        extra = None if extra_schema is False else self.node(
            extra_schema, f"{where}/additionalProperties")
        compiled = {}
        for name, sub in props.items():
            key = json.dumps(name, ensure_ascii=False).encode()[1:]  # after the opening quote
            compiled[name] = (key, self.node(sub, f"{where}/properties/{name}"))
        self.g.nodes[node_id] = ("object", ObjectSpec(compiled, frozenset(required), extra))
        return node_id

    def _ref(self, ref: object, where: str) -> int:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"json schema at {where}: only local $ref ('#' or a JSON "
                             f"pointer '#/...') is supported, got {ref!r:.80}")
        if ref in self.refs:
            return self.refs[ref]
        target: object = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise ValueError(f"json schema at {where}: $ref {ref!r} points nowhere")
        # A placeholder first, so a recursive schema refers to itself.
        placeholder = self.g.add(("anyof", ()))
        self.refs[ref] = placeholder
        self.g.nodes[placeholder] = ("anyof", (self.node(target, ref),))
        return placeholder


def _counts(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
    """A pair of count keywords (minItems / maxItems, minLength / maxLength), checked."""
    for name in (low_key, high_key):
        value = schema.get(name, 0)  # present: null is as wrong as -1
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"json schema at {where}: {name} must be an integer >= 0")
    low, high = schema.get(low_key, 0), schema.get(high_key)
    if high is not None and high < low:
        raise ValueError(f"json schema at {where}: {high_key} {high} < {low_key} {low}")
    return low, high


def _is_type(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "object": dict, "array": list}.get(kind)
    return value is None if kind == "null" else python is not None and isinstance(value, python)


# `format` on a number (OpenAPI's int64, double) is accepted and has no effect: JSON Schema
# applies formats to strings only.
_TYPE_KEYWORDS = {
    "string": _LENGTHS | {"format"}, "integer": _BOUNDS | {"format"},
    "number": _BOUNDS | {"format"}, "boolean": set(), "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
