"""What a request constrains its output to: vLLM's `StructuredOutputsParams` (json, regex, choice,
grammar, json_object), checked on construction. Nothing here imports xgrammar."""

from __future__ import annotations

import enum
import json as json_lib
from dataclasses import dataclass
from typing import Any

from kvstore.engine.errors import InvalidRequest

# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING. Compile time grows steeply with depth (measured with
# xgrammar 0.2.8 on SmolLM2's vocabulary: arrays of arrays 64 deep 0.23 s, 5,000 deep > 6 CPU-minutes).
MAX_JSON_NESTING = 64
# The largest constraint compiled (the schema as compact JSON, the regex, the grammar, the choices as
# a JSON list, in UTF-8). Compile time and memory grow faster than size: an enum of 20,000 short
# strings (360 KB) took 3 s and 74 MB, one of 200,000 minutes; 128 KiB of enum compiles in ~1 s.
MAX_CONSTRAINT_BYTES = 128 * 1024
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputOptions(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in a parsed JSON document (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # their values are JSON data, not schemas


def _external_ref(schema: Any) -> str | None:
    """The first `$ref` that points outside the schema (a URL or a file), if any: nothing here can
    fetch it, and xgrammar would silently allow any value in its place."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, dict or string), `regex`, `choice` (the answer is
    one of these strings), `grammar` (EBNF, as in llama.cpp / xgrammar) or `json_object=True` (any
    JSON object). `disable_any_whitespace` makes JSON compact (no free whitespace between tokens)."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid structured_outputs: {msg}", param="structured_outputs")

        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object must be a bool")
        given = [
            k for k in _KINDS if getattr(self, k) is not None and (k != "json_object" or self.json_object)
        ]
        if len(given) != 1:
            raise bad(f"give exactly one of {', '.join(_KINDS)}; got {', '.join(given) or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise bad("disable_any_whitespace must be a bool")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json_lib.loads(schema)
                except RecursionError:
                    raise bad(f"the JSON schema nests more than {MAX_JSON_NESTING} levels deep") from None
                except ValueError as e:
                    raise bad(f"json is not a valid JSON document: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad(f"json must be a JSON schema (an object or a bool), got {type(schema).__name__}")
            if _nesting(schema) > MAX_JSON_NESTING:
                raise bad(
                    f"the JSON schema nests objects and arrays more than {MAX_JSON_NESTING} levels deep"
                )
            if (ref := _external_ref(schema)) is not None:
                raise bad(f"$ref {ref[:100]!r} points outside the schema; only local references (#/...) work")
            object.__setattr__(self, "json", schema)
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise bad("regex must be a non-empty string")
            if "\x00" in self.regex:
                raise bad("regex must not contain a NUL character")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise bad("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("every choice must be a non-empty string")
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar must be a non-empty EBNF string")
        size = len(self.key[1].encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise bad(
                f"the {self.kind.value} constraint is {size:,} bytes; at most {MAX_CONSTRAINT_BYTES:,} "
                "are compiled"
            )

    @property
    def kind(self) -> StructuredOutputOptions:
        if self.json is not None:
            return StructuredOutputOptions.JSON
        if self.json_object:
            return StructuredOutputOptions.JSON_OBJECT
        if self.regex is not None:
            return StructuredOutputOptions.REGEX
        if self.choice is not None:
            return StructuredOutputOptions.CHOICE
        return StructuredOutputOptions.GRAMMAR

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache key, with the tokenizer's).
        A schema is re-serialised compactly but in its own key order: xgrammar emits properties in
        schema order, so two orders are two grammars."""
        kind = self.kind
        if kind is StructuredOutputOptions.JSON:
            spec = json_lib.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
        elif kind is StructuredOutputOptions.JSON_OBJECT:
            spec = ""
        elif kind is StructuredOutputOptions.CHOICE:
            spec = json_lib.dumps(self.choice, ensure_ascii=False)
        else:
            spec = self.regex if kind is StructuredOutputOptions.REGEX else self.grammar
        whitespace = self.disable_any_whitespace and kind in (
            StructuredOutputOptions.JSON,
            StructuredOutputOptions.JSON_OBJECT,
        )
        return kind.value, spec, whitespace


def choice_as_grammar(choice: list[str]) -> str:
    """`root ::= "a" | "b"` with the literals escaped for xgrammar's EBNF (as vLLM does)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(s: str) -> str:
        chars = (escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s)
        return '"' + "".join(chars) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choice)
