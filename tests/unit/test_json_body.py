"""The HTTP layer's JSON out (app/json_body.py): the same JSON the standard library writes, read back by the standard
library's parser, for the shapes the server sends; what orjson declines still goes out; nothing that is not JSON."""

import json
import math

from flask import Flask

from app.json_body import JSONProvider, dumps, dumps_bytes


def reference(value) -> object:
    """What the standard library's encoder and parser make of ``value`` (Flask's default layout)."""
    return json.loads(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


BODY = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [
        {
            "index": 0,
            "text": 'héllo 😀 \u2028 \x00 "q" \\',
            "logprobs": {
                "tokens": ["h", "é", "bytes:\\xe2\\x80"],
                "token_logprobs": [-0.1, -1e-05, -123456.789e-10, -0.0],
                "top_logprobs": [{"h": -0.1, "x": -2.5}, {"é": -1e-05}, None],
                "text_offset": [0, 1, 2],
            },
            "finish_reason": "length",
        }
    ],
    "prompt_logprobs": [None, {17: {"logprob": -3.25, "rank": 2, "decoded_token": "a"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    "flags": [True, False, None, 2**63 - 1, 1e300, 5e-324],
}


def test_a_response_reads_back_as_the_standard_librarys_does_with_keys_in_order():
    text = dumps(BODY)
    assert json.loads(text) == reference(BODY)
    assert list(json.loads(text)) == list(BODY)  # keys keep their order (no sorting)
    assert "é" in text and "😀" in text  # not escaped to ASCII
    assert '", "' not in text and '": ' not in text  # compact separators, as Flask writes a response


def test_what_orjson_declines_is_written_by_the_standard_library():
    lone = {"text": "a\ud800b", "big": 2**70}  # a lone surrogate (the parser refuses them); an integer past 64 bits
    assert json.loads(dumps_bytes(lone)) == lone


def test_nan_and_infinity_come_out_as_null_never_as_tokens_json_does_not_have():
    text = dumps({"a": math.nan, "b": math.inf, "c": -math.inf})
    assert json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name))) == {
        "a": None,
        "b": None,
        "c": None,
    }


def test_flask_responses_use_it():
    app = Flask(__name__)
    app.json = JSONProvider(app)
    with app.app_context():
        response = app.json.response(BODY)
        assert response.mimetype == "application/json"
        assert response.get_data() == dumps_bytes(BODY) + b"\n"
        assert json.loads(app.json.dumps(BODY)) == reference(BODY)
        assert app.json.dumps({"b": 1, "a": 2}, indent=2) == '{\n  "b": 1,\n  "a": 2\n}'  # a layout asked for
