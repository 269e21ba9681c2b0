"""instructor against a saker server, run with the clients' virtualenv (.venv-clients: instructor's pins disagree with
requirements-dev.txt's openai) by tests/live/test_agent_libraries.py.

    .venv-clients/bin/python tests/clients/instructor_flows.py URL MODEL FLOW

FLOW: tools, json, json_schema, responses_tools (``create`` in that mode) or partial (``create_partial`` in TOOLS
mode). One JSON object on stdout: ``result`` (the parsed model's dump) or ``partials`` (each partial's dump), and
``exchanges`` (each request's method, path and body, the answer's status and, unless streamed, its body); on an
error, ``error`` (its type and message) and the exchanges so far, exit status 1."""

from __future__ import annotations

import json
import sys

import httpx2
import instructor
import openai
from pydantic import BaseModel


class UserDetail(BaseModel):
    name: str
    age: int


MESSAGES = [{"role": "user", "content": "Extract the user: Jason is 25 years old."}]
MODES = {
    "tools": instructor.Mode.TOOLS,
    "json": instructor.Mode.JSON,
    "json_schema": instructor.Mode.JSON_SCHEMA,
    "responses_tools": instructor.Mode.RESPONSES_TOOLS,
    "partial": instructor.Mode.TOOLS,
}


def main(url: str, model: str, flow: str) -> int:
    exchanges: list[dict] = []

    def on_request(request: httpx2.Request) -> None:
        body = request.read()
        exchanges.append({"method": request.method, "path": request.url.path, "request": json.loads(body or "null")})

    def on_response(response: httpx2.Response) -> None:
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        exchanges[-1]["status"] = response.status_code
        if not streamed:
            response.read()
            exchanges[-1]["response"] = response.text

    http = httpx2.Client(event_hooks={"request": [on_request], "response": [on_response]})
    client = instructor.from_openai(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http), mode=MODES[flow]
    )
    # max_retries=0: one attempt, no re-ask (what comes back is what the server's first answer parses into)
    fields = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=120, max_retries=0)
    out: dict = {"flow": flow, "exchanges": exchanges}
    try:
        if flow == "partial":
            partials = client.chat.completions.create_partial(response_model=UserDetail, **fields)
            out["partials"] = [p.model_dump() for p in partials]
        else:
            out["result"] = client.chat.completions.create(response_model=UserDetail, **fields).model_dump()
    except Exception as error:  # the report names it; the test fails on it
        out["error"] = f"{type(error).__name__}: {error}"
    print(json.dumps(out))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
