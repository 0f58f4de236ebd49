"""An external agent process for the service tests: only the client helpers and the openai SDK.

Usage: OPENAI_BASE_URL=<gateway>/v1 OPENAI_API_KEY=<user key> python service_agent.py N_ITEMS
Prints one JSON line: {"rewards": [...], "errors": [...], "sessions": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import sys

import openai
from areal_env_client import AgentRunner


async def agent(item: dict) -> float:
    client = openai.AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the env
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": item["question"]}],
        max_tokens=8,
        temperature=1.0,
    )
    text = reply.choices[0].message.content or ""
    return 1.0 if len(text.split()) <= 3 else 0.0  # "answer briefly"


def main() -> None:
    n = int(sys.argv[1])
    items = [{"question": f"In one word, what colour is thing number {i}?"} for i in range(n)]
    results = asyncio.run(
        AgentRunner().run(
            agent, items, concurrency=2, group_size=1, group_prefix="shared", progress=False
        )
    )
    print(
        json.dumps(
            {
                "rewards": [r.rewards[0] for r in results],
                "errors": [r.errors[0] for r in results],
                "sessions": [r.session_ids[0] for r in results],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
