"""One logging configuration for every line a saker process writes: gunicorn's, saker's and the access log.

``logging_config(settings)`` builds a ``logging.config.dictConfig`` dict: one stderr handler, in the layout
``SAKER_LOG_FORMAT`` picks, under the root logger (saker's loggers, Python warnings, libraries that propagate)
and ``gunicorn.error``; ``gunicorn.access`` silent (saker writes its own); the access log's logger
``saker.access`` routed by ``SAKER_ACCESS_LOG``. gunicorn takes the dict as ``logconfig_dict``
(gunicorn.conf.py); ``python -m app serve`` and ``batch`` apply it with ``configure_logging``.

- ``text``: ``2026-11-22T10:44:10.131+00:00 INFO [4242] saker.worker: message key=value ...``
- ``json``: ``{"time": ..., "level": ..., "pid": ..., "logger": ..., "message": ..., <fields>}``, one object per
  line; a record's structured fields (``extra={"fields": {...}}``, as the access log passes them) are keys of
  the object, a traceback is the ``traceback`` key.

The access log (``app/access_log.py``) logs through ``saker.access``: ``-`` propagates to the root's stderr
handler (the one format), a file path gets an ``AccessFileHandler`` (always JSON lines: the file is for
programs) and nothing else, ``off`` nothing at all.
"""

from __future__ import annotations

import json
import logging
import logging.config
import logging.handlers
import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ACCESS_LOGGER = "saker.access"
LOG_FORMATS = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ms), level, pid, logger, message, then the record's fields (a
    field never replaces one of those five), then ``traceback``/``stack`` when the record carries them."""

    BASE = ("time", "level", "pid", "logger", "message")

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            if key not in self.BASE:
                entry[key] = value
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["traceback"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str)


def _text_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str) and value and not any(c.isspace() or c in '"=\\' for c in value):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """``time level [pid] logger: message`` and the record's fields as ``key=value`` (unset ones left out;
    values with spaces, quotes or ``=`` JSON-quoted); a traceback follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} [{record.process}] {record.name}: {record.getMessage()}"
        pairs = [f"{key}={_text_value(value)}" for key, value in _fields(record).items() if value is not None]
        if pairs:
            line += " " + " ".join(pairs)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class AccessFileHandler(logging.handlers.WatchedFileHandler):
    """The access log's file (``SAKER_ACCESS_LOG=/path``): appended, its folder created at once, the file opened
    at the first line (so gunicorn's master, which configures logging but serves nothing, never holds it open
    across a rotation), reopened when logrotate moves it, JSON lines whatever ``SAKER_LOG_FORMAT`` says."""

    def __init__(self, filename: str):
        path = Path(filename).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.destination = filename
        self.setFormatter(JsonFormatter())


def _access_logger_config(destination: str) -> tuple[dict, dict]:
    """(handlers, logger entry) of ``saker.access`` for an ``SAKER_ACCESS_LOG`` value. Its level is INFO
    whatever ``SAKER_LOG_LEVEL`` says: a request line is written unless the access log is ``off``."""
    if destination == "-":
        return {}, {"level": "INFO", "handlers": [], "propagate": True}
    if destination == "off":
        return {}, {"level": "INFO", "handlers": [], "propagate": False}
    handler = {"()": f"{__name__}.AccessFileHandler", "filename": destination}
    return {"access_file": handler}, {"level": "INFO", "handlers": ["access_file"], "propagate": False}


def logging_config(settings) -> dict:
    """The ``dictConfig`` dict for these settings (``log_format``, ``log_level``, ``access_log``)."""
    level = str(settings.log_level).upper()
    log_format = str(getattr(settings, "log_format", "text"))
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, not {log_format!r}")
    access_handlers, access_logger = _access_logger_config(settings.access_log)
    stderr = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": log_format}
    return {
        "version": 1,
        "disable_existing_loggers": False,  # saker's loggers exist before gunicorn configures logging
        "formatters": {
            "text": {"()": f"{__name__}.TextFormatter"},
            "json": {"()": f"{__name__}.JsonFormatter"},
        },
        "handlers": {"stderr": stderr, **access_handlers},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": {"level": level, "handlers": ["stderr"], "propagate": False},
            # gunicorn's access log: saker writes its own, and gunicorn logs requests whenever a logconfig_dict
            # is given, so its lines go nowhere
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": False},
            ACCESS_LOGGER: access_logger,
        },
    }


def configure_logging(settings) -> None:
    """Apply ``logging_config(settings)`` to this process, and send what would bypass it through it: Python
    warnings (``py.warnings``) and uncaught exceptions of threads; with ``json``, no progress bars."""
    logging.config.dictConfig(logging_config(settings))
    capture_stray_output()
    if str(getattr(settings, "log_format", "text")) == "json":
        quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers and huggingface_hub ("Loading weights", downloads): they are not log lines.
    Set before either is imported (they read it then); an explicit ``HF_HUB_DISABLE_PROGRESS_BARS`` wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("saker").critical(
        "uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


def capture_stray_output() -> None:
    """Python warnings and threads' uncaught exceptions go through logging, not straight to stderr."""
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception


def adopt_library_loggers() -> None:
    """transformers, once imported, writes through a stderr handler of its own and does not propagate: hand its
    records to the root handler instead (call after it is imported: in a gunicorn worker after the app loads)."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - a broken install
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


class AccessStderrHandler(logging.StreamHandler):
    """``SAKER_ACCESS_LOG=-`` where saker's logging configuration is not in place (a test, another WSGI server):
    JSON lines to whatever ``sys.stderr`` is at the time, as the access log wrote before it went through logging."""

    def __init__(self):
        super().__init__()
        self.setFormatter(JsonFormatter())

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; stderr is read at each line instead
        pass


def _configured_root() -> bool:
    """Whether the root logger writes through one of our formatters (the dict above is in place)."""
    return any(isinstance(h.formatter, (TextFormatter, JsonFormatter)) for h in logging.getLogger().handlers)


def route_access_log(destination: str) -> logging.Logger:
    """Make ``saker.access`` match ``destination`` as ``logging_config`` does, for a process that may not have
    applied the dict (tests, another WSGI server): ``-`` propagates to the root's handler when that is ours and
    has an ``AccessStderrHandler`` otherwise. A file handler already open on the same path is kept (gunicorn's
    worker: the dict opened it); any other handler of ours is closed. Returns the logger."""
    logger = logging.getLogger(ACCESS_LOGGER)
    _, wanted = _access_logger_config(destination)
    own_stderr = destination == "-" and not _configured_root()
    keep = None
    for handler in list(logger.handlers):
        same_file = isinstance(handler, AccessFileHandler) and handler.destination == destination
        if (same_file or (own_stderr and isinstance(handler, AccessStderrHandler))) and keep is None:
            keep = handler
        elif isinstance(handler, (AccessFileHandler, AccessStderrHandler)):
            logger.removeHandler(handler)
            handler.close()
    if keep is None and wanted["handlers"]:
        logger.addHandler(AccessFileHandler(destination))
    elif keep is None and own_stderr:
        logger.addHandler(AccessStderrHandler())
    logger.setLevel(wanted["level"])
    logger.propagate = wanted["propagate"] and not own_stderr
    logger.disabled = False
    return logger
