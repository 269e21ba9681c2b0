"""One log format for every line a worker writes (app/log_config.py): the formatters by themselves, the
dictConfig dict applied in a fresh process, the access log's routing, and a real gunicorn in each format."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from app.errors import ConfigError
from app.log_config import (
    ACCESS_LOGGER,
    AccessFileHandler,
    AccessStderrHandler,
    JsonFormatter,
    TextFormatter,
    logging_config,
    route_access_log,
)
from app.settings import load_settings
from servers import Gunicorn

ROOT = Path(__file__).resolve().parents[2]
# time (UTC, ms) level [pid] logger: message
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[\d+\] [\w.]+: "
)


def record(msg="hello %s", args=("world",), level=logging.INFO, name="saker.test", exc_info=None, **extra):
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    rec.created = 1795000000.25
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def boom():
    try:
        raise ValueError("bad value")
    except ValueError:
        return sys.exc_info()


# -- the formatters --------------------------------------------------------------------------------------
def test_json_formatter_base_keys_and_fields():
    fields = {"request_id": "r1", "status": 200, "stream": False, "model": None, "prompt": ["é", {"a": 1}]}
    line = JsonFormatter().format(record(fields=fields))
    assert "\n" not in line
    entry = json.loads(line)
    assert list(entry)[:5] == ["time", "level", "pid", "logger", "message"]
    assert entry["time"] == "2026-11-18T11:06:40.250+00:00"
    assert entry["level"] == "INFO" and entry["logger"] == "saker.test" and entry["message"] == "hello world"
    assert isinstance(entry["pid"], int)
    # the fields are keys of the object, not a string inside it; nulls kept
    assert {k: entry[k] for k in fields} == fields
    assert "é" in line  # not escaped


def test_json_formatter_fields_never_replace_the_base_keys():
    entry = json.loads(JsonFormatter().format(record(fields={"message": "forged", "level": "X", "extra": 1})))
    assert entry["message"] == "hello world" and entry["level"] == "INFO" and entry["extra"] == 1


def test_json_formatter_traceback_and_odd_values():
    entry = json.loads(JsonFormatter().format(record(level=logging.ERROR, exc_info=boom(), fields={"p": Path("/x")})))
    assert entry["level"] == "ERROR" and entry["p"] == "/x"
    assert entry["traceback"].startswith("Traceback") and "ValueError: bad value" in entry["traceback"]
    multi = json.loads(JsonFormatter().format(record(msg="two\nlines", args=())))
    assert multi["message"] == "two\nlines"


def test_text_formatter_layout_and_fields():
    fields = {"request_id": "r1", "status": 200, "stream": False, "model": None, "path": "/v1/x y", "ok": True}
    line = TextFormatter().format(record(fields=fields))
    assert TEXT_LINE.match(line), line
    assert line.startswith("2026-11-18T11:06:40.250+00:00 INFO [")
    assert line.endswith('saker.test: hello world request_id=r1 status=200 stream=false path="/v1/x y" ok=true')
    assert "model=" not in line  # unset fields left out
    plain = TextFormatter().format(record())
    assert plain.endswith("] saker.test: hello world")


def test_text_formatter_quotes_what_would_break_key_value():
    line = TextFormatter().format(record(fields={"a": 'say "hi"', "b": "k=v", "c": "", "d": [1, "x"], "e": 1.5}))
    assert line.endswith(r'a="say \"hi\"" b="k=v" c="" d=[1,"x"] e=1.5')


def test_text_formatter_traceback_follows_the_line():
    first, *rest = TextFormatter().format(record(level=logging.ERROR, exc_info=boom())).splitlines()
    assert TEXT_LINE.match(first) and " ERROR " in first
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: bad value"


# -- the setting and the dict ------------------------------------------------------------------------------
def test_log_format_setting(monkeypatch):
    assert load_settings().log_format == "text"
    monkeypatch.setenv("SAKER_LOG_FORMAT", "JSON")
    assert load_settings().log_format == "json"
    assert load_settings(log_format="text").log_format == "text"
    monkeypatch.setenv("SAKER_LOG_FORMAT", "yaml")
    with pytest.raises(ConfigError, match="SAKER_LOG_FORMAT"):
        load_settings()


@pytest.mark.parametrize(
    "access_log,handlers,propagate", [("-", [], True), ("off", [], False), ("/tmp/a.log", ["access_file"], False)]
)
def test_logging_config_routes_the_access_log(access_log, handlers, propagate):
    config = logging_config(load_settings(access_log=access_log, log_format="json", log_level="warning"))
    assert config["root"] == {"level": "WARNING", "handlers": ["stderr"]}
    assert config["handlers"]["stderr"]["formatter"] == "json"
    assert config["loggers"]["gunicorn.error"]["handlers"] == ["stderr"]
    assert config["loggers"]["gunicorn.access"]["handlers"] == []  # saker writes its own
    access = config["loggers"][ACCESS_LOGGER]
    assert access["handlers"] == handlers and access["propagate"] is propagate and access["level"] == "INFO"


APPLY = """
import logging, sys, warnings, threading
from app.log_config import configure_logging
from app.settings import load_settings
configure_logging(load_settings(access_log=sys.argv[1]))
logging.getLogger("saker.worker").info("model %s loaded", "m")
logging.getLogger("saker.worker").debug("not shown at info")
logging.getLogger("gunicorn.error").info("Booting worker with pid: 1")
logging.getLogger("gunicorn.access").info("gunicorn's own access line")
logging.getLogger("saker.access").info("GET /health 200", extra={"fields": {"request_id": "r9", "status": 200}})
warnings.warn("a python warning")
t = threading.Thread(target=lambda: 1 / 0, name="crasher"); t.start(); t.join()
try:
    raise KeyError("k")
except KeyError:
    logging.getLogger("saker").exception("failed")
"""


def apply_in_a_process(log_format: str, access_log: str = "-") -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "SAKER_LOG_FORMAT": log_format}
    return subprocess.run(
        [sys.executable, "-c", APPLY, access_log], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_configure_logging_json_in_a_process(tmp_path):
    done = apply_in_a_process("json")
    assert done.returncode == 0 and done.stdout == "", done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is one object
    by_logger = {}
    for line in lines:
        by_logger.setdefault(line["logger"], []).append(line)
    assert [x["message"] for x in by_logger["saker.worker"]] == ["model m loaded"]
    assert by_logger["gunicorn.error"][0]["message"] == "Booting worker with pid: 1"
    assert "gunicorn.access" not in by_logger
    (access,) = by_logger["saker.access"]
    assert access["request_id"] == "r9" and access["status"] == 200
    assert "a python warning" in by_logger["py.warnings"][0]["message"]
    crash, failed = by_logger["saker"]
    assert crash["level"] == "CRITICAL" and "crasher" in crash["message"] and "ZeroDivisionError" in crash["traceback"]
    assert failed["message"] == "failed" and "KeyError" in failed["traceback"]

    log_file = tmp_path / "logs" / "access.log"
    done = apply_in_a_process("json", str(log_file))
    assert "saker.access" not in done.stderr
    (line,) = [json.loads(x) for x in log_file.read_text().splitlines()]
    assert line["logger"] == "saker.access" and line["request_id"] == "r9"


def test_configure_logging_text_in_a_process(tmp_path):
    done = apply_in_a_process("text")
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stderr.splitlines() if TEXT_LINE.match(line)]
    assert len(heads) == 6, done.stderr  # worker, gunicorn, access, warning, thread, exception
    assert any(line.endswith("saker.access: GET /health 200 request_id=r9 status=200") for line in heads)
    # the access file is JSON lines in either format: it is read by programs
    log_file = tmp_path / "access.log"
    done = apply_in_a_process("text", str(log_file))
    assert json.loads(log_file.read_text())["request_id"] == "r9"


ADOPT = """
from app.log_config import adopt_library_loggers, configure_logging
from app.settings import load_settings
configure_logging(load_settings())
from transformers.utils import logging as hf_logging
adopt_library_loggers()
hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
"""


def test_transformers_warnings_join_the_one_format():
    env = {"PATH": "/usr/bin:/bin", "SAKER_LOG_FORMAT": "json", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", ADOPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (line,) = [json.loads(x) for x in done.stderr.splitlines()]  # not also "[transformers] ..." from its handler
    assert line["logger"] == "transformers.modeling_utils" and line["message"] == "a transformers warning"


# -- the access log's routing ------------------------------------------------------------------------------
@pytest.fixture
def access_logger():
    logger = logging.getLogger(ACCESS_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    # as in a fresh process: an app built by an earlier test left it non-propagating, and pytest then hangs its
    # capture handlers on it for the test's call (it does so for every non-propagating logger)
    logger.handlers[:] = []
    logger.propagate = True
    yield logger
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_route_access_log_to_files_and_back(access_logger, tmp_path, capfd):
    first, second = tmp_path / "a" / "one.log", tmp_path / "two.log"
    route_access_log(str(first))
    (handler,) = access_logger.handlers
    assert isinstance(handler, AccessFileHandler) and not access_logger.propagate
    assert route_access_log(str(first)).handlers == [handler]  # the same file: kept open
    access_logger.info("GET / 200", extra={"fields": {"request_id": "a1"}})
    route_access_log(str(second))
    (other,) = access_logger.handlers
    assert other is not handler and handler.stream is None  # the first one closed
    access_logger.info("GET / 200", extra={"fields": {"request_id": "b1"}})
    assert json.loads(first.read_text())["request_id"] == "a1"
    assert json.loads(second.read_text())["request_id"] == "b1"

    route_access_log("off")
    assert access_logger.handlers == [] and not access_logger.propagate
    # "-" where saker's configuration is not in place (pytest's root handlers): JSON on stderr as before
    route_access_log("-")
    (own,) = access_logger.handlers
    assert isinstance(own, AccessStderrHandler) and not access_logger.propagate
    access_logger.info("GET / 200", extra={"fields": {"request_id": "c1"}})
    (line,) = [json.loads(x) for x in capfd.readouterr().err.splitlines() if '"c1"' in x]
    assert line["request_id"] == "c1"


def test_route_access_log_propagates_under_our_configuration(access_logger, monkeypatch):
    root = logging.getLogger()
    ours = logging.StreamHandler()
    ours.setFormatter(TextFormatter())
    monkeypatch.setattr(root, "handlers", [*root.handlers, ours])
    route_access_log("-")
    assert access_logger.handlers == [] and access_logger.propagate


# -- a real gunicorn, every line in the one format -----------------------------------------------------------
def serve_and_log(gpt2_dir: Path, log_format: str) -> str:
    srv = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_LOG_FORMAT": log_format,
            "SAKER_ACCESS_LOG": "-",
            "SAKER_LOG_LEVEL": "info",
        }
    )
    try:
        srv.wait_ready()
        body = {"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 3}
        assert requests.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert requests.post(srv.url + "/v1/completions", json={**body, "model": "nope"}, timeout=60).status_code == 404
    finally:
        srv.stop()
    return srv.output()


@pytest.mark.slow
def test_gunicorn_json_every_line_is_an_object(gpt2_dir):
    out = serve_and_log(gpt2_dir, "json")
    lines = out.splitlines()
    for line in lines:
        assert line.startswith("{") and line.endswith("}"), line
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        assert {"time", "level", "pid", "logger", "message"} <= set(entry), line
    entries = [json.loads(line) for line in lines]
    messages = {(e["logger"], e["message"]) for e in entries}
    assert ("gunicorn.error", "Starting gunicorn " + __import__("gunicorn").__version__) in messages
    assert any(lg == "gunicorn.error" and m.startswith("Booting worker with pid") for lg, m in messages)
    assert any(lg == "saker.worker" and m.startswith("serving tiny-gpt2") for lg, m in messages)
    access = [e for e in entries if e["logger"] == "saker.access" and e["path"] == "/v1/completions"]
    ok, missing = access
    assert ok["status"] == 200 and ok["completion_tokens"] == 3 and ok["request_id"] and ok["duration_ms"] > 0
    assert missing["status"] == 404 and missing["error_code"] == "model_not_found"
    assert not [e for e in entries if e["logger"] == "gunicorn.access"]  # gunicorn's own access log stays off


@pytest.mark.slow
def test_gunicorn_text_lines_share_one_layout(gpt2_dir):
    out = serve_and_log(gpt2_dir, "text")
    lines = out.splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), out
    assert any("] gunicorn.error: Starting gunicorn" in line for line in lines)
    assert any("] saker.worker: serving tiny-gpt2" in line for line in lines)
    completions = [line for line in lines if "] saker.access: POST /v1/completions" in line]
    assert len(completions) == 2 and "status=200" in completions[0] and "error_code=model_not_found" in completions[1]
