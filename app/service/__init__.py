"""The serving layer between the routes (``app/api.py``) and the engine's worker: engine results -> OpenAI
responses and stream chunks. No Flask and no torch here.

- ``completion_service``: ``CompletionService`` (model names, limits, ``prepare``, ``complete``, ``stream``).
- ``prepared``: ``PreparedRequest`` (a validated request, ready for the worker) and ``ServedResponse``.
- ``chat_template``: rendering messages (and tools) with the chat template.
- ``answers``: whole completion and chat answers, logprob shapes, timing.
- ``answer_reader``: a chat answer read for thoughts and tool calls (answers and streams alike).
- ``stream_chunks``: a streamed answer's chunks.
- ``tokenization``: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``.
"""

from app.service.completion_service import CompletionService
from app.service.prepared import PreparedRequest, ServedResponse

__all__ = ["CompletionService", "PreparedRequest", "ServedResponse"]
