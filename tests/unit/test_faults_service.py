"""A client that retries ``set_reward`` or ``finalize`` after a timeout (issue 15, item 3): the
first call may have landed, so the retry must not count the reward twice or hand the trainer
the trajectory twice. Real gateway over two real proxies (scripted engine, no model)."""

from __future__ import annotations

import httpx

from areal_env.engine.testing import ScriptedEngine
from tests.fixtures.service import SERVICE_USER_KEYS, make_service_stack

ALICE = SERVICE_USER_KEYS[0]


def test_retried_set_reward_and_finalize_count_once(tokenizer):
    stack = make_service_stack(
        ScriptedEngine(tokenizer, default="Hi."), tokenizer, n_samples=1, batch_size=1
    )
    handed: list[dict] = []
    real_put = stack.source.put

    def put(record, group_id=None):
        handed.append(record)
        return real_put(record, group_id)

    stack.source.put = put
    try:
        with httpx.Client(base_url=stack.base_url, timeout=30) as c:
            user = {"Authorization": f"Bearer {ALICE}"}
            sid = c.post("/rl/v1/sessions", json={}, headers=user).json()["session_id"]
            key = {"Authorization": f"Bearer {ALICE}:{sid}"}
            r = c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers=key,
            )
            assert r.status_code == 200
            for _ in range(3):  # the first answer was "lost": the client sends it again
                assert c.post("/rl/v1/set_reward", json={"reward": 0.5}, headers=key).is_success
            first = c.post("/rl/v1/finalize", json={"final_reward": 1.0}, headers=key)
            assert first.status_code == 200 and first.json()["status"] == "ok"
            retry = c.post("/rl/v1/finalize", json={"final_reward": 1.0}, headers=key)
            # the retry learns the session is finalized; it never finalizes it again
            assert retry.status_code in (200, 409), retry.text
            if retry.status_code == 200:
                assert retry.json()["status"] == "ok"
        assert len(handed) == 1, "the trajectory was handed to the trainer twice"
        rewards = [t["reward"] for t in handed[0]["trajectories"].values()]
        assert rewards == [1.0]  # set, not 0.5 * 3 + 1.0
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()
