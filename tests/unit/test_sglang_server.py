"""``areal-env serve`` speaks SGLang's HTTP protocol: raw HTTP checks of the shapes clients see."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from areal_env.engine.sglang_wire import BadRequest, gconfig_from_sampling_params


@pytest.fixture(scope="module")
def base(sglang_servers) -> str:
    return f"http://{sglang_servers.addresses[1]}"


def test_sampling_params_translation():
    g = gconfig_from_sampling_params(
        {"max_new_tokens": 5, "temperature": 0, "top_k": -1, "stop": "x", "sampling_seed": 4,
         "skip_special_tokens": False, "no_stop_trim": True, "frequency_penalty": 0.0}
    )  # fmt: skip
    assert g.max_new_tokens == 5 and g.is_greedy and g.top_k == 0 and g.stop == ["x"]
    assert g.seed == 4
    assert gconfig_from_sampling_params({}).max_new_tokens == 128  # SGLang's default
    with pytest.raises(BadRequest, match="frequency_penalty"):
        gconfig_from_sampling_params({"frequency_penalty": 0.5})
    with pytest.raises(BadRequest, match="unknown"):
        gconfig_from_sampling_params({"beam_width": 2})
    with pytest.raises(BadRequest, match="top_p"):
        gconfig_from_sampling_params({"top_p": 0})


def test_structured_output_params_both_directions():
    """A constraint travels as SGLang's own structured-output params (json_schema, regex,
    ebnf: a Lark grammar marked for SGLang's llguidance backend) and comes back unchanged, so
    ``areal-env serve`` decodes what SGLangEngine sends under the same constraint."""
    from areal_env.api.io import Constraint, GenerationConfig
    from areal_env.engine.sglang_wire import sampling_params_from_gconfig

    for kind, param in (("json_schema", "json_schema"), ("regex", "regex"), ("grammar", "ebnf")):
        value = '{"type": "object"}' if kind == "json_schema" else "start: /[0-9]+/"
        g = GenerationConfig(constraint=Constraint(kind, value), top_logprobs=2)  # type: ignore[arg-type]
        sp = sampling_params_from_gconfig(g)
        assert param in sp and sp[param].endswith(value)
        if kind == "grammar":
            assert sp[param].startswith("%llguidance {}")
        back = gconfig_from_sampling_params(sp)
        assert back.constraint is not None and back.constraint.kind == kind
    with pytest.raises(BadRequest, match="only one"):
        gconfig_from_sampling_params({"json_schema": "{}", "regex": "a"})


async def test_generate_shapes(base, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        r = await c.post(
            f"{base}/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True,
                "rid": "shape-1",
            },
        )
        assert r.status_code == 200
        out = r.json()
        meta = out["meta_info"]
        assert meta["id"] == "shape-1" and meta["prompt_tokens"] == len(ids)
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
        assert meta["completion_tokens"] == 4 and isinstance(meta["weight_version"], str)
        assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)

        # Text input and a batch of prompts (a list answer), without logprobs.
        r = await c.post(
            f"{base}/generate",
            json={"text": ["Hello", "Bye"], "sampling_params": {"max_new_tokens": 2}},
        )
        outs = r.json()
        assert len(outs) == 2 and all(len(o["output_ids"]) == 2 for o in outs)
        assert "output_token_logprobs" not in outs[0]["meta_info"]

        # A stop token is reported as matched.
        r = await c.post(
            f"{base}/generate",
            json={
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": 20,
                    "temperature": 0,
                    "stop_token_ids": [out["output_ids"][1]],
                },
            },
        )
        fr = r.json()["meta_info"]["finish_reason"]
        assert fr == {"type": "stop", "matched": out["output_ids"][1]}


async def test_stream_events(base, tokenizer):
    ids = tokenizer.encode("One, two, three,")
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
        "stream": True,
    }
    events = []
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        async with c.stream("POST", f"{base}/generate", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        full = (await c.post(f"{base}/generate", json={**body, "stream": False})).json()
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(d["meta_info"]["finish_reason"] is None for d in data[:-1])
    streamed = [t for d in data for t in d["output_ids"]]
    assert streamed == full["output_ids"]
    assert [d["meta_info"]["completion_tokens"] for d in data][-1] == 5


async def test_errors_in_sglang_shape(base):
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        r = await c.post(f"{base}/generate", content=b"{not json")
        assert r.status_code == 400 and "error" in r.json()
        r = await c.post(f"{base}/generate", json={"sampling_params": {}})
        assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]
        r = await c.post(
            f"{base}/generate", json={"input_ids": [1, 2], "sampling_params": {"n": 2}}
        )
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]
        r = await c.post(f"{base}/update_weights_from_disk", json={"model_path": "/nope"})
        assert r.status_code == 400 and r.json()["success"] is False
        r = await c.post(f"{base}/pause_generation", json={"mode": "sideways"})
        assert r.status_code == 400


async def test_duplicate_rid_refused_while_running(base, tokenizer):
    body = {
        "input_ids": tokenizer.encode("Tell me a story"),
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        "rid": "dup-rid",
    }
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        first = asyncio.create_task(c.post(f"{base}/generate", json=body))
        while (await c.get(f"{base}/get_server_info")).json()["inflight"] == 0:
            await asyncio.sleep(0.05)
        second = await c.post(f"{base}/generate", json=body)
        assert second.status_code == 400 and "Duplicate" in second.json()["error"]["message"]
        assert (await first).status_code == 200


async def test_control_endpoints(base, model_path):
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        assert (await c.get(f"{base}/health")).status_code == 200
        assert (await c.get(f"{base}/health_generate")).status_code == 200
        assert (await c.post(f"{base}/flush_cache")).status_code == 200
        info = (await c.get(f"{base}/get_model_info")).json()
        assert info["model_path"] == model_path and info["is_generation"] is True
        old = (await c.get(f"{base}/get_weight_version")).json()["weight_version"]
        try:
            r = await c.post(f"{base}/update_weight_version", json={"new_version": "v-test"})
            assert r.json()["success"] is True
            assert (await c.get(f"{base}/get_weight_version")).json() == {
                "weight_version": "v-test"
            }
        finally:
            await c.post(f"{base}/update_weight_version", json={"new_version": old})
        # in_place pause holds requests where they are; continue releases them.
        r = await c.post(f"{base}/pause_generation", json={"mode": "in_place"})
        assert r.json()["status"] == "ok"
        task = asyncio.create_task(
            c.post(
                f"{base}/generate",
                json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            )
        )
        await asyncio.sleep(0.5)
        assert not task.done()
        await c.post(f"{base}/continue_generation")
        assert (await task).status_code == 200
