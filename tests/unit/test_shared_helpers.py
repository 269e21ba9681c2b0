"""The shared helpers: the SSE reader (``tooling/sse.py``) on tricky frames, ``free_port`` and the gunicorn starter's
errors (``tooling/processes.py``), and that the HTTP-side helpers stay free of torch and Flask. Fast cases only."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys

import pytest

from tooling.processes import ROOT, GunicornServer, ServerNotReady, ServerStartError, free_port, stop_process
from tooling.sse import Event, iter_data, iter_events, iter_json, iter_lines, read_stream


# -- SSE --------------------------------------------------------------------------------------------------
def test_lines_end_in_crlf_lf_or_cr_even_when_split_between_pieces():
    pieces = [b"one\r", b"\ntwo\r", b"three\n", b"\r", b"\n", b"four\r\n", b"\n", b"cut"]
    assert list(iter_lines(pieces)) == ["one", "two", "three", "", "four", "", "cut"]
    # a CR alone at the end of a piece is a line end at once (the next piece is not waited for)
    lines = iter_lines(iter([b"a\r", b"b"]))
    assert next(lines) == "a"


def test_the_event_stream_rules_on_a_binary_stream():
    raw = (
        b": a comment, skipped\r\n"
        b"event: message\r\nid: 7\r\ndata: one\r\n\r\n"  # CRLF
        b"data:two\n\n"  # no space after the colon
        b"data: three\rdata:  four\r\r"  # lone CR; only one leading space is dropped
        b"retry: 100\n\n"  # an event without data: nothing
        b"data\n\n"  # a bare field name: empty data
        + "data: caf\u00e9 \U0001f642\n\n".encode()  # UTF-8
        + b"data: cut off"
    )  # no blank line at the end
    assert list(iter_data(io.BytesIO(raw))) == ["one", "two", "three\n four", "", "caf\u00e9 \U0001f642", "cut off"]


def test_utf8_split_inside_a_character_and_invalid_bytes():
    data = "data: café 🙂\n\n".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]  # one byte at a time
    assert list(iter_data(pieces)) == ["café 🙂"]
    assert list(iter_data([b"data: \xff\xfe ok\n\n"])) == ["\ufffd\ufffd ok"]


def test_multi_line_data_comments_event_and_id_fields():
    text = (
        ": a comment, skipped\n"
        "event: response.created\n"
        "id: 7\n"
        "data: {\n"
        'data:  "a": 1\n'  # one leading space is dropped, the second kept
        "data:}\n"
        "retry: 100\n"
        "\n"
        "event: ping\n"  # an event without data lines is not dispatched
        "\n"
        "data\n"  # a field without a colon: data with an empty value
        "\n"
        "data: plain\n\n"
    )
    events = list(iter_events(text))
    assert events == [
        Event('{\n "a": 1\n}', "response.created", "7"),
        Event("", "message", "7"),
        Event("plain", "message", "7"),
    ]
    assert events[0].json() == {"a": 1}


def test_done_ends_the_data_and_cut_off_event_is_still_delivered():
    source = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n", b"data: after\n\n"]
    assert list(iter_json(source)) == [{"n": 1}, {"n": 2}]
    assert list(iter_data(b"data: one\n\ndata: cut off")) == ["one", "cut off"]


def test_read_stream_on_a_binary_stream_and_error_frames():
    body = io.BytesIO(b'data: {"choices": []}\r\n\r\ndata: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n')
    stream = read_stream(body)
    assert stream.done and len(stream.events) == 3
    assert stream.chunks == [{"choices": []}, {"error": {"message": "boom"}}]
    assert stream.errors == [{"error": {"message": "boom"}}]
    assert not read_stream('data: {"a": 1}\n\n').done
    with pytest.raises(ValueError):
        read_stream("data: <html>\n\n")


def test_read_stream_on_responses_events():
    frames = "".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind})}\n\n" for kind in ("response.created", "response.completed")
    )
    stream = read_stream(frames)
    assert [e.event for e in stream.events] == ["response.created", "response.completed"]
    assert [c["type"] for c in stream.chunks] == ["response.created", "response.completed"]
    assert not stream.done


# -- processes ------------------------------------------------------------------------------------------
def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_server_that_cannot_start_raises_with_its_log_tail(tmp_path):
    # an app that cannot be imported: gunicorn's master exits at once and says why in its log
    server = GunicornServer({}, log_dir=tmp_path, app="no_such_module_here:app", args=("--workers", "1"))
    try:
        with pytest.raises(ServerStartError) as info:
            server.wait_ready(timeout=60)
    finally:
        server.stop(timeout=10)
    assert info.value.returncode not in (None, 0)
    assert "no_such_module_here" in info.value.log_tail and "no_such_module_here" in str(info.value)
    assert not isinstance(info.value, ServerNotReady)
    assert server.log.closed and server.log_path.parent == tmp_path


def test_a_server_that_never_answers_raises_not_ready(tmp_path):
    server = GunicornServer({}, log_dir=tmp_path, app="no_such_module_here:app")
    stop_process(server.proc)  # stand-in: a process that runs but never answers, from the waiter's side
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        with pytest.raises(ServerNotReady) as info:
            server.wait_ready(timeout=0.5)
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, ServerStartError)
    finally:
        server.stop(timeout=5)


def test_http_side_helpers_import_neither_torch_nor_flask():
    """Imported through the tooling package (whose ``__init__`` imports nothing): their own imports pull in none of
    these, nor the server (``app``)."""
    code = (
        "import sys\n"
        "import tooling.processes, tooling.sse\n"
        "print([m for m in ('torch', 'flask', 'transformers', 'app') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out
