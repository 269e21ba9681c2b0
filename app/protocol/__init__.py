"""Request and response schemas (OpenAI's shapes); requests convert themselves into engine parameters.

Validation errors become ``InvalidRequestError`` with ``param`` naming the field (see ``parse_request``).
Limits that depend on the server's settings are checked in ``to_sampling_params``.

- ``parse``: a JSON body -> a request schema, the first problem -> a 400 naming its field.
- ``fields``: field types and the checks of fields completions and chat share (logit_bias, stop, nulls).
- ``structured_outputs``: ``response_format``/``structured_outputs``/``guided_*`` checked, and as a ``Constraint``.
- ``sampling``: ``SamplingRequest`` (the fields completions and chat share), ``Limits``, -> ``SamplingParams``.
- ``completions``, ``chat``, ``tokenization``: each endpoint's request and answer schemas.
- ``answers``: usage and timing, shared by completion and chat answers; ``server``: models, health, errors.
"""

from app.protocol.answers import Timing, Usage
from app.protocol.chat import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTool,
    ChatTopLogprob,
    FunctionCall,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    TemplateFields,
    TextPart,
)
from app.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Prompt,
    TokenIds,
)
from app.protocol.fields import Number
from app.protocol.parse import parse_request
from app.protocol.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    Limits,
    SamplingRequest,
    StreamOptions,
)
from app.protocol.server import ErrorDetail, ErrorResponse, HealthResponse, ModelCard, ModelList
from app.protocol.structured_outputs import json_constraint
from app.protocol.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)

__all__ = [
    "GREEDY_BELOW_TEMPERATURE",
    "REPETITION_PENALTY_RANGE",
    "ChatChoice",
    "ChatChoiceLogprobs",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "ChatTool",
    "ChatTopLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorDetail",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDefinition",
    "HealthResponse",
    "Limits",
    "MessageToolCall",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "Number",
    "Prompt",
    "SamplingRequest",
    "StreamOptions",
    "TemplateFields",
    "TextPart",
    "Timing",
    "TokenIds",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizerInfo",
    "Usage",
    "json_constraint",
    "parse_request",
]
