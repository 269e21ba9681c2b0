"""Regenerate openai_responses_schema.json from OpenAI's OpenAPI document (github.com/openai/openai-openapi).

    python tests/data/extract_openai_schema.py path/to/openapi.json COMMIT > tests/data/openai_responses_schema.json
    python tests/data/extract_openai_schema.py path/to/openapi.json COMMIT CreateCompletionResponse \
        CreateChatCompletionResponse CreateChatCompletionStreamResponse ListModelsResponse Model ErrorResponse \
        > tests/data/openai_chat_completions_schema.json

Takes the named schemas (default: ``Response`` and ``ResponseStreamEvent``) with every schema they reference
(transitively) from
``components/schemas``, rewrites ``#/components/schemas/X`` to ``#/$defs/X`` (a self-contained JSON Schema 2020-12
document), turns the 2019-09 ``$recursiveRef: "#"`` (CompoundFilter) into a plain ``$ref`` to its own definition,
turns OpenAPI 3.0's ``nullable: true`` into JSON Schema (``null`` added to the type or enum), and leaves out what
does not validate: descriptions, titles, examples, ``x-*`` extensions and OpenAPI's ``discriminator``."""

from __future__ import annotations

import json
import sys

ROOTS = ("Response", "ResponseStreamEvent")
DROP = {"description", "title", "example", "examples", "deprecated", "discriminator", "$recursiveAnchor"}
NAMED = {"properties", "patternProperties", "$defs", "definitions"}  # maps of names to schemas


def clean(node, name):
    if isinstance(node, list):
        return [clean(v, name) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    if node.get("nullable") is True:  # OpenAPI 3.0's nullable, which JSON Schema does not know: null allowed
        node = {k: v for k, v in node.items() if k != "nullable"}
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        if isinstance(node.get("enum"), list) and None not in node["enum"]:
            node["enum"] = node["enum"] + [None]
        if "type" not in node and ("$ref" in node or "allOf" in node or "anyOf" in node or "oneOf" in node):
            node = {"anyOf": [node, {"type": "null"}]}
    for key, value in node.items():
        if key == "nullable" or key in DROP or key.startswith("x-"):
            continue
        if key == "$ref":
            out[key] = "#/$defs/" + value.removeprefix("#/components/schemas/")
        elif key == "$recursiveRef":
            assert value == "#"
            out["$ref"] = f"#/$defs/{name}"
        elif key in NAMED:
            out[key] = {k: clean(v, name) for k, v in value.items()}
        else:
            out[key] = clean(value, name)
    return out


def refs(node, found):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            found.add(node["$ref"].removeprefix("#/components/schemas/"))
        for value in node.values():
            refs(value, found)
    elif isinstance(node, list):
        for value in node:
            refs(value, found)


def main(path: str, commit: str, *roots: str) -> None:
    roots = roots or ROOTS
    schemas = json.load(open(path))["components"]["schemas"]
    keep, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            found: set[str] = set()
            refs(schemas[name], found)
            todo += sorted(found)
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": (
            f"OpenAI's {', '.join(roots)} schemas and every schema they reference, from "
            f"github.com/openai/openai-openapi, openapi.json (components/schemas) at commit {commit}; "
            "made self-contained by tests/data/extract_openai_schema.py (refs to #/$defs, descriptions "
            "and x-* extensions left out). Validate against #/$defs/<one of them>."
        ),
        "$defs": {name: clean(schemas[name], name) for name in sorted(keep)},
    }
    json.dump(doc, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
