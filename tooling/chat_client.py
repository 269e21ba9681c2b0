"""``python -m app chat [--url URL] [--model NAME]``: a terminal chat shell for any OpenAI-compatible server.

In the spirit of Aceso's ``bot.py`` and llm-foundry's ``hf_chat.py``, but over HTTP: the shell keeps the
conversation, sends all of it with each new message to ``POST {url}/chat/completions`` with ``stream: true`` and
prints ``delta.content`` as it arrives (a server that answers 400 to streaming gets plain requests from then on).
Commands start with ``/`` (``/help`` lists them); ``//text`` sends a message that starts with ``/``.

Standard library only (``urllib`` and the server-sent-events reader of ``tooling/sse.py``): ``requests`` and
``openai`` are development dependencies of this project, not runtime ones.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, fields, replace
from typing import IO, Any, Callable, Iterator

from tooling.sse import iter_data

DEFAULT_URL = "http://127.0.0.1:8000/v1"
TIMEOUT_S = 600.0  # a long generation may take a while before (or between) tokens
PROMPT = ">>> "

HELP = """\
Type a message to chat; the whole conversation is sent each time.
  /help, /?                 this list
  /params                   show the sampling parameters
  /params NAME=VALUE ...    set them: temperature=0.7 top_k=40 top_p=0.9 max_tokens=128
                            repetition_penalty=1.1 (NAME=default goes back to the server's default)
  /system TEXT              set the system prompt (it applies to the whole conversation)
  /system                   show the system prompt; /system --clear removes it
  /prompt                   show the full prompt as the model sees it (via the server's /tokenize)
  /reset                    start a new conversation (system prompt and parameters are kept)
  /quit, /exit              leave (Ctrl-D too; Ctrl-C stops a reply, or leaves at the prompt)
  //text                    send a message that starts with "/"
"""


class ChatError(Exception):
    """A failure to show as one line; the shell goes on."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _one_line(text: str, limit: int = 500) -> str:
    text = printable(" ".join(str(text).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_error(status: int | None, body: Any) -> str:
    """An OpenAI error body (``{"error": {message, type, param, code}}``), or any other body, as one line."""
    head = f"error {status}" if status is not None else "error"
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return f"{head}: {_one_line(body) or '(empty body)'}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):  # some servers send {"error": "message"}
        error = {"message": error}
    if not isinstance(error, dict):
        return f"{head}: {_one_line(json.dumps(body, ensure_ascii=False))}"
    details = [str(error["type"])] if error.get("type") else []
    details += [f"{key}={error[key]}" for key in ("param", "code") if error.get(key) is not None]
    suffix = f" ({', '.join(details)})" if details else ""
    return f"{head}{suffix}: {_one_line(error.get('message') or '(no message)')}"


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Text as shown in the terminal: control characters (ESC and the like, which a model or a server could send
    to move the cursor or change colours) appear as ``\\x1b`` escapes; newlines, tabs and CR stay as they are.
    The conversation keeps the text as it came."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclass
class ChatAnswer:
    """The assistant's answer to one turn: its text and why it ended."""

    content: str = ""
    finish_reason: str | None = None


def iter_chat_stream(stream: IO[bytes], reply: ChatAnswer | None = None) -> Iterator[str]:
    """The ``delta.content`` pieces of choice 0 in a chat completion stream, until ``data: [DONE]``.

    ``reply`` (when given) collects the text and ``finish_reason``. An ``{"error": ...}`` frame (an error after
    the stream began) raises ChatError.
    """
    reply = reply if reply is not None else ChatAnswer()
    for data in iter_data(stream):
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ChatError(f"error: the server sent a stream frame that is not JSON: {_one_line(data, 200)}") from None
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            raise ChatError(format_error(None, chunk))
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content") if isinstance(delta, dict) else None
            if content:
                reply.content += content
                yield content
            if choice.get("finish_reason"):
                reply.finish_reason = choice["finish_reason"]


# -- HTTP --------------------------------------------------------------------------------------------------


class HTTPClient:
    """JSON over urllib; every failure becomes a ChatError with one line to show."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ChatError(f"error: --url must be an http(s) URL such as {DEFAULT_URL}, not {base_url!r}")
        # vLLM serves /tokenize and /detokenize beside /v1, not under it
        self.root_url = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.api_key = api_key
        self.timeout = timeout
        handlers = []
        if parsed.hostname in ("127.0.0.1", "localhost", "::1"):
            handlers.append(urllib.request.ProxyHandler({}))  # a local server is never behind the proxy
        self._opener = urllib.request.build_opener(*handlers)

    def open(self, method: str, url: str, payload: Any = None, *, stream: bool = False) -> http.client.HTTPResponse:
        headers = {"Accept": "text/event-stream" if stream else "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            return self._opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                body = exc.read()
            raise ChatError(format_error(exc.code, body), status=exc.code) from None
        except urllib.error.URLError as exc:
            raise ChatError(f"error: cannot reach {url}: {exc.reason}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise ChatError(f"error: {url}: {_one_line(exc) or type(exc).__name__}") from None

    def json(self, method: str, url: str, payload: Any = None) -> Any:
        response = self.open(method, url, payload)
        with response:
            try:
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise ChatError(f"error: {url}: {_one_line(exc) or type(exc).__name__}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ChatError(
                f"error: {url} did not answer JSON: {_one_line(raw.decode('utf-8', 'replace'), 200)}"
            ) from None

    def first_model(self) -> str:
        listing = self.json("GET", self.base_url + "/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if not data or not isinstance(data[0], dict) or not data[0].get("id"):
            raise ChatError(f"error: {self.base_url}/models lists no model; pass --model NAME")
        return str(data[0]["id"])


# -- parameters --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    """Sampling parameters sent with each message; None = not sent (the server's default)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None

    def request_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            lines.append(f"  {f.name} = {'(server default)' if value is None else value}")
        return "\n".join(lines)


_ALIASES = {"max_new_tokens": "max_tokens", "temp": "temperature"}
_UNSET = {"default", "none", "null", "unset"}


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {text!r}")
    return value


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {text!r}") from None


def _check_value(name: str, text: str) -> int | float:
    if name == "temperature":
        value = _number(name, text)
        if not 0 <= value <= 2:
            raise ValueError(f"temperature must be between 0 and 2 (0 = greedy), not {text}")
        return value
    if name == "top_p":
        value = _number(name, text)
        if not 0 < value <= 1:
            raise ValueError(f"top_p must be more than 0 and at most 1 (1 = off), not {text}")
        return value
    if name == "top_k":
        value = _integer(name, text)
        if value < -1:
            raise ValueError(f"top_k must be a positive whole number, or 0 or -1 for off, not {text}")
        return value
    if name == "max_tokens":
        value = _integer(name, text)
        if value < 1:
            raise ValueError(f"max_tokens must be at least 1, not {text}")
        return value
    if name == "repetition_penalty":
        value = _number(name, text)
        if value <= 0:
            raise ValueError(f"repetition_penalty must be more than 0 (1 = off), not {text}")
        return value
    raise AssertionError(name)


def parse_params(text: str, current: Params) -> Params:
    """``"temperature=0.7 top_k=40"`` applied to ``current``; ValueError with a clear message (nothing applied)."""
    text = re.sub(r"\s*=\s*", "=", text.strip())
    names = [f.name for f in fields(Params)]
    changes: dict[str, Any] = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        key = _ALIASES.get(name.lower().replace("-", "_"), name.lower().replace("-", "_"))
        if key not in names:
            raise ValueError(f"unknown parameter {name!r}; known: {', '.join(names)}")
        if not sep or value == "":
            raise ValueError(
                f"write {key}=VALUE (for example {key}={_EXAMPLES[key]}), or {key}=default for the server's default"
            )
        if key in changes:
            raise ValueError(f"{key} is given twice")
        changes[key] = None if value.lower() in _UNSET else _check_value(key, value)
    if not changes:
        raise ValueError("nothing to set; write NAME=VALUE, for example temperature=0.7")
    return replace(current, **changes)


_EXAMPLES = {"temperature": "0.7", "top_k": "40", "top_p": "0.9", "max_tokens": "128", "repetition_penalty": "1.1"}


# -- commands ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    name: str  # without the slash, lower case
    arg: str  # the rest of the line, stripped


@dataclass(frozen=True)
class Message:
    text: str


_COMMAND_ALIASES = {
    "?": "help",
    "h": "help",
    "exit": "quit",
    "q": "quit",
    "bye": "quit",
    "clear": "reset",
    "param": "params",
    "parameters": "params",
}
COMMANDS = ("help", "params", "system", "prompt", "reset", "quit")


def parse_shell_line(line: str) -> Command | Message | None:
    """A line typed at the shell's prompt: a command (``/name arg``), a message, or None for a blank line.
    ``//text`` is the message ``/text``."""
    stripped = line.strip()
    if not stripped:
        return None
    if stripped.startswith("//"):
        return Message(stripped[1:])
    if stripped.startswith("/"):
        name, _, arg = stripped[1:].partition(" ")
        name = name.lower()
        return Command(_COMMAND_ALIASES.get(name, name), arg.strip())
    return Message(line.rstrip("\r\n"))


# -- the shell ---------------------------------------------------------------------------------------------


class ChatShell:
    def __init__(self, client: HTTPClient, model: str, out: IO[str] | None = None, *, stream: bool = True):
        self.client = client
        self.model = model
        self.out = out or sys.stdout
        self.stream = stream
        self.params = Params()
        self.system_prompt: str | None = None
        self.history: list[dict[str, str]] = []  # user and assistant turns, in order

    # -- output
    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    # -- conversation
    def messages(self, user_text: str | None = None) -> list[dict[str, str]]:
        """What is sent: the system prompt, the turns so far, and (when given) the new user message."""
        result = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        result += [dict(m) for m in self.history]
        if user_text is not None:
            result.append({"role": "user", "content": user_text})
        return result

    def request_body(self, messages: list[dict[str, str]], stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.params.request_fields()}
        if stream:
            body["stream"] = True
        return body

    def send(self, text: str) -> ChatAnswer | None:
        """One turn: print the reply as it arrives; keep the turn only when it succeeded (or was cut by Ctrl-C)."""
        messages = self.messages(text)
        reply = ChatAnswer()
        fell_back = False
        try:
            if self.stream:
                try:
                    self._stream_reply(messages, reply)
                except ChatError as exc:
                    if exc.status != 400:
                        raise
                    reply = ChatAnswer()
                    self._plain_reply(messages, reply)  # raises the same 400 if it was not streaming
                    self.stream, fell_back = False, True
            else:
                self._plain_reply(messages, reply)
        except ChatError as exc:
            if reply.content:
                self._write("\n")
            self.say(str(exc))
            return None
        except KeyboardInterrupt:
            self._write("\n" if reply.content else "")
            self.say("[interrupted]")
            if not reply.content:
                return None
            reply.finish_reason = "interrupted"
        else:
            if not reply.content:
                self._write("(empty reply)")
            self._write("" if reply.content.endswith("\n") else "\n")
            if reply.finish_reason == "length":
                self.say("[cut at max_tokens; /params max_tokens=N for longer replies]")
            if fell_back:
                self.say("(the server refused stream: true; replies now come whole)")
        self.history.append({"role": "user", "content": text})
        self.history.append({"role": "assistant", "content": reply.content})
        return reply

    def _stream_reply(self, messages: list[dict[str, str]], reply: ChatAnswer) -> None:
        url = self.client.base_url + "/chat/completions"
        response = self.client.open("POST", url, self.request_body(messages, stream=True), stream=True)
        with response:
            if "text/event-stream" not in (response.headers.get("Content-Type") or ""):
                # a server that ignores stream: true and answers the whole completion
                self._show_whole(self._read_json(response, url), reply)
                return
            try:
                for piece in iter_chat_stream(response, reply):
                    self._write(printable(piece))
            except (OSError, http.client.HTTPException) as exc:
                raise ChatError(f"error: the stream broke off: {_one_line(exc) or type(exc).__name__}") from None

    def _plain_reply(self, messages: list[dict[str, str]], reply: ChatAnswer) -> None:
        url = self.client.base_url + "/chat/completions"
        self._show_whole(self.client.json("POST", url, self.request_body(messages, stream=False)), reply)

    def _read_json(self, response, url: str) -> Any:
        try:
            return json.loads(response.read())
        except (ValueError, OSError, http.client.HTTPException):
            raise ChatError(f"error: {url} did not answer JSON") from None

    def _show_whole(self, completion: Any, reply: ChatAnswer) -> None:
        try:
            choice = completion["choices"][0]
            content = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ChatError(
                format_error(None, completion)
                if isinstance(completion, dict) and "error" in completion
                else "error: the server's answer has no choices[0].message"
            ) from None
        reply.content = content
        reply.finish_reason = choice.get("finish_reason")
        self._write(printable(content))

    # -- commands
    def handle(self, line: str) -> bool:
        """Act on one input line; False when the shell should end."""
        parsed = parse_shell_line(line)
        if parsed is None:
            return True
        if isinstance(parsed, Message):
            self.send(parsed.text)
            return True
        name, arg = parsed.name, parsed.arg
        if name == "quit":
            return False
        if name == "help":
            self._write(HELP)
        elif name == "params":
            self.do_params(arg)
        elif name == "system":
            self.do_system(arg)
        elif name == "prompt":
            self.show_prompt()
        elif name == "reset":
            self.history.clear()
            self.say("conversation cleared (system prompt and parameters kept)")
        else:
            self.say(f"unknown command /{name}; /help lists the commands (//text sends a message starting with /)")
        return True

    def do_params(self, arg: str) -> None:
        if not arg:
            self.say(f"parameters (model {self.model}):")
            self.say(self.params.describe())
            return
        try:
            new = parse_params(arg, self.params)
        except ValueError as exc:
            self.say(f"/params: {exc} (nothing changed)")
            return
        changed = [
            f"{f.name}={'default' if getattr(new, f.name) is None else getattr(new, f.name)}"
            for f in fields(Params)
            if getattr(new, f.name) != getattr(self.params, f.name)
        ]
        self.params = new
        self.say("set " + ", ".join(changed) if changed else "no change")

    def do_system(self, arg: str) -> None:
        if not arg:
            self.say(
                f"system prompt: {self.system_prompt}"
                if self.system_prompt
                else "no system prompt (/system TEXT sets one)"
            )
        elif arg == "--clear":
            self.system_prompt = None
            self.say("system prompt removed")
        else:
            self.system_prompt = arg
            self.say("system prompt set (it applies to the whole conversation; /reset starts a new one)")

    def show_prompt(self) -> None:
        """The rendered prompt of the conversation so far, via vLLM-style /tokenize + /detokenize."""
        messages = self.messages()
        if not messages:
            self.say("the conversation is empty: nothing to show yet (send a message or set /system first)")
            return
        try:
            tokenized = self.client.json(
                "POST",
                self.client.root_url + "/tokenize",
                {"model": self.model, "messages": messages, "add_generation_prompt": True},
            )
            tokens = tokenized["tokens"]
            detokenized = self.client.json(
                "POST", self.client.root_url + "/detokenize", {"model": self.model, "tokens": tokens}
            )
            text = detokenized["prompt"]
        except ChatError as exc:
            if exc.status in (404, 405, 501):
                self.say(f"this server has no /tokenize and /detokenize endpoints ({exc}); the messages sent are:")
            else:
                self.say(f"{exc}; the messages sent are:")
            self.say(json.dumps(messages, indent=2, ensure_ascii=False))
            return
        except (KeyError, TypeError):
            self.say("the server's /tokenize or /detokenize answer is not in vLLM's shape; the messages sent are:")
            self.say(json.dumps(messages, indent=2, ensure_ascii=False))
            return
        count = tokenized.get("count", len(tokens))
        limit = tokenized.get("max_model_len")
        self.say(f"--- prompt: {count} tokens" + (f" (the model takes {limit})" if limit else "") + " ---")
        self._write(printable(text) if text.endswith("\n") else printable(text) + "\n")
        self.say("--- end of prompt ---")
        if isinstance(limit, int) and isinstance(count, int) and count >= limit:
            self.say(
                f"the prompt already fills the model's {limit} tokens: the next message will be refused "
                "(/reset starts a new conversation)"
            )

    # -- the loop
    def run(self, read_line: Callable[[str], str] = input) -> int:
        self.say(f"saker chat with {self.model} at {self.client.base_url}. Type /help or /? to list commands.")
        while True:
            try:
                line = read_line(PROMPT)
            except EOFError:
                self._write("\n")
                return 0
            except KeyboardInterrupt:
                self._write("\n")
                return 0
            if not self.handle(line):
                return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"base URL of an OpenAI-compatible API (default: {DEFAULT_URL}, `python -m app serve`)",
    )
    parser.add_argument("--model", default=None, help="model name to ask for (default: the first of GET /models)")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` when the server wants one")


def main(args: argparse.Namespace) -> int:
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a model's odd characters never kill the shell
    try:
        client = HTTPClient(args.url, api_key=args.api_key)
        model = args.model or client.first_model()
    except ChatError as exc:
        print(f"saker chat: {exc}", file=sys.stderr)
        return 1
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    return ChatShell(client, model).run(input)
