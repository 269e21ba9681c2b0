"""saker's tooling, beside the server (``app/``) and not part of it: the performance suite (``tooling/bench/``), the
reliability run (``tooling/reliability/``), the terminal chat client, the tiny models the tests and the bench build,
the servers they start (``processes.py``) and the SSE reader (``sse.py``). ``python -m app bench|reliability|chat``
forward here; the server never imports this package (tests/unit/test_architecture_map.py checks it)."""
