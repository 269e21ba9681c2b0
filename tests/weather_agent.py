"""An OpenAI Agents SDK agent with one function tool, for the tests that run the SDK against saker."""

from __future__ import annotations

from typing import Literal

import pytest


def weather_agent(base_url: str, model: str, **agent_fields):
    """An OpenAI Agents SDK agent with one function tool, its model an OpenAIResponsesModel over an AsyncOpenAI
    client pointed at saker (tracing off: nothing leaves the machine); (the agent, the cities the tool saw, the
    client: closed by the caller inside its event loop, else its sockets outlive the loop: ResourceWarning)."""
    pytest.importorskip("agents", reason="openai-agents is not installed: pip install -r requirements-dev.txt")
    import openai
    from agents import Agent, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"18 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return (
        Agent(
            name="weather",
            instructions="Answer questions about the weather; use the tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=model, openai_client=client),
            **agent_fields,
        ),
        cities,
        client,
    )
