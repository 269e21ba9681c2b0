"""Agent and structured-output libraries against a real gunicorn serving the embedded SmolLM2 with nothing configured
(no model, no chat template: the model's own template, which does not render tools). What the 135M model writes is
not checked, only that each library gets what it asked for and parses it: the result validates against its pydantic
model.

- instructor 1.17 in TOOLS, JSON, JSON_SCHEMA and RESPONSES_TOOLS modes, and ``create_partial`` in TOOLS mode. Its
  pins disagree with requirements-dev.txt's openai (jiter), so it runs in a virtualenv of its own (.venv-clients,
  ``make install-clients``, requirements-clients.txt) as a subprocess: tests/clients/instructor_flows.py.
- pydantic-ai: an output tool (its default for a pydantic output type), NativeOutput (a json_schema
  response_format) and one function-tool round trip (the tool's result sent back, then the output tool)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from pydantic import BaseModel

from servers import ROOT, Gunicorn

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def server(saker_cache):
    from app.engine.loader import ensure_default_model

    from conftest import make_settings

    ensure_default_model(make_settings(cache_dir=str(saker_cache)))
    srv = Gunicorn({"SAKER_CACHE_DIR": str(saker_cache), "SAKER_THREADS": "4"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


class UserDetail(BaseModel):
    """instructor's response model (tests/clients/instructor_flows.py has the same one)."""

    name: str
    age: int


class City(BaseModel):
    city: str
    country: str


def instructor_flow(server, flow: str) -> dict:
    """tests/clients/instructor_flows.py run with the clients' virtualenv: its JSON report. A failure shows the
    requests it sent and what the server answered."""
    if not CLIENTS_PYTHON.exists():
        pytest.skip("instructor's virtualenv is missing: make install-clients")
    script = ROOT / "tests" / "clients" / "instructor_flows.py"
    done = subprocess.run(
        [str(CLIENTS_PYTHON), str(script), server.url, MODEL, flow], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert all(exchange["status"] == 200 for exchange in report["exchanges"]), report["exchanges"]
    return report


@pytest.mark.parametrize(
    "flow, path",
    [
        ("tools", "/v1/chat/completions"),
        ("json", "/v1/chat/completions"),
        ("json_schema", "/v1/chat/completions"),
        ("responses_tools", "/v1/responses"),
    ],
)
def test_instructor_modes(server, flow, path):
    """instructor's ``create`` in each mode, one attempt (no re-ask): one request, its answer parsed into the
    model."""
    report = instructor_flow(server, flow)
    assert [exchange["path"] for exchange in report["exchanges"]] == [path]
    UserDetail.model_validate(report["result"])


def test_instructor_create_partial(server):
    """``create_partial`` in TOOLS mode (a streamed forced call): several distinct partials, the last one whole."""
    report = instructor_flow(server, "partial")
    [exchange] = report["exchanges"]
    assert exchange["request"]["stream"] is True
    partials = report["partials"]
    assert len({json.dumps(p, sort_keys=True) for p in partials}) > 1, partials
    UserDetail.model_validate(partials[-1])


def run_agent(server, output_type, prompt: str, settings, tools=()):
    """A pydantic-ai Agent over an OpenAIChatModel pointed at the server, run once: (the run's output, its messages).
    The AsyncOpenAI client is closed inside the run's event loop (else its sockets outlive the loop)."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -r requirements-dev.txt")
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, output_type=output_type, model_settings=settings, tools=list(tools))
            result = await agent.run(prompt)
            return result.output, result.all_messages()
        finally:
            await client.close()

    return asyncio.run(run())


SETTINGS = {"temperature": 0.0, "max_tokens": 120}


def test_pydantic_ai_tool_output(server):
    """A pydantic output type is an output tool by default (``final_result``, tool_choice required): its call's
    arguments are the output."""
    output, messages = run_agent(server, City, "What is the capital of Italy?", SETTINGS)
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    assert isinstance(output, City)
    City.model_validate(output.model_dump())
    calls = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    assert calls and calls[0].tool_name == "final_result"


def test_pydantic_ai_native_output(server):
    """NativeOutput: a json_schema response_format, the message's text is the output."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -r requirements-dev.txt")
    from pydantic_ai import NativeOutput
    from pydantic_ai.messages import ModelResponse, TextPart

    output, messages = run_agent(server, NativeOutput(City), "What is the capital of Italy?", SETTINGS)
    assert isinstance(output, City)
    [response] = [m for m in messages if isinstance(m, ModelResponse)]
    [text] = [p for p in response.parts if isinstance(p, TextPart)]
    assert City.model_validate_json(text.content) == output


def test_pydantic_ai_tool_round_trip(server):
    """One function-tool round trip: the first step must call ``get_capital`` (the Python function runs with
    arguments from its schema), its result goes back as a tool message, the second step must call the output tool.
    (Both steps forced: left to choose, the 135M model calls get_capital again and again.)"""
    seen: list[str] = []

    def get_capital(country: str) -> str:
        """The capital city of a country."""
        seen.append(country)
        return "Rome"

    def settings(ctx):
        step = ["get_capital"] if ctx.run_step <= 1 else ["final_result"]
        return {**SETTINGS, "tool_choice": step, "parallel_tool_calls": False}

    output, messages = run_agent(server, City, "What is the capital of Italy?", settings, tools=[get_capital])
    from pydantic_ai.messages import ModelRequest, ToolReturnPart

    assert isinstance(output, City)
    City.model_validate(output.model_dump())
    assert len(seen) == 1 and isinstance(seen[0], str)
    returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [p.tool_name for p in returns][:1] == ["get_capital"] and returns[0].content == "Rome"
