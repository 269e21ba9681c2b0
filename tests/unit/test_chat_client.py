"""The terminal chat client (``python -m app chat``): commands, /params validation, SSE parsing, conversation
bookkeeping, against a tiny fake OpenAI-compatible server (http.server on 127.0.0.1) answering canned SSE."""

from __future__ import annotations

import io
import json
import re
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tooling.chat_client import (
    ChatError,
    ChatAnswer,
    ChatShell,
    Command,
    HTTPClient,
    Message,
    Params,
    format_error,
    iter_chat_stream,
    parse_params,
    parse_shell_line,
    printable,
)

ROOT = Path(__file__).resolve().parents[2]


# -- a fake server -----------------------------------------------------------------------------------------


def chunk(content=None, *, role=None, finish=None, index=0) -> bytes:
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fake",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def completion(content: str, finish: str = "stop") -> dict:
    return {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "created": 1,
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def error_body(message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


class JSON:
    def __init__(self, body, status: int = 200):
        self.body, self.status = body, status


class SSE:
    """Frames (bytes) written as chunks, flushed one by one; callables in between run on the server thread."""

    def __init__(self, *frames, content_type: str = "text/event-stream"):
        self.frames, self.content_type = frames, content_type


class FakeServer:
    def __init__(self, routes: dict):
        self.routes = routes  # (method, path) -> function(body) -> JSON | SSE
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                server.requests.append(
                    {"method": method, "path": self.path, "body": body, "headers": dict(self.headers)}
                )
                route = server.routes.get((method, self.path))
                answer = route(body) if route else JSON(error_body(f"no route {self.path}"), 404)
                if isinstance(answer, JSON):
                    data = json.dumps(answer.body).encode()
                    self.send_response(answer.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for frame in answer.frames:
                        if callable(frame):
                            frame()
                            continue
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    server.dropped = True

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.dropped = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = self.root + "/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def chat_requests(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["path"] == "/v1/chat/completions"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def fake():
    servers = []

    def make(routes):
        server = FakeServer(routes)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def streaming_echo(body):
    """A server that streams 'you said: <last user message>' in three pieces."""
    text = body["messages"][-1]["content"]
    if not body.get("stream"):
        return JSON(completion(f"you said: {text}"))
    return SSE(
        chunk(role="assistant", content=""), chunk("you "), chunk("said: "), chunk(text), chunk(finish="stop"), DONE
    )


def shell_for(server, **kwargs) -> tuple[ChatShell, io.StringIO]:
    out = io.StringIO()
    return ChatShell(HTTPClient(server.url), "fake-model", out, **kwargs), out


def reader(lines, out):
    """A read_line over given lines that writes the prompt, like input() does with piped stdin."""
    iterator = iter(lines)

    def read_line(prompt):
        out.write(prompt)
        try:
            return next(iterator)
        except StopIteration:
            raise EOFError from None

    return read_line


# -- commands and /params ----------------------------------------------------------------------------------


def test_parse_shell_line_commands_messages_and_escapes():
    assert parse_shell_line("") is None and parse_shell_line("   \n") is None
    assert parse_shell_line("hello there\n") == Message("hello there")
    assert parse_shell_line("/help") == Command("help", "") and parse_shell_line("/?") == Command("help", "")
    assert parse_shell_line("/params temperature=0.7  top_k=40 ") == Command("params", "temperature=0.7  top_k=40")
    assert parse_shell_line("/SYSTEM Be brief.") == Command("system", "Be brief.")
    assert parse_shell_line("/exit") == Command("quit", "") and parse_shell_line("/q") == Command("quit", "")
    assert parse_shell_line("//etc/passwd is a file") == Message("/etc/passwd is a file")
    assert parse_shell_line("/frobnicate x") == Command("frobnicate", "x")


def test_params_set_show_and_defaults():
    params = parse_params("temperature=0.7 top_k=40 top_p=0.9 max_tokens=128 repetition_penalty=1.1", Params())
    assert params == Params(temperature=0.7, top_k=40, top_p=0.9, max_tokens=128, repetition_penalty=1.1)
    assert params.request_fields() == {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "max_tokens": 128,
        "repetition_penalty": 1.1,
    }
    assert Params().request_fields() == {}  # nothing sent: the server's defaults
    # spaces around '=', dashes, aliases, case; default goes back to the server's value
    again = parse_params("Temperature = 0  max-new-tokens=5 top_k=default", params)
    assert again == Params(temperature=0.0, top_k=None, top_p=0.9, max_tokens=5, repetition_penalty=1.1)
    assert parse_params("top_k=-1", Params()).top_k == -1 and parse_params("top_k=0", Params()).top_k == 0
    assert parse_params("temperature=2", Params()).temperature == 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("temp=hot", "temperature must be a number, not 'hot'"),
        ("temperature=2.5", "temperature must be between 0 and 2"),
        ("temperature=-0.1", "temperature must be between 0 and 2"),
        ("temperature=nan", "finite"),
        ("top_p=0", "top_p must be more than 0 and at most 1"),
        ("top_p=1.5", "top_p must be more than 0 and at most 1"),
        ("top_k=40.5", "top_k must be a whole number, not '40.5'"),
        ("top_k=-2", "top_k must be a positive whole number, or 0 or -1 for off"),
        ("max_tokens=0", "max_tokens must be at least 1"),
        ("max_tokens=lots", "max_tokens must be a whole number"),
        ("repetition_penalty=0", "repetition_penalty must be more than 0"),
        (
            "temperatur=0.5",
            "unknown parameter 'temperatur'; known: temperature, top_k, top_p, max_tokens, repetition_penalty",
        ),
        ("temperature", "write temperature=VALUE (for example temperature=0.7)"),
        ("top_k=", "write top_k=VALUE"),
        ("top_k=1 top_k=2", "top_k is given twice"),
        ("   ", "nothing to set"),
    ],
)
def test_params_validation_messages(text, fragment):
    with pytest.raises(ValueError) as err:
        parse_params(text, Params())
    assert fragment in str(err.value)


def test_params_command_applies_all_or_nothing():
    shell = ChatShell(HTTPClient("http://127.0.0.1:9/v1"), "m", io.StringIO())
    shell.handle("/params temperature=0.5 top_k=40")
    assert shell.params == Params(temperature=0.5, top_k=40)
    assert "set temperature=0.5, top_k=40" in shell.out.getvalue()
    shell.handle("/params temperature=0.9 top_p=7")
    assert shell.params == Params(temperature=0.5, top_k=40)  # nothing changed
    assert "/params: top_p must be more than 0 and at most 1 (1 = off), not 7 (nothing changed)" in shell.out.getvalue()
    shell.out = io.StringIO()
    shell.handle("/params")
    shown = shell.out.getvalue()
    assert "temperature = 0.5" in shown and "top_k = 40" in shown and "max_tokens = (server default)" in shown


def test_help_system_reset_and_unknown_commands():
    shell = ChatShell(HTTPClient("http://127.0.0.1:9/v1"), "m", io.StringIO())
    shell.handle("/help")
    for command in ("/params", "/system", "/prompt", "/reset", "/quit"):
        assert command in shell.out.getvalue()
    shell.handle("/system")
    assert "no system prompt" in shell.out.getvalue()
    shell.handle("/system You are terse.")
    assert shell.system_prompt == "You are terse."
    shell.out = io.StringIO()
    shell.handle("/system")
    assert shell.out.getvalue() == "system prompt: You are terse.\n"
    shell.history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert shell.messages("c") == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    shell.handle("/reset")
    assert shell.history == [] and shell.system_prompt == "You are terse."
    shell.handle("/system --clear")
    assert shell.system_prompt is None and shell.messages() == []
    shell.out = io.StringIO()
    assert shell.handle("/frobnicate") is True
    assert "unknown command /frobnicate; /help lists the commands" in shell.out.getvalue()
    assert shell.handle("/quit") is False and shell.handle("/exit") is False


def test_bad_url_is_one_clear_error():
    with pytest.raises(ChatError, match="--url must be an http"):
        HTTPClient("127.0.0.1:8000")
    assert HTTPClient("http://h:1/v1/").root_url == "http://h:1"
    assert HTTPClient("http://h:1/api").root_url == "http://h:1/api"


# -- SSE and error bodies ----------------------------------------------------------------------------------


def test_iter_chat_stream_collects_content_and_stops_at_done():
    usage = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 5}}
    raw = (
        chunk(role="assistant", content="")
        + chunk("Hel")
        + chunk("lo")
        + chunk("other", index=1)
        + chunk(finish="length")
        + b"data: "
        + json.dumps(usage).encode()
        + b"\n\n"
        + DONE
        + chunk("after")
    )
    reply = ChatAnswer()
    assert list(iter_chat_stream(io.BytesIO(raw), reply)) == ["Hel", "lo"]
    assert reply == ChatAnswer("Hello", "length")


def test_iter_chat_stream_error_frame_and_garbage():
    raw = (
        chunk("Hi") + b'data: {"error": {"message": "worker\\ncrashed", "type": "server_error", "param": null, '
        b'"code": null}}\n\n' + DONE
    )
    stream = iter_chat_stream(io.BytesIO(raw))
    assert next(stream) == "Hi"
    with pytest.raises(ChatError) as err:
        next(stream)
    assert str(err.value) == "error (server_error): worker crashed"
    with pytest.raises(ChatError, match="not JSON"):
        list(iter_chat_stream(io.BytesIO(b"data: <html>\n\n")))


def test_control_characters_are_shown_escaped(fake):
    assert printable("a\x1b[31mb\n\tc\r\x00\x9b\u00e9 \U0001f642") == "a\\x1b[31mb\n\tc\r\\x00\\x9b\u00e9 \U0001f642"
    server = fake({("POST", "/v1/chat/completions"): lambda body: SSE(chunk("red \x1b[31m"), chunk("!"), DONE)})
    shell, out = shell_for(server)
    shell.handle("hi")
    assert out.getvalue() == "red \\x1b[31m!\n"
    assert shell.history[-1]["content"] == "red \x1b[31m!"  # the conversation keeps the text as it came


def test_format_error_is_one_line():
    assert (
        format_error(400, json.dumps(error_body("temperature must be\nat most 2", "temperature")))
        == "error 400 (invalid_request_error, param=temperature): temperature must be at most 2"
    )
    assert (
        format_error(404, error_body("no such model", "model", "model_not_found"))
        == "error 404 (invalid_request_error, param=model, code=model_not_found): no such model"
    )
    assert (
        format_error(502, b"<html>\n<h1>Bad Gateway</h1>\n</html>") == "error 502: <html> <h1>Bad Gateway</h1> </html>"
    )
    assert format_error(500, '{"error": "boom"}') == "error 500: boom"
    assert format_error(503, b"") == "error 503: (empty body)"


# -- against the fake server -------------------------------------------------------------------------------


def test_conversation_streams_and_keeps_history(fake):
    server = fake({("POST", "/v1/chat/completions"): streaming_echo})
    shell, out = shell_for(server)
    shell.handle("/system Be brief.")
    shell.handle("/params temperature=0 max_tokens=8")
    shell.handle("hello")
    shell.handle("and again")
    assert "you said: hello\n" in out.getvalue() and "you said: and again\n" in out.getvalue()
    first, second = server.chat_requests()
    assert first == {
        "model": "fake-model",
        "stream": True,
        "temperature": 0.0,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    }
    assert second["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "you said: hello"},
        {"role": "user", "content": "and again"},
    ]
    assert server.requests[0]["headers"]["Accept"] == "text/event-stream"
    shell.handle("/reset")
    shell.handle("fresh")
    assert server.chat_requests()[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "fresh"},
    ]


def test_reply_is_printed_token_by_token(fake):
    """The server sends its second piece only once the client has printed the first."""
    printed_first = threading.Event()
    seen = {}

    def wait_for_client():
        seen["before_second"] = printed_first.wait(10)

    server = fake(
        {
            ("POST", "/v1/chat/completions"): lambda body: SSE(
                chunk("first "), wait_for_client, chunk("second"), chunk(finish="stop"), DONE
            )
        }
    )

    class Out(io.StringIO):
        def write(self, text):
            if "first" in text:
                printed_first.set()
            return super().write(text)

    shell = ChatShell(HTTPClient(server.url), "m", Out())
    reply = shell.send("go")
    assert seen["before_second"] is True
    assert reply == ChatAnswer("first second", "stop")


def test_length_finish_and_empty_reply_are_told(fake):
    answers = iter([SSE(chunk("abc"), chunk(finish="length"), DONE), SSE(chunk(finish="stop"), DONE)])
    server = fake({("POST", "/v1/chat/completions"): lambda body: next(answers)})
    shell, out = shell_for(server)
    shell.handle("one")
    shell.handle("two")
    assert "abc\n[cut at max_tokens; /params max_tokens=N for longer replies]\n" in out.getvalue()
    assert "(empty reply)\n" in out.getvalue()
    assert shell.history[-1] == {"role": "assistant", "content": ""}


def test_falls_back_to_plain_requests_when_streaming_is_refused(fake):
    def no_streams(body):
        if body.get("stream"):
            return JSON(error_body("streaming is not supported", "stream"), 400)
        return JSON(completion("whole reply"))

    server = fake({("POST", "/v1/chat/completions"): no_streams})
    shell, out = shell_for(server)
    shell.handle("hi")
    shell.handle("more")
    assert out.getvalue().count("whole reply\n") == 2
    assert "replies now come whole" in out.getvalue()
    assert [bool(b.get("stream")) for b in server.chat_requests()] == [True, False, False]
    assert shell.stream is False and len(shell.history) == 4


def test_server_errors_are_one_line_and_the_turn_is_dropped(fake):
    def picky(body):
        if body.get("temperature", 0) > 1:
            return JSON(error_body("temperature must be at most 1 here", "temperature"), 400)
        return streaming_echo(body)

    server = fake({("POST", "/v1/chat/completions"): picky})
    shell, out = shell_for(server)
    shell.handle("/params temperature=1.5")
    shell.handle("hi")
    lines = out.getvalue().splitlines()
    assert "error 400 (invalid_request_error, param=temperature): temperature must be at most 1 here" in lines
    assert shell.history == [] and shell.stream is True  # a 400 on both tries is not about streaming
    assert len(server.chat_requests()) == 2
    shell.handle("/params temperature=default")
    shell.handle("hi")
    assert shell.history[-1] == {"role": "assistant", "content": "you said: hi"}


def test_error_after_the_stream_began(fake):
    broken = SSE(
        chunk("par"),
        b'data: {"error": {"message": "out of memory", "type": "server_error", "param": null, "code": null}}\n\n',
        DONE,
    )
    server = fake({("POST", "/v1/chat/completions"): lambda body: broken})
    shell, out = shell_for(server)
    assert shell.send("hi") is None
    assert out.getvalue() == "par\nerror (server_error): out of memory\n"
    assert shell.history == [] and len(server.chat_requests()) == 1  # not retried


def test_a_server_that_ignores_stream_true(fake):
    server = fake({("POST", "/v1/chat/completions"): lambda body: JSON(completion("all at once"))})
    shell, out = shell_for(server)
    assert shell.send("hi") == ChatAnswer("all at once", "stop")
    assert out.getvalue() == "all at once\n"


def test_unreachable_server_keeps_the_shell(fake):
    server = fake({})
    server.close()
    shell, out = shell_for(server)
    assert shell.handle("hi") is True
    assert out.getvalue().startswith(f"error: cannot reach {server.url}/chat/completions")
    assert shell.history == []


def test_ctrl_c_during_a_reply_stops_it_and_keeps_what_was_shown(fake):
    server = fake(
        {("POST", "/v1/chat/completions"): lambda body: SSE(chunk("one "), chunk("two "), *[chunk("x")] * 50, DONE)}
    )

    class Out(io.StringIO):
        def write(self, text):
            if text == "two ":
                raise KeyboardInterrupt
            return super().write(text)

    shell = ChatShell(HTTPClient(server.url), "m", Out())
    reply = shell.send("go")
    assert reply.finish_reason == "interrupted"
    assert shell.out.getvalue() == "one \n[interrupted]\n"
    assert shell.history[-1]["role"] == "assistant" and shell.history[-1]["content"].startswith("one ")


def test_prompt_via_tokenize_and_detokenize(fake):
    def tokenize(body):
        return JSON({"count": 4, "max_model_len": 256, "tokens": [1, 2, 3, 4]})

    def detokenize(body):
        return JSON({"prompt": "<|system|>\nBe brief.\n<|user|>\nhello\n<|assistant|>\n"})

    server = fake(
        {
            ("POST", "/v1/chat/completions"): streaming_echo,
            ("POST", "/tokenize"): tokenize,
            ("POST", "/detokenize"): detokenize,
        }
    )
    shell, out = shell_for(server)
    shell.handle("/system Be brief.")
    shell.handle("/prompt")
    tok, detok = [r for r in server.requests if r["path"] in ("/tokenize", "/detokenize")]
    assert tok["body"] == {
        "model": "fake-model",
        "add_generation_prompt": True,
        "messages": [{"role": "system", "content": "Be brief."}],
    }
    assert detok["body"] == {"model": "fake-model", "tokens": [1, 2, 3, 4]}
    assert (
        "--- prompt: 4 tokens (the model takes 256) ---\n<|system|>\nBe brief.\n<|user|>\nhello\n"
        "<|assistant|>\n--- end of prompt ---\n"
    ) in out.getvalue()


def test_prompt_without_tokenize_shows_the_messages(fake):
    server = fake({("POST", "/v1/chat/completions"): streaming_echo})
    shell, out = shell_for(server)
    shell.handle("/system Be brief.")
    shell.handle("hello")
    shell.handle("/prompt")
    text = out.getvalue()
    assert "this server has no /tokenize and /detokenize endpoints (error 404" in text
    shown = text[text.index("the messages sent are:\n") + len("the messages sent are:\n") :]
    assert json.loads(shown) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "you said: hello"},
    ]


def test_prompt_error_from_tokenize_is_shown(fake):
    server = fake({("POST", "/tokenize"): lambda body: JSON(error_body("the model has no chat template"), 400)})
    shell, out = shell_for(server)
    shell.handle("/prompt")
    assert out.getvalue() == "the conversation is empty: nothing to show yet (send a message or set /system first)\n"
    assert server.requests == []
    shell.system_prompt = "x"
    shell.handle("/prompt")
    assert (
        "error 400 (invalid_request_error): the model has no chat template; the messages sent are:\n[\n"
        in out.getvalue()
    )


def test_prompt_that_fills_the_context_is_flagged(fake):
    server = fake(
        {
            ("POST", "/tokenize"): lambda body: JSON({"count": 9, "max_model_len": 8, "tokens": [5] * 9}),
            ("POST", "/detokenize"): lambda body: JSON({"prompt": "long \x1b[2J"}),
        }
    )
    shell, out = shell_for(server)
    shell.system_prompt = "x"
    shell.handle("/prompt")
    assert out.getvalue() == (
        "--- prompt: 9 tokens (the model takes 8) ---\nlong \\x1b[2J\n--- end of prompt ---\n"
        "the prompt already fills the model's 8 tokens: the next message will be refused "
        "(/reset starts a new conversation)\n"
    )


def test_model_from_the_models_list_and_api_key(fake):
    server = fake(
        {
            ("GET", "/v1/models"): lambda body: JSON(
                {"object": "list", "data": [{"id": "first", "object": "model"}, {"id": "second", "object": "model"}]}
            )
        }
    )
    client = HTTPClient(server.url, api_key="sk-test")
    assert client.first_model() == "first"
    assert server.requests[0]["headers"]["Authorization"] == "Bearer sk-test"
    empty = fake({("GET", "/v1/models"): lambda body: JSON({"object": "list", "data": []})})
    with pytest.raises(ChatError, match="lists no model; pass --model NAME"):
        HTTPClient(empty.url).first_model()


def test_run_loop_ends_on_quit_eof_and_ctrl_c(fake):
    server = fake({("POST", "/v1/chat/completions"): streaming_echo})
    shell, out = shell_for(server)
    assert shell.run(reader(["hi", "", "/quit", "never sent"], out)) == 0
    assert len(server.chat_requests()) == 1
    assert out.getvalue().startswith(f"saker chat with fake-model at {server.url}. Type /help or /? to list")
    assert out.getvalue().endswith(">>> you said: hi\n>>> >>> ")
    assert shell.run(reader([], out)) == 0  # EOF

    def interrupted(prompt):
        raise KeyboardInterrupt

    assert shell.run(interrupted) == 0


def test_python_m_app_chat_with_piped_input(fake):
    """The CLI end to end (argparse, model discovery, input() on a pipe) against the fake server."""
    server = fake(
        {
            ("GET", "/v1/models"): lambda body: JSON({"object": "list", "data": [{"id": "fake-1"}]}),
            ("POST", "/v1/chat/completions"): streaming_echo,
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--url", server.url],
        input="hello\n/params top_k=abc\n/reset\n/quit\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "saker chat with fake-1" in result.stdout
    assert ">>> you said: hello\n" in result.stdout
    assert "/params: top_k must be a whole number, not 'abc' (nothing changed)" in result.stdout
    assert "conversation cleared" in result.stdout
    assert server.chat_requests()[0]["model"] == "fake-1"


def test_python_m_app_chat_without_a_server():
    result = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--url", "http://127.0.0.1:9/v1"],
        input="",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("saker chat: error: cannot reach http://127.0.0.1:9/v1/models")


# -- against a real gunicorn -------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_shell_against_real_gunicorn(llama_dir, reference):
    """``python -m app chat`` with piped input against a real gunicorn serving the tiny Llama (chat template)."""
    import torch

    from servers import Gunicorn

    server = Gunicorn({"SAKER_MODEL": str(llama_dir), "SAKER_SERVED_MODEL_NAME": "tiny-llama", "SAKER_THREADS": "2"})
    try:
        server.wait_ready()
        script = (
            "hello\n/params temperature=0\n/system be brief\n/prompt\n/reset\n/prompt\n/params max_tokens=8\n"
            "What is the capital of France?\n/quit\n"
        )
        result = subprocess.run(
            [sys.executable, "-m", "app", "chat", "--url", server.url + "/v1"],
            input=script.encode(),
            capture_output=True,
            cwd=ROOT,
            timeout=300,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )
    finally:
        server.stop()
    out = result.stdout.decode("utf-8")  # bytes: a CR in the sampled reply must stay a CR
    assert result.returncode == 0, (out, result.stderr.decode())
    assert result.stderr == b""
    parts = out.split(">>> ")
    assert len(parts) == 10, out
    assert parts[0] == f"saker chat with tiny-llama at {server.url}/v1. Type /help or /? to list commands.\n"
    assert parts[2] == "set temperature=0.0\n"
    assert parts[3] == "system prompt set (it applies to the whole conversation; /reset starts a new one)\n"
    assert parts[5] == "conversation cleared (system prompt and parameters kept)\n"
    assert parts[7] == "set max_tokens=8\n"
    assert parts[9] == ""

    model, tok = reference(llama_dir)

    def rendered(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def prompt_block(text):
        match = re.fullmatch(
            r"--- prompt: (\d+) tokens \(the model takes 256\) ---\n(.*)\n--- end of prompt ---\n"
            r"(the prompt already fills.*\n)?",
            text,
            re.S,
        )
        assert match, text
        return int(match.group(1)), match.group(2) + "\n"

    # the first reply was sampled (the server's default temperature): the prompt holds it as it was shown
    first_reply = parts[1].removesuffix("[cut at max_tokens; /params max_tokens=N for longer replies]\n")
    first_reply = "" if first_reply == "(empty reply)\n" else first_reply
    count, text = prompt_block(parts[4])
    head, tail = "<s><|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n", "\n<|assistant|>\n"
    assert text.startswith(head) and text.endswith(tail)
    shown_reply = text[len(head) : -len(tail)]
    assert first_reply in (shown_reply, shown_reply + "\n")
    if "\\x" not in shown_reply:  # no escaped control characters: the text is exact
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": shown_reply},
        ]
        assert count == len(rendered(messages))

    # after /reset only the system prompt is left
    ids = rendered([{"role": "system", "content": "be brief"}])
    assert prompt_block(parts[6]) == (len(ids), tok.decode(ids))
    assert tok.decode(ids) == "<s><|system|>\nbe brief\n<|assistant|>\n"

    # temperature=0, max_tokens=8 and the system prompt reached the server: the reply is generate()'s greedy text
    ids = rendered(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is the capital of France?"}]
    )
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)[
        0
    ].tolist()
    new = generated[len(ids) :]
    expected = tok.decode(generated, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)) :]
    shown = printable(expected) or "(empty reply)"
    shown += "" if shown.endswith("\n") else "\n"
    if len(new) == 8 and new[-1] != tok.eos_token_id:
        shown += "[cut at max_tokens; /params max_tokens=N for longer replies]\n"
    assert parts[8] == shown
