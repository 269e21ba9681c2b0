"""Field types and the checks of the fields completions and chat share. ``SamplingRequest``'s validators call
these; a ``ValueError`` becomes a 400 naming the field (``parse_request``)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AllowInfNan, StrictFloat

Number = Annotated[StrictFloat, AllowInfNan(False)]  # ints are taken; NaN and +-inf are not
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
# An explicit null means the default for these fields (OpenAI documents them as nullable). Not for
# max_tokens (null = up to the context) nor prompt (required).
NULL_IS_DEFAULT = frozenset(
    {"n", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "logprobs_mode"}
)


def nulls_as_defaults(data):
    """The request body with the explicit nulls of ``NULL_IS_DEFAULT`` fields left out (so they take defaults)."""
    if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
        data = {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
    return data


def check_logit_bias(value):
    """Every bad entry is named (the first 8), not only the first one found."""
    problems = []
    for key, bias in (value or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):  # str.isdigit() takes "²", which int() refuses
            problems.append(f"keys must be token ids, got {key[:40]!r}")
        elif len(key.lstrip("-")) > 12:  # no vocabulary is that large (and int() refuses 4300+ digits)
            problems.append(f"keys must be token ids, got a {len(key)}-digit number")
        elif not -100 <= bias <= 100:
            problems.append(f"values must be within [-100, 100], got {bias} for {key}")
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValueError("logit_bias " + "; ".join(problems[:8]) + more)
    return value


def check_stop_strings(value):
    stops = [value] if isinstance(value, str) else (value or [])
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return value
