"""How JSON schemas are read for constrained decoding, shared by structured outputs (``grammar.py``) and forced
tool calls (``app/tool_calls.py``). No torch here."""

from __future__ import annotations

# Whitespace where JSON allows it (around every bracket, comma and colon) in the layouts models write: none, one
# space, or a line break and an indentation of up to 32 spaces or 8 tabs. Compact JSON, json.dumps' separators and
# an indented layout (indent=2 or 4, 8 levels deep) all fit; a run of whitespace is bounded, so a model that would
# go on writing it cannot. Forbidding whitespace made a model that wanted to indent take a token far down its list
# and degenerate (instructor's JSON mode on the embedded SmolLM2).
WHITESPACE = r"( |\r?\n( {0,32}|\t{0,8}))?"
COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}  # json.dumps' layout


def json_options(whitespace: str | None = None) -> dict:
    """llguidance's JSON layout options: whitespace matching ``whitespace`` (a regex; None: ``WHITESPACE``) around
    every bracket, comma and colon, or with ``""`` json.dumps' separators and no other whitespace."""
    if whitespace == "":
        return dict(COMPACT)
    return {"item_separator": ",", "key_separator": ":", "whitespace_pattern": whitespace or WHITESPACE}


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
