"""The embedded SmolLM2 under 20+ JSON schemas (nested objects, arrays, enums, required fields, bounded numbers,
patterned strings, anyOf, $defs): every answer, all requests sharing the batch, parses and validates with
``jsonschema``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from conftest import make_settings, make_worker

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "city": {
        "type": "object",
        "properties": {"city": NAME, "country": NAME},
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
    },
    "enum": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
    },
    "bool": {"type": "object", "properties": {"is_capital": {"type": "boolean"}}, "required": ["is_capital"]},
    "number-bounds": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["temperature"],
    },
    "int-exclusive": {
        "type": "object",
        "properties": {"rating": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6}},
        "required": ["rating"],
    },
    "array-strings": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["colors"],
    },
    "array-ints": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 5,
    },
    "nested": {
        "type": "object",
        "properties": {
            "book": {
                "type": "object",
                "properties": {
                    "title": NAME,
                    "author": {
                        "type": "object",
                        "properties": {"first": NAME, "last": NAME},
                        "required": ["first", "last"],
                    },
                },
                "required": ["title", "author"],
            }
        },
        "required": ["book"],
    },
    "pattern-zip": {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    },
    "pattern-email": {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
        "required": ["email"],
    },
    "date-format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "report"}},
        "required": ["version", "kind"],
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "pattern": "^[A-Z]{3}$"},
                ]
            }
        },
        "required": ["id"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["nickname"],
    },
    "defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "array-objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
    },
    "enum-array": {
        "type": "object",
        "properties": {"days": {"type": "array", "maxItems": 3, "items": {"enum": ["mon", "tue", "wed", "thu"]}}},
        "required": ["days"],
    },
    "top-level-enum": {"enum": ["red", "green", "blue"]},
    "top-level-string": {"type": "string", "maxLength": 30},
    "many-required": {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abcdef"},
        "required": list("abcdef"),
        "additionalProperties": False,
    },
    "optional-fields": {
        "type": "object",
        "properties": {"a": NAME, "b": NAME},
        "required": ["a"],
        "additionalProperties": False,
    },
    "string-length": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 4}},
        "required": ["code"],
    },
}


@pytest.fixture(scope="module")
def service(saker_cache):
    from app.engine.model.load_config import LoadConfig
    from app.engine.model.loader import ensure_default_model
    from app.service import CompletionService

    settings = make_settings(model=str(ensure_default_model(LoadConfig(cache_dir=str(saker_cache)))))
    return CompletionService(settings, make_worker(settings))


def test_every_answer_validates_against_its_schema(service):
    from app.protocol import ChatCompletionRequest, parse_request

    def ask(item):
        name, schema = item
        body = {
            "messages": [{"role": "user", "content": f"Answer in JSON ({name}): tell me about Paris."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": name.replace("-", "_"), "schema": schema},
            },
            "temperature": 0.7,
            "seed": 1,
            "max_tokens": 160,
        }
        choice = service.complete(parse_request(ChatCompletionRequest, body)).body["choices"][0]
        return name, schema, choice

    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(8) as pool:  # they share the decode batch
        results = list(pool.map(ask, SCHEMAS.items()))
    for name, schema, choice in results:
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


USER_DETAIL = {
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
    "required": ["name", "age"],
    "title": "UserDetail",
    "type": "object",
}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_json_mode_prompt_with_an_indented_schema_ends_in_valid_json(service, temperature):
    """instructor's JSON mode: the schema printed with indent=2 in the system message and ``json_object``. The model
    wants a line break after ``{``; a grammar without whitespace made it take ``'",'`` at -9.4 and write
    ``{", ": 1000000000...`` until max_tokens. Now: a whole JSON object within 100 tokens whose keys are words (what
    is in it is the 135M model's reading: at 0.7 it copies the schema). With json.dumps' layout forced (and the
    digit bound) the sampled answer still starts ``{", ": 25.00000001``."""
    from app.protocol import ChatCompletionRequest, parse_request

    system = (
        "As a genius expert, your task is to understand the content and provide the parsed objects in json that "
        f"match the following json_schema:\n\n{json.dumps(USER_DETAIL, indent=2)}\n\n"
        "Make sure to return an instance of the JSON, not the schema itself"
    )
    body = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Extract Jason is 25 years old"},
        ],
        "response_format": {"type": "json_object"},
        "temperature": temperature,
        "seed": 3,
        "max_tokens": 100,
    }
    answer = service.complete(parse_request(ChatCompletionRequest, body)).body
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice["message"]["content"]
    parsed = json.loads(choice["message"]["content"])
    assert isinstance(parsed, dict) and answer["usage"]["completion_tokens"] <= 100

    def keys(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from keys(value)
        elif isinstance(node, list):
            for value in node:
                yield from keys(value)

    assert all(re.fullmatch(r"\w+", key) for key in keys(parsed)), parsed
