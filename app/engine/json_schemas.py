"""How JSON schemas are read for constrained decoding, shared by structured outputs (``grammar.py``) and forced
tool calls (``app/tool_calls.py``). No torch here."""

from __future__ import annotations

# JSON as models write it in prose and code (json.dumps' separators), and no free whitespace: a small model
# that may add whitespace tends to add it forever
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_objects(node, is_map: bool = False):
    """The schema with ``additionalProperties: false`` on every object schema that lists ``properties`` and says
    nothing of others (as vLLM's default backend, xgrammar, reads schemas): a small model otherwise goes on
    inventing keys. A schema that allows other keys says so."""
    if isinstance(node, list):
        return [closed_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: closed_objects(value, not is_map and key in _MAPS) for key, value in node.items()}
    if (
        not is_map
        and isinstance(node.get("properties"), dict)
        and "additionalProperties" not in node
        and "unevaluatedProperties" not in node
    ):
        out["additionalProperties"] = False
    return out
