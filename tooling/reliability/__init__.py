"""``python -m app reliability``: the reliability figures of the hardening issue. A measurement, not a test: it
starts its own gunicorn on 127.0.0.1 (``gunicorn.conf.py``, saker's worker) against ``--model`` (default: the
embedded SmolLM2-135M-Instruct, converted once into ``--cache-dir``), runs the sections below, prints a table and
writes a JSON report (``--out``). ``--quick`` is the bounded form CI runs (tests/live/test_reliability.py).

Sections (``--only load,bad,slow,memory,close,wedge``; all by default):

- load    16, 32 and 64 closed-loop clients (threads, plain ``http.client``) for ``--load-seconds`` each: plain and
          streamed completions and chat completions; one client in four drops every request it sends (a stream is
          closed after its first frames, a plain request's socket right after it is sent). Each request is
          answered (200, whole: a stream ends with ``[DONE]``), busy (a clean 429/503 in the OpenAI error shape
          with ``Retry-After``), dropped (by us), or lost: anything else (a connection error we did not cause, a
          5xx or another status, a truncated stream, an error frame). Goal: lost = 0, and the server's running and
          queued counts back to 0 afterwards (no slot kept by a dropped request).
- bad     a corpus of malformed and hostile requests over raw sockets: bad JSON, wrong types and huge numbers in
          every field, deep nesting, invalid UTF-8, lone surrogates, bad logit_bias keys, bad response_format /
          structured_outputs / tools / messages, malformed chunked bodies, gzip bombs, unknown encodings, protocol
          errors (bad Content-Length, HTTP/0.9, oversized request line and headers, ...). Goal: no answer >= 500,
          every error answer JSON in the OpenAI shape, and a normal request answered 200 afterwards.
- slow    ``--slow-clients`` connections (200) that send their request head one line every 2 s, reconnecting when
          answered 408, for ``--slow-seconds``, while a normal client sends a completion and a /health every 0.5 s.
          Goal: all slow connections held at once and every normal request answered (its latency is reported).
- memory  the gunicorn worker's RSS (VmRSS of the worker and its children, every 50 ms) before, during and after
          the worst legal request (a prompt filling the context minus 92 tokens, n = best_of = 20, logprobs 20,
          echo, max_tokens null: it may be refused 400 because its candidates cannot fit the KV budget, which is a
          correct answer), a variant that fits (n = best_of = 2, max_tokens 16) and prompt scoring (full mode: a
          3,500-token prompt, n = best_of = 8, logprobs 20, echo, max_tokens 16; goal: the worker grows by at most
          1 GiB, its peak over the RSS just before it). Bound: the RSS at ready + the
          KV budget in bytes (``saker_kv_cache_budget_tokens`` x 2 x layers x KV heads x head size x dtype bytes)
          + a transient allowance of two prefill chunks of float32 logits (chunk x vocabulary x 4 bytes x 2).
          Full mode also runs a sequence on a second server with a small budget (``--memory-budget-tokens``, 4096):
          a long prompt (half the budget), then a request of 2 x SAKER_MAX_BATCH_ROWS one-word rows.
- close   how long the server works on after its client leaves: a long stream (max_tokens 4000, ignore_eos) and
          a long plain request (also one with a ``stop`` string), closed by the client after ~1 s of decoding, and
          (full mode) a stream and a plain request closed while a long prompt is still being prefilled, and a
          stream closed 1 s into the prefill of a 6,000-token prompt (``stream-long-prefill``). Measured
          from the close to ``saker_requests_running`` back to 0 (/metrics polled every 20 ms) and to the server's
          "ended early" log line, compared with one decode step and one prefill chunk (timed on the same server
          from ``X-Saker-*`` headers). Goal: <= one step (or chunk).
- wedge   no request can wedge the server. On the run's server: ``n`` = ``best_of`` = the server's ``max_n``
          (128) with max_tokens 1, 2, 16 and 200 (quick: 1, 2, 16), through completions and chat, alone, then again
          beside 3 closed-loop clients (plain and streamed completions; quick: max_tokens 1 only). A 400 saying the
          candidates cannot fit the KV budget (param ``n``/``best_of``) is a correct answer, and the request is
          sent again with half the ``n`` until taken. Goal: every wide request 200 with its n choices, every other
          request answered, nothing running or queued afterwards, a greedy request answers the text it answered
          before, ``saker_engine_repairs_total`` 0. Then on a second gunicorn
          (``tooling.reliability.faulty_wsgi:app``: every fault point of every engine step fails with the probability
          in the file named by ``RELIABILITY_FAULT_FILE``, tooling/reliability/faults.py), in process and (full mode)
          with SAKER_ENGINE_PROCESS: 4 clients send plain, streamed, ``n`` > 1 and chat requests for 30 s (quick 5)
          and on until 20 (quick 5) steps failed, at p = 0.02, then p = 0. Goal: every request ended (200 whole, a
          JSON 500 ``server_error`` naming its request id, or a stream's error frame then ``[DONE]``; a connection
          error or a time-out is a failure), steps did fail (``saker_engine_step_failures_total``), then nothing
          running or queued, ``saker_kv_cache_usage`` 0 (it counts blocks held by rows and prompts; the prefix
          cache's blocks with no holder are not in it), no repair, /livez and /health 200, the greedy text of the
          run's server, the same worker. That server's log is not in the "no traceback" goal: each failed step is
          logged with its traceback by design.

Timing and memory figures are reported, never asserted; the exit status is 1 when a correctness goal is missed
(lost requests, 5xx, non-JSON errors, slow clients starving the server, a slot never released, a wide
request or an injected fault that leaves a request unanswered or something held), else 0.
"""

from __future__ import annotations

from tooling.reliability.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
