"""The demo agent: a plain OpenAI SDK agent with a verifiable reward.

It asks the model for a country's capital and scores the reply itself:

- 1.0  the reply names the right city and is at most ``max_words`` words long;
- 0.5  the right city, but wordier (``The capital of France is Paris, a city ...``);
- 0.0  the wrong city (or none).

So the reward has a correctness component (a short *wrong* answer earns nothing — the model
cannot game it by answering in one random word) and a format component the tiny default model
learns within a few steps. Nothing in here knows about training: it is an ordinary agent that
takes ``base_url`` / ``api_key`` / ``http_client`` and returns a float.
"""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI

PROMPT = "What is the capital of {country}? Answer with the city name only."


def _norm(text: str) -> str:
    return re.sub(r"[^a-z ]+", " ", text.lower()).strip()


def capital_reward(reply: str, answer: str, max_words: int = 3) -> float:
    """1.0 correct and short, 0.5 correct but long, 0.0 wrong."""
    words = _norm(reply).split()
    target = _norm(answer).split()
    n = len(target)
    correct = any(words[i : i + n] == target for i in range(len(words) - n + 1))
    if not correct:
        return 0.0
    return 1.0 if len(words) <= max_words + n - 1 else 0.5


class CapitalsAgent:
    """``await CapitalsAgent().run({"country": "France", "answer": "Paris"}, base_url=...)``."""

    def __init__(
        self,
        model: str = "default",
        max_tokens: int = 24,
        temperature: float = 1.0,
        max_words: int = 3,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_words = max_words

    async def run(
        self,
        data: dict[str, Any],
        *,
        base_url: str,
        api_key: str,
        http_client: Any = None,
        **_: Any,
    ) -> float:
        # Not `async with`: that would close the shared http_client the trainer lent us.
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        resp = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": PROMPT.format(country=data["country"])}],
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        reply = resp.choices[0].message.content or ""
        return capital_reward(reply, data["answer"], self.max_words)


class ShortReplyAgent:
    """A length target (for the quick learning test): reward 1 for a reply of at most
    ``max_words`` words, falling linearly to 0 at ``max_words + 20`` words. The graded reward gives
    every group some variance, so it learns within a few steps — it proves the loop learns, not
    that answers get better."""

    def __init__(self, model: str = "default", max_tokens: int = 24, max_words: int = 5) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_words = max_words

    async def run(
        self,
        data: dict[str, Any],
        *,
        base_url: str,
        api_key: str,
        http_client: Any = None,
        **_: Any,
    ) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        resp = await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": data["prompt"]}],
            max_tokens=self.max_tokens,
            temperature=1.0,
        )
        n = len((resp.choices[0].message.content or "").split())
        if n == 0:
            return 0.0
        return 1.0 if n <= self.max_words else max(0.0, 1.0 - (n - self.max_words) / 20)
