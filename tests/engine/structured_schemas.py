"""Twenty JSON schemas for the structured-output tests, each with the request a user would send.

Strings carry maxLength or a bounded pattern and arrays maxItems, so that a greedy 135M model
finishes every answer within the tests' max_tokens (an unbounded string may run to max_tokens, which
is the answer's `length` finish, not a constraint failure).
"""

from __future__ import annotations

import threading

import psutil

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "a fictional person with a name and an age", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    }),
    ("address", "a postal address in the United States", {
        "type": "object",
        "properties": {
            "street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["USA", "Canada", "Mexico"]},
        },
        "required": ["street", "city", "zip", "country"],
    }),
    ("book", "a famous novel", {
        "type": "object",
        "properties": {
            "title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2025},
            "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "romance"]},
                       "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "author", "year", "genres"],
    }),
    ("product", "a product in a hardware store", {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"},
        },
        "required": ["sku", "price", "in_stock"],
    }),
    ("weather", "today's weather in Paris", {
        "type": "object",
        "properties": {
            "city": NAME, "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
            "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        },
        "required": ["city", "temperature_c", "condition"],
    }),
    ("todo", "a short to-do list", {
        "type": "object",
        "properties": {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"task": {"type": "string", "maxLength": 30}, "done": {"type": "boolean"}},
            "required": ["task", "done"],
        }}},
        "required": ["items"],
    }),
    ("lottery", "five lottery numbers", {
        "type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 49}, "minItems": 2, "maxItems": 5,
    }),
    ("color", "the color of the sky", {"enum": ["red", "green", "blue", "yellow"]}),
    ("rgb", "the RGB values of orange", {
        "type": "object",
        "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
        "required": ["r", "g", "b"],
    }),
    ("event", "a concert next summer", {
        "type": "object",
        "properties": {
            "name": NAME, "date": {"type": "string", "format": "date"},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
        },
        "required": ["name", "date", "attendees"],
    }),
    ("contact", "the contact details of a plumber", {
        "type": "object",
        "properties": {
            "name": NAME, "email": {"type": "string", "format": "email"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9]{10,12}$"},
        },
        "required": ["name", "email", "phone"],
    }),
    ("company", "a technology company and its chief executive", {
        "type": "object",
        "properties": {
            "company": {"type": "object", "properties": {
                "name": NAME,
                "ceo": {"type": "object", "properties": {
                    "name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99},
                }, "required": ["name", "age"]},
            }, "required": ["name", "ceo"]},
            "employees": {"type": "integer", "minimum": 1, "maximum": 1000000},
        },
        "required": ["company", "employees"],
    }),
    ("recipe", "a pancake recipe", {
        "type": "object",
        "properties": {
            "name": NAME,
            "ingredients": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"item": NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}},
                "required": ["item", "grams"],
            }},
        },
        "required": ["name", "ingredients"],
    }),
    ("movie", "a film; the subtitle is optional", {
        "type": "object",
        "properties": {"title": NAME, "subtitle": NAME},
        "required": ["title"],
    }),
    ("status", "the status of an API", {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
    }),
    ("answer", "the answer to a quiz question, a number or a short word", {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 10}]}},
        "required": ["value"],
    }),
    ("segment", "a line segment between two points", {
        "$defs": {"point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                           "y": {"type": "integer", "minimum": -100, "maximum": 100}},
            "required": ["x", "y"],
        }},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    }),
    ("feature", "a feature flag", {
        "type": "object",
        "properties": {"enabled": {"type": "boolean"}, "comment": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["enabled", "comment"],
    }),
    ("account", "a user account", {
        "type": "object",
        "properties": {
            "username": {"type": "string", "minLength": 3, "maxLength": 12},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        },
        "required": ["username", "role", "tags"],
    }),
    ("grades", "a student's exam results", {
        "type": "object",
        "properties": {
            "student": NAME,
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "minItems": 1, "maxItems": 4},
            "grade": {"enum": ["A", "B", "C", "D", "F"]},
        },
        "required": ["student", "scores", "grade"],
    }),
]  # fmt: skip


def chat(description: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply in JSON only. Describe {description}."}]


def slow_schema(salt: int, strings: int = 16) -> dict:
    """A compile bomb of a few hundred bytes: xgrammar spends ~2 s per string of its own maxLength
    (16 of them: 36 s of CPU). Each `salt` is a new constraint (no shared compile, no cache hit)."""
    props = {f"s{i}": {"type": "string", "maxLength": 1000 + 100 * salt + i} for i in range(strings)}
    return {"type": "object", "properties": props}


def small_schema(salt: int) -> dict:
    """A fresh small schema (compiles in milliseconds); each `salt` a new constraint."""
    return {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", f"blue-{salt}"]}},
        "required": ["color"],
    }


def compiling() -> int:
    """Compiles running in this process's compile helpers (their forked children)."""
    return sum(c.startswith("compile pid") for c in grammar_compiles_alive())


def grammar_compiles_alive() -> list[str]:
    """Compiles still burning CPU: children of this process's compile helpers, and threads that
    compile in this process (the in-process fallback, and the compiles before the helper)."""
    helpers = [
        p
        for p in psutil.Process().children()
        if "kvstore.engine.structured_output.compile_worker" in p.cmdline()
    ]
    compiles = [f"compile pid {c.pid}" for h in helpers for c in h.children()]
    return compiles + [t.name for t in threading.enumerate() if t.name == "grammar-compile"]
