"""An agent trained through the service: plain openai SDK code plus ``AgentRunner``.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=demo-user-key \
        python examples/service/agent.py [N_ITEMS]

Needs only ``pip install ./client openai`` on the agent's machine (no torch). Each capital
question runs ``group_size`` times (one GRPO group); the reward checks the answer.
"""

from __future__ import annotations

import asyncio
import sys

import openai
from areal_env_client import AgentRunner

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
]


async def agent(item: dict) -> float:
    client = openai.AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": f"What is the capital of {item['country']}?"}],
        max_tokens=24,
    )
    text = reply.choices[0].message.content or ""
    return 1.0 if item["capital"].lower() in text.lower() else 0.0


async def main(n_items: int) -> None:
    items = [{"country": c, "capital": k} for c, k in CAPITALS] * (n_items // len(CAPITALS) + 1)
    results = await AgentRunner().run(agent, items[:n_items], concurrency=8, group_size=4)
    done = [r for r in results if r.ok]
    mean = sum(r.mean_reward or 0.0 for r in done) / max(1, len(done))
    print(f"{len(done)}/{len(results)} items done, mean reward {mean:.2f}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 16))
