"""gunicorn settings for saker: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Values come from the SAKER_* settings (app/settings.py). Flags given on the command line (``-b HOST:PORT``)
win over this file. The master never imports torch: the model is loaded in each worker after the fork,
so CUDA is initialised only there.
"""
import sys

from app.errors import ConfigError
from app.settings import load_settings

try:
    _settings = load_settings()
except ConfigError as exc:          # one clear line, no traceback
    print(f"saker: {exc}", file=sys.stderr)
    sys.exit(1)

# Where to listen (SAKER_HOST/SAKER_PORT); `-b` on the command line overrides it.
bind = f"{_settings.host}:{_settings.port}"
# One worker process per model copy: each worker loads the whole model.
workers = _settings.workers
# gthread: a thread per connection, so /health answers while a generation runs; requests wait for the model.
worker_class = "gthread"
threads = _settings.threads
# Never load the app in the master: the model (and CUDA) belong to the worker.
preload_app = False
# The gthread heartbeat does not depend on request length, so long generations do not trip this.
timeout = 120
# SIGTERM: stop accepting, give in-flight requests this long to finish, then exit.
graceful_timeout = 120
keepalive = 5
# Log to stderr. gunicorn's access log stays off: saker logs failed requests itself (structured access logs
# are tracked in the operations issue).
errorlog = "-"
loglevel = _settings.log_level
# gunicorn 27's control socket (a shared path under ~/.gunicorn) is not used by saker; several servers on one
# host would fight over it.
control_socket_disable = True
