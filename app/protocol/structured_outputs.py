"""Structured outputs as requests ask for them: ``response_format`` (OpenAI's and llama.cpp's shapes),
``structured_outputs`` (vLLM's) and the older ``guided_*`` fields, checked, and turned into one ``Constraint``
for the engine (``app/engine/sampling/grammar.py`` compiles it)."""

from __future__ import annotations

import json
import re
from typing import Any

from app.engine.params import Constraint
from app.errors import InvalidRequestError

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _check_schema(schema: Any, where: str) -> None:
    """A JSON schema is an object (llguidance says later whether it can compile it)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, not {type(schema).__name__}")


def json_constraint(schema: dict) -> Constraint:
    """A JSON schema as a constraint (its JSON text: equal schemas share a compiled grammar). Keys keep their
    order: properties are generated in the order the schema lists them."""
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


def guided_as_structured_outputs(data):
    """The request body with vLLM's older ``guided_*`` fields given as ``structured_outputs``."""
    if isinstance(data, dict) and any(data.get(k) is not None for k in _GUIDED):
        # vLLM's names before 0.12 (guided_json, ...), still sent by many clients: the same as
        # structured_outputs, so that a request for JSON never gets free text
        given = {_GUIDED[k]: data[k] for k in _GUIDED if data.get(k) is not None}
        if data.get("structured_outputs") is not None:
            raise InvalidRequestError(
                "send structured_outputs or the older guided_* fields, not both", param="structured_outputs"
            )
        data = {**data, "structured_outputs": given}
    return data


def check_response_format(value):
    """OpenAI's shapes: ``text``, ``json_object``, ``json_schema`` with ``json_schema: {name, description,
    schema, strict}``; also llama.cpp's ``schema`` next to ``type`` (json_object or json_schema)."""
    if value is None:
        return value
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"response_format type must be one of text, json_object, json_schema, not {kind!r}")
    if kind == "json_schema":
        spec = value.get("json_schema", {"schema": value["schema"]} if "schema" in value else None)
        if not isinstance(spec, dict):
            raise ValueError("response_format json_schema needs a json_schema object: {name, schema, strict}")
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
            raise ValueError("response_format json_schema.name must be 1-64 letters, digits, _ or -")
        _check_schema(spec.get("schema", {}), "response_format json_schema.schema")
    elif kind == "json_object" and "schema" in value:
        _check_schema(value["schema"], "response_format schema")
    return value


def check_structured_outputs(value):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    if value is None:
        return value
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) not in (None, False)]
    if "structural_tag" in value:
        raise ValueError("structured_outputs structural_tag is not supported; use json, regex, choice or grammar")
    if len(given) != 1:
        raise ValueError(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
            + (f"; got {', '.join(given)}" if given else "")
        )
    kind, spec = given[0], value[given[0]]
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise ValueError(
                    "structured_outputs json must be a JSON schema (an object, or its JSON text)"
                ) from None
        _check_schema(spec, "structured_outputs json")
    elif kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
    elif kind == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
    elif spec is not True:
        raise ValueError("structured_outputs json_object must be true")
    return {kind: spec}


def constraint_of(fmt: dict | None, outputs: dict | None) -> tuple[Constraint | None, str | None]:
    """What the output must match (``response_format`` or ``structured_outputs``, as their validators left
    them) and the field that asked."""
    if fmt is not None and fmt.get("type") != "text" and outputs is not None:
        raise InvalidRequestError(
            "send either response_format or structured_outputs, not both", param="structured_outputs"
        )
    if outputs is not None:
        ((kind, spec),) = outputs.items()
        if kind == "json":
            return json_constraint(spec), "structured_outputs"
        if kind == "json_object":
            return json_constraint({"type": "object"}), "structured_outputs"
        return Constraint(kind, json.dumps(spec) if kind == "choice" else spec), "structured_outputs"
    if fmt is None or fmt["type"] == "text":
        return None, None
    if fmt["type"] == "json_object":
        return json_constraint(fmt.get("schema", {"type": "object"})), "response_format"
    spec = fmt.get("json_schema", {"schema": fmt.get("schema")})
    return json_constraint(spec.get("schema") or {"type": "object"}), "response_format"
