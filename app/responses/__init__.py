"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path: a request becomes a chat completion request
(the same template, sampling, stops, limits, grammar and tool-call reader), its answer becomes a response object,
and a streamed answer becomes Responses events. No Flask and no torch here.

- ``request``: ``ResponsesRequest``, the request's fields.
- ``to_chat``: ``chat_request`` turns it (and the stored conversation it continues) into a chat body, so that a
  string ``input`` gives, token for token, what chat gives for that user message.
- ``responses_service``: ``ResponsesService``: ``create`` (a whole response), ``events`` (a stream),
  ``get``/``delete`` (the store).
- ``builder``: ``ResponseBuilder``, the response object; ``stream_events``: ``StreamState``, a stream's events.
- Tool types a local server cannot run (``web_search``, ``file_search``, ...) are left out and named in the
  ``X-Saker-Ignored-Tools`` header; fields that do not apply to a local model are accepted and ignored.
"""

from app.responses.builder import ResponseBuilder
from app.responses.request import ResponsesRequest
from app.responses.responses_service import ResponsesService
from app.responses.stream_events import StreamState

__all__ = ["ResponseBuilder", "ResponsesRequest", "ResponsesService", "StreamState"]
