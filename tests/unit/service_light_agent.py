"""An agent that needs nothing but the light client (``pip install ./client``): no torch, no
openai SDK. It speaks the OpenAI protocol with httpx, inside ``AgentRunner`` sessions.

Usage: OPENAI_BASE_URL=<service>/v1 OPENAI_API_KEY=<key> python service_light_agent.py N GROUP
[THINK]: each episode makes one model call, then "thinks" THINK seconds (default 0) before it
returns its reward, so its session stays open for at least that long, as a real agent's does.
Prints one JSON line: {"sessions": [[...], ...], "errors": [...], "torch": false}.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys

import httpx
from areal_env_client import AgentRunner

THINK = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0


async def agent(item: dict) -> float:
    async with httpx.AsyncClient(timeout=120) as http:  # tagged with the session by the hook
        r = await http.post(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": item["question"]}],
                "max_tokens": 6,
            },
            headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
        )
        r.raise_for_status()
        text = r.json()["choices"][0]["message"]["content"] or ""
    await asyncio.sleep(THINK)
    return 1.0 if len(text.split()) <= 2 else 0.0


def main() -> None:
    n, group = int(sys.argv[1]), int(sys.argv[2])
    items = [{"question": f"In one word, what colour is thing number {i}?"} for i in range(n)]
    results = asyncio.run(
        AgentRunner().run(
            agent,
            items,
            concurrency=4,
            group_size=group,
            group_prefix="light",
            progress=False,
            backoff=0.5,
            max_backoff=3.0,
            retry_for=600.0,
        )
    )
    print(
        json.dumps(
            {
                "sessions": [r.session_ids for r in results],
                "errors": [e for r in results for e in r.errors],
                "attempts": sum(sum(r.attempts) for r in results),
                "torch": importlib.util.find_spec("torch") is not None,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
