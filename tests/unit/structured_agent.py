"""An openai-agents agent with a structured final output (``Agent(output_type=City)``), trained
by ``test_structured_outputs.py::test_training_an_output_type_agent_has_no_parse_failures``.

A reply that does not parse raises the SDK's ``ModelBehaviorError``: the episode then fails and
the trainer counts it as rejected, so a run with no rejected episodes had no parse failure.
"""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic import BaseModel

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled


class City(BaseModel):
    name: str
    country: str
    population: int


class CityAgent:
    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        agent = Agent(
            name="geo",
            instructions="You answer questions about cities.",
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
            output_type=City,
        )
        result = await Runner.run(agent, data["prompt"], max_turns=2)
        city = result.final_output
        assert isinstance(city, City)
        # the task: a big city of the country asked about
        return float(city.population >= 1_000_000 and data["country"] in city.country)
