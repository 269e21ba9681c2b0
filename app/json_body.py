"""JSON out: every response body and stream frame the HTTP layer writes, encoded by orjson.

A completion with ``logprobs`` is tens of kB of numbers (128 tokens with 5 alternatives: 25 kB); the standard
library's encoder took 0.6-0.8 ms of the request thread's interpreter time for it, orjson about 0.04 ms
(docs/performance.md, "The wave boundary"). The text is the same JSON: keys in the order given, no ASCII escaping,
compact separators, floats written shortest-exact (``1e-05`` reads back as the same float). A value orjson
declines (a lone surrogate, which the request parser already refuses; an integer past 64 bits) is written by the
standard library, escaped to ASCII; NaN / Infinity, which are not JSON, come out as ``null`` instead
of the standard library's invalid tokens.
"""

from __future__ import annotations

import json

import orjson
from flask.json.provider import DefaultJSONProvider

_OPTIONS = orjson.OPT_NON_STR_KEYS  # vLLM's prompt_logprobs shape keys by token id


# what orjson does not know itself: Flask's own conversions (dates, decimals, UUIDs, dataclasses, ``__html__``)
_default = DefaultJSONProvider.default


def dumps_bytes(value) -> bytes:
    """``value`` as UTF-8 JSON."""
    try:
        return orjson.dumps(value, default=_default, option=_OPTIONS)
    except orjson.JSONEncodeError:
        return json.dumps(value, default=_default, separators=(",", ":")).encode()  # ASCII: any str encodes


def dumps(value) -> str:
    return dumps_bytes(value).decode()


class JSONProvider(DefaultJSONProvider):
    """Flask's JSON for ``jsonify`` and ``app.json``: orjson for the common case (no keyword arguments)."""

    sort_keys = False
    ensure_ascii = False

    def dumps(self, obj, **kwargs) -> str:
        if kwargs:  # a caller that asks for a layout (indent, ...) gets the standard library's
            return super().dumps(obj, **kwargs)
        return dumps(obj)

    def response(self, *args, **kwargs):
        obj = self._prepare_response_obj(args, kwargs)
        return self._app.response_class(dumps_bytes(obj) + b"\n", mimetype=self.mimetype)
