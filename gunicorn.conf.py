"""gunicorn settings for saker: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Values come from the SAKER_* settings (app/settings.py, docs/configuration.md). Flags given on the command
line (``-b HOST:PORT``) win over this file. The master never imports torch: the model is loaded in each worker
after the fork, so CUDA is initialised only there.

Shutdown: on SIGTERM (``docker stop``, Kubernetes, Slurm's ``scancel``) the master asks each worker to stop;
a worker stops accepting connections, lets the requests it holds (running, queued for the model, and streams)
finish for up to ``graceful_timeout`` seconds, then exits. Give the orchestrator a longer grace period than
that (``docker stop -t``, ``terminationGracePeriodSeconds``). SIGINT/SIGQUIT stop at once.
"""

import logging
import logging.config
import os
import sys

from app.errors import ConfigError
from app.gunicorn_errors import install as _json_protocol_errors
from app.log_config import adopt_library_loggers, capture_stray_output, logging_config, quiet_progress_bars
from app.settings import load_settings

try:
    _settings = load_settings()
except ConfigError as exc:  # one clear line, no traceback
    print(f"saker: {exc}", file=sys.stderr)
    sys.exit(1)

# -- where and how many ----------------------------------------------------------------------------------
# Where to listen (SAKER_HOST/SAKER_PORT); `-b` on the command line overrides it.
bind = f"{_settings.host}:{_settings.port}"
# One worker process per model copy: each worker loads the whole model (and has its own /metrics registry).
# On a multi-GPU node prefer one replica per GPU (each with its own port) over several workers.
workers = _settings.workers
# gthread: a pool of threads per worker. A request holds a thread while it waits for the model and while it
# runs (streams too), so /health, /metrics and 429 answers need threads beyond the requests the model serves
# and queues: keep SAKER_THREADS > SAKER_MAX_RUNNING_REQUESTS + SAKER_MAX_QUEUE (see the check at the end).
# saker's gthread (app/gunicorn_worker.py): a request's head and announced body are read by the worker's main loop
# before a thread takes it, so slow clients hold no thread (408 after 10 s); a stopping worker refuses new
# connections at once.
worker_class = "app.gunicorn_worker.BufferingThreadWorker"
threads = _settings.threads
# Most open connections per worker (idle keep-alive ones included); gunicorn's default.
worker_connections = 1000
# Never load the app in the master: the model (and CUDA) belong to the worker.
preload_app = False
# Never recycle workers after N requests: reloading the model costs seconds to minutes.
max_requests = 0

# -- time limits -----------------------------------------------------------------------------------------
# The arbiter kills a worker whose main loop has not checked in for this long. In gthread the main loop keeps
# checking in while threads generate, so long generations do not trip it; a model load runs in a background
# thread for the same reason.
timeout = 120
# SIGTERM: stop accepting, give in-flight requests this long to finish, then exit (SAKER_GRACEFUL_TIMEOUT).
graceful_timeout = _settings.graceful_timeout
# Seconds an idle keep-alive connection stays open. Behind nginx (upstream keepalive) keep this above 0;
# nginx's own keepalive_timeout towards gunicorn should be lower than this.
keepalive = 5
# The worker heartbeat file: on /dev/shm (memory) where there is one, so a slow disk (Docker's overlay
# filesystem) cannot stall the heartbeat.
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

# -- requests --------------------------------------------------------------------------------------------
# gunicorn's own header limits stay at their defaults (request line 4094 bytes, 100 header fields of at most
# 8190 bytes each); the body limit is SAKER_MAX_REQUEST_BYTES, checked by the app (413) from Content-Length
# before the body is read, and while reading a chunked body.
limit_request_line = 4094
limit_request_fields = 100
limit_request_field_size = 8190
# X-Forwarded-* from a reverse proxy are honoured by the app (werkzeug ProxyFix, SAKER_PROXY_HOPS), which
# also fixes the client address in the access log. gunicorn itself only trusts X-Forwarded-Proto from these.
forwarded_allow_ips = "127.0.0.1,::1"

# Errors gunicorn answers itself (malformed request line or headers, 414, 431, bad Content-Length...) are written in
# the OpenAI error shape, as JSON, like every error the app answers (app/gunicorn_errors.py).
_json_protocol_errors()

# -- logs ------------------------------------------------------------------------------------------------
# gunicorn's access log stays off: saker writes one line per request itself (SAKER_ACCESS_LOG), with the request
# id, token counts and timings.
accesslog = None
# gunicorn's own handler for its error log; replaced by the stderr handler of logconfig_dict below.
errorlog = "-"
loglevel = _settings.log_level
# One logging configuration (app/log_config.py) for gunicorn's lines, saker's and the access log: one layout,
# SAKER_LOG_FORMAT=text or json, on stderr; the access log to SAKER_ACCESS_LOG. The master applies it here already
# (for the lines below), gunicorn again when it sets up its logger; workers inherit it.
logconfig_dict = logging_config(_settings)
logging.config.dictConfig(logconfig_dict)
capture_stray_output()
# No tqdm progress bars from transformers/huggingface_hub in a server's log (set before a worker imports them).
quiet_progress_bars()


# A worker, once the app is loaded (transformers imported): transformers' own stderr handler gives way to the
# root's, so its warnings are in the one format too.
def post_worker_init(worker):
    adopt_library_loggers()


# gunicorn 27's control socket (a shared path under ~/.gunicorn) is not used by saker; several servers on one
# host would fight over it.
control_socket_disable = True

_busy = _settings.max_running_requests + _settings.max_queue  # threads the model's requests can hold at once
if threads <= _busy:
    logging.getLogger("saker").warning(
        "SAKER_THREADS=%d leaves no thread for /health while SAKER_MAX_RUNNING_REQUESTS=%d requests run and "
        "SAKER_MAX_QUEUE=%d wait; set SAKER_THREADS to at least %d",
        threads,
        _settings.max_running_requests,
        _settings.max_queue,
        _busy + 2,
    )
