"""The reliability run's gunicorn entry for injected faults (``gunicorn -c gunicorn.conf.py
tooling.reliability.faulty_wsgi:app``): saker's app with every engine step liable to fail at the rate written in the
file named by ``RELIABILITY_FAULT_FILE`` (tooling/reliability/faults.py), in the engine process too. Never serve with
it: it exists for ``python -m app reliability --only wedge``."""

from tooling.reliability import faults  # noqa: F401 - the patch, before the app is built
from app import create_app

app = create_app(exit_on_load_error=True)
