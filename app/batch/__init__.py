"""``python -m app batch``: push JSONL files of OpenAI-style requests through the model offline.

Each input line is a ``/v1/completions`` body (or a chat body with ``messages``); each answer is one output line
``{"line": N, "request": <as read>, "result": <the server's JSON + request_time>}`` or, for a malformed line or an
invalid request, ``{"line": N, "request": ..., "error": <OpenAI error object>}``. Requests go through the same
``CompletionService`` the HTTP server uses, in process, so results are the JSON the server would return.

- Outputs are resumable: every output line stores its input line number; a rerun skips the lines already answered
  (results and request errors; internal errors, out-of-memory and overload errors are retried) and appends the
  rest.
- Lines are written whole: each group's lines in one write, flushed and fsync'ed; SIGINT/SIGTERM are deferred
  while a write is in progress, and a torn last line (power loss, SIGKILL) is cut off on the next run.
- Requests are grouped by a token budget (``--max-batch-tokens``, the engine's setting of that name); ``answer_group``
  hands one group to the engine at once, whose scheduler decodes its requests in shared forward passes.
- stdout holds one JSON summary line (the last line); the progress bar and logs go to stderr.
- Exit codes: 0 every line answered, 1 some lines hold errors (or the run failed), 2 usage or set-up error
  (nothing was run), 128+signal when interrupted.

No torch import at module level: the parser is built by ``python -m app`` for every command.

- ``cli``: arguments, ``run``, ``main``; ``files``: inputs paired with outputs, planned and checked for a resume;
  ``inputs``: input files and lines; ``outputs``: reading, cleaning and appending to outputs; ``signals``: SIGINT/
  SIGTERM deferred during writes; ``lines``: a line as a prepared request (``Item``); ``batching``: groups by the
  token budget, ``answer_group``; ``runner``: the run over every file (``run_files``, ``Stats``).
"""

from app.batch.batching import answer_group, group_items
from app.batch.cli import (
    DEFAULT_MAX_BATCH_TOKENS,
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    add_arguments,
    build_parser,
    main,
    run,
)
from app.batch.files import BatchFile, check_file, plan_files
from app.batch.inputs import UsageError, parse_json_line
from app.batch.lines import Item, make_item
from app.batch.signals import Interrupted, SignalGuard

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "EXIT_ERRORS",
    "EXIT_OK",
    "EXIT_USAGE",
    "BatchFile",
    "Interrupted",
    "Item",
    "SignalGuard",
    "UsageError",
    "add_arguments",
    "answer_group",
    "build_parser",
    "check_file",
    "group_items",
    "main",
    "make_item",
    "parse_json_line",
    "plan_files",
    "run",
]
