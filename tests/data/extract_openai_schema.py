"""Regenerate openai_responses_schema.json from OpenAI's OpenAPI document (github.com/openai/openai-openapi).

    python tests/data/extract_openai_schema.py path/to/openapi.json COMMIT > tests/data/openai_responses_schema.json

Takes ``Response`` and ``ResponseStreamEvent`` with every schema they reference (transitively) from
``components/schemas``, rewrites ``#/components/schemas/X`` to ``#/$defs/X`` (a self-contained JSON Schema 2020-12
document), turns the 2019-09 ``$recursiveRef: "#"`` (CompoundFilter) into a plain ``$ref`` to its own definition,
and leaves out what does not validate: descriptions, titles, examples, ``x-*`` extensions and OpenAPI's
``discriminator``."""
from __future__ import annotations

import json
import sys

ROOTS = ("Response", "ResponseStreamEvent")
DROP = {"description", "title", "example", "examples", "deprecated", "discriminator", "$recursiveAnchor"}
NAMED = {"properties", "patternProperties", "$defs", "definitions"}      # maps of names to schemas


def clean(node, name):
    if isinstance(node, list):
        return [clean(v, name) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in DROP or key.startswith("x-"):
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


def main(path: str, commit: str) -> None:
    schemas = json.load(open(path))["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            found: set[str] = set()
            refs(schemas[name], found)
            todo += sorted(found)
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": ("OpenAI's Response and ResponseStreamEvent schemas and every schema they reference, from "
                        f"github.com/openai/openai-openapi, openapi.json (components/schemas) at commit {commit}; "
                        "made self-contained by tests/data/extract_openai_schema.py (refs to #/$defs, descriptions "
                        "and x-* extensions left out). Validate against #/$defs/Response or "
                        "#/$defs/ResponseStreamEvent."),
        "$defs": {name: clean(schemas[name], name) for name in sorted(keep)},
    }
    json.dump(doc, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
