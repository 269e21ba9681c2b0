"""gunicorn entry point: ``gunicorn -c gunicorn.conf.py wsgi:app`` (the model loads in the worker)."""

from app import create_app

app = create_app(exit_on_load_error=True)
