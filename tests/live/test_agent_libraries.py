"""Agent and structured-output libraries against a real gunicorn serving the embedded SmolLM2 with nothing configured
(no model, no chat template: the model's own template, which does not render tools). What the 135M model writes is
not checked, only that each library gets what it asked for and parses it: the result validates against its pydantic
model.

- instructor 1.17 in TOOLS, JSON, JSON_SCHEMA and RESPONSES_TOOLS modes, and ``create_partial`` in TOOLS mode. Its
  pins disagree with requirements-dev.txt's openai (jiter), so it runs in a virtualenv of its own (.venv-clients,
  ``make install-clients``, requirements-clients.txt) as a subprocess: tests/clients/instructor_flows.py.
- pydantic-ai: an output tool (its default for a pydantic output type), NativeOutput (a json_schema
  response_format) and one function-tool round trip (the tool's result sent back, then the output tool).
- LangChain: ``with_structured_output`` by json_schema, function_calling and json_mode, ``bind_tools`` with a forced
  tool, and its streamed tool-call chunks.
- The openai client's forced tool call, and the OpenAI Agents SDK with a function tool (Responses API)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from pydantic import BaseModel

from servers import ROOT, openai_client, running

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def server(saker_cache):
    from app.engine.model.loader import ensure_default_model

    from conftest import make_settings

    ensure_default_model(make_settings(cache_dir=str(saker_cache)))
    with running({"SAKER_CACHE_DIR": str(saker_cache), "SAKER_THREADS": "4"}) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai_client(server)


class UserDetail(BaseModel):
    """instructor's response model (tests/clients/instructor_flows.py has the same one)."""

    name: str
    age: int


class City(BaseModel):
    city: str
    country: str


def instructor_flow(server, flow: str, model_errors: bool = False) -> dict:
    """tests/clients/instructor_flows.py run with the clients' virtualenv: its JSON report. A failure shows the
    requests it sent and what the server answered. ``model_errors``: a report whose error is instructor's
    validation of the model's answer is returned too (the caller judges it)."""
    if not CLIENTS_PYTHON.exists():
        pytest.skip("instructor's virtualenv is missing: make install-clients")
    script = ROOT / "tests" / "clients" / "instructor_flows.py"
    done = subprocess.run(
        [str(CLIENTS_PYTHON), str(script), server.url, MODEL, flow], capture_output=True, text=True, timeout=300
    )
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    validation = model_errors and "validation error" in report.get("error", "")
    assert done.returncode == 0 or validation, done.stdout[-6000:] + done.stderr[-3000:]
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
    model. In JSON mode the schema is only in instructor's system prompt and the request asks for
    ``json_object``: the server promises a JSON object, and whether its keys are the schema's is the model's doing
    (the embedded 135M model's greedy answer has been either), so that mode holds the server to the JSON object."""
    report = instructor_flow(server, flow, model_errors=flow == "json")
    assert [exchange["path"] for exchange in report["exchanges"]] == [path]
    if flow == "json":
        [exchange] = report["exchanges"]
        assert exchange["request"]["response_format"] == {"type": "json_object"}
        content = json.loads(exchange["response"])["choices"][0]["message"]["content"]
        assert isinstance(json.loads(content), dict), content
        if "error" in report:
            return
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


def test_langchain_with_structured_output(server):
    """LangChain's ChatOpenAI(...).with_structured_output(City) (its json_schema method) gets a City."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_retries=0
    )
    answer = llm.with_structured_output(City).invoke("What is the capital of Italy?")
    assert isinstance(answer, City) and answer.city


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_forced_tool_call_on_the_default_template(client):
    """The embedded model's own template does not render tools, and nothing is configured: the tools go into the
    system message in the call format's words and a forced call comes back, valid against its schema."""
    import jsonschema

    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_langchain_structured_output_by_function_calling(server):
    """LangChain's with_structured_output(City, method="function_calling") (a forced call of a tool named City) on
    the default template gets a City."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_retries=0
    )
    answer = llm.with_structured_output(City, method="function_calling").invoke("What is the capital of Italy?")
    assert isinstance(answer, City) and answer.city


def test_agents_sdk_function_tool_on_the_default_template(server):
    """The OpenAI Agents SDK (Responses API) with one function tool and tool_choice required, on the embedded model
    with nothing configured: the Python tool runs with arguments from its schema."""
    import asyncio

    pytest.importorskip("agents", reason="openai-agents is not installed: pip install -r requirements-dev.txt")
    from agents import ModelSettings, Runner

    from weather_agent import weather_agent

    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    agent, cities, client = weather_agent(
        server.url, MODEL, tool_use_behavior="stop_on_first_tool", model_settings=settings
    )

    async def run():
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert cities and cities[0] in ("Paris", "Rome", "Oslo")
    assert result.final_output == f"18 degrees and sunny in {cities[0]}"


def langchain_model(server, **kwargs):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_retries=0, **kwargs
    )


def test_langchain_structured_output_by_json_mode(server):
    """with_structured_output(method="json_mode"): response_format json_object, the schema only in LangChain's
    instructions; what comes back parses as JSON (a 135M model may not fill City, so the dict is checked)."""
    answer = (
        langchain_model(server, max_tokens=80)
        .with_structured_output(None, method="json_mode")
        .invoke("Answer in JSON with the keys city and country: what is the capital of Italy?")
    )
    assert isinstance(answer, dict)


def test_langchain_bind_tools_forced_and_its_streamed_chunks(server):
    """bind_tools with a forced tool: the plain answer holds a call valid against the tool's schema, and the stream's
    tool_call_chunks come in several pieces that add up to the same call."""
    import jsonschema

    llm = langchain_model(server, max_tokens=60).bind_tools([WEATHER], tool_choice="get_weather")
    plain = llm.invoke("What is the weather in Paris?")
    [call] = plain.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    chunks = list(llm.stream("What is the weather in Paris?"))
    pieces = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert len(pieces) > 1
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert [(t["name"], t["args"]) for t in total.tool_calls] == [(call["name"], call["args"])]
