"""A varied, deterministic set of function tools and prompts (tests and `tokenstream bench worker`).

Each tool mixes JSON-schema features: strings (some bounded, some with a pattern or format),
integers and numbers with ranges, booleans, enums, arrays (bounded), nested objects, optional
properties, anyOf, and every tenth tool takes no parameters.
"""

from __future__ import annotations

import random
from typing import Any

DOMAINS = [
    ("weather", "the weather forecast", ["city", "country", "days", "unit", "hourly"]),
    ("flight", "a flight search", ["origin", "destination", "date", "passengers", "cabin"]),
    ("order", "an order in the shop", ["order_id", "quantity", "express", "items", "note"]),
    ("calendar", "a calendar event", ["title", "start", "minutes", "attendees", "remind"]),
    ("translate", "a translation", ["text", "source", "target", "formal", "glossary"]),
    ("stock", "a stock quote", ["symbol", "exchange", "period", "adjusted", "metrics"]),
    ("recipe", "a recipe search", ["dish", "servings", "vegetarian", "cuisine", "max_minutes"]),
    ("email", "an email", ["to", "subject", "body", "priority", "cc"]),
]


def _prop(rng: random.Random, field: str) -> dict[str, Any]:
    kind = rng.choice(
        [
            "string",
            "short",
            "pattern",
            "integer",
            "number",
            "boolean",
            "enum",
            "array",
            "int_array",
            "object",
            "any_of",
            "date",
        ]
    )
    if kind == "string":
        return {"type": "string", "description": f"the {field}"}
    if kind == "short":
        return {"type": "string", "maxLength": 24}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z]{3}$", "description": "a three-letter code"}
    if kind == "integer":
        lo = rng.randint(0, 5)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 999])}
    if kind == "number":
        return {"type": "number", "minimum": 0}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {
            "type": "string",
            "enum": rng.sample(
                ["low", "normal", "high", "urgent", "celsius", "fahrenheit", "economy", "business"], 3
            ),
        }
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}
    if kind == "int_array":
        return {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 1,
            "maxItems": 4,
        }
    if kind == "object":
        return {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "count": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["name", "count"],
        }
    if kind == "any_of":
        return {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 12}]
        }
    return {"type": "string", "format": "date"}


def tools(n: int = 50) -> list[tuple[dict[str, Any], str]]:
    """`n` (tool, prompt) pairs in OpenAI's `tools` shape."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        domain, what, fields = DOMAINS[i % len(DOMAINS)]
        name = f"{domain}_{i}"
        function: dict[str, Any] = {"name": name, "description": f"Look up or create {what}."}
        if i % 10 != 9:
            chosen = rng.sample(fields, rng.randint(1, len(fields)))
            props = {f: _prop(rng, f) for f in chosen}
            required = [f for f in chosen if rng.random() < 0.7] or chosen[:1]
            function["parameters"] = {"type": "object", "properties": props, "required": required}
            if rng.random() < 0.5:
                function["parameters"]["additionalProperties"] = False
        out.append(
            (
                {"type": "function", "function": function},
                f"Please help me with {what}: call {name} with sensible values.",
            )
        )
    return out
