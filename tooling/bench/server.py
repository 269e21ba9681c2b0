"""Our server under gunicorn, started and stopped by the bench: ``gunicorn -c gunicorn.conf.py wsgi:app`` on
127.0.0.1 with the generated model, in a process group of its own (``tooling.processes.GunicornServer``)."""

from __future__ import annotations

from pathlib import Path

from tooling.processes import GunicornServer, without_api_keys
from tooling.processes import free_port as free_port  # re-exported: parts import it from here


def settings_fields() -> set[str]:
    from app.settings import Settings

    return set(Settings.model_fields)


class Server(GunicornServer):
    """The bench's private server: ``SAKER_MODEL`` = ``model_dir`` served as ``name``, quiet logs, no API keys
    from the caller's environment (the bench would not know them); its log is ``log_dir/gunicorn-NAME-PORT.log``.
    Stopped with SIGTERM to its process group."""

    def __init__(self, model_dir: Path, name: str, env: dict[str, str], log_dir: Path):
        super().__init__(
            {"SAKER_MODEL": str(model_dir), "SAKER_SERVED_MODEL_NAME": name, "SAKER_LOG_LEVEL": "warning", **env},
            log_dir=log_dir,
            name=f"gunicorn-{name}",
            inherit=without_api_keys,
        )
        self.model_name = name


def batch_env(size: int) -> dict[str, str]:
    """Our server's settings for a batch of ``size``: that many rows decoded together and requests admitted at once
    (what the bench's ``--max-batch-size`` sets)."""
    return {"SAKER_MAX_BATCH_ROWS": str(size), "SAKER_MAX_RUNNING_REQUESTS": str(size)}
