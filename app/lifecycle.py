"""Where this process is in its life, for the probes (``/livez``, ``/readyz``): ``draining`` is set when a stop
was asked for (SIGTERM to a gunicorn worker: app/gunicorn_worker.py), so that ``/readyz`` turns 503 and routers
stop sending new requests while the ones in flight finish."""

from __future__ import annotations

import threading

draining = threading.Event()
